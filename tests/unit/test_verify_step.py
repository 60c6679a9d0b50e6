"""A verify step's layout among its new tokens (specsplit/step.py): the mask and positions made
once per shape and shared must equal the ones made from the definition, for every shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsplit.kv_cache import KVCache
from specsplit.step import (
    _CACHED_PENDING,
    build_forward_batch,
    decode_batch,
    page_tables,
    same_tree_batch,
    verify_step,
)
from specsplit.tree import DraftTree


def _expected(c: int, p: int, parents: list[int]) -> tuple[np.ndarray, list[int]]:
    """From the definition: pending i sees pending 0..i; node k sees every pending token, its
    ancestors and itself; pending i sits at c + i, a node at depth d at c + p - 1 + d."""
    n = len(parents)

    def lineage(k: int) -> set[int]:
        return set() if k < 0 else {k} | lineage(parents[k])

    mask = np.zeros((p + n, p + n), dtype=bool)
    for i in range(p):
        mask[i, : i + 1] = True
    for k in range(n):
        mask[p + k, :p] = True
        for j in lineage(k):
            mask[p + k, p + j] = True
    positions = [c + i for i in range(p)] + [c + p - 1 + len(lineage(k)) for k in range(n)]
    return mask, positions


SHAPES = [
    (1, [-1, 0, 1]),  # a chain of 3 after one pending token: most rounds
    (1, [-1, -1, 0, 0, 1, 2]),  # a top-2 tree
    (3, [-1, 0, -1]),  # a few pending tokens after a gap
    (_CACHED_PENDING + 4, [-1, 0]),  # a first round's prompt: made each time
]


@pytest.mark.parametrize(("p", "parents"), SHAPES, ids=["chain", "topk2", "pending3", "prompt"])
def test_verify_step_layout_matches_its_definition(p: int, parents: list[int]) -> None:
    kv = KVCache(1, 1, 4, 64, 4, torch.float32, "cpu")
    for c in (0, 5, 13):  # same shape at different lengths: a shared layout, own positions
        seq = kv.new_seq()
        seq.kv_committed_len = c
        kv.reserve(seq, c + p + len(parents))
        tree = DraftTree(list(range(10, 10 + len(parents))), parents)
        step = verify_step(seq, list(range(1, p + 1)), tree, [p - 1])
        mask, positions = _expected(c, p, parents)
        assert step.new_mask is not None
        assert np.array_equal(step.new_mask.numpy(), mask)
        assert step.positions == positions
        assert step.storage == list(range(c, c + p + len(parents)))
        kv.release(seq)


def test_a_shared_layout_is_left_as_it_was_by_the_batch_built_from_it() -> None:
    kv = KVCache(1, 1, 4, 64, 4, torch.float32, "cpu")
    steps = []
    for c in (2, 9):
        seq = kv.new_seq()
        seq.kv_committed_len = c
        kv.reserve(seq, c + 4)
        steps.append(verify_step(seq, [7], DraftTree([3, 4, 5], [-1, 0, 1]), [0, 1, 2, 3]))
    assert steps[0].new_mask is steps[1].new_mask  # one layout for the shape
    before = steps[0].new_mask.clone()
    batch, _ = build_forward_batch(steps, 4)
    assert batch.tree_mask is not None
    batch.tree_mask[:] = False  # a consumer writing into the batch's mask
    assert torch.equal(steps[0].new_mask, before)
    for step in steps:
        kv.release(step.seq)


@pytest.mark.parametrize("lengths", [[3], [3, 3], [3, 1, 0], [0]])
def test_page_tables_are_zero_padded_to_the_longest(lengths: list[int]) -> None:
    """Tables of one length (a batch of 1) and of several: each row its table, then zeros;
    at least one column."""
    kv = KVCache(1, 1, 4, 16, 4, torch.float32, "cpu")
    seqs = []
    for n in lengths:
        seq = kv.new_seq()
        kv.reserve(seq, 4 * n)
        seqs.append(seq)
    width = max(max(lengths), 1)
    want = [seq.page_table + [0] * (width - len(seq.page_table)) for seq in seqs]
    table = page_tables(seqs)
    assert table.dtype == np.int32
    assert table.tolist() == want
    for seq in seqs:
        kv.release(seq)


def test_batch_fields_hold_each_steps_values_in_order() -> None:
    """Two steps' ids, positions, slots, row offsets and lengths, back to back."""
    kv = KVCache(1, 1, 4, 16, 4, torch.float32, "cpu")
    a, b = kv.new_seq(), kv.new_seq()
    kv.reserve(a, 9)
    kv.reserve(b, 6)
    a.kv_committed_len, b.kv_committed_len = 5, 4
    steps = [
        verify_step(a, [11], DraftTree([12, 13], [-1, 0]), [0, 1, 2]),
        verify_step(b, [21, 22], DraftTree(), [1]),
    ]
    steps[0].hidden_rows = [0, 1]
    batch, slices = build_forward_batch(steps, 4)
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22]
    assert batch.positions.tolist() == [5, 6, 7, 4, 5]
    assert batch.slot_mapping.tolist() == [*a.slots_of([5, 6, 7]), *b.slots_of([4, 5])]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 5]
    assert batch.kv_lens.tolist() == [8, 6]
    assert batch.prefix_lens.tolist() == [5, 4]
    assert batch.logit_indices.tolist() == [0, 1, 2, 4]
    assert batch.hidden_indices is not None and batch.hidden_indices.tolist() == [0, 1]
    assert slices == [slice(0, 3), slice(3, 4)]
    kv.release(a)
    kv.release(b)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_batch_is_the_batch_of_its_decode_steps(page_size: int) -> None:
    """decode_batch (array ops) gives build_forward_batch's batch of one-token decode steps
    field for field, dtypes included: committed lengths inside a page, at a page's start (the
    next page just reserved) and past pages a longer sequence holds (ragged tables), shuffled
    page ids, a fork (shared pages); and an empty batch."""
    kv = KVCache(1, 1, 4, 256, page_size, torch.float32, "cpu")
    rng = np.random.default_rng(page_size)
    taken = kv.allocator.alloc(7)  # the sequences' pages are not 0, 1, 2, ...
    seqs = [kv.new_seq() for _ in range(9)]
    committed = [0, 1, page_size - 1, page_size, 2 * page_size, 3 * page_size + 1, 5, 40, 17]
    for seq, length in zip(seqs, committed, strict=True):
        kv.reserve(seq, length + 1 + int(rng.integers(0, 2 * page_size)))  # room past the step
        seq.kv_committed_len = length
    fork = kv.fork(seqs[5], 3 * page_size + 1)  # shared pages, its partial one copied
    kv.reserve(fork, 3 * page_size + 2)
    seqs.append(fork)
    tokens = rng.integers(0, 1000, len(seqs)).tolist()
    got, got_slices = decode_batch(seqs, tokens, page_size)
    steps = [verify_step(seq, [t], DraftTree(), [0]) for seq, t in zip(seqs, tokens, strict=True)]
    want, want_slices = build_forward_batch(steps, page_size)
    assert got_slices == want_slices
    assert got.max_q_len == want.max_q_len == 1 and got.page_size == want.page_size
    assert got.tree_mask is None and want.tree_mask is None
    assert got.hidden_indices is None and want.hidden_indices is None
    for name in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "kv_lens",
                 "prefix_lens", "block_table", "logit_indices"):  # fmt: skip
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    empty, no_slices = decode_batch([], [], page_size)
    assert empty.num_seqs == 0 and no_slices == [] and empty.max_q_len == 0
    for seq in reversed(seqs):  # (the fork before the sequence it shares pages with)
        kv.release(seq)
    kv.allocator.free(taken)


def test_decode_batch_refuses_a_token_past_its_own_pages() -> None:
    """A sequence whose next token's page is not reserved is refused, even beside a sequence
    with a wider table (whose padding would otherwise hand it another sequence's page)."""
    kv = KVCache(1, 1, 4, 16, 4, torch.float32, "cpu")
    wide, short = kv.new_seq(), kv.new_seq()
    kv.reserve(wide, 12)
    kv.reserve(short, 4)
    wide.kv_committed_len, short.kv_committed_len = 5, 4  # short's token needs a second page
    with pytest.raises(AssertionError):
        decode_batch([wide, short], [1, 2], 4)
    kv.release(wide)
    kv.release(short)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("parents", [[-1, 0, 1], [-1, -1, 0, 1, 1]], ids=["chain", "tree"])
def test_same_tree_batch_is_the_batch_of_its_verify_steps(
    page_size: int, hidden: bool, parents: list[int]
) -> None:
    """same_tree_batch (array ops) gives build_forward_batch's batch of verify steps with one
    pending token and trees of one shape, field for field, dtypes and the tree mask included:
    committed lengths inside a page, at a page's start and crossing pages, ragged tables,
    shuffled page ids, a fork (shared pages)."""
    kv = KVCache(1, 1, 4, 512, page_size, torch.float32, "cpu")
    rng = np.random.default_rng(page_size + len(parents))
    taken = kv.allocator.alloc(7)  # the sequences' pages are not 0, 1, 2, ...
    n = len(parents)
    seqs = [kv.new_seq() for _ in range(8)]
    committed = [0, 1, page_size - 1, page_size, 2 * page_size, 3 * page_size + 1, 5, 40]
    for seq, length in zip(seqs, committed, strict=True):
        kv.reserve(seq, length + 1 + n + int(rng.integers(0, 2 * page_size)))
        seq.kv_committed_len = length
    fork = kv.fork(seqs[5], 3 * page_size + 1)
    kv.reserve(fork, 3 * page_size + 2 + n)
    seqs.append(fork)
    roots = rng.integers(0, 1000, len(seqs)).tolist()
    trees = [DraftTree(rng.integers(0, 1000, n).tolist(), parents) for _ in seqs]
    got, got_slices = same_tree_batch(seqs, roots, trees, page_size, hidden)
    steps = []
    for seq, root, tree in zip(seqs, roots, trees, strict=True):
        step = verify_step(seq, [root], tree, list(range(1 + n)))
        step.hidden_rows = list(range(1 + n)) if hidden else []
        steps.append(step)
    want, want_slices = build_forward_batch(steps, page_size)
    assert got_slices == want_slices
    assert got.max_q_len == want.max_q_len == 1 + n and got.page_size == want.page_size
    assert (got.hidden_indices is None) == (want.hidden_indices is None) == (not hidden)
    names = ["input_ids", "positions", "slot_mapping", "cu_seqlens_q", "kv_lens", "prefix_lens",
             "block_table", "logit_indices", "tree_mask"] + ["hidden_indices"] * hidden  # fmt: skip
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for seq in reversed(seqs):
        kv.release(seq)
    kv.allocator.free(taken)
