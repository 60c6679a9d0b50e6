"""The gateway's hints on the verifier (draft-ahead's trees for the outcomes of a round in flight,
`NextTrees`) as the engine keeps them between rounds: the next round each sequence's hint names,
the sequences of the round finished last that wait for theirs (`launch_on_hint`), and why a
round of a sequence that sends hints had none run ahead after it. Host state only: the engine
launches the rounds (`VerifierEngine._launch_next`) and counts the ones taken or dropped."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Container

from specsplit.messages import NextTrees, VerifyInput, VerifyOutput
from specsplit.tree import DraftTree
from verifier.rounds import round_base

# why no round ran ahead after a round (specsplit_round_not_ahead_total{reason}): "late" (no hint
# for it before the next round started), "stale" (a hint for another round), "unguessed" (the
# outcome was not among the hint's, and misses do not run plain), "refused" (the checks, the
# context or free pages), "busy" (that round ran further decode steps, or the device had other
# work queued), "off" (the gateway sent no hint for that round: VerifyInput.unhinted, the
# overlap gate's draft-ahead rounds without hints)
NOT_AHEAD_REASONS = ("late", "stale", "unguessed", "refused", "busy", "off")
# the guess rate (`HintBook.guess_rate`): over the last GUESS_WINDOW sequence rounds that had a
# hint for them, once GUESS_MIN_ROUNDS have; a hint that runs misses plain guesses every round
# (the one after a miss is the plain round)
GUESS_WINDOW = 32
GUESS_MIN_ROUNDS = 8


class HintBook:
    def __init__(self) -> None:
        self.next: dict[str, NextTrees] = {}  # by sequence, until the round it names finishes
        # the round finished last, by sequence (its input and output), while its hints may
        # still launch its next round (the engine's launch_on_hint)
        self.finished: dict[str, tuple[VerifyInput, VerifyOutput]] = {}
        # sequences whose last round had a hint: their rounds run no decode step ahead (their
        # next round is most often a tree the hint names, which would drop the step)
        self.hinted: set[str] = set()
        self.hinting: set[str] = set()  # sequences that sent a hint: the counts are theirs
        # the sequences counted "late" at the last round's start, by the round their hint would
        # name: a hint that comes after that is dropped
        self.missed: dict[str, int] = {}
        self.num_not_ahead: Counter[str] = Counter()
        self.on_not_ahead: Callable[[str], None] | None = None
        # per sequence round that had a hint for it, lately: whether the hint named the round
        # after it (its outcome among the hint's, or a miss run plain: `guess_rate`)
        self.guessed: deque[bool] = deque(maxlen=GUESS_WINDOW)

    def store(self, hints: list[NextTrees], known: Container[str]) -> list[str]:
        """Keep `hints` by sequence (only for sequences in `known`: nothing would ever drop the
        others), one dict entry each; the ids whose hint is kept (not one for a round that has
        started already)."""
        kept = []
        for hint in hints:
            if hint.seq_id not in known:
                continue
            self.hinting.add(hint.seq_id)
            if self.missed.get(hint.seq_id) != hint.base:
                self.next[hint.seq_id] = hint
                kept.append(hint.seq_id)
        return kept

    def wants(self) -> bool:
        """Whether a finished round needs looking at: hints kept, or sequences that send them."""
        return bool(self.next or self.hinting)

    def round_finished(self, inputs: list[VerifyInput], outputs: list[VerifyOutput]) -> None:
        """A round of `inputs` finished (answered by `outputs`): the round before it waits for
        no hint now, which of its sequences had one is noted (`hinted`), and for each hint
        that named this round whether it named the round after it (`guess_rate`)."""
        self.finished.clear()
        for item, out in zip(inputs, outputs, strict=True):
            hint = self.next.get(item.seq_id)
            if hint is None:
                self.hinted.discard(item.seq_id)
                continue
            self.hinted.add(item.seq_id)
            if hint.base == round_base(out):
                self.guessed.append(hint.plain or _outcome_tree(hint, out) is not None)

    def guess_rate(self) -> float | None:
        """The share of the last sequence rounds with a hint whose next round the hint named:
        its outcome among the hint's, or a miss the hint runs plain (GUESS_WINDOW of them); None
        before GUESS_MIN_ROUNDS."""
        if len(self.guessed) < GUESS_MIN_ROUNDS:
            return None
        return sum(self.guessed) / len(self.guessed)

    def round_started(self) -> None:
        """A round started: the sequences waiting for their hints have none run ahead now
        ("late"), and a hint that comes for them after this is dropped (`missed`)."""
        if self.finished:  # (every greedy sequence of a round is parked: most send no hints)
            finished, self.finished = self.finished, {}
            self.missed = {k: round_base(o) for k, (_, o) in finished.items() if k in self.hinting}
            self.not_ahead([k for k in self.missed if not finished[k][0].unhinted], "late")
            self.not_ahead([k for k in self.missed if finished[k][0].unhinted], "off")

    def park(
        self, inputs: list[VerifyInput], outputs: list[VerifyOutput], known: Container[str]
    ) -> None:
        """Keep the round's greedy sequences that are still `known` in `finished`: their next
        rounds launch once the answer went out, or when their hints come."""
        for item, out in zip(inputs, outputs, strict=True):
            if item.sampling.greedy and item.seq_id in known:
                self.finished[item.seq_id] = (item, out)

    def ready(self, seq_ids: list[str]) -> list[tuple[VerifyInput, VerifyOutput]]:
        """Take the parked rounds of `seq_ids` whose kept hint names them."""
        return [
            self.finished.pop(s)
            for s in seq_ids
            if s in self.finished and s in self.next
            and self.next[s].base == round_base(self.finished[s][1])
        ]  # fmt: skip

    def waiting(self) -> list[str]:
        """The parked sequences that have a hint kept."""
        return [seq_id for seq_id in self.finished if seq_id in self.next]

    def next_tree(self, item: VerifyInput, out: VerifyOutput, park: bool) -> DraftTree | None:
        """The tree of the round after `item`'s (answered by `out`) that its hint names (an
        empty one for a miss run plain), the hint taken. None where none runs: no hint yet
        (with `park` the round waits for it in `finished`), a hint for another round, or the
        outcome not among the hint's (each counted)."""
        hint = self.next.pop(item.seq_id, None)
        if hint is None and park:
            self.finished[item.seq_id] = (item, out)
            return None
        if hint is None or hint.base != round_base(out):
            reason = "stale" if hint is not None else "off" if item.unhinted else "late"
            self.not_ahead([item.seq_id], reason)
            return None
        tree = _outcome_tree(hint, out)
        if tree is None and not hint.plain:
            self.not_ahead([item.seq_id], "unguessed")
            return None
        return DraftTree() if tree is None else tree

    def take(self, seq_ids: list[str]) -> None:
        """These sequences' hints were used: their next round is queued already (chained on
        the device behind the round they named)."""
        for seq_id in seq_ids:
            self.next.pop(seq_id, None)

    def drop(self, seq_ids: list[str], reason: str) -> None:
        """No round runs ahead after these sequences' round (`reason`): their hints for it are
        of no use now."""
        for seq_id in seq_ids:
            self.next.pop(seq_id, None)
        self.not_ahead(seq_ids, reason)

    def not_ahead(self, seq_ids: list[str], reason: str) -> None:
        """Count the sequences of `seq_ids` that send hints as having no round run ahead after
        their last round, for `reason` (NOT_AHEAD_REASONS)."""
        for seq_id in seq_ids:
            if seq_id in self.hinting:
                self.num_not_ahead[reason] += 1
                if self.on_not_ahead is not None:
                    self.on_not_ahead(reason)

    def forget(self, seq_id: str, released: bool) -> None:
        """A sequence truncated (its next rounds start from the new length) or released."""
        self.next.pop(seq_id, None)
        self.finished.pop(seq_id, None)
        if released:
            self.hinted.discard(seq_id)
            self.hinting.discard(seq_id)
            self.missed.pop(seq_id, None)


def _outcome_tree(hint: NextTrees, out: VerifyOutput) -> DraftTree | None:
    """The tree `hint` names for the outcome `out` answers (its accepted drafts and bonus
    token), or None where the hint did not guess it."""
    outcome = [*out.accepted_tokens, out.bonus_token]
    return next((t.tree for t in hint.trees if t.tokens == outcome), None)
