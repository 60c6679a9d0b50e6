"""Per-sequence shares of a forward step, and the ragged ForwardBatch built from them.

Each sequence's cache is addressed by *storage index* (its logical slot number, mapped to a
physical slot through its page table). A step writes K/V for its query tokens at the given
storage indices and attends over storage [0, kv_len): the first `prefix_len` always, the rest
(the step's new region) under `new_mask`, or causally when it is None.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from specsplit.kv_cache import SeqKV
from specsplit.model.batch import ForwardBatch
from specsplit.tree import DraftTree, ancestor_mask, depths


@dataclass
class SeqStep:
    seq: SeqKV
    input_ids: list[int]  # [q] query tokens
    positions: list[int]  # [q] RoPE positions
    storage: list[int]  # [q] storage index each token's K/V is written to
    kv_len: int  # storage [0, kv_len) attended
    prefix_len: int  # storage [0, prefix_len) visible to every query
    new_mask: torch.Tensor | None  # [q, kv_len - prefix_len] bool; None = causal
    logit_rows: list[int]  # rows of this step (0..q-1) whose logits are wanted
    hidden_rows: list[int] = field(default_factory=list)  # rows whose hidden states are wanted

    def __post_init__(self) -> None:
        q = len(self.input_ids)
        assert len(self.positions) == len(self.storage) == q, (self.positions, self.storage)
        assert 0 <= self.prefix_len <= self.kv_len, (self.prefix_len, self.kv_len)
        if self.new_mask is None:
            assert self.kv_len - self.prefix_len >= q, "a causal step attends to its own tokens"
        else:
            assert self.new_mask.shape == (q, self.kv_len - self.prefix_len), self.new_mask.shape


def causal_step(
    seq: SeqKV, tokens: list[int], logit_rows: list[int], start: int | None = None
) -> SeqStep:
    """`tokens` appended causally at storage `start` (default: the committed prefix's end)."""
    c = seq.kv_committed_len if start is None else start
    q = len(tokens)
    return SeqStep(
        seq=seq,
        input_ids=list(tokens),
        positions=list(range(c, c + q)),
        storage=list(range(c, c + q)),
        kv_len=c + q,
        prefix_len=c,
        new_mask=None,
        logit_rows=logit_rows,
    )


def verify_step(seq: SeqKV, pending: list[int], tree: DraftTree, logit_rows: list[int]) -> SeqStep:
    """Pending tokens (causal) then tree nodes (prefix + pending + ancestors + self).

    With c = kv_committed_len and p pending tokens: pending i sits at position c + i, a tree
    node at depth d at c + p - 1 + d; node j's K/V goes to storage c + p + j.
    """
    c, p, n = seq.kv_committed_len, len(pending), len(tree)
    assert p >= 1, "a step needs at least one pending token (the root)"
    if n == 0:
        return causal_step(seq, pending, logit_rows)
    parents = tuple(tree.parents)
    layout = _tree_layout(p, parents) if p <= _CACHED_PENDING else _new_tokens_layout(p, parents)
    mask, offsets = layout
    return SeqStep(
        seq=seq,
        input_ids=[*pending, *tree.tokens],
        positions=[c + offset for offset in offsets],
        storage=list(range(c, c + p + n)),
        kv_len=c + p + n,
        prefix_len=c,
        new_mask=mask,
        logit_rows=logit_rows,
    )


def _new_tokens_layout(p: int, parents: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A verify step's mask among its new tokens (p pending, then tree nodes with these
    parents) and each new token's position past the committed prefix."""
    n = len(parents)
    mask = np.zeros((p + n, p + n), dtype=bool)  # numpy: host-cheap
    mask[:p, :p] = np.tri(p, dtype=bool)
    mask[p:, :p] = True
    mask[p:, p:] = ancestor_mask(parents)
    return torch.from_numpy(mask), (*range(p), *(p - 1 + d for d in depths(parents)))


# Rounds repeat a few shapes (one pending token and the round's chain or tree, or a few pending
# tokens after a gap): each shape's layout is made once (~30 us a sequence at batch 32 on the
# host otherwise) and shared, read-only, by every step of that shape. A first round's prompt is
# pending tokens too: those are made each time, not kept.
_CACHED_PENDING = 16
_tree_layout = functools.lru_cache(maxsize=1024)(_new_tokens_layout)


def _views(array: np.ndarray, sizes: list[int]) -> list[torch.Tensor]:
    """Consecutive pieces of `array` of these sizes, as tensors sharing its memory (numpy's
    slices, each wrapped: ~0.7 us a piece, where np.cumsum and torch's slices cost ~2)."""
    pieces, end = [], 0
    for size in sizes:
        pieces.append(torch.from_numpy(array[end : end + size]))
        end += size
    return pieces


def page_tables(seqs: list[SeqKV]) -> np.ndarray:
    """[B, the most pages of any (at least 1)] int32: each sequence's page table, 0-padded,
    from each one's int32 mirror (`SeqKV.table_array`), not its list."""
    tables = [seq.table_array() for seq in seqs]
    width = max(map(len, tables), default=0)
    if width and all(len(table) == width for table in tables):  # (batch 1, equal lengths)
        return np.stack(tables)
    table = np.zeros((len(seqs), max(width, 1)), dtype=np.int32)
    for b, pages in enumerate(tables):
        table[b, : len(pages)] = pages
    return table


def _appended_slots(
    seqs: list[SeqKV], q: int, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(committed lengths [B] int64, the page tables `page_tables`, [B, q] int64 cache slots)
    of q tokens appended at each sequence's committed length (storage committed + 0..q-1),
    each in a page reserved in its own table (a wider table's padding is another's page)."""
    num_seqs = len(seqs)
    assert all(seq.page_size == page_size for seq in seqs), page_size
    committed = np.fromiter((seq.kv_committed_len for seq in seqs), np.int64, num_seqs)
    held = np.fromiter((len(seq.page_table) for seq in seqs), np.int64, num_seqs)
    storage = committed[:, None] + np.arange(q)  # [B, q]
    column = storage // page_size  # each token's page in its table
    assert ((committed >= 0) & (column[:, -1] < held)).all(), (committed, held)
    table = page_tables(seqs)
    pages = table[np.arange(num_seqs)[:, None], column].astype(np.int64)
    return committed, table, pages * page_size + storage % page_size


def decode_batch(
    seqs: list[SeqKV], tokens: list[int], page_size: int
) -> tuple[ForwardBatch, list[slice]]:
    """`build_forward_batch` of decode steps, each sequence's one token appended causally at its
    committed length, its logit row wanted (`verify_step(seq, [token], DraftTree(), [0])`),
    built with array ops instead of a SeqStep a sequence: the same batch, field for field (the
    host work of a decode step at batch 32 and up, where the device may outrun it)."""
    num_seqs = len(seqs)
    assert len(tokens) == num_seqs, (len(tokens), num_seqs)
    committed, table, slots = _appended_slots(seqs, 1, page_size)
    rows = np.arange(num_seqs, dtype=np.int64)  # each sequence's one row: its logits' too
    lens = committed.astype(np.int32)
    batch = _packed_batch(
        np.concatenate([np.array(tokens, np.int64), committed, slots[:, 0], rows]),
        (num_seqs, num_seqs, 0),
        np.concatenate([np.arange(num_seqs + 1, dtype=np.int32), lens + 1, lens]),
        torch.from_numpy(table),
        None,
        1 if num_seqs else 0,
        page_size,
    )
    return batch, [slice(b, b + 1) for b in range(num_seqs)]


def same_tree_batch(
    seqs: list[SeqKV],
    roots: list[int],  # each sequence's one pending token
    trees: list[DraftTree],  # of one shape: the same parents
    page_size: int,
    hidden: bool,  # every row's hidden states wanted too
) -> tuple[ForwardBatch, list[slice]]:
    """`build_forward_batch` of verify steps that each have one pending token and a tree of the
    same shape (a round of chains, most often), every row's logits wanted (`verify_step(seq,
    [root], tree, range(1 + n))`, hidden rows too when `hidden`), built with array ops instead
    of a SeqStep a sequence: the same batch, field for field (~0.25 ms of a speculative round's
    host work at batch 32, bench/decode_host.py --chain 3)."""
    num_seqs, parents = len(seqs), tuple(trees[0].parents)
    q = 1 + len(parents)
    assert q > 1, "a tree (decode steps: decode_batch)"
    assert all(tuple(tree.parents) == parents for tree in trees), "trees of one shape"
    mask, offsets = _tree_layout(1, parents)
    committed, table, slots = _appended_slots(seqs, q, page_size)
    ids = np.empty((num_seqs, q), np.int64)
    ids[:, 0] = roots
    ids[:, 1:] = [tree.tokens for tree in trees]
    rows = np.arange(num_seqs * q, dtype=np.int64)  # every row's logits (and hidden states)
    lens = committed.astype(np.int32)
    batch = _packed_batch(
        np.concatenate(
            [
                ids.reshape(-1),
                (committed[:, None] + np.array(offsets, np.int64)).reshape(-1),
                slots.reshape(-1),
                rows,
                rows if hidden else rows[:0],
            ]
        ),
        (num_seqs * q, num_seqs * q, num_seqs * q if hidden else 0),
        np.concatenate([np.arange(num_seqs + 1, dtype=np.int32) * q, lens + q, lens]),
        torch.from_numpy(table),
        torch.from_numpy(np.broadcast_to(mask.numpy(), (num_seqs, q, q)).copy()),
        q,
        page_size,
    )
    return batch, [slice(b * q, (b + 1) * q) for b in range(num_seqs)]


def build_forward_batch(steps: list[SeqStep], page_size: int) -> tuple[ForwardBatch, list[slice]]:
    """Concatenate steps (host tensors); returns the batch and each step's slice of the logit
    rows (its hidden rows follow each other in step order). The tree mask is built only when
    some step is not causal."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    logit_indices: list[int] = []
    hidden_indices: list[int] = []
    logit_slices: list[slice] = []
    cu_seqlens = [0]
    for step in steps:
        assert step.seq.page_size == page_size, (step.seq.page_size, page_size)
        input_ids += step.input_ids
        positions += step.positions
        slot_mapping += step.seq.slots_of(step.storage)
        start = len(logit_indices)
        logit_indices += [cu_seqlens[-1] + row for row in step.logit_rows]
        hidden_indices += [cu_seqlens[-1] + row for row in step.hidden_rows]
        logit_slices.append(slice(start, len(logit_indices)))
        cu_seqlens.append(cu_seqlens[-1] + len(step.input_ids))
    q_lens = [len(step.input_ids) for step in steps]
    max_q = max(q_lens, default=0)
    tree_mask = None  # built in numpy: per-sequence torch ops cost ~5 us each on the host
    if any(step.new_mask is not None for step in steps):
        max_new = max(step.kv_len - step.prefix_len for step in steps)
        mask = np.zeros((len(steps), max_q, max_new), dtype=bool)
        for b, step in enumerate(steps):
            q, new = len(step.input_ids), step.kv_len - step.prefix_len
            if step.new_mask is not None:
                mask[b, :q, :new] = step.new_mask.numpy()
            else:  # causal: query i sees the new tokens up to its own storage index
                mask[b, :q, :new] = np.tri(q, new, new - q, dtype=bool)
        tree_mask = torch.from_numpy(mask)
    block_table = torch.from_numpy(page_tables([step.seq for step in steps]))
    kv_lens = [step.kv_len for step in steps]
    prefix_lens = [step.prefix_len for step in steps]
    batch = _packed_batch(
        np.array(input_ids + positions + slot_mapping + logit_indices + hidden_indices, np.int64),
        (len(input_ids), len(logit_indices), len(hidden_indices)),
        np.array(cu_seqlens + kv_lens + prefix_lens, np.int32),
        block_table,
        tree_mask,
        max_q,
        page_size,
    )
    return batch, logit_slices


def _packed_batch(
    ints64: np.ndarray,  # input ids, positions, slots [T] each, then logit rows, hidden rows
    sizes: tuple[int, int, int],  # T, the logit rows', the hidden rows'
    ints32: np.ndarray,  # cu_seqlens_q [B + 1], kv_lens [B], prefix_lens [B]
    block_table: torch.Tensor,
    tree_mask: torch.Tensor | None,
    max_q_len: int,
    page_size: int,
) -> ForwardBatch:
    """A batch whose integer fields are views of one array per integer type (torch.tensor of
    each list costs ~5 us); no hidden rows: hidden_indices None."""
    num_tokens, num_logits, num_hidden = sizes
    num_seqs = (ints32.shape[0] - 1) // 3
    i64 = _views(ints64, [num_tokens] * 3 + [num_logits, num_hidden])
    i32 = _views(ints32, [num_seqs + 1, num_seqs, num_seqs])
    return ForwardBatch(
        input_ids=i64[0],
        positions=i64[1],
        slot_mapping=i64[2],
        cu_seqlens_q=i32[0],
        kv_lens=i32[1],
        prefix_lens=i32[2],
        block_table=block_table,
        tree_mask=tree_mask,
        logit_indices=i64[3],
        hidden_indices=i64[4] if num_hidden else None,
        max_q_len=max_q_len,
        page_size=page_size,
    )
