"""On a CUDA device: batched greedy acceptance and KV compaction equal the per-sequence references,
issue no host sync, and replay correctly from a CUDA graph. Skipped where there is no GPU (CI)."""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.kernels.accept import (
    BatchedAccept,
    accept_greedy_from_logits,
    accepted_kv_moves,
    compact_accepted_kv,
)
from tests.unit.test_batched_accept import (
    check_accept,
    check_commit,
    kv_shape,
    make_kv_case,
    mixed_specs,
    reference_commit,
    run_commit,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_matches_per_sequence_references(page_size: int) -> None:
    for seed in range(30):
        rng = random.Random(seed)
        width = rng.randint(1, 16)
        case = make_kv_case(seed, mixed_specs(rng, 8, width), width, page_size).to("cuda")
        expected = reference_commit(case)
        check_accept(case.batch, run_commit(case))
        check_commit(case, expected)


def test_cuda_no_host_sync() -> None:
    case = make_kv_case(0, mixed_specs(random.Random(0), 8, 12), 12, page_size=16).to("cuda")
    expected = reference_commit(case)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = run_commit(case)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_accept(case.batch, result)
    check_commit(case, expected)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_replays_with_new_inputs(page_size: int) -> None:
    batch_size, width = 8, 12
    max_pages, _ = kv_shape(batch_size, width, page_size)
    first = make_kv_case(100, mixed_specs(random.Random(100), batch_size, width), width, page_size)
    static = first.to("cuda")  # the graph's fixed buffers; later cases are copied into them

    def step() -> tuple[torch.Tensor, ...]:
        result = accept_greedy_from_logits(
            static.batch.target_logits, static.batch.draft_tokens, static.batch.parents
        )
        src, dst = accepted_kv_moves(
            static.base,
            result.accepted_nodes,
            result.num_accepted_drafts,
            static.block_table,
            page_size,
            static.scratch_slot,
        )
        compact_accepted_kv(static.kv_data, src, dst)
        return result.num_accepted_drafts, result.accepted_nodes, result.bonus_tokens

    kv_before = static.kv_data.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    static.kv_data.copy_(kv_before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    for seed in range(101, 111):
        case = make_kv_case(
            seed, mixed_specs(random.Random(seed), batch_size, width), width, page_size
        )
        assert case.scratch_slot == static.scratch_slot  # captured as a constant
        assert tuple(case.block_table.shape) == (batch_size, max_pages)
        for name in ("base", "block_table", "kv_data"):
            getattr(static, name).copy_(getattr(case, name))
        for name in ("target_logits", "draft_tokens", "parents"):
            getattr(static.batch, name).copy_(getattr(case.batch, name))
        expected = reference_commit(case)
        graph.replay()
        check_accept(case.batch, BatchedAccept(*(t.clone() for t in outputs)))
        check_commit(static, expected)
