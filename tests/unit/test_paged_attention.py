"""The paged-attention Triton kernel equals its plain-torch reference (float32, under the Triton
interpreter on the CPU), for every shape of step the engines run: decode, ragged batches,
prefill, tree verify, drafter new-region masks, GQA, padding sequences, shuffled pages; and the
split-KV path (keys cut into chunks, partials merged) equals it on the same cases."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

import specsplit.kernels.paged_attention as paged_attention_module
from specsplit.kernels.paged_attention import (
    MAX_SPLITS,
    auto_num_splits,
    launch_splits,
    paged_attention,
    split_programs_per_sm,
    wide_block,
)
from specsplit.kernels.paged_attention_reference import paged_attention_reference, reference_plan
from tests.unit.attention_cases import Case, make_case, verify_new_mask

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


SENTINEL = 7.0  # out rows no sequence owns keep this value


def check_matches_reference(case: Case, num_splits: int | None = None) -> torch.Tensor:
    out = torch.full_like(case.q, SENTINEL)
    got = paged_attention(**case.args(), out=out, num_splits=num_splits)
    assert got is out
    want = paged_attention_reference(**case.args(), out=torch.full_like(case.q, SENTINEL))
    num_tokens = int(case.cu_seqlens_q[-1])
    assert torch.isfinite(got[:num_tokens]).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[num_tokens:] == SENTINEL).all()  # rows no sequence owns are not written
    return got


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_one_query_per_sequence(page_size: int) -> None:
    seqs = [(1, 1, 0), (1, 17, 16), (1, 40, 39), (1, 33, 0)]
    check_matches_reference(make_case(seqs, page_size=page_size))


def test_ragged_batch_with_different_q_and_kv_lens() -> None:
    seqs = [(1, 5, 4), (7, 30, 23), (3, 3, 0), (12, 50, 20), (2, 9, 9)]
    check_matches_reference(make_case(seqs, page_size=4))


def test_prefill_causal_q_equals_kv_len() -> None:
    check_matches_reference(make_case([(45, 45, 0), (41, 41, 0)], page_size=16))


def test_verify_tree_mask_pending_causal_nodes_see_ancestors_only() -> None:
    trees = [(20, 2, [-1, -1, 0, 0, 1, 3]), (5, 1, [-1, 0, 1]), (13, 3, [-1, -1, -1, 2])]
    seqs, masks = [], []
    for committed, pending, parents in trees:
        q_len = pending + len(parents)
        seqs.append((q_len, committed + q_len, committed))
        masks.append(verify_new_mask(pending, parents))
    case = make_case(seqs, page_size=4, new_masks=masks)
    got = check_matches_reference(case)
    # a tree node ignores its siblings: changing a sibling's V leaves the node's output alone
    sibling_slot = int(case.block_table[0, 23 // 4]) * 4 + 23 % 4  # node 1 (a sibling of node 0)
    case.v_cache[sibling_slot] += 100.0
    again = paged_attention(**case.args())
    node0 = 2  # row of node 0 in sequence 0
    torch.testing.assert_close(again[node0], got[node0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(again[2 + 1], got[2 + 1])  # node 1 itself does see it


def test_drafter_rectangular_new_region_mask() -> None:
    gen = torch.Generator().manual_seed(3)
    seqs = [(4, 21, 9), (2, 10, 3), (3, 7, 0)]  # q_len < kv_len - prefix_len
    masks = []
    for q_len, kv_len, prefix_len in seqs:
        m = torch.rand(q_len, kv_len - prefix_len, generator=gen) < 0.5
        m[:, 0] = True  # every row sees a key even without a prefix
        masks.append(m)
    check_matches_reference(make_case(seqs, page_size=2, new_masks=masks))


def test_tree_mask_uint8_equals_bool() -> None:
    case = make_case([(4, 12, 8)], new_masks=[verify_new_mask(1, [-1, 0, -1])])
    assert case.tree_mask is not None
    as_bool = paged_attention(**case.args())[:4]
    as_uint8 = paged_attention(**replace(case, tree_mask=case.tree_mask.to(torch.uint8)).args())
    assert torch.equal(as_bool, as_uint8[:4])


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_gqa_groups_and_head_dims(group: int, head_dim: int) -> None:
    seqs = [(1, 19, 18), (5, 26, 21), (9, 9, 0)]
    case = make_case(seqs, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, seed=group)
    check_matches_reference(case)


def test_padding_sequences_with_no_queries_write_nothing() -> None:
    # CUDA-graph padding: q_len 0 sequences (kv_len 0 too), max_q_len of the bucket not the batch
    seqs = [(0, 0, 0), (3, 11, 8), (0, 0, 0), (1, 6, 5), (0, 4, 4)]
    check_matches_reference(make_case(seqs, max_q_len=8))
    masks: list[torch.Tensor | None] = [None, verify_new_mask(1, [-1, 0]), None, None, None]
    check_matches_reference(make_case(seqs, max_q_len=8, new_masks=masks))


def test_shuffled_pages_give_the_same_output_as_contiguous_ones() -> None:
    seqs = [(3, 23, 20), (6, 37, 0)]
    contiguous = make_case(seqs, page_size=4, shuffle=False, seed=5)
    shuffled = make_case(seqs, page_size=4, shuffle=True, seed=5)
    assert not torch.equal(contiguous.block_table, shuffled.block_table)
    # the same K/V per storage index, laid out in other slots
    src_plan = reference_plan(**_plan_args(contiguous))
    dst_plan = reference_plan(**_plan_args(shuffled))
    for (_, _, src, _), (_, _, dst, _) in zip(src_plan, dst_plan, strict=True):
        shuffled.k_cache[dst] = contiguous.k_cache[src]
        shuffled.v_cache[dst] = contiguous.v_cache[src]
    a = check_matches_reference(contiguous)
    b = check_matches_reference(replace(shuffled, q=contiguous.q))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_kv_len_not_a_multiple_of_the_tile() -> None:
    # interpreter tiles are 16 keys: lengths just past, just short of and far from a multiple
    check_matches_reference(make_case([(2, 17, 15), (1, 31, 30), (5, 49, 44)], page_size=8))


def test_reference_plan_mask_of_a_verify_step_exactly() -> None:
    # committed 2, one pending token, tree nodes 0 and 1 children of the root, node 2 of node 0
    mask = verify_new_mask(1, [-1, -1, 0])
    tree_mask = mask[None]  # [1, 4, 4]
    plan = reference_plan(
        torch.tensor([0, 4], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([[3, 1]], dtype=torch.int32),
        4,
        tree_mask,
    )
    q_start, q_end, slots, dense = plan[0]
    assert (q_start, q_end) == (0, 4)
    assert slots.tolist() == [12, 13, 14, 15, 4, 5]
    want = [
        [1, 1, 1, 0, 0, 0],  # pending token
        [1, 1, 1, 1, 0, 0],  # node 0
        [1, 1, 1, 0, 1, 0],  # node 1: not its sibling node 0
        [1, 1, 1, 1, 0, 1],  # node 2: ancestor node 0, not node 1
    ]
    assert dense.int().tolist() == want
    # causal, prefix 1, kv_len 5: the two queries sit at storage 3 and 4
    causal = reference_plan(
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([[0, 1]], dtype=torch.int32),
        4,
        None,
    )[0][3]
    assert causal.int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


# split-KV: under the interpreter key tiles are 16, so a chunk is one or more 16-key tiles and
# num_splits past cdiv(kv_len, 16) leaves chunks empty (neutral partials the merge must ignore)
SPLIT_CASES: dict[str, tuple[int, Callable[[], Case]]] = {  # name: (num_splits, case)
    "decode": (
        5,
        lambda: make_case([(1, 1, 0), (1, 17, 16), (1, 70, 69), (1, 33, 0)], page_size=16),
    ),
    "ragged": (3, lambda: make_case([(1, 5, 4), (7, 30, 23), (3, 3, 0), (12, 50, 20)])),
    "prefill": (2, lambda: make_case([(45, 45, 0), (20, 20, 0)], page_size=16)),
    "tree verify": (
        4,
        lambda: make_case(
            [(7, 27, 20), (4, 17, 13)],
            new_masks=[verify_new_mask(2, [-1, -1, 0, 0, 1]), verify_new_mask(1, [-1, 0, -1])],
        ),
    ),
    "drafter rectangular mask": (
        3,
        lambda: make_case(
            [(4, 41, 9), (2, 10, 3)],
            new_masks=[torch.eye(4, 32, dtype=torch.bool), torch.ones(2, 7, dtype=torch.bool)],
        ),
    ),
    "padding sequences": (
        2,
        lambda: make_case([(0, 0, 0), (3, 40, 37), (0, 0, 0), (1, 6, 5), (0, 4, 4)], max_q_len=8),
    ),
    "gqa group 3": (
        5,
        lambda: make_case([(1, 35, 34), (5, 26, 21)], num_heads=6, num_kv_heads=2),
    ),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_kv_matches_reference(name: str) -> None:
    num_splits, case = SPLIT_CASES[name]
    check_matches_reference(case(), num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_page_ids_loaded_a_tile_ahead_give_the_same_output(
    name: str, num_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PAGES_AHEAD (an A/B switch): each key tile's page ids loaded one tile before it, in the
    single pass and in chunks, over the split cases (decode, trees, prefill, padding, GQA,
    page sizes 4 and 16, lengths off the tile)."""
    _, case = SPLIT_CASES[name]
    monkeypatch.setattr(paged_attention_module, "PAGES_AHEAD", True)
    check_matches_reference(case(), num_splits=num_splits)


def test_page_ids_loaded_a_tile_ahead_with_pages_of_one_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(paged_attention_module, "PAGES_AHEAD", True)
    check_matches_reference(make_case([(1, 5, 4), (3, 70, 67), (1, 33, 32)], page_size=1))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefix_tiles_unmasked_and_the_rest_masked_meet_on_the_tile_edge(num_splits: int) -> None:
    """The key loop's unmasked pass takes the tiles wholly inside the prefix (16 keys under the
    interpreter): prefixes on a tile edge (32), one short of it (47) and one past it (49), under
    tree masks and causal, queries short of max_q_len (rows past q_len in the unmasked pass)."""
    seqs = [(3, 35, 32), (2, 49, 47), (4, 53, 49), (1, 33, 32)]
    masks = [verify_new_mask(1, [-1, 0]), None, verify_new_mask(1, [-1, 0, 0]), None]
    check_matches_reference(make_case(seqs, new_masks=masks, max_q_len=6), num_splits=num_splits)
    check_matches_reference(make_case(seqs, page_size=16, max_q_len=6), num_splits=num_splits)


def poison_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split pass's partials start as NaN (uninitialised in a graph pool: anything)."""

    def nan_scratch(q: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=torch.float32, device=q.device)

    monkeypatch.setattr(paged_attention_module, "_scratch", nan_scratch)


@pytest.mark.parametrize("skip_empty", [False, True])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_kv_over_nan_scratch_reads_only_what_it_stored(
    name: str, skip_empty: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SKIP_EMPTY_CHUNKS (the default) on: empty chunks (past kv_end) store their max alone
    and the merge ignores their sum and acc; off: every chunk stores its partial. Either way
    scratch full of NaN changes nothing."""
    num_splits, case = SPLIT_CASES[name]
    poison_scratch(monkeypatch)
    monkeypatch.setattr(paged_attention_module, "SKIP_EMPTY_CHUNKS", skip_empty)
    check_matches_reference(case(), num_splits=num_splits)


def test_skipped_empty_chunks_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """More chunks than keys (most empty), fully masked rows, trees: the merge's sum is the
    same with the empty chunks skipped as with their neutral partials, bit for bit."""
    seqs = [(1, 1, 0), (1, 2, 1), (2, 5, 3), (1, 3, 0), (3, 40, 0)]
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[1] = False  # a row that sees no key at all: 0 both ways
    masks = [None, None, verify_new_mask(0, [-1, 0]), None, mask]
    case = make_case(seqs, page_size=2, new_masks=masks)
    monkeypatch.setattr(paged_attention_module, "SKIP_EMPTY_CHUNKS", False)
    stored = paged_attention(**case.args(), num_splits=8)
    poison_scratch(monkeypatch)
    monkeypatch.setattr(paged_attention_module, "SKIP_EMPTY_CHUNKS", True)
    skipped = paged_attention(**case.args(), num_splits=8)
    owned = int(case.args()["cu_seqlens_q"][-1])  # (rows past every sequence's: not written)
    assert torch.equal(stored[:owned], skipped[:owned])
    check_matches_reference(case, num_splits=8)


def test_split_kv_with_more_splits_than_keys() -> None:
    # kv_len 1..5 over 8 chunks: all but the first chunk of each sequence are empty
    seqs = [(1, 1, 0), (1, 2, 1), (2, 5, 3), (1, 3, 0)]
    check_matches_reference(make_case(seqs, page_size=2), num_splits=8)
    masks = [None, None, verify_new_mask(0, [-1, 0]), None]
    check_matches_reference(make_case(seqs, page_size=2, new_masks=masks), num_splits=7)


def test_split_kv_equals_single_pass_and_fully_masked_rows_are_zero() -> None:
    # a tree row that sees no key at all (no prefix, empty mask row): 0 in both paths, no NaN
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[1] = False
    case = make_case([(3, 40, 0), (1, 9, 8)], new_masks=[mask, None])
    single = paged_attention(**case.args(), num_splits=1)
    split = paged_attention(**case.args(), num_splits=4)
    torch.testing.assert_close(split[:4], single[:4], atol=1e-5, rtol=1e-5)
    assert (split[1] == 0).all() and (single[1] == 0).all()


def test_only_the_causal_decode_tile_of_a_128_wide_head_pipelines_decode_stages() -> None:
    config = paged_attention_module._launch_config  # (head_dim, group, max_q_len, split, ...)
    assert config(128, 4, 1, False, False) == (16, 128, 4, paged_attention_module.DECODE_STAGES)
    assert config(128, 4, 4, False, False, True)[3] == 2  # a 1 + 3 tree over 16 rows
    assert config(128, 4, 1, True, False)[3] == 2  # split chunks
    assert config(64, 3, 1, False, False)[3] == 2  # SmolLM2's 64-wide head
    assert config(128, 4, 9, False, False)[3] == 2  # 1 + 8 causal over 64 rows
    assert config(128, 4, 1, False, True)[3] == 1  # the interpreter's


def test_auto_num_splits_fills_the_grid_only_when_small() -> None:
    assert auto_num_splits(num_programs=8, num_sms=132) == MAX_SPLITS  # 8B decode, batch 1
    assert auto_num_splits(num_programs=24, num_sms=132) == 22  # 3 KV heads, batch 8
    assert auto_num_splits(num_programs=64, num_sms=132) == 9  # 8 KV heads, batch 8
    assert auto_num_splits(num_programs=131, num_sms=132) == 5
    assert auto_num_splits(num_programs=132, num_sms=132) == 1  # one program per SM already
    assert auto_num_splits(num_programs=4096, num_sms=132) == 1
    # 3 programs a SM, not 4: a 128-wide head's blocks, decode's and a verify tree's 64 rows
    assert auto_num_splits(num_programs=8, num_sms=132, per_sm=3) == MAX_SPLITS  # batch 1
    assert auto_num_splits(num_programs=16, num_sms=132, per_sm=3) == 25  # batch 2
    assert auto_num_splits(num_programs=64, num_sms=132, per_sm=3) == 7  # batch 8
    assert auto_num_splits(num_programs=128, num_sms=132, per_sm=3) == 4  # batch 16
    assert wide_block(head_dim=128, block_m=64) and not wide_block(head_dim=128, block_m=32)
    assert not wide_block(head_dim=64, block_m=64)  # (SmolLM2's: its tiles as they were)


@pytest.mark.parametrize(
    ("head_dim", "block_m", "per_sm"),
    [(64, 16, 4), (64, 64, 4), (128, 16, 3), (128, 64, 3)],
    ids=["smollm2-decode", "smollm2-tree", "8b-decode", "8b-tree"],
)
def test_split_targets_by_head_and_block(
    head_dim: int, block_m: int, per_sm: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert split_programs_per_sm(head_dim, block_m) == per_sm
    # each from its own switch: the three constants read at each launch
    monkeypatch.setattr(paged_attention_module, "SPLIT_PROGRAMS_PER_SM", 5)
    monkeypatch.setattr(paged_attention_module, "LARGE_HEAD_SPLIT_PROGRAMS_PER_SM", 6)
    monkeypatch.setattr(paged_attention_module, "WIDE_SPLIT_PROGRAMS_PER_SM", 7)
    moved = {(64, 16): 5, (64, 64): 5, (128, 16): 6, (128, 64): 7}[(head_dim, block_m)]
    assert split_programs_per_sm(head_dim, block_m) == moved


def test_a_launch_splits_at_its_blocks_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """launch_splits (the wrapper's and bench/attention_kernel.py's choice): the SMs counted on
    the device, the target as split_programs_per_sm gives it."""
    monkeypatch.setattr(paged_attention_module, "_num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert launch_splits(128, 64, 128, cpu) == 4  # the 8B's 1 + 8 tree, batch 16
    assert launch_splits(128, 16, 128, cpu) == 4  # its decode, batch 16
    assert launch_splits(64, 16, 24, cpu) == 22  # SmolLM2's decode, batch 8
    assert launch_splits(128, 16, 256, cpu) == 1  # the grid fills the SMs


def test_wrapper_rejects_num_splits_out_of_range() -> None:
    case = make_case([(1, 5, 4)])
    for bad in (0, MAX_SPLITS + 1):
        with pytest.raises(ValueError, match="num_splits"):
            paged_attention(**case.args(), num_splits=bad)


def _plan_args(case: Case) -> dict[str, Any]:
    keys = ("cu_seqlens_q", "kv_lens", "prefix_lens", "block_table", "page_size", "tree_mask")
    return {k: getattr(case, k) for k in keys}


def _strided_last_dim(t: torch.Tensor) -> torch.Tensor:
    return torch.randn(*t.shape[:-1], 2 * t.shape[-1])[..., ::2]


BAD_INPUTS: dict[str, tuple[Callable[[Case], Case], str]] = {
    "metadata not int32": (lambda c: replace(c, kv_lens=c.kv_lens.long()), "int32"),
    "block table not int32": (lambda c: replace(c, block_table=c.block_table.long()), "int32"),
    "head_dim not a power of two": (
        lambda c: replace(
            c, q=c.q[..., :12], k_cache=c.k_cache[..., :12], v_cache=c.v_cache[..., :12]
        ),
        "power of two",
    ),
    "heads not a multiple of kv heads": (lambda c: replace(c, q=c.q[:, :3]), "multiple"),
    "q last dim strided": (lambda c: replace(c, q=_strided_last_dim(c.q)), "contiguous"),
    "cache last dim strided": (
        lambda c: replace(c, k_cache=_strided_last_dim(c.k_cache)),
        "contiguous",
    ),
    "k and v shapes differ": (lambda c: replace(c, v_cache=c.v_cache[:-1]), "v_cache"),
    "cu_seqlens_q wrong length": (
        lambda c: replace(c, cu_seqlens_q=c.cu_seqlens_q[:-1]),
        "cu_seqlens_q",
    ),
    "block table rows != batch": (
        lambda c: replace(c, block_table=c.block_table[:1]),
        "block_table",
    ),
    "metadata on another device": (lambda c: replace(c, kv_lens=c.kv_lens.to("meta")), "device"),
    "tree mask rows < max_q_len": (
        lambda c: replace(c, tree_mask=torch.ones(2, 1, 8, dtype=torch.bool)),
        "tree_mask",
    ),
    "tree mask float": (lambda c: replace(c, tree_mask=torch.ones(2, 4, 8)), "bool or uint8"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_wrapper_rejects_bad_inputs(name: str) -> None:
    mutate, match = BAD_INPUTS[name]
    case = mutate(make_case([(4, 10, 6), (1, 5, 4)], num_heads=4, num_kv_heads=2, head_dim=16))
    with pytest.raises(ValueError, match=match):
        paged_attention(**case.args())


def test_wrapper_rejects_cpu_tensors_without_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = make_case([(1, 5, 4)])
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_attention(**case.args())
