"""The KV pool's size: as asked, a fixed pool on the CPU, a share of the free memory on a GPU;
a CPU pool's pages zero and resident only once touched."""

from __future__ import annotations

import pytest
import torch

from specsplit.kv_cache import CPU_NUM_PAGES, MIN_NUM_PAGES, KVCache, pool_num_pages

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cpu_pool_reads_zero_and_is_aligned(dtype: torch.dtype) -> None:
    kv = KVCache(3, 2, 8, num_pages=5, page_size=4, dtype=dtype, device="cpu")
    assert kv.data.shape == (3, 2, 6 * 4, 2, 8) and kv.data.dtype == dtype
    # heads outer on the CPU: [3, 2, 2 heads, 24 slots, 8] in memory, seen slot-major
    assert kv.data.transpose(2, 3).is_contiguous() and kv.data.data_ptr() % 64 == 0
    assert kv.k[0].stride() == (8, 24 * 8, 1)
    assert not kv.data.any()
    kv.k[1][5] = 1.0  # the per-layer views write through to the pool
    assert kv.data[1, 0, 5].eq(1).all() and kv.data.count_nonzero() == 2 * 8


def test_a_slot_major_cpu_pool_is_contiguous() -> None:
    kv = KVCache(3, 2, 8, num_pages=5, page_size=4, dtype=torch.float32, device="cpu",
                 heads_outer=False)  # fmt: skip
    assert kv.data.shape == (3, 2, 6 * 4, 2, 8) and kv.data.is_contiguous()
    assert kv.k[0].stride() == (2 * 8, 8, 1)


def test_a_cpu_pool_asks_for_small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's whole pages are advised MADV_NOHUGEPAGE: a heads-outer pool's first touch of
    each KV head's region would otherwise zero (and compact for) a 2 MB huge page."""
    from specsplit import kv_cache

    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(kv_cache, "_madvise", lambda: lambda *a: calls.append(a) or 0)
    kv = KVCache(3, 2, 8, num_pages=500, page_size=16, dtype=torch.float32, device="cpu")
    ((start, length, advice),) = calls
    first = kv.data.data_ptr()
    last = first + kv.data.numel() * kv.data.element_size()
    assert advice == 15 and start % 4096 == 0 and length % 4096 == 0
    assert start <= first and start + length >= last - 4096  # all but a partial last page
    monkeypatch.setattr(kv_cache, "_madvise", lambda: None)  # off Linux: nothing to ask
    assert not KVCache(
        3, 2, 8, num_pages=5, page_size=4, dtype=torch.float32, device="cpu"
    ).data.any()
