"""Each sequence's logit-rules rows kept on the device between rounds (`RuleRows`): its bias, its
output's counts and its prompt's tokens spread over the vocabulary, a row each in [slots, vocab]
tables, so a round's bending (verifier/round_rules.py) reads them by the sequence's slot instead
of sending and spreading them again every round (at batch 32 with a 512-token prompt and a few
hundred distinct output tokens, ~300 KiB and ~2.5 ms of host a round on an H200,
bench/RESULTS.md).

A sequence's `RuleSlot` (on VerifierSeq) says which rules' context its rows hold once its
`deltas` (the tokens its commits appended since the rows were last brought up to date) are
counted in: each commit adds its tokens (`keep`, from verifier/kept_rules.py), each bending that
reads the rows counts them in first, in its own host-to-device copy, so the rows follow the
output without a copy of their own. A round whose rules read another context (a first round, a
context sent again, other penalties) fills the rows from its rules. Every device op is queued
on the one stream in the host's order, so a round reads its rows as they were when it was
launched whatever is queued behind it. Slot 0 stays zero: the rows of the rules that read none
(min_tokens, min_p or a guide alone)."""

from __future__ import annotations

import heapq
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specsplit.logit_rules import LogitRules

MIN_SLOTS = 8  # the tables' slots at first and at least (slot 0 among them)
# `trim` halves the tables only once they have been trimmable this long: a batch that leaves
# and comes back (or a count of ruled sequences that swings about a power of two) would
# otherwise shrink them and grow them again, and each new table drops every rules graph
# (verifier/rules_graphs.py: captured again, a few ms each; H200, a batch of 8 run twice)
TRIM_DELAY_S = 10.0


@dataclass(eq=False)
class RuleSlot:
    """A sequence's rows in a `RuleRows`: `index`; `context`, the rules whose bias, output
    counts and prompt the rows hold once `deltas` are counted in (None: not filled yet)."""

    index: int
    free: Callable[[], object]  # gives the slot back (once; also when its sequence is collected)
    context: LogitRules | None = None
    deltas: list[int] = field(default_factory=list)

    def holds(self, rules: LogitRules) -> bool:
        """Whether the rows, deltas counted in, are those `rules` read."""
        context = self.context
        return context is not None and (context is rules or context.same_context(rules))

    def keep(self, rules: LogitRules, appended: list[int], kept: LogitRules) -> bool:
        """After a commit of `appended` under `rules`: the rows follow into `kept`'s context.
        False where they held another context (the slot is then to be given back)."""
        if not self.holds(rules):
            return False
        self.context = kept
        self.deltas += appended
        return True


class HasRuleSlot(Protocol):
    rule_slot: RuleSlot | None


def drop_slot(holder: HasRuleSlot) -> None:
    """Give the holder's slot back (its rules are gone or changed)."""
    if holder.rule_slot is not None:
        holder.rule_slot.free()
        holder.rule_slot = None


class RuleRows:
    """[slots, vocab] tables on one device: `bias` (float32), `counts` (float32: the output's,
    deltas counted in on the device) and `seen` (bool: the prompt's tokens, for repetition);
    grown (doubled) as sequences with rules come, a slot given back when its sequence's rules
    end or the sequence is released or collected, the tables halved again once their slots in
    use all sit in the lowest quarter (`trim`: at an 8B's vocabulary a slot holds 1.15 MB, held
    outside the KV pool's share of the memory), once they have stayed so TRIM_DELAY_S
    (`clock`'s seconds)."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._clock = clock
        self._free: list[int] = []  # a heap: the lowest free slot goes out first
        self._trimmable_since: float | None = None  # when the tables last became trimmable
        self.bias = self.counts = torch.zeros(1, vocab_size, device=self.device)
        self.seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=self.device)
        self._grow(MIN_SLOTS)

    @property
    def nbytes(self) -> int:
        """The tables' device memory (read from the metrics thread: one length)."""
        return len(self.bias) * self.vocab_size * (4 + 4 + 1)

    @property
    def num_used(self) -> int:
        return len(self.bias) - 1 - len(self._free)

    def slot(self, holder: HasRuleSlot) -> RuleSlot:
        """The holder's slot, a free one given it where it has none."""
        if holder.rule_slot is None:
            if not self._free:
                self._grow(2 * len(self.bias))
            index = heapq.heappop(self._free)
            if index >= len(self.bias) // 4:
                self._trimmable_since = None  # (a slot in use past the lowest quarter)
            free = weakref.finalize(holder, heapq.heappush, self._free, index)
            holder.rule_slot = RuleSlot(index, free)
        return holder.rule_slot

    def trim(self) -> None:
        """The tables halved while the highest slot in use (slots go out lowest first) lies below
        a quarter of them, down to MIN_SLOTS, once they have been trimmable TRIM_DELAY_S (from
        the first call that found them so, no slot taken past their lowest quarter since); no
        slot in use moves. The tables let go are freed in the device's stream order, behind
        the work queued to read them (as `_grow`'s)."""
        size = len(self.bias)
        if size <= MIN_SLOTS or self.num_used >= size // 4:
            self._trimmable_since = None
            return
        free = set(self._free)
        top = max(i for i in range(size) if i not in free)  # (slot 0 at least: never free)
        if top >= size // 4:
            self._trimmable_since = None
            return
        now = self._clock()
        if self._trimmable_since is None:
            self._trimmable_since = now
        if now - self._trimmable_since < TRIM_DELAY_S:
            return
        new = size
        while new > MIN_SLOTS and top < new // 4:
            new //= 2
        self.bias, self.counts, self.seen = (t[:new].clone() for t in self._tables)
        self._free = sorted(i for i in self._free if i < new)  # (a heap)
        self._trimmable_since = None

    @property
    def _tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.bias, self.counts, self.seen

    def _grow(self, size: int) -> None:
        """The tables at `size` slots, the rows held copied (queued on the device)."""
        old = len(self.bias)
        tables = []
        for table in self._tables:
            grown = table.new_zeros(size, self.vocab_size)
            grown[:old].copy_(table)
            tables.append(grown)
        self.bias, self.counts, self.seen = tables
        for index in range(old, size):
            heapq.heappush(self._free, index)
