"""A round's logit rules (specsplit/logit_rules.py) on its logits, before the acceptance: every
row of every sequence with rules bent in place, as `bend_row` bends one, in one host-to-device
copy and a fixed run of device launches whatever the batch.

Each sequence's bias, output counts and prompt tokens are kept on the device between rounds, a
row each over the vocabulary (verifier/rule_rows.py): the host lists only what changed, the
tokens its commits appended since (or, for a context the rows do not hold, the whole of it),
and per rule row the counts its path changes (each token on the path from the root to the row's
node) and the stop tokens min_tokens holds back; the device brings the rows up to date and bends
the rows' logits (specsplit/kernels/bend_rules.py: on a GPU three Triton launches, elsewhere
torch's ops) in `bend_row`'s order and float32 ops: bias, repetition, presence and frequency,
min_tokens, a guide's masks, min_p. The guide's masks travel as their words in the table, each
rule row indexing its own. A decode step run ahead under rules (verifier/run_ahead.py) reads its
input token, which only the device has, into its counts there (`pending`). A steady round on the
forward graph's logits (no slot refilled, no stop token held back) goes to the engine's rules
graphs instead, its entries packed into a fixed layout: one copy and one replay
(verifier/rules_graphs.py)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from specsplit.kernels.bend_rules import (
    BIAS,
    CLEAR,
    COUNTS,
    DELTAS,
    PATHS,
    PENDING,
    PROMPT,
    SECTIONS,
    STOPS,
    Layout,
    as_bits,
    bend_rows,
)
from specsplit.logit_rules import NO_MASK, LogitRules, Penalties, mask_words, min_p_cut
from specsplit.messages import VerifyInput
from specsplit.model.transfer import to_device
from specsplit.tree import DraftTree, ancestor_mask, depths
from verifier.rule_rows import HasRuleSlot, RuleRows, RuleSlot, drop_slot
from verifier.rules_graphs import Bent, RulesGraphs, Steady


def node_paths(tree: DraftTree) -> list[list[int]]:
    """Per node, the tree's tokens from the root's first child down to the node."""
    return [[tree.tokens[j] for j in tree.path_to(node)] for node in range(len(tree))]


@functools.lru_cache(maxsize=256)
def _tree_pairs(parents: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
    """For a tree of these parents: every (node, node or one of its ancestors) pair as two index
    lists (a node's path tokens, each once per occurrence), and each node's depth (a child of
    the root: 1). Cached: a round's trees share few shapes."""
    node, on_path = np.nonzero(ancestor_mask(parents))
    return node.tolist(), on_path.tolist(), list(depths(parents))


class _Section:
    """One section of the host table, gathered a sequence at a time as Python lists (a round's
    steady entries are a few tokens a sequence: numpy's per-call cost would outweigh them), made
    one array at the end: its entries' owners (a slot or a rule row), tokens and values (or
    `value`, every entry's)."""

    def __init__(self, value: int | None = None) -> None:
        self.value = value
        self.owners: list[int] = []
        self.tokens: list[int] = []
        self.values: list[int] = []

    def add(
        self,
        owner: int | list[int],
        tokens: list[int] | np.ndarray,
        values: np.ndarray | None = None,
    ) -> None:
        """Entries for `tokens` (one owner for all, or one each), each its value (`values`, or
        the section's)."""
        tokens = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
        self.owners += owner if isinstance(owner, list) else [owner] * len(tokens)
        self.tokens += tokens
        if values is not None:
            self.values += values.tolist()

    def array(self) -> np.ndarray:
        """[3, entries] int64: owner, token, value."""
        values = self.values if self.value is None else [self.value] * len(self.tokens)
        return np.array([self.owners, self.tokens, values], dtype=np.int64).reshape(3, -1)


# each section's value for all its entries (None: each its own)
_VALUES = {BIAS: None, COUNTS: None, PROMPT: 1, DELTAS: 1, PATHS: 1, STOPS: 0, PENDING: 0, CLEAR: 0}


def _counted(p: Penalties) -> bool:
    """Whether the penalties read the output's counts (and a row's path)."""
    return p.presence != 0 or p.frequency != 0 or p.repetition != 1


def _add_rows(sections: list[_Section], rules: LogitRules, slot: RuleSlot) -> None:
    """The sequence's kept rows brought to its rules: their deltas counted in where they hold
    its context, else filled from its rules (cleared first)."""
    if slot.holds(rules):
        if slot.deltas:
            sections[DELTAS].add(slot.index, slot.deltas)
    else:
        sections[CLEAR].add(slot.index, [0])
        p = rules.penalties
        if p.bias:
            bias_tokens, bias_values = p.bias_arrays
            sections[BIAS].add(slot.index, bias_tokens, as_bits(bias_values))
        if _counted(p):
            tokens, counts, prompt = rules.arrays
            if len(tokens):
                sections[COUNTS].add(slot.index, tokens, counts)
            if p.repetition != 1 and len(prompt):
                sections[PROMPT].add(slot.index, prompt)
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
        tokens = tree.tokens
        sections[PATHS].add([first + 1 + n for n in node], [tokens[j] for j in on_path])
    # the rows whose output holds fewer than min_tokens tokens: their stop tokens held back
    held = p.min_tokens - rules.total - more if p.stop_ids else 0
    if held > 0:
        stop_ids = list(p.stop_ids)
        rows = [first] + ([first + 1 + n for n, d in enumerate(depth) if d < held] if tree else [])
        for row in rows:
            sections[STOPS].add(row, stop_ids)


def bend_by_rules(
    inputs: list[VerifyInput],
    logits: torch.Tensor,  # [L, vocab] float32 on the device, bent in place
    rows: list[range],  # per sequence its n + 1 rows of `logits`
    pending: torch.Tensor | None = None,
    kept: tuple[RuleRows, Sequence[HasRuleSlot]] | None = None,
    kernel: bool | None = None,
    graphs: RulesGraphs | None = None,
    no_graphs: str = "no graphs",
) -> Bent | None:
    """The rows of the inputs with rules bent by them, or None where none has rules (where
    some had, the logits' argmax must be taken again: a graph's comes with it; `Bent.eager`
    says why no graph bent them: `no_graphs` without `graphs`, "refill", or the graphs'). pending: a
    decode step run ahead's input tokens on the device, one an input (verifier/run_ahead.py),
    each its output's next token, which its rules (the round's before) do not hold yet:
    counted on the device. kept: the engine's rows and the inputs' sequences, whose slots they
    keep (verifier/rule_rows.py); None: rows of this call alone. kernel: the Triton kernels
    (True) or torch's ops; None: the kernels on a GPU. graphs: the engine's rules graphs,
    where the logits are a view of the forward graph's output (a qualifying round replays
    one, verifier/rules_graphs.py); no_graphs: why there are none ("logits": the engine has
    them, but the forward's rows were gathered)."""
    ruled = [(i, r) for i, r in enumerate(rows) if inputs[i].rules is not None]
    if not ruled:
        return None
    if kept is None:
        kept = RuleRows(logits.shape[1], logits.device), [_Holder() for _ in inputs]
    table_rows, holders = kept
    sections = [_Section(_VALUES[section]) for section in SECTIONS]
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
    inputs_of = [i for i, r in ruled for _ in r] if pending is not None else None
    flags = (
        biased,
        any(s[0] != 1 or s[1] != 0 or s[2] != 0 for s in scalars),  # counted
        any(s[0] != 1 for s in scalars),  # repeats
        any(s[3] > -math.inf for s in scalars),  # cut (a cut of -inf keeps every token)
    )
    tables = (table_rows.bias, table_rows.counts, table_rows.seen)
    mask_of, masks = _masks([(inputs[i], r) for i, r in ruled], logits.shape[1])
    flat = np.frombuffer(b"".join(masks), dtype=np.int32)
    # a steady round (no slot refilled, no stop token held back) fits a graph
    refills = any(sections[s].tokens for s in (BIAS, COUNTS, PROMPT, STOPS, CLEAR))
    eager = no_graphs if graphs is None else "refill" if refills else None
    if graphs is not None and not refills:
        deltas, paths = sections[DELTAS], sections[PATHS]
        guided = (mask_of, flat, mask_words(logits.shape[1])) if masks else (None, None, 0)
        entries = Steady(
            (deltas.owners, deltas.tokens), (paths.owners, paths.tokens), inputs_of,
            row_of, k_of, scalars, flags, *guided,
        )  # fmt: skip
        greedy = all(item.sampling.greedy for item in inputs)
        bent = graphs.bend(logits, entries, tables, pending, greedy)
        if isinstance(bent, Bent):
            return bent
        eager = bent
    if inputs_of is not None:  # (every rule row: its input's token)
        sections[PENDING].add(list(range(len(row_of))), inputs_of)
    parts = [section.array() for section in sections]
    sizes = [part.shape[1] for part in parts]
    rule_rows = np.stack([np.array(row_of), np.array(k_of), np.array(mask_of)])
    # per rule row its first path entry and first stop entry (each section in rule row order)
    first_of = np.arange(len(row_of) + 1)
    extents = [np.searchsorted(parts[s][0], first_of) for s in (PATHS, STOPS)]
    extents_part = np.stack([*extents, np.zeros_like(first_of)])
    # per sequence (columns): repetition, frequency, presence; then min_p's cut and the slot
    per_seq = np.array(scalars).T
    slot_of = per_seq[4].astype(np.int32)
    cut_slot = np.stack([as_bits(per_seq[3]), slot_of, np.zeros_like(slot_of)])
    # the masks' words, three to a column after the scalars
    words = np.pad(flat, (0, -len(flat) % 3)).reshape(3, -1, order="F")
    parts = [*parts, rule_rows, extents_part, as_bits(per_seq[:3]), cut_slot, words]
    table = np.concatenate(parts, axis=1, dtype=np.int32)  # (token ids and rows < 2**31)
    layout = Layout(
        tuple(np.cumsum([0, *sizes]).tolist()), len(row_of), len(ruled), len(flat), *flags
    )
    on_device = to_device(torch.from_numpy(table), logits.device)
    bend_rows(logits, on_device, layout, tables, pending, kernel)
    return Bent(eager=eager)


class _Holder:
    """A sequence's slot for rows kept by one call alone (`bend_by_rules` without `kept`)."""

    rule_slot: RuleSlot | None = None


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
