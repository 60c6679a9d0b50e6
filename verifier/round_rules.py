"""A round's logit rules (specsplit/logit_rules.py) on its logits, before the acceptance: every
row of every sequence with rules bent in place, as `bend_row` bends one, in one host-to-device
copy and a fixed run of device ops whatever the batch.

Each sequence's bias, output counts and prompt tokens are kept on the device between rounds, a
row each over the vocabulary (verifier/rule_rows.py): the host lists only what changed, the
tokens its commits appended since (or, for a context the rows do not hold, the whole of it),
and per rule row the counts its path changes (each token on the path from the root to the row's
node) and the stop tokens min_tokens holds back; the device brings the rows up to date, gathers
them per rule row and bends the rows' logits in `bend_row`'s order and float32 ops: bias,
repetition, presence and frequency, min_tokens, a guide's masks, min_p. The guide's masks
travel as their words in the table, unpacked to [masks, vocab] bits on the device, each rule row
indexing its own. A decode step run ahead under rules (verifier/run_ahead.py) reads its input
token, which only the device has, into its counts there (`pending`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from specsplit.logit_rules import NO_MASK, LogitRules, Penalties, mask_words, min_p_cut
from specsplit.messages import VerifyInput
from specsplit.model.transfer import to_device
from specsplit.tree import DraftTree, ancestor_mask, depths
from verifier.rule_rows import HasRuleSlot, RuleRows, RuleSlot, drop_slot

# the host table's sections, each [3, n] int32: (slot, token, value) for the rows refilled and
# the deltas counted in (verifier/rule_rows.py); (rule row, token, value) for the paths and the
# stops; a step run ahead's (`pending`): (rule row, the row's input, 0); the slots refilled
_BIAS, _COUNTS, _PROMPT, _DELTAS, _PATHS, _STOPS, _PENDING, _CLEAR = range(8)


def node_paths(tree: DraftTree) -> list[list[int]]:
    """Per node, the tree's tokens from the root's first child down to the node."""
    return [[tree.tokens[j] for j in tree.path_to(node)] for node in range(len(tree))]


@functools.lru_cache(maxsize=256)
def _tree_pairs(parents: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a tree of these parents: every (node, node or one of its ancestors) pair as two index
    arrays (a node's path tokens, each once per occurrence), and each node's depth (a child of
    the root: 1). Cached: a round's trees share few shapes."""
    node, on_path = np.nonzero(ancestor_mask(parents))
    return node, on_path, np.array(depths(parents), dtype=np.int64)


def _as_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as the int32 holding their bits (the table is one int32 array)."""
    return values.astype(np.float32).view(np.int32)


def _from_bits(column: torch.Tensor) -> torch.Tensor:
    return column.contiguous().view(torch.float32)


class _Section:
    """One section of the host table, gathered a sequence at a time as arrays (no per-token
    Python): its entries' owners (a slot or a rule row), tokens and values."""

    def __init__(self) -> None:
        self.owners: list[int] = []
        self.sizes: list[int] = []
        self.tokens: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def add(self, owner: int | np.ndarray, tokens: np.ndarray, values: np.ndarray | int) -> None:
        """Entries for `tokens` (one owner for all, or one each), each its value (or one)."""
        if isinstance(owner, np.ndarray):
            self.owners += owner.tolist()
            self.sizes += [1] * len(owner)
        else:
            self.owners.append(owner)
            self.sizes.append(len(tokens))
        self.tokens.append(tokens)
        if isinstance(values, int):
            values = np.full(len(tokens), values, dtype=np.int64)
        self.values.append(values)

    def array(self) -> np.ndarray:
        """[3, entries] int64: owner, token, value."""
        if not self.tokens:
            return np.zeros((3, 0), dtype=np.int64)
        owners = np.repeat(np.array(self.owners, dtype=np.int64), self.sizes)
        return np.stack([owners, np.concatenate(self.tokens), np.concatenate(self.values)])


def _counted(p: Penalties) -> bool:
    """Whether the penalties read the output's counts (and a row's path)."""
    return p.presence != 0 or p.frequency != 0 or p.repetition != 1


def _add_rows(sections: list[_Section], rules: LogitRules, slot: RuleSlot) -> None:
    """The sequence's kept rows brought to its rules: their deltas counted in where they hold
    its context, else filled from its rules (cleared first)."""
    if slot.holds(rules):
        if slot.deltas:
            sections[_DELTAS].add(slot.index, np.array(slot.deltas, dtype=np.int64), 1)
    else:
        sections[_CLEAR].add(slot.index, np.zeros(1, dtype=np.int64), 0)
        p = rules.penalties
        if p.bias:
            bias_tokens, bias_values = p.bias_arrays
            sections[_BIAS].add(slot.index, bias_tokens, _as_bits(bias_values))
        if _counted(p):
            tokens, counts, prompt = rules.arrays
            if len(tokens):
                sections[_COUNTS].add(slot.index, tokens, counts)
            if p.repetition != 1 and len(prompt):
                sections[_PROMPT].add(slot.index, prompt, 1)
        slot.context = rules
    slot.deltas = []


def _add_sequence(
    sections: list[_Section], rules: LogitRules, tree: DraftTree, first: int, more: int
) -> None:
    """The sequence's entries for its rule rows: its paths' counts and the stop tokens held
    back (its kept rows hold the rest); `first`: its root's row among the rule rows; `more`:
    output tokens its rules do not hold yet (a step run ahead's pending token, on the
    device)."""
    p = rules.penalties
    counted = _counted(p)
    if tree and (counted or (p.min_tokens and p.stop_ids)):
        node, on_path, depth = _tree_pairs(tuple(tree.parents))
    if counted and tree:  # each node's row counts its path's tokens once more
        path_tokens = np.array(tree.tokens, dtype=np.int64)[on_path]
        sections[_PATHS].add(first + 1 + node, path_tokens, 1)
    # the rows whose output holds fewer than min_tokens tokens: their stop tokens held back
    held = p.min_tokens - rules.total - more if p.stop_ids else 0
    if held > 0:
        stop_ids = np.array(p.stop_ids, dtype=np.int64)
        rows = [first] + ((first + 1 + np.flatnonzero(depth < held)).tolist() if tree else [])
        for row in rows:
            sections[_STOPS].add(row, stop_ids, 0)


def bend_by_rules(
    inputs: list[VerifyInput],
    logits: torch.Tensor,  # [L, vocab] float32 on the device, bent in place
    rows: list[range],  # per sequence its n + 1 rows of `logits`
    pending: torch.Tensor | None = None,
    kept: tuple[RuleRows, Sequence[HasRuleSlot]] | None = None,
) -> bool:
    """The rows of the inputs with rules bent by them; whether any were (the logits' argmax
    must then be taken again). pending: a decode step run ahead's input tokens on the device,
    one an input (verifier/run_ahead.py), each its output's next token, which its rules (the
    round's before) do not hold yet: counted on the device. kept: the engine's rows and the
    inputs' sequences, whose slots they keep (verifier/rule_rows.py); None: rows of this call
    alone."""
    ruled = [(i, r) for i, r in enumerate(rows) if inputs[i].rules is not None]
    if not ruled:
        return False
    if kept is None:
        kept = RuleRows(logits.shape[1], logits.device), [_Holder() for _ in inputs]
    table_rows, holders = kept
    sections = [_Section() for _ in range(8)]
    row_of: list[int] = []  # per rule row: its logits row
    k_of: list[int] = []  # per rule row: its sequence
    biased = False  # (any sequence with a bias)
    scalars: list[tuple[float, float, float, float, int]] = []  # per sequence
    for k, (i, r) in enumerate(ruled):
        item = inputs[i]
        rules = item.rules
        assert rules is not None
        p = rules.penalties
        slot = 0
        biased = biased or bool(p.bias)
        if p.bias or _counted(p):
            kept_slot = table_rows.slot(holders[i])
            _add_rows(sections, rules, kept_slot)
            slot = kept_slot.index
        else:
            drop_slot(holders[i])
        first = len(row_of)
        _add_sequence(sections, rules, item.tree, first, int(pending is not None))
        row_of += r
        k_of += [k] * len(r)
        cut = min_p_cut(p.min_p, item.sampling.temperature)
        scalars.append((p.repetition, p.frequency, p.presence, cut, slot))
    if pending is not None:  # (every rule row: its input's token)
        inputs_of = np.repeat([i for i, _ in ruled], [len(r) for _, r in ruled])
        sections[_PENDING].add(np.arange(len(row_of)), inputs_of, 0)
    parts = [section.array() for section in sections]
    sizes = [part.shape[1] for part in parts]
    mask_of, masks = _masks([(inputs[i], r) for i, r in ruled], logits.shape[1])
    rule_rows = np.stack([np.array(row_of), np.array(k_of), np.array(mask_of)])
    # per sequence (columns): repetition, frequency, presence; then min_p's cut and the slot
    per_seq = np.array(scalars).T
    slot_of = per_seq[4].astype(np.int32)
    cut_slot = np.stack([_as_bits(per_seq[3]), slot_of, np.zeros_like(slot_of)])
    # the masks' words, three to a column after the scalars
    flat = np.frombuffer(b"".join(masks), dtype=np.int32)
    words = np.pad(flat, (0, -len(flat) % 3)).reshape(3, -1, order="F")
    parts = [*parts, rule_rows, _as_bits(per_seq[:3]), cut_slot, words]
    table = np.concatenate(parts, axis=1, dtype=np.int32)  # (token ids and rows < 2**31)
    on_device = to_device(torch.from_numpy(table), logits.device)
    ends = np.cumsum([*sizes, len(row_of)]).tolist()
    # the sections as indices (int64), and the bits of the biases and the scalars as float32
    split = torch.tensor_split(on_device[:, : ends[-1]].long(), ends[:-1], dim=1)
    bias, counts, prompt, deltas, paths, stops, pend, clear, rule_rows_d = split
    num_seqs = len(ruled)
    scalar = _from_bits(on_device[:, ends[-1] : ends[-1] + num_seqs])  # [3, K]
    scalars_end = ends[-1] + 2 * num_seqs
    cuts = _from_bits(on_device[0, ends[-1] + num_seqs : scalars_end])  # [K]: min_p's
    _bring_up(table_rows, sizes, bias, counts, prompt, deltas, clear)
    vocab = logits.shape[1]
    rows_at, ks = rule_rows_d[0], rule_rows_d[1]
    slots = on_device[1, ends[-1] + num_seqs : scalars_end].long()[ks]  # [R]: each row's
    x = logits[rows_at]  # [R, vocab]
    if biased:
        x = x + table_rows.bias[slots]
    repeats = any(s[0] != 1 for s in scalars)
    if repeats or any(s[1] != 0 or s[2] != 0 for s in scalars):
        count = table_rows.counts[slots]  # [R, vocab]: each row's output counts, plus its path's
        cells = count.view(-1)
        cells.scatter_add_(0, paths[0] * vocab + paths[1], paths[2].to(logits.dtype))
        if pending is not None:  # (each rule row: its input's token, once)
            drawn = pending.to(torch.int64)[pend[1]]
            ones = torch.ones_like(drawn, dtype=cells.dtype)
            cells.scatter_add_(0, pend[0] * vocab + drawn, ones)
        present = count > 0
        repetition, frequency, presence = (s[ks][:, None] for s in scalar)
        if repeats:  # (x / 1 and x * 1 are x: the rows without it keep theirs)
            seen = present | table_rows.seen[slots]
            x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - (frequency * count + presence * present)
    if sizes[_STOPS]:
        x[stops[0], stops[1]] = _on(x.device, -math.inf)
    if masks:
        words_d = on_device[:, scalars_end:].t().reshape(-1)[: len(flat)]  # (the host's order)
        x.masked_fill_(~_allowed(words_d, rule_rows_d[2], vocab), -torch.inf)
    if any(s[3] > -math.inf for s in scalars):  # (a cut of -inf keeps every token)
        below = x.max(dim=-1, keepdim=True).values + cuts[ks][:, None]
        x = torch.where(x < below, -torch.inf, x)
    logits[rows_at] = x
    return True


def _bring_up(
    table_rows: RuleRows,
    sizes: list[int],
    bias: torch.Tensor,
    counts: torch.Tensor,
    prompt: torch.Tensor,
    deltas: torch.Tensor,
    clear: torch.Tensor,
) -> None:
    """The kept rows as this round's rules read them, queued on the device: the slots refilled
    cleared and filled, the deltas counted in (each [3, n]: slot, token, value)."""
    vocab = table_rows.vocab_size
    if sizes[_CLEAR]:
        for table in (table_rows.bias, table_rows.counts, table_rows.seen):
            table.index_fill_(0, clear[0], 0)  # (a value, not a tensor from the host: no sync)
    if sizes[_BIAS]:
        table_rows.bias.view(-1)[bias[0] * vocab + bias[1]] = _from_bits(bias[2].int())
    if sizes[_COUNTS]:
        table_rows.counts.view(-1)[counts[0] * vocab + counts[1]] = counts[2].float()
    if sizes[_PROMPT]:
        table_rows.seen.view(-1)[prompt[0] * vocab + prompt[1]] = prompt[2].bool()
    if sizes[_DELTAS]:  # (a token twice: counted twice)
        cells = table_rows.counts.view(-1)
        cells.index_put_((deltas[0] * vocab + deltas[1],), deltas[2].float(), accumulate=True)


class _Holder:
    """A sequence's slot for rows kept by one call alone (`bend_by_rules` without `kept`)."""

    rule_slot: RuleSlot | None = None


def _on(device: torch.device, value: float | bool) -> torch.Tensor:
    """`value` made on `device` for an indexed assignment: a Python scalar there is copied from
    the host first, a copy that waits for everything the device has queued (the decode step
    launched ahead of this round's, verifier/run_ahead.py: it would run serial again)."""
    return torch.full((), value, device=device)


def _masks(ruled: list[tuple[VerifyInput, range]], vocab: int) -> tuple[list[int], list[bytes]]:
    """Per rule row its guide's mask among the round's (NO_MASK: none), and those masks, each
    once (rows in one state, of one guide, share theirs, across sequences too)."""
    size = 4 * mask_words(vocab)
    index: dict[bytes, int] = {}
    mask_of: list[int] = []
    for item, r in ruled:
        assert item.rules is not None
        allowed = item.rules.allowed
        if allowed is None:
            mask_of += [NO_MASK] * len(r)
            continue
        words = allowed.words
        mine = [index.setdefault(words[m * size : (m + 1) * size], len(index))
                for m in range(len(words) // size)]  # fmt: skip
        mask_of += [NO_MASK if m == NO_MASK else mine[m] for m in allowed.rows]
    return mask_of, list(index)


def _allowed(words: torch.Tensor, mask_of: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] bool: each rule row's allowed tokens from the masks' words (int32 on the device,
    mask after mask) and its mask (NO_MASK: every token)."""
    num_words = mask_words(vocab)
    masks = words.new_empty(len(words) // num_words, 4 * num_words, dtype=torch.uint8)
    masks.view(torch.int32).copy_(words.view(-1, num_words))  # [M, 4 words]: 8 tokens a byte
    every = torch.full_like(masks[:1], 255)  # the last: NO_MASK's
    rows = torch.cat([masks, every])[torch.where(mask_of == NO_MASK, len(masks), mask_of)]
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    return ((rows[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
