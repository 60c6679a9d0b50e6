"""A round's columns (specsplit/convert.py's round messages): entry i of a per-sequence column
is sequence i's; a flat column holds the sequences' lists back to back by a count column. Each
column is read with one call; what few sequences carry (sampling, draft probabilities,
draft-ahead) travels as an indexed message beside the columns, and a round's draft probabilities
as one message. Malformed data raises ServiceError(INVALID_ARGUMENT) naming the field."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

import numpy as np
import torch

from specsplit.errors import invalid
from specsplit.messages import AheadTree
from specsplit.tree import DRAFT_SUPPORT, DraftProbs, DraftTree, Flat, padded_width
from specsplit.v1 import common_pb2, drafter_pb2, verifier_pb2
from specsplit.wire_tensors import split_rows

T = TypeVar("T")


def fill_probs(msg: common_pb2.DraftProbs, probs: DraftProbs) -> None:
    """Each row's support up to its last nonzero probability, rows back to back, with their
    widths (`DraftProbs.flat`): a drafter's rows hold their kept tokens first
    (`draw_from_cut`: 0 past its tail, top-k and top-p cuts), so a round's rows cross at their
    own widths, not the widest's nor DRAFT_SUPPORT's (a real model's draft rows at T = 0.7 keep
    14 tokens at the median). Exact: a token the support does not list has probability 0
    either way (the reader pads)."""
    msg.vocab_size = probs.vocab_size
    flat = probs.flat()
    msg.row_widths.extend(flat.widths.tolist())
    for column, values, dtype in (
        (msg.tokens, flat.tokens, "int32"),
        (msg.probs, flat.probs, "float32"),
    ):
        column.dtype = dtype
        column.shape.append(values.size)
        column.data = values.astype(dtype, copy=False).tobytes()


def probs_from_proto(msg: common_pb2.DraftProbs, field: str) -> DraftProbs:
    """Draft distributions' supports, checked, at their rows' own widths (padded to [n, k],
    k the widest row's, where asked for: the verifier's acceptance): int32 tokens inside the
    vocabulary and float32 finite, non-negative probabilities, as many of each as the rows'
    widths add up to."""
    if msg.vocab_size <= 0:
        raise invalid(f"{field}.vocab_size = {msg.vocab_size}: must be > 0")
    if msg.tokens.dtype != "int32" or msg.probs.dtype != "float32":
        raise invalid(f"{field}: tokens must be int32 and probs float32")
    widths = np.asarray(msg.row_widths, dtype=np.int64)
    if widths.size and widths.min() < 0:
        raise invalid(f"{field}.row_widths must be >= 0")
    total = int(widths.sum())
    shapes = list(msg.tokens.shape), list(msg.probs.shape)
    if shapes != ([total], [total]):
        raise invalid(
            f"{field}: tokens {shapes[0]} and probs {shapes[1]} must both be [{total}], the "
            "row_widths' sum"
        )
    if len(msg.tokens.data) != 4 * total or len(msg.probs.data) != 4 * total:
        raise invalid(f"{field}: tokens and probs must carry {4 * total} bytes each")
    n, k = widths.size, padded_width(widths)
    if n * k > 2 * total + n * DRAFT_SUPPORT:  # padded, a message could ask for any memory
        raise invalid(
            f"{field}.row_widths pad to {n} x {k} entries, past twice the {total} sent plus "
            f"{DRAFT_SUPPORT} a row"
        )
    # read-only views of the message's bytes (numpy: a few us a check, where torch's ~5)
    ids = np.frombuffer(msg.tokens.data, dtype=np.int32)
    values = np.frombuffer(msg.probs.data, dtype=np.float32)
    if ids.size and not (ids.min() >= 0 and ids.max() < msg.vocab_size):
        raise invalid(f"{field}.tokens outside the vocabulary [0, {msg.vocab_size})")
    if values.size and not ((values >= 0).all() and values.max() < math.inf):  # nan fails >= 0
        raise invalid(f"{field}.probs must be finite and >= 0")
    return DraftProbs.ragged(Flat(ids, values, widths), msg.vocab_size)


def fill_round_probs(msg: common_pb2.DraftProbs, trees: list[DraftTree]) -> None:
    """The draft probabilities of a round's trees that have them, as one message: their rows
    back to back in order (a message per sequence cost ~40 us a sequence to build and read)."""
    parts = [tree.draft_probs for tree in trees if tree.draft_probs is not None]
    if parts:
        fill_probs(msg, DraftProbs.cat(parts))


def read_round_probs(
    msg: verifier_pb2.VerifyRequest | drafter_pb2.DraftResponse,
    trees: list[DraftTree],
    field: str = "draft_probs",
) -> None:
    """Give each of `trees` (those said to have draft probabilities, in order) its rows of the
    round's message (`field`: its DraftProbs field): views of one checked copy."""
    counts = [len(tree) for tree in trees]
    if not msg.HasField(field):  # type: ignore[arg-type]
        if trees:
            raise invalid(f"{len(trees)} trees have draft probabilities; {field} unset")
        return
    probs = probs_from_proto(getattr(msg, field), field)
    if len(probs) != sum(counts):
        raise invalid(
            f"{field} has {len(probs)} rows; the trees said to have them have {sum(counts)} nodes"
        )
    parts = [probs] if len(trees) == 1 else probs.split(counts)
    for tree, part in zip(trees, parts, strict=True):
        tree.draft_probs = part


def column_of(values: Any, num_seqs: int, field: str, default: Any = None) -> list[Any]:
    """A per-sequence column as a list: `num_seqs` entries, or none when it may be left empty
    (`default` for every sequence)."""
    column = list(values)
    if not column and default is not None:
        return [default] * num_seqs
    if len(column) != num_seqs:
        raise invalid(f"{field} has {len(column)} entries for {num_seqs} sequences")
    return column


def split_flat(flat: Iterable[T], counts: list[int], field: str, count_field: str) -> list[list[T]]:
    """Each sequence's list of a flat column (or of items made from columns), `counts[i]`
    entries for sequence i."""
    values = list(flat)
    if len(counts) == 1 and counts[0] == len(values):  # one sequence: its list is the column
        return [values]
    if counts and min(counts) < 0:
        raise invalid(f"{count_field}: a sequence's count is negative ({min(counts)})")
    if sum(counts) != len(values):
        raise invalid(f"{field} has {len(values)} entries, {count_field} sums to {sum(counts)}")
    lists, end = [], 0
    for n in counts:  # (half the time of slicing at itertools.accumulate's ends)
        lists.append(values[end : end + n])
        end += n
    return lists


def flat_lists(msg: Any, num_seqs: int, counts: str, flat: str, default: Any = None) -> list[Any]:
    """Each sequence's list of the flat column `flat`, by the count column `counts`."""
    column = column_of(getattr(msg, counts), num_seqs, counts, default)
    return split_flat(getattr(msg, flat), column, flat, counts)


def indexed(entries: Any, num_seqs: int, field: str) -> dict[int, Any]:
    """An indexed side message per sequence that has one, by index (in order, each once)."""
    by_index: dict[int, Any] = {}
    last = -1
    for entry in entries:
        if not last < entry.index < num_seqs:
            raise invalid(f"{field}: index {entry.index} out of order or outside [0, {num_seqs})")
        by_index[entry.index] = entry
        last = entry.index
    return by_index


TREE_COLUMNS = ("num_tree_nodes", "tree_tokens", "tree_parents")  # a round's trees
AHEAD_COLUMNS = ("num_ahead_nodes", "ahead_tokens", "ahead_parents")  # DraftResponse's ahead


def fill_trees(msg: Any, trees: list[DraftTree], columns: tuple[str, ...] = TREE_COLUMNS) -> None:
    """Each tree into the message's three tree columns (`columns`: the node counts, the flat
    tokens, the flat parents); draft probabilities go in the side messages."""
    counts, tokens, parents = (getattr(msg, name) for name in columns)
    counts.extend([len(tree) for tree in trees])
    tokens.extend([t for tree in trees for t in tree.tokens])
    parents.extend([p for tree in trees for p in tree.parents])


def read_trees(
    msg: Any, num_trees: int, columns: tuple[str, ...] = TREE_COLUMNS
) -> list[DraftTree]:
    """Each tree from the three tree columns (no draft probabilities: see indexed)."""
    counts_name, tokens_name, parents_name = columns
    counts = column_of(getattr(msg, counts_name), num_trees, counts_name, default=0)
    tokens, parents = getattr(msg, tokens_name), getattr(msg, parents_name)
    if not any(counts) and not tokens and not parents:
        return [DraftTree() for _ in counts]  # no drafts: target-only rounds
    token_lists = split_flat(tokens, counts, tokens_name, counts_name)
    parent_lists = split_flat(parents, counts, parents_name, counts_name)
    return [DraftTree(t, p) for t, p in zip(token_lists, parent_lists, strict=True)]


def fill_outcomes(
    msg: drafter_pb2.DraftResponse | verifier_pb2.VerifyHint,
    per_seq: list[list[AheadTree]],
    columns: tuple[str, ...],
) -> None:
    """Each sequence's outcomes and the trees drafted for them into the outcome columns (the
    counts, each outcome's tokens) and the tree columns `columns`."""
    msg.num_outcomes.extend([len(aheads) for aheads in per_seq])
    outcomes = [ahead for aheads in per_seq for ahead in aheads]
    msg.num_outcome_tokens.extend([len(ahead.tokens) for ahead in outcomes])
    msg.outcome_tokens.extend([t for ahead in outcomes for t in ahead.tokens])
    fill_trees(msg, [ahead.tree for ahead in outcomes], columns)


def read_outcomes(
    msg: drafter_pb2.DraftResponse | verifier_pb2.VerifyHint,
    num_seqs: int,
    columns: tuple[str, ...],
) -> list[list[AheadTree]]:
    """Each sequence's outcomes with their trees, from the columns fill_outcomes fills."""
    counts = column_of(msg.num_outcomes, num_seqs, "num_outcomes", default=0)
    num_outcomes = sum(counts)
    outcomes = flat_lists(msg, num_outcomes, "num_outcome_tokens", "outcome_tokens", default=0)
    trees = read_trees(msg, num_outcomes, columns)
    aheads = [AheadTree(t, tree) for t, tree in zip(outcomes, trees, strict=True)]
    return split_flat(aheads, counts, "outcomes", "num_outcomes")


def row_counts(per_sequence: list[torch.Tensor | None]) -> list[int]:
    """A rows column: each sequence's row count, -1 for none; empty when no sequence has rows."""
    if all(rows is None for rows in per_sequence):
        return []
    return [-1 if rows is None else rows.shape[0] for rows in per_sequence]


def rows_of(
    msg: Any,
    counts: Any,
    num_seqs: int,
    field: str,
    count_field: str,
    beside: bytearray | memoryview | None,
) -> list[Any]:
    column = column_of(counts, num_seqs, count_field, default=-1)
    return split_rows(msg, [None if n == -1 else n for n in column], field, beside)


def nothing_beside(beside: bytearray | memoryview | None, message: str) -> None:
    """A message that carries no rows: refuse bytes that came beside it."""
    if beside:
        raise invalid(f"{len(beside)} bytes beside a {message}, which carries no rows")
