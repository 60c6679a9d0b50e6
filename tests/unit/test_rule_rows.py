"""Each sequence's logit-rules rows kept on the device between rounds (verifier/rule_rows.py):
rounds whose rules read the context a commit kept count only the appended tokens into the rows,
not the context again, and bend every row exactly as the one-row reference does (bit for bit),
through commits, a decode step run ahead (its pending token on the device) and the tables
growing; a context the rows do not hold is filled in their place; a slot goes back when its
sequence's rules end, on release and truncate, and when its sequence is collected."""

from __future__ import annotations

import gc
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from specsplit.logit_rules import LogitRules, Penalties, distinct
from specsplit.messages import Truncation, VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.rules_reference import rules_for
from tests.unit.test_verify_logprobs import (  # noqa: F401  (fixtures)
    PROMPT,
    _engine,
    device,
    reference,
    target_dir,
)
from tests.unit.test_verify_rules import STRONG, _rules, reference_bend
from verifier.kept_rules import keep_rules
from verifier.round_rules import bend_by_rules
from verifier.rounds import VerifierSeq
from verifier.rule_rows import TRIM_DELAY_S, RuleRows, drop_slot
from verifier.rules_graphs import RulesGraphs

VOCAB = 64
SAMPLED = SamplingParams(temperature=0.8)
KINDS = [
    Penalties(bias=((3, 2.0), (50, -7.5))),
    Penalties(presence=0.5, frequency=1.25),
    Penalties(repetition=1.4),
    replace(STRONG, min_tokens=6, stop_ids=(1, 2), min_p=0.1),
    Penalties(min_p=0.2),  # (reads no rows: slot 0, zeros)
    Penalties(frequency=-0.5, bias=((9, 1.0),)),
]


class _Seqs:
    """Sequences as the verifier keeps them (rules, slot), with their whole outputs (what the
    gateway would send) and the engine's rows."""

    def __init__(
        self,
        num: int,
        on: str = "cpu",
        kernel: bool | None = None,
        graphs: RulesGraphs | None = None,
    ) -> None:
        self.kernel = kernel  # (the Triton kernels: True, torch's ops: False, None: by device)
        self.graphs = graphs  # (the rules graphs' fixed layout, where a round qualifies)
        self.rows = RuleRows(VOCAB, on)
        self.seqs = [VerifierSeq(f"s{i}", None) for i in range(num)]  # type: ignore[arg-type]
        self.kinds = [KINDS[i % len(KINDS)] for i in range(num)]
        self.prompts = [distinct([i, 7, 30 + i, 63]) for i in range(num)]
        self.outputs: list[list[int]] = [[i % 5, 40] for i in range(num)]

    def sent(self, i: int, more: list[int] | None = None) -> LogitRules | None:
        """Sequence i's rules as the wire makes them (new objects) for its output and `more`."""
        return rules_for(self.kinds[i], self.prompts[i], Counter(self.outputs[i] + (more or [])))

    def bend(self, items: list[VerifyInput], pending: torch.Tensor | None = None) -> None:
        """Bend a round of `items` through the kept rows and check it against the reference."""
        rows, start = [], 0
        for item in items:
            rows.append(range(start, start + len(item.tree) + 1))
            start += len(item.tree) + 1
        logits = torch.randn(start, VOCAB) * 4
        if pending is None:
            want = reference_bend(items, rows, logits)
        else:  # (each step's output through its pending token)
            counted = [
                replace(item, rules=self.sent(int(item.seq_id[1:]), [int(p)]))
                for item, p in zip(items, pending.tolist(), strict=True)
            ]
            want = reference_bend(counted, rows, logits)
        seqs = [self.seqs[int(item.seq_id[1:])] for item in items]
        on = self.rows.device
        got = logits.to(on)
        pending = None if pending is None else pending.to(on)
        kept, kernel, graphs = (self.rows, seqs), self.kernel, self.graphs
        if on.type != "cuda":
            assert bend_by_rules(items, got, rows, pending, kept, kernel, graphs)
        else:  # (behind queued work, as a step run ahead: waiting for none of it)
            torch.cuda.synchronize()
            torch.cuda._sleep(10**6)
            torch.cuda.set_sync_debug_mode("error")
            try:
                assert bend_by_rules(items, got, rows, pending, kept, kernel, graphs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got.cpu(), want)

    def commit(self, item: VerifyInput, appended: list[int]) -> None:
        i = int(item.seq_id[1:])
        keep_rules(item, self.seqs[i], appended)
        self.outputs[i] += appended


def _tree(rng: random.Random) -> DraftTree:
    n = rng.randint(0, 4)
    return DraftTree(
        [rng.randrange(VOCAB) for _ in range(n)], [rng.randint(-1, j - 1) for j in range(n)]
    )


def test_rounds_count_only_what_their_commits_appended(
    on: str = "cpu", kernel: bool | None = None, graphs: RulesGraphs | None = None
) -> None:
    """Ten sequences (the tables grow past their first seven slots) of every kind of rules,
    fifteen rounds of random trees, each round's rules new objects for the output so far: every
    row equals the reference's, and each sequence's rows were filled once, by its first round
    (the slot's context stays the rules the commits kept, never the round's sent ones)."""
    torch.manual_seed(2)
    rng = random.Random(2)
    state = _Seqs(10, on, kernel, graphs)
    for round_number in range(15):
        items = [
            VerifyInput(seq.seq_id, False, 10, [4], _tree(rng), SAMPLED, rules=state.sent(i))
            for i, seq in enumerate(state.seqs)
        ]
        kept = [seq.rules for seq in state.seqs]
        state.bend(items)
        for i, (item, seq) in enumerate(zip(items, state.seqs, strict=True)):
            slot = seq.rule_slot
            if state.kinds[i] == Penalties(min_p=0.2):
                assert slot is None
                continue
            assert slot is not None and not slot.deltas
            if round_number:  # (the rows followed the commits: not filled again)
                assert slot.context is kept[i] and slot.context is not item.rules
            nodes = item.tree.path_to(rng.randrange(len(item.tree))) if item.tree else []
            state.commit(item, [item.tree.tokens[j] for j in nodes] + [rng.randrange(VOCAB)])
    assert state.rows.num_used == 9 and len(state.rows.bias) == 16  # (slot 0 and 15 more)


def test_a_step_run_ahead_counts_its_pending_token_and_its_commit_follows(
    on: str = "cpu", kernel: bool | None = None, graphs: RulesGraphs | None = None
) -> None:
    """A decode round, then the step run ahead behind it (its rules the round's, its input the
    round's token, which only the device has), then both commits: each bends as the reference
    does with its output through its pending token, and the round after reads the rows as the
    two commits left them."""
    torch.manual_seed(4)
    state = _Seqs(3, on, kernel, graphs)
    for _ in range(4):
        items = [
            VerifyInput(s.seq_id, False, 10, [4], DraftTree(), SAMPLED, rules=state.sent(i))
            for i, s in enumerate(state.seqs)
        ]
        state.bend(items)
        tokens = [11, 12, 3]
        ahead = [replace(item) for item in items]  # (the round's rules)
        state.bend(ahead, torch.tensor(tokens, dtype=torch.int32))
        for item, token in zip(items, tokens, strict=True):
            state.commit(item, [token])
        for item, seq in zip(ahead, state.seqs, strict=True):  # (`_finish_round`)
            item.rules = seq.rules
            state.commit(item, [5])
    last = [
        VerifyInput(
            s.seq_id, False, 10, [4], DraftTree([3, 5], [-1, 0]), SAMPLED, rules=state.sent(i)
        )
        for i, s in enumerate(state.seqs)
    ]
    state.bend(last)


def test_a_context_the_rows_do_not_hold_fills_them_again() -> None:
    """Rules whose output is not the kept one (a context sent again after the verifier lost it,
    or another generation's) bend as the reference does: the rows are filled from them, the
    deltas dropped."""
    torch.manual_seed(6)
    state = _Seqs(2)
    items = [
        VerifyInput(s.seq_id, False, 10, [4], DraftTree(), SAMPLED, rules=state.sent(i))
        for i, s in enumerate(state.seqs)
    ]
    state.bend(items)
    for item in items:
        state.commit(item, [9, 9])
    state.outputs[0] = [1, 2, 2, 60]  # (not what the commits kept)
    state.kinds[1] = replace(state.kinds[1], frequency=2.0)  # (other penalties)
    items = [
        VerifyInput(s.seq_id, False, 10, [4], DraftTree([2], [-1]), SAMPLED, rules=state.sent(i))
        for i, s in enumerate(state.seqs)
    ]
    state.bend(items)
    for item, seq in zip(items, state.seqs, strict=True):
        assert seq.rule_slot is not None and seq.rule_slot.context is item.rules


def test_slots_go_back_when_rules_end_and_with_their_sequences() -> None:
    """min_tokens reached with nothing else left: the commit gives the slot back; a sequence
    collected gives its own back; a slot given back serves the next sequence, refilled."""
    state = _Seqs(2)
    state.kinds = [Penalties(min_tokens=3, stop_ids=(1,), bias=((4, 1.0),)), STRONG]
    items = [
        VerifyInput(s.seq_id, False, 10, [4], DraftTree(), SAMPLED, rules=state.sent(i))
        for i, s in enumerate(state.seqs)
    ]
    state.bend(items)
    assert state.rows.num_used == 2
    state.kinds[0] = Penalties(min_tokens=3, stop_ids=(1,))
    items[0] = replace(items[0], rules=state.sent(0))
    state.bend(items[:1])  # (its rules read no rows now: given back)
    assert state.seqs[0].rule_slot is None and state.rows.num_used == 1
    index = state.seqs[1].rule_slot.index  # type: ignore[union-attr]
    del state.seqs[1], items
    gc.collect()
    assert state.rows.num_used == 0
    other = VerifierSeq("s1", None)  # type: ignore[arg-type]
    state.seqs.append(other)
    state.outputs[1] = [8]
    state.bend([VerifyInput("s1", False, 10, [4], DraftTree(), SAMPLED, rules=state.sent(1))])
    assert other.rule_slot is not None and other.rule_slot.index in (index, 1)


class _Clock:
    """Seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_tables_shrink_once_the_slots_in_use_sit_low() -> None:
    """A burst of 40 sequences grows the tables to 64 slots; `trim` keeps them while a slot in
    use sits in their upper three quarters, and halves them down to 8 once the slots in use
    (the lowest two) have sat in the lowest quarter TRIM_DELAY_S: those keep their rows and
    indices, and the next sequence takes the lowest free slot."""
    clock = _Clock()
    rows = RuleRows(VOCAB, "cpu", clock=clock)
    seqs = [VerifierSeq(f"s{i}", None) for i in range(40)]  # type: ignore[arg-type]
    slots = [rows.slot(seq) for seq in seqs]
    assert [slot.index for slot in slots] == list(range(1, 41)) and len(rows.bias) == 64
    rows.counts[2, 5] = 3.0
    for seq in seqs[2:30] + seqs[31:]:
        drop_slot(seq)
    rows.trim()
    assert len(rows.bias) == 64 and rows.num_used == 3  # (slot 31 in use: past 64 / 4)
    drop_slot(seqs[30])
    rows.trim()  # (trimmable from now)
    clock.now += TRIM_DELAY_S - 0.5
    rows.trim()
    assert len(rows.bias) == 64
    clock.now += 0.5
    rows.trim()
    assert len(rows.bias) == len(rows.counts) == len(rows.seen) == 8 and rows.num_used == 2
    tables = (rows.bias, rows.counts, rows.seen)
    assert rows.nbytes == sum(t.numel() * t.element_size() for t in tables)  # (the metric's)
    assert rows.counts[2, 5] == 3.0 and seqs[1].rule_slot is slots[1] and slots[1].index == 2
    assert rows.slot(VerifierSeq("new", None)).index == 3  # type: ignore[arg-type]
    clock.now += 2 * TRIM_DELAY_S
    rows.trim()
    assert len(rows.bias) == 8


def test_a_batch_that_leaves_and_comes_back_keeps_the_tables() -> None:
    """A batch of 8 grows the tables to 16 slots; released and sent again within TRIM_DELAY_S,
    it finds the same tables (their addresses are what the rules graphs hold, so a new table
    would drop every graph): a slot taken past the lowest quarter restarts the delay, and a
    trimmable spell only counts from the first `trim` that sees it."""
    clock = _Clock()
    rows = RuleRows(VOCAB, "cpu", clock=clock)
    for _ in range(3):
        batch = [VerifierSeq(f"s{i}", None) for i in range(8)]  # type: ignore[arg-type]
        for seq in batch:
            rows.slot(seq)
        tables = rows.bias.data_ptr()
        assert len(rows.bias) == 16
        clock.now += TRIM_DELAY_S  # (a long batch: its slots were in use, not trimmable)
        for seq in batch:
            drop_slot(seq)
        rows.trim()
        assert rows.bias.data_ptr() == tables and rows.num_used == 0
        clock.now += TRIM_DELAY_S / 2
    rows.trim()  # (TRIM_DELAY_S / 2 since the last release found them trimmable)
    assert len(rows.bias) == 16
    clock.now += TRIM_DELAY_S / 2
    rows.trim()
    assert len(rows.bias) == 8


def test_release_and_truncate_give_the_engines_slots_back(
    target_dir: Path,  # noqa: F811
    device: str,  # noqa: F811
) -> None:
    """Through the engine: a sequence with rules holds a slot while its rules read rows; a
    truncate (the next turn sends its own rules) and a release give it back
    (`check_integrity` counts them)."""
    engine = _engine(target_dir, device)
    for seq_id in ("a", "b"):
        first = VerifyInput(seq_id, True, 0, PROMPT, DraftTree(), rules=_rules(STRONG, []))
        out = engine.verify([first])[0]
        item = VerifyInput(
            seq_id, False, len(PROMPT), [out.bonus_token], DraftTree(),
            rules=_rules(STRONG, [out.bonus_token]),
        )  # fmt: skip
        engine.verify([item])
    assert engine.rule_rows.num_used == 2
    engine.check_integrity()
    engine.truncate([Truncation("a", len(PROMPT))])
    assert engine.seqs["a"].rule_slot is None and engine.rule_rows.num_used == 1
    engine.release(["b"])
    assert engine.rule_rows.num_used == 0
    engine.check_integrity()
    engine.release(["a"])
