"""Gates: of several ways to run a round, the one that commits more tokens per second, measured
per batch size (`ModeGate`). The speculation gate (speculate or plain rounds) is described
below; the overlap gate (`OverlapGate`: a speculating round as pipelined groups, draft-ahead or
a serial round) measures the same way, exploring its modes in order (a batch size met after
another chose: from that one's mode) and probing the others in turn.

The speculation gate: speculate only while it pays, measured.

Speculation pays when the tokens a round commits per second of round beat plain decoding's
(one token per sequence per round). Which one wins depends on what the gateway cannot know in
advance: the model's size, the GPU, the drafter, the prompts, the batch size. On two H200s with
SmolLM2-135M-Instruct and the shipped EAGLE-3 head, speculation streams 0.57-0.79x of the target
alone; on the 2-core CPU it streams 1.7x. So the gate measures both, per batch size.

Per batch-size bucket (powers of two: 1, 2, 3-4, 5-8, ...), over the gateway's rounds in which
every sequence follows the gateway's default spec (a request that asks for its own spec always
gets it, and rounds with one in them are not measured), and in which at most one sequence in
eight (none below eight: the scheduler's NEW_SHARE) is in its first two rounds after a prefill
(the prefill, then the drafter's catch-up of it: under steady arrivals at a full batch some
always are), and, for
a speculating round, the drafter was up (down or still loading, rounds decode without drafts:
as fast as plain ones; on two H200s such rounds read 3x plain rounds' speed) and, with the
overlap gate, the round ran the kind it chose (not one it explores or probes: the scheduler's):
- first WINDOW measured rounds speculating, then WINDOW rounds plain (no drafts); a bucket met
  after another has chosen starts from the nearest one's measurements and choice instead, and
  one still exploring when another chooses takes that choice (exploring is left to the first);
  a larger batch than one that chose speculation probes plain rounds after its own first
  WINDOW rounds (a draft's gain shrinks as the batch grows: two H200s, 8B-shaped target at 80
  requests a second, batch 64 took batch 32's speculation, committed 0.8x the target alone's
  tokens a second, and its first probe would have waited longer than the 3 s run);
- then the mode with more committed tokens per second of round (running sums over the last
  WINDOW measured rounds of each mode, less the slowest of them where it took more than STALL
  x their median: the first rounds of a mode may build kernels or capture graphs, a stall that
  is not the mode's speed; a slow round that is, as one group's round holding a newcomer's
  prefill and catch-up under arrivals, stays, or a mode whose rounds are lumpy would read up to
  a WINDOW-th faster than it runs; speculation must beat plain by SPEC_MARGIN) runs;
- after PROBE_EVERY rounds the other mode runs WINDOW rounds again, and the choice is made
  anew: acceptance changes with the prompts, the round times with the batch. Each probe that
  confirms the choice doubles the wait for the next (up to MAX_BACKOFF x PROBE_EVERY); one that
  changes it starts over from PROBE_EVERY;
- and a probe waits until the chosen mode has run for 1 / PROBE_BUDGET times as long as the
  last probe took, so that probing takes at most PROBE_BUDGET of the time;
- where speculation could not win even with every draft accepted (its measured round time
  with each sequence committing its whole draft path and bonus token, the round's `most`,
  still commits fewer tokens per second than plain rounds), the first wait is
  MAX_BACKOFF x PROBE_EVERY at once: probes then only follow a change in the round times
  (the batch, the context), which acceptance alone cannot bring; a larger batch size met
  later waits as long for its first (a draft's gain shrinks as the batch grows). A probe of
  speculation is costly where it loses: its first round verifies again every token since the
  last features (two H200s, SmolLM2, 8 or 32 streams: 30-100 ms, a dozen plain rounds), then
  WINDOW rounds speculate at up to twice a plain round's time. Its cost is every round's time
  from the switch until the first measured round back in the chosen mode (the settle and
  catch-up rounds included), and at least the other mode's measured window (so that the
  first probe, before any cost is known, waits too); a bucket met for the first time takes the
  nearest one's.
The first round after a switch is not measured (the pipelined groups refill; an EAGLE drafter
catches up). Plain rounds ask the verifier for no target features, so they cost what the target
alone does; on resuming, the verifier takes back a sequence's tokens past its last features and
verifies them again with them (the scheduler's `_restart_features`). Only the draft trees
change, so the output is the target's in either mode.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

from specsplit import metrics

log = logging.getLogger(__name__)

WINDOW = 8  # measured rounds per mode before choosing, and in each probe
PROBE_EVERY = 96  # rounds in the chosen mode between probes of another
SPEC_MARGIN = 1.03  # speculation must commit 3% more tokens per second than plain rounds
OVERLAP_MARGIN = 1.03  # groups or draft-ahead must commit 3% more than serial rounds
SETTLE = 1  # rounds after a switch that are not measured
MAX_BACKOFF = 8  # probes that confirm the choice space out, up to this many x PROBE_EVERY
PROBE_BUDGET = 0.05  # the chosen mode runs at least 1 / this x the last probe's time between
STALL = 4.0  # a window's slowest round past this x its median round is a stall, left out


@dataclass
class _Bucket:
    """One batch-size bucket's measurements and state; modes by their index."""

    key: int  # the batch-size bucket
    window: int
    num_modes: int
    # per mode: (tokens, seconds, most) of its measured rounds, the last `window`; most: the
    # tokens the round could have committed at best (None: not known)
    rounds: list[deque[tuple[int, float, int | None]]] = field(init=False)
    mode: int = 0  # the mode running now
    chosen: int | None = None  # the mode chosen after the last measurement; None: exploring
    next_probe: int = 0  # the mode the next probe tries (never the chosen one)
    rounds_in_mode: int = 0  # since the last switch
    settle: int = 0  # rounds left that are not measured
    probe_every: int = 0  # rounds in the chosen mode before the next probe (set on choosing)
    seconds_in_mode: float = 0.0  # the rounds' time since the last switch (measured or not)
    probe_seconds: float | None = None  # the last probe's cost (None: none yet)
    probing_since_switch: float | None = None  # the open probe's time so far (None: closed)
    # its last choice was the plain mode where no other could have beaten it at its best
    # (`ModeGate._hopeless`), or it took that from a smaller bucket (`ModeGate._adopt`)
    hopeless: bool = False
    # its first probe after `window` rounds, whatever the probe costs (`ModeGate._adopt`)
    early_probe: bool = False

    def __post_init__(self) -> None:
        self.rounds = [deque(maxlen=self.window) for _ in range(self.num_modes)]

    def _window(self, mode: int) -> list[tuple[int, float, int | None]] | None:
        """The mode's measured rounds less the slowest where it stalled (past STALL x their
        median: a one-off stall, as a kernel built or a graph captured on a mode's first use,
        or a collection, does not decide), None until the window is full."""
        rounds = list(self.rounds[mode])
        if len(rounds) < self.window:
            return None
        slowest = max(rounds, key=lambda r: r[1])
        if len(rounds) > 2 and slowest[1] > STALL * statistics.median(r[1] for r in rounds):
            rounds.remove(slowest)
        return rounds

    def rate(self, mode: int) -> float | None:
        """Committed tokens per second of round over the window (`_window`)."""
        return self._per_second(mode, 0)

    def ceiling(self, mode: int) -> float | None:
        """Tokens per second the same rounds would have committed at best (each its `most`),
        None until the window is full or where a round's best is not known."""
        return self._per_second(mode, 2)

    def _per_second(self, mode: int, column: int) -> float | None:
        """Column `column` of the window's rounds (0: tokens, 2: most) summed over their time;
        None until the window is full or where a round's value is not known."""
        rounds = self._window(mode)
        if rounds is None:
            return None
        values = [r[column] for r in rounds]
        if any(v is None for v in values):
            return None
        return sum(v for v in values if v is not None) / max(sum(r[1] for r in rounds), 1e-9)


class ModeGate:
    """Which of `modes` the next round runs in, per batch size, from what rounds measured: each
    explored in order, then the one committing the most tokens per second, where every mode but
    the last (the plain one: plain rounds, serial rounds) must beat it by `margin`; the others
    probed in turn now and then. Subclasses name the modes and report each choice."""

    name = "gate"
    modes: tuple[str, ...] = ("the first mode", "the other mode")
    adopts = True  # a bucket met after another chose takes its choice (`_adopt`)

    def __init__(
        self,
        window: int = WINDOW,
        probe_every: int = PROBE_EVERY,
        margin: float = SPEC_MARGIN,
        probe_budget: float = PROBE_BUDGET,
        hopeless_backoff: int = MAX_BACKOFF,
    ) -> None:
        """hopeless_backoff: the wait for the first probe, in probe_every's, after choosing the
        plain mode where no other could have beaten it at its best (`_choose`); 1 = as any
        choice."""
        assert window >= 1 and probe_every >= 1 and margin > 0 and 0 < probe_budget <= 1
        assert 1 <= hopeless_backoff <= MAX_BACKOFF
        assert len(self.modes) >= 2
        self.window = window
        self.probe_every = probe_every
        self.margin = margin
        self.probe_budget = probe_budget
        self.hopeless_backoff = hopeless_backoff
        self._buckets: dict[int, _Bucket] = {}
        self.num_switches = 0

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return 1 << max(batch_size - 1, 0).bit_length()

    def _bucket(self, batch_size: int) -> _Bucket:
        key = self.bucket_of(batch_size)
        if key not in self._buckets:
            self._buckets[key] = self._new_bucket(key)
        return self._buckets[key]

    def _new_bucket(self, key: int) -> _Bucket:
        """A batch size met for the first time starts from the nearest bucket that chose
        (`_adopt`). With none chosen yet, it explores; a gate that does not adopt explores
        each bucket, from the nearest chosen bucket's mode (a batch that shrinks as its
        streams finish meets new buckets in its last rounds: they run the likely mode first,
        not the first mode in order)."""
        b = _Bucket(key, self.window, len(self.modes))
        if self.adopts:
            self._adopt(b, fresh=True)
        else:
            near = self._nearest_chosen(key)
            if near is not None and near.chosen is not None:
                b.mode = near.chosen
        return b

    def _nearest_chosen(self, key: int) -> _Bucket | None:
        """The chosen bucket nearest `key` (in powers of two), if any chose."""
        chosen = [other for other in self._buckets.values() if other.chosen is not None]
        if not chosen:
            return None
        return min(chosen, key=lambda o: abs(o.key.bit_length() - key.bit_length()))

    def _adopt(self, b: _Bucket, fresh: bool = False) -> None:
        """An exploring bucket takes the nearest chosen bucket's measurements, choice and probe
        cost (probed again after probe_every rounds here; hopeless_backoff x that for a larger
        batch than a bucket where no mode could beat the plain one), if any bucket chose: a
        batch that shrinks as its streams finish crosses a bucket every halving, and exploring
        each anew would switch modes there (resuming speculation verifies every sequence's
        tokens since its last features again). So exploring is left to the first bucket that
        gets there."""
        near = self._nearest_chosen(b.key)
        if b.chosen is not None or near is None or near.chosen is None:
            return
        for mine, theirs in zip(b.rounds, near.rounds, strict=True):
            mine.extend(theirs)
        if fresh:
            b.mode = near.chosen  # no round ran in it yet: no switch
        elif b.mode != near.chosen:
            self._switch(b, near.chosen)
        b.chosen = b.mode
        b.next_probe = self._after(b.chosen, b.chosen)
        b.rounds_in_mode, b.seconds_in_mode = 0, 0.0  # the wait for its first probe starts now
        b.probe_every = self.probe_every
        # a larger batch than a bucket where nothing could beat the plain mode at its best
        # waits as long for its first probe: a draft's gain only shrinks as the batch grows
        # (a verify's rows grow with it while plain rounds get cheaper a token)
        if near.hopeless and b.key > near.key:
            b.hopeless = True
            b.probe_every = self.hopeless_backoff * self.probe_every
        # nor does a larger batch than one where another mode beat the plain one know that
        # it does here too: it probes the plain mode once its own window is measured
        elif b.key > near.key and b.chosen != len(self.modes) - 1:
            b.early_probe = True
            b.probe_every = self.window
        b.probe_seconds = near.probe_seconds
        self.report(b.key, self.modes[b.chosen])

    def _after(self, mode: int, chosen: int) -> int:
        """The mode after `mode` in turn, skipping `chosen`."""
        nxt = (mode + 1) % len(self.modes)
        return (nxt + 1) % len(self.modes) if nxt == chosen else nxt

    def report(self, batch_bucket: int, mode: str) -> None:
        """A bucket chose (a metric's hook)."""

    def mode(self, batch_size: int) -> str:
        """The next round's mode at this batch size."""
        return self.modes[self._bucket(batch_size).mode]

    def observe_mode(
        self,
        batch_size: int,
        mode: str,
        tokens: int,
        seconds: float,
        measured: bool = True,
        most: int | None = None,
    ) -> None:
        """A round: `tokens` committed in `seconds`, in `mode` (as `mode()` gave it); `most`:
        the tokens it could have committed at best (None: not known). Only `measured` rounds
        count towards the rates; every round's time counts towards the time in the mode and
        the cost of a probe."""
        b = self._bucket(batch_size)
        index = self.modes.index(mode)
        if index != b.mode:
            return  # a round of another mode (the bucket switched meanwhile)
        b.seconds_in_mode += seconds
        if b.probing_since_switch is not None:
            b.probing_since_switch += seconds
        if not measured:
            return
        b.rounds_in_mode += 1
        if b.settle > 0:
            b.settle -= 1
            return
        if b.probing_since_switch is not None and b.mode == b.chosen:
            # the first measured round back in the chosen mode: the probe's cost is known
            b.probe_seconds = b.probing_since_switch - seconds
            b.probing_since_switch = None
            log.info(
                "%s, batch <= %d: the probe took %.3f s; the next after %d rounds and %.1f s",
                self.name,
                b.key,
                b.probe_seconds,
                b.probe_every,
                self._probe_wait(b),
            )
        b.rounds[index].append((tokens, seconds, most))
        if b.chosen is None:  # exploring: each mode not measured yet, in order
            if b.rate(index) is not None:
                unmeasured = [mode for mode in range(len(self.modes)) if b.rate(mode) is None]
                if unmeasured:
                    self._switch(b, unmeasured[0])
                else:
                    self._choose(b)
        elif b.mode != b.chosen:  # probing another mode
            if b.rounds_in_mode >= self.window + SETTLE:
                self._choose(b)
        elif b.rounds_in_mode >= b.probe_every and (
            b.early_probe or b.seconds_in_mode >= self._probe_wait(b)
        ):
            log.info(
                "%s, batch <= %d: probing %s after %d rounds, %.2f s",
                self.name,
                b.key,
                self.modes[b.next_probe],
                b.rounds_in_mode,
                b.seconds_in_mode,
            )
            b.probing_since_switch = 0.0
            if b.early_probe:  # later probes as any bucket's
                b.early_probe, b.probe_every = False, self.probe_every
            probe = b.next_probe
            b.next_probe = self._after(probe, b.chosen)
            self._switch(b, probe)

    def _probe_wait(self, b: _Bucket) -> float:
        """Seconds in the chosen mode before the next probe: its cost / the budget. The cost is
        the last probe's, and at least the probed mode's measured window (a probe runs that
        window again): so the first probe, whose cost is not known yet, waits too."""
        probed = b.rounds[b.next_probe]
        cost = max(b.probe_seconds or 0.0, sum(r[1] for r in probed))
        return cost / self.probe_budget

    def _choose(self, b: _Bucket) -> None:
        rates = [b.rate(mode) for mode in range(len(self.modes))]
        plain = len(self.modes) - 1
        # every mode but the plain one must beat it by the margin; ties: the earlier mode
        scores = [
            -1.0 if rate is None else rate / (1.0 if mode == plain else self.margin)
            for mode, rate in enumerate(rates)
        ]
        chosen = max(range(len(scores)), key=lambda mode: (scores[mode], -mode))
        # a probe that confirms the choice: the next comes twice as late (up to MAX_BACKOFF x)
        confirmed = chosen == b.chosen
        b.probe_every = (
            min(2 * b.probe_every, MAX_BACKOFF * self.probe_every)
            if confirmed
            else self.probe_every
        )
        # a window whose best is not known (the overlap gate explored or probed a round kind
        # meanwhile) keeps the last verdict: it showed nothing that could win
        verdict = self._hopeless(b) if chosen == plain else False
        hopeless = b.hopeless if verdict is None else verdict
        if hopeless and not b.hopeless:
            self._log_hopeless(b)
        b.hopeless = hopeless
        if hopeless:
            b.probe_every = max(b.probe_every, self.hopeless_backoff * self.probe_every)
        if not confirmed:
            measured = ", ".join(
                f"{name} {rate:.1f}"
                for name, rate in zip(self.modes, rates, strict=True)
                if rate is not None
            )
            log.info(
                "%s, batch <= %d: tokens/s %s: %s",
                self.name,
                b.key,
                measured,
                self.modes[chosen],
            )
            self.report(b.key, self.modes[chosen])
            b.next_probe = self._after(chosen, chosen)
        b.chosen = chosen
        self._switch(b, chosen)
        for other in self._buckets.values() if self.adopts else ():
            self._adopt(other)  # those still exploring (met before any chose)

    def _hopeless(self, b: _Bucket) -> bool | None:
        """No mode but the plain one could have beaten it even at its best: each one's
        `ceiling` below the plain mode's rate (with the margin). None where one's is not known."""
        plain = len(self.modes) - 1
        plain_rate = b.rate(plain)
        ceilings = [b.ceiling(mode) for mode in range(plain)]
        if plain_rate is None or any(c is None for c in ceilings):
            return None
        return all(c is not None and c < plain_rate * self.margin for c in ceilings)

    def _log_hopeless(self, b: _Bucket) -> None:
        plain = len(self.modes) - 1
        log.info(
            "%s, batch <= %d: at best %s tokens/s against %s %.1f: probing after %d rounds",
            self.name,
            b.key,
            ", ".join(f"{self.modes[m]} {b.ceiling(m) or 0.0:.1f}" for m in range(plain)),
            self.modes[plain],
            b.rate(plain) or 0.0,
            self.hopeless_backoff * self.probe_every,
        )

    def _switch(self, b: _Bucket, mode: int) -> None:
        if mode != b.mode:
            self.num_switches += 1
            b.settle = SETTLE
        b.mode = mode
        b.rounds_in_mode = 0
        b.seconds_in_mode = 0.0

    def settled(self, batch_size: int) -> bool:
        """At this batch size a mode was chosen and runs (neither exploring nor probing)."""
        b = self._bucket(batch_size)
        return b.chosen is not None and b.mode == b.chosen

    def rate(self, batch_size: int, mode: str) -> float | None:
        """Committed tokens per second of `mode` at this batch size, as measured."""
        return self._bucket(batch_size).rate(self.modes.index(mode))

    def ceiling(self, batch_size: int, mode: str) -> float | None:
        """The most tokens per second `mode`'s measured rounds could have committed at this
        batch size (None: not known)."""
        return self._bucket(batch_size).ceiling(self.modes.index(mode))


class SpeculationGate(ModeGate):
    """Whether the next round speculates or runs plain rounds."""

    name = "speculation gate"
    modes = ("speculating", "plain rounds")

    def speculate(self, batch_size: int) -> bool:
        return self.mode(batch_size) == "speculating"

    def observe(
        self,
        batch_size: int,
        speculated: bool,
        tokens: int,
        seconds: float,
        measured: bool = True,
        most: int | None = None,
    ) -> None:
        """most: a speculating round's tokens had every sequence's draft path been accepted
        whole (its depth + the bonus token, summed)."""
        mode = self.modes[0 if speculated else 1]
        self.observe_mode(batch_size, mode, tokens, seconds, measured, most)

    def rates(self, batch_size: int) -> tuple[float | None, float | None]:
        """(speculating, plain) committed tokens per second at this batch size, as measured."""
        return self.rate(batch_size, "speculating"), self.rate(batch_size, "plain rounds")

    def report(self, batch_bucket: int, mode: str) -> None:
        metrics.observe_speculation_gate(batch_bucket, mode == "speculating")


class OverlapGate(ModeGate):
    """Which round kind a speculating round runs as (the scheduler's: "groups", "ahead",
    "serial"; "ahead-plain", draft-ahead whose misses are verified with no tree, only where
    `modes` names it). Groups hide the draft, but each Verify carries half the batch: where a
    verify costs about the same for half the batch as for all of it (a large target,
    memory-bound), two half-batch Verifies cost more than the draft they hide. Draft-ahead hides
    the draft only for the rounds whose outcome it guessed, and its call drafts (chain length +
    1) x guesses trees. Through the services on two H100s, groups ran 1.33x / 1.18x serial at
    batch 8 / 32 with SmolLM2 and its EAGLE-3 head, but 0.84x / 0.94x with an 8B-shaped target
    and a 1B-shaped draft model; draft-ahead 1.36x (misses drafted) and 1.14x-1.46x (misses
    plain, four runs) at batch 1 but 0.74x-0.92x at 8 / 32 with SmolLM2 (bench/RESULTS.md):
    so it is measured.
    "ahead" misses as the scheduler's `ahead_miss` says (plain by default); "ahead-plain"
    (always plain) only where asked."""

    name = "overlap gate"
    # each batch size explores: the fastest mode changes with it (draft-ahead 1.14x-1.46x serial
    # at batch 1 and 0.77x at 8 above), and trying one costs no re-verify (leaving groups commits
    # the group verified last; at most one group's trees drafted for nothing). It explores from
    # the nearest chosen bucket's mode (`_new_bucket`)
    adopts = False

    def __init__(
        self,
        modes: tuple[str, ...] = ("groups", "ahead", "serial"),
        window: int = WINDOW,
        probe_every: int = PROBE_EVERY,
        margin: float = OVERLAP_MARGIN,
        probe_budget: float = PROBE_BUDGET,
    ) -> None:
        assert modes[-1:] == ("serial",) and len(set(modes)) == len(modes)
        self.modes = modes
        super().__init__(window, probe_every, margin, probe_budget)

    def report(self, batch_bucket: int, mode: str) -> None:
        metrics.observe_overlap_gate(batch_bucket, mode, self.modes)
