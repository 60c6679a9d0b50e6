"""The CPU attention path (`paged_attention_with_plan`: grouped query heads stacked as rows of
one SDPA per KV head; no mask where every query sees every key) equals attention written out
per query head and key in float64, for decode, prefill, tree verify, ragged batches and each
GQA grouping; and its plan leaves exactly the all-visible sequences unmasked."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specsplit.kernels.paged_attention_reference import (
    paged_attention_reference,
    reference_plan,
)

PAGE = 4


def _visible(
    i: int, p: int, q_len: int, kv_len: int, prefix: int, tree: torch.Tensor | None
) -> bool:
    """Whether query i of a sequence sees storage index p (the kernel's rules)."""
    if p < prefix:
        return True
    if tree is not None:
        return bool(tree[i, p - prefix])
    return p <= kv_len - q_len + i


def _written_out(case: dict[str, Any], groups: int) -> torch.Tensor:
    """Each query head's softmax over its visible keys, float64, one (query, head) at a time."""
    q, k, v = case["q"].double(), case["k_cache"].double(), case["v_cache"].double()
    out = torch.zeros_like(q)
    cu, bt = case["cu_seqlens_q"].tolist(), case["block_table"]
    for b, (kv_len, prefix) in enumerate(
        zip(case["kv_lens"].tolist(), case["prefix_lens"].tolist(), strict=True)
    ):
        tree = None if case["tree_mask"] is None else case["tree_mask"][b]
        q_len = cu[b + 1] - cu[b]
        slots = [int(bt[b, p // PAGE]) * PAGE + p % PAGE for p in range(kv_len)]
        for i in range(q_len):
            seen = [s for p, s in enumerate(slots) if _visible(i, p, q_len, kv_len, prefix, tree)]
            for h in range(q.shape[1]):
                keys, values = k[seen, h // groups], v[seen, h // groups]
                weights = torch.softmax(keys @ q[cu[b] + i, h] * case["scale"], dim=0)
                out[cu[b] + i, h] = weights @ values
    return out


def _case(
    seqs: list[tuple[int, int, int]], heads: int, kv_heads: int, tree: bool
) -> dict[str, Any]:
    """(q_len, kv_len, prefix_len) per sequence; pages shuffled; slots no sequence owns NaN."""
    gen = torch.Generator().manual_seed(len(seqs) * 10 + heads)
    pages = [-(-kv_len // PAGE) for _, kv_len, _ in seqs]
    order = torch.randperm(sum(pages) + 2, generator=gen)
    table = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
    k = torch.full(((sum(pages) + 2) * PAGE, kv_heads, 8), float("nan"))
    v = k.clone()
    used = 0
    for b, ((_, kv_len, _), n) in enumerate(zip(seqs, pages, strict=True)):
        table[b, :n] = order[used : used + n].to(torch.int32)
        used += n
        for p in range(kv_len):
            slot = int(table[b, p // PAGE]) * PAGE + p % PAGE
            k[slot] = torch.randn(kv_heads, 8, generator=gen)
            v[slot] = torch.randn(kv_heads, 8, generator=gen)
    tree_mask = None
    if tree:  # random visibility among the new tokens, each always seeing itself
        max_q = max(s[0] for s in seqs)
        max_new = max(kv_len - prefix for _, kv_len, prefix in seqs)
        tree_mask = torch.rand(len(seqs), max_q, max_new, generator=gen) < 0.5
        tree_mask |= torch.eye(max_q, max_new, dtype=torch.bool)
    q_lens = [s[0] for s in seqs]
    return {
        "q": torch.randn(sum(q_lens), heads, 8, generator=gen),
        "k_cache": k,
        "v_cache": v,
        "cu_seqlens_q": torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        "kv_lens": torch.tensor([s[1] for s in seqs], dtype=torch.int32),
        "prefix_lens": torch.tensor([s[2] for s in seqs], dtype=torch.int32),
        "block_table": table,
        "page_size": PAGE,
        "tree_mask": tree_mask,
        "max_q_len": max(q_lens),
        "scale": 8**-0.5,
    }


STEPS = {
    "decode": ([(1, 9, 8), (1, 3, 2), (1, 17, 16)], False),
    "prefill": ([(7, 7, 0), (5, 5, 0)], False),
    "verify causal": ([(4, 12, 8), (2, 6, 4)], False),
    "tree verify": ([(4, 13, 9), (3, 7, 4), (1, 5, 4)], True),
    "ragged": ([(1, 10, 9), (6, 6, 0), (3, 11, 8)], False),
}
GROUPINGS = {"mha": (4, 4), "gqa 2": (4, 2), "gqa 3 (SmolLM2)": (9, 3), "mqa": (4, 1)}


@pytest.mark.parametrize("grouping", GROUPINGS.values(), ids=GROUPINGS.keys())
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_cpu_attention_equals_attention_written_out_per_head(
    step: tuple[list[tuple[int, int, int]], bool], grouping: tuple[int, int]
) -> None:
    (seqs, tree), (heads, kv_heads) = step, grouping
    case = _case(seqs, heads, kv_heads, tree)
    got = paged_attention_reference(**case)
    assert torch.isfinite(got).all()  # no NaN slot read
    want = _written_out(case, heads // kv_heads)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_plan_drops_the_mask_only_where_every_query_sees_every_key() -> None:
    case = _case([(1, 9, 8), (4, 12, 8), (3, 3, 3), (2, 6, 4)], 4, 2, False)
    plan = reference_plan(
        case["cu_seqlens_q"], case["kv_lens"], case["prefix_lens"], case["block_table"], PAGE, None
    )
    # decode; a verify's causal new tokens; queries inside the prefix; two causal new tokens
    assert [mask is None for *_, mask in plan] == [True, False, True, False]
    tree = torch.ones(1, 2, 2, dtype=torch.bool)  # a tree mask that hides nothing
    full = reference_plan(
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32),
        torch.tensor([4], dtype=torch.int32),
        case["block_table"][:1],
        PAGE,
        tree,
    )
    assert full[0][3] is None
