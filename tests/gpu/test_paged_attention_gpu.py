"""On a CUDA device: the paged-attention Triton kernel in bfloat16 matches the float32 reference
on realistic shapes (decode, tree verify, prefill; head_dim 64/128, GQA groups 3/4, kv_len 512,
page 16, batch 1/8/32), through the single pass and the split-KV path (the wrapper's choice, which
splits at small grids), and replays correctly from a CUDA graph when the lengths change.
Skipped where there is no GPU (CI)."""

from __future__ import annotations

import pytest
import torch

import specsplit.kernels.paged_attention as paged_attention_module
from specsplit.kernels.paged_attention import paged_attention
from specsplit.kernels.paged_attention_reference import paged_attention_reference
from specsplit.tree import DraftTree

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PAGE_SIZE = 16
KV_LEN = 512
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 4]  # 7 draft nodes, depth 4
ATOL = RTOL = 2e-2  # bfloat16 inputs and P, float32 softmax and accumulator


def make_batch(
    step: str,  # "decode" | "verify" | "prefill"
    batch_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    seed: int = 0,
    kv_len: int = KV_LEN,
) -> dict:
    """Arguments of paged_attention on CUDA, bfloat16, pages shuffled over a shared cache."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = (kv_len - torch.randint(0, 40, (batch_size,), generator=gen)).tolist()
    kv_lens[0] = kv_len
    q_len = {"decode": 1, "verify": 1 + len(TREE_PARENTS), "prefill": None}[step]
    q_lens = [kv if q_len is None else q_len for kv in kv_lens]
    prefix_lens = [
        0 if step == "prefill" else kv - q for kv, q in zip(kv_lens, q_lens, strict=True)
    ]

    pages_per_seq = kv_len // PAGE_SIZE
    num_pages = batch_size * pages_per_seq + 8
    block_table = torch.randperm(num_pages, generator=gen)[: batch_size * pages_per_seq]
    block_table = block_table.view(batch_size, pages_per_seq).to(torch.int32)
    kv = torch.randn(num_pages * PAGE_SIZE, 2, num_kv_heads, head_dim, generator=gen)
    tree_mask = None
    if step == "verify":
        n = len(TREE_PARENTS)
        new = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        new[:, 0] = True  # the pending token (the root)
        new[1:, 1:] = DraftTree(tokens=[0] * n, parents=TREE_PARENTS).ancestor_mask()
        tree_mask = new.expand(batch_size, n + 1, n + 1).contiguous()

    cuda = torch.device("cuda")
    return {
        "q": torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(
            cuda, torch.bfloat16
        ),
        "k_cache": kv[:, 0].to(cuda, torch.bfloat16),
        "v_cache": kv[:, 1].to(cuda, torch.bfloat16),
        "cu_seqlens_q": torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]).to(
            cuda, torch.int32
        ),
        "kv_lens": torch.tensor(kv_lens, dtype=torch.int32, device=cuda),
        "prefix_lens": torch.tensor(prefix_lens, dtype=torch.int32, device=cuda),
        "block_table": block_table.to(cuda),
        "page_size": PAGE_SIZE,
        "tree_mask": None if tree_mask is None else tree_mask.to(cuda),
        "max_q_len": max(q_lens),
        "scale": head_dim**-0.5,
    }


def reference_float32(args: dict) -> torch.Tensor:
    up = {k: args[k].float() for k in ("q", "k_cache", "v_cache")}
    return paged_attention_reference(**{**args, **up})


@pytest.mark.parametrize("num_splits", [None, 1])  # the wrapper's choice; single pass
@pytest.mark.parametrize("batch_size", [1, 8, 32])
@pytest.mark.parametrize("step", ["decode", "verify", "prefill"])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (8, 4, 128)])
def test_bf16_kernel_matches_float32_reference(
    step: str,
    batch_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    num_splits: int | None,
) -> None:
    if step == "prefill" and batch_size == 32:
        batch_size = 4  # 32 prompts of 512 tokens add time, not coverage
    args = make_batch(step, batch_size, num_kv_heads, group, head_dim)
    got = paged_attention(**args, num_splits=num_splits)
    assert got.dtype == torch.bfloat16
    want = reference_float32(args)
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [None, 3, 32])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (8, 4, 128)])
def test_split_kv_long_decode_matches_float32_reference(
    num_kv_heads: int, group: int, head_dim: int, num_splits: int | None
) -> None:
    args = make_batch("decode", 2, num_kv_heads, group, head_dim, kv_len=4096)
    got = paged_attention(**args, num_splits=num_splits)
    torch.testing.assert_close(got.float(), reference_float32(args), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("step", ["decode", "verify", "prefill"])
def test_page_ids_loaded_a_tile_ahead_match_float32_reference(
    step: str, num_splits: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PAGES_AHEAD (an A/B switch, bench/attention_kernel.py --sweep): the 8B's heads at batch
    8 (the wrapper splits) and 32, page ids shuffled."""
    monkeypatch.setattr(paged_attention_module, "PAGES_AHEAD", True)
    for batch_size in (8, 32 if step != "prefill" else 4):
        args = make_batch(step, batch_size, 8, 4, 128, seed=batch_size)
        got = paged_attention(**args, num_splits=num_splits)
        torch.testing.assert_close(got.float(), reference_float32(args), atol=ATOL, rtol=RTOL)


def test_cuda_graph_replay_follows_new_lengths() -> None:
    """Captured once over fixed buffers, replayed after the lengths, pages and tree change in
    place: the output matches the reference each time (no host sync in the wrapper). Batch 8 x 3
    KV heads is a small grid: the split path and its merge, with scratch from the graph pool."""
    first = make_batch("verify", 8, 3, 3, 64, seed=1)
    second = make_batch("verify", 8, 3, 3, 64, seed=2)
    out = torch.empty_like(first["q"])
    paged_attention(**first, out=out)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(**first, out=out)
    for args in (first, second):
        for name, value in args.items():
            if isinstance(value, torch.Tensor):
                first[name].copy_(value)
        graph.replay()
        torch.testing.assert_close(out.float(), reference_float32(first), atol=ATOL, rtol=RTOL)
