"""The CPU attention path (`paged_attention_with_plan`: grouped query heads stacked as rows of
one SDPA per KV head; no mask where every query sees every key) equals attention written out
per query head and key in float64, for decode, prefill, tree verify, ragged batches and each
GQA grouping; and its plan leaves exactly the all-visible sequences unmasked."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.paged_attention_reference import (
    paged_attention_reference,
    reference_plan,
)
from tests.unit.attention_cases import Case, make_case, verify_new_mask


def _visible(
    i: int, p: int, q_len: int, kv_len: int, prefix: int, tree: torch.Tensor | None
) -> bool:
    """Whether query i of a sequence sees storage index p (the kernel's rules)."""
    if p < prefix:
        return True
    if tree is not None:
        return bool(tree[i, p - prefix])
    return p <= kv_len - q_len + i


def _written_out(case: Case) -> torch.Tensor:
    """Each query head's softmax over its visible keys, float64, one (query, head) at a time."""
    q, k, v = case.q.double(), case.k_cache.double(), case.v_cache.double()
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    cu, lens = (
        case.cu_seqlens_q.tolist(),
        zip(case.kv_lens.tolist(), case.prefix_lens.tolist(), strict=True),
    )
    for b, (kv_len, prefix) in enumerate(lens):
        tree = None if case.tree_mask is None else case.tree_mask[b]
        q_len = cu[b + 1] - cu[b]
        page = case.page_size
        slots = [int(case.block_table[b, p // page]) * page + p % page for p in range(kv_len)]
        for i in range(q_len):
            seen = [s for p, s in enumerate(slots) if _visible(i, p, q_len, kv_len, prefix, tree)]
            for h in range(q.shape[1]):
                keys, values = k[seen, h // groups], v[seen, h // groups]
                weights = torch.softmax(keys @ q[cu[b] + i, h] * case.scale, dim=0)
                out[cu[b] + i, h] = weights @ values
    return out


STEPS: dict[str, tuple[list[tuple[int, int, int]], list[torch.Tensor | None] | None]] = {
    # (q_len, kv_len, prefix_len) per sequence; the new tokens' tree masks, if any
    "decode": ([(1, 9, 8), (1, 3, 2), (1, 17, 16)], None),
    "prefill": ([(7, 7, 0), (5, 5, 0)], None),
    "verify causal": ([(4, 12, 8), (2, 6, 4)], None),
    "tree verify": (
        [(4, 13, 9), (3, 7, 4), (1, 5, 4)],
        [verify_new_mask(1, [-1, -1, 0]), verify_new_mask(1, [-1, 0]), None],
    ),
    "ragged": ([(1, 10, 9), (6, 6, 0), (3, 11, 8)], None),
}
GROUPINGS = {"mha": (4, 4), "gqa 2": (4, 2), "gqa 3 (SmolLM2)": (9, 3), "mqa": (4, 1)}


@pytest.mark.parametrize("grouping", GROUPINGS.values(), ids=GROUPINGS.keys())
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_cpu_attention_equals_attention_written_out_per_head(
    step: tuple[list[tuple[int, int, int]], list[torch.Tensor | None] | None],
    grouping: tuple[int, int],
) -> None:
    (seqs, masks), (heads, kv_heads) = step, grouping
    case = make_case(seqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=8, new_masks=masks)
    num_tokens = int(case.cu_seqlens_q[-1])  # the rows after them no sequence owns
    got = paged_attention_reference(**case.args())[:num_tokens]
    assert torch.isfinite(got).all()  # no NaN slot read
    want = _written_out(case)[:num_tokens]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_plan_drops_the_mask_only_where_every_query_sees_every_key() -> None:
    case = make_case([(1, 9, 8), (4, 12, 8), (3, 3, 3), (2, 6, 4)])
    args = (case.cu_seqlens_q, case.kv_lens, case.prefix_lens, case.block_table, case.page_size)
    # decode; a verify's causal new tokens; queries inside the prefix; two causal new tokens
    assert [mask is None for *_, mask in reference_plan(*args, None)] == [True, False, True, False]
    tree = torch.ones(1, 2, 2, dtype=torch.bool)  # a tree mask that hides nothing
    full = reference_plan(
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32),
        torch.tensor([4], dtype=torch.int32),
        case.block_table[:1],
        case.page_size,
        tree,
    )
    assert full[0][3] is None
