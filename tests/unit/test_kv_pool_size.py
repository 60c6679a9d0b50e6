"""The KV pool's size: as asked, a fixed pool on the CPU, a share of the free memory on a GPU."""

from __future__ import annotations

import pytest
import torch

from specsplit.kv_cache import CPU_NUM_PAGES, MIN_NUM_PAGES, pool_num_pages

GIB = 2**30


def test_pages_asked_for_are_kept() -> None:
    assert pool_num_pages(77, "cuda", 4096, 0.8) == 77
    assert pool_num_pages(77, "cpu", 4096, 0.8) == 77


def test_cpu_pool_is_fixed() -> None:
    assert pool_num_pages(None, "cpu", 4096, 0.8) == CPU_NUM_PAGES


def test_gpu_pool_is_a_share_of_free_memory_less_the_reserve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 10 * GIB, 80 * GIB  # free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    per_page = 2 * 2**20
    assert pool_num_pages(None, "cuda:1", per_page, 0.5) == 5 * GIB // per_page
    assert pool_num_pages(None, "cuda:1", per_page, 0.5, reserve_bytes=GIB) == 4 * GIB // per_page
    assert asked == [torch.device("cuda:1")] * 2
    # nothing left: still a usable minimum (requests then get RESOURCE_EXHAUSTED, not a crash)
    assert pool_num_pages(None, "cuda", per_page, 0.5, reserve_bytes=20 * GIB) == MIN_NUM_PAGES
