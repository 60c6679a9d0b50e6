"""A gate: of several ways to run a round (its modes, the last of them the plain one), the one
that commits more tokens per second of round, measured per batch size (`ModeGate`). The
speculation gate and the overlap gate (gateway/gate.py) are two; the rounds each measures are
the scheduler's to say (gateway/round_gates.py).

Per batch-size bucket (powers of two: 1, 2, 3-4, 5-8, ...), over the rounds the gate is told
are measured:
- first WINDOW measured rounds of each mode, in order (CUT_ROUNDS where a mode commits under
  1 / CUT of the rate another mode measured: its window stays unfilled, it is not chosen, and a
  later probe measures it again; `_cut`); a bucket met after another has chosen
  starts from the nearest one's measurements and choice instead (a mode's first round measured
  here drops the rounds taken: a window mixes no batch sizes), and one still exploring when
  another chooses takes that choice (exploring is left to the first; a gate that does not
  adopt, as the overlap gate, explores each bucket, from the nearest one's mode); a larger
  batch than one that chose a mode other than the plain one probes the plain one after its
  own first WINDOW rounds (a draft's gain shrinks as the batch grows: two H200s, 8B-shaped
  target at 80 requests a second, batch 64 took batch 32's speculation, committed 0.8x the
  target alone's tokens a second, and its first probe would have waited longer than the 3 s
  run); likewise a smaller batch than one that chose the plain one probes the others (the
  same system at 20 requests a second after 80: batches up to 16 took batch 64's plain rounds
  and ran them 4.5 s, 236 rounds, before their first probe found speculation 2.4x faster);
  "than one" is the batch size whose own rounds made the choice (a bucket may take it from
  another that took it in turn);
- then the mode with the most committed tokens per second of round (running sums over the
  last WINDOW measured rounds of each mode, less the slowest of them where it took more than
  STALL x their median: the first rounds of a mode may build kernels or capture graphs, a
  stall that is not the mode's speed; a slow round that is, as one group's round holding a
  newcomer's prefill and catch-up under arrivals, stays, or a mode whose rounds are lumpy
  would read up to a WINDOW-th faster than it runs; every mode but the plain one must beat it
  by MARGIN) runs;
- after PROBE_EVERY rounds another mode runs WINDOW rounds again (each in turn; CUT_ROUNDS
  where it commits under 1 / CUT of the chosen one's rate), and the
  choice is made anew: acceptance changes with the prompts, the round times with the batch.
  Each probe that confirms the choice doubles the wait for the next (up to MAX_BACKOFF x
  PROBE_EVERY); one that changes it starts over from PROBE_EVERY;
- and a probe waits until the chosen mode has run for 1 / PROBE_BUDGET times as long as the
  last probe took, so that probing takes at most PROBE_BUDGET of the time;
- where no other mode could beat the plain one even at its best (a speculating round's
  `most`: its measured round time with each sequence committing its whole draft path and
  bonus token, still fewer tokens per second than plain rounds), the first wait is
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
The first SETTLE rounds after a switch are not measured (the pipelined groups refill; an EAGLE
drafter catches up).
"""

from __future__ import annotations

import logging

from gateway.gate_bucket import Bucket

log = logging.getLogger(__name__)

WINDOW = 8  # measured rounds per mode before choosing, and in each probe
PROBE_EVERY = 96  # rounds in the chosen mode between probes of another
MARGIN = 1.03  # every mode but the plain one must commit 3% more tokens per second than it
SETTLE = 1  # rounds after a switch that are not measured
MAX_BACKOFF = 8  # probes that confirm the choice space out, up to this many x PROBE_EVERY
PROBE_BUDGET = 0.05  # the chosen mode runs at least 1 / this x the last probe's time between
CUT = 2.0  # a mode explored or probed that commits under 1 / CUT of another's measured rate
CUT_ROUNDS = 3  # after this many measured rounds stops there (`ModeGate._cut`)


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
        margin: float = MARGIN,
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
        self._buckets: dict[int, Bucket] = {}
        self.num_switches = 0

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return 1 << max(batch_size - 1, 0).bit_length()

    def _bucket(self, batch_size: int) -> Bucket:
        key = self.bucket_of(batch_size)
        if key not in self._buckets:
            self._buckets[key] = self._new_bucket(key)
        return self._buckets[key]

    def _new_bucket(self, key: int) -> Bucket:
        """A batch size met for the first time starts from the nearest bucket that chose
        (`_adopt`). With none chosen yet, it explores; a gate that does not adopt explores
        each bucket, from the nearest chosen bucket's mode (a batch that shrinks as its
        streams finish meets new buckets in its last rounds: they run the likely mode first,
        not the first mode in order)."""
        b = Bucket(key, self.window, len(self.modes))
        if self.adopts:
            self._adopt(b, fresh=True)
        else:
            near = self._nearest_chosen(key)
            if near is not None and near.chosen is not None:
                b.mode = near.chosen
        return b

    def _nearest_chosen(self, key: int) -> Bucket | None:
        """The chosen bucket nearest `key` (in powers of two), if any chose."""
        chosen = [other for other in self._buckets.values() if other.chosen is not None]
        if not chosen:
            return None
        return min(chosen, key=lambda o: abs(o.key.bit_length() - key.bit_length()))

    def _adopt(self, b: Bucket, fresh: bool = False) -> None:
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
        # the batch size those measurements were made at (where `near` took them in turn from
        # another bucket, as every bucket still exploring does when one first chooses)
        source = b.source = near.source
        for mode, (mine, theirs) in enumerate(zip(b.rounds, near.rounds, strict=True)):
            if theirs:
                mine.extend(theirs)
                b.adopted.add(mode)
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
        plain = len(self.modes) - 1
        if near.hopeless and b.key > source:
            b.hopeless = True
            b.probe_every = self.hopeless_backoff * self.probe_every
        # nor does a larger batch than one where another mode beat the plain one know that
        # it does here too, nor a smaller batch than one where the plain one won that it wins
        # here: it probes the other mode(s) once its own window is measured
        elif (b.key > source and b.chosen != plain) or (b.key < source and b.chosen == plain):
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
        b.measure(index, (tokens, seconds, most, batch_size))
        if b.mode != b.chosen:  # exploring or probing: what `_cut` reads
            b.visit.append((tokens, seconds))
        if b.chosen is None:  # exploring: each mode with no rounds yet (not measured nor cut)
            if b.rate(index) is not None or self._cut(b, index):
                unmeasured = [mode for mode in range(len(self.modes)) if not b.rounds[mode]]
                if unmeasured:
                    self._switch(b, unmeasured[0])
                else:
                    self._choose(b)
        elif b.mode != b.chosen:  # probing another mode
            if b.rounds_in_mode >= self.window + SETTLE or self._cut(b, index):
                self._choose(b)
        elif (
            b.rounds_in_mode >= b.probe_every
            and b.measured_here(b.chosen)  # what the probe is weighed against (a switch's
            # settle rounds count in rounds_in_mode, not in the window)
            and (b.early_probe or b.seconds_in_mode >= self._probe_wait(b))
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

    def _cut(self, b: Bucket, mode: int) -> bool:
        """Whether `mode`, explored or probed, stops short: after CUT_ROUNDS measured rounds
        it commits under 1 / CUT of the best rate another mode measured (a full window). Its
        window stays unfilled (no rate: it is not chosen) until a later probe fills it. Where
        one mode is far slower (draft-ahead at an overloaded batch 64 on two H200s: 53-64 ms
        rounds against groups' 11) each of its visits then costs 3 rounds instead of a window;
        a mode within CUT of the best is measured whole, as before."""
        if len(b.visit) < CUT_ROUNDS:
            return False
        others = [b.rate(other) for other in range(len(self.modes)) if other != mode]
        best = max((rate for rate in others if rate is not None), default=None)
        rate = b.visit_rate()
        if best is None or rate * CUT >= best:
            return False
        log.info(
            "%s, batch <= %d: %s cut after %d rounds: %.1f tokens/s, under 1/%g of %.1f",
            self.name,
            b.key,
            self.modes[mode],
            len(b.visit),
            rate,
            CUT,
            best,
        )
        return True

    def _probe_wait(self, b: Bucket) -> float:
        """Seconds in the chosen mode before the next probe: its cost / the budget. The cost is
        the last probe's, and at least the probed mode's measured window (a probe runs that
        window again): so the first probe, whose cost is not known yet, waits too."""
        probed = b.rounds[b.next_probe]
        cost = max(b.probe_seconds or 0.0, sum(r[1] for r in probed))
        return cost / self.probe_budget

    def _choose(self, b: Bucket) -> None:
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
                f"{name} {rate:.1f}{b.shape(mode)}"
                for mode, (name, rate) in enumerate(zip(self.modes, rates, strict=True))
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
        b.chosen, b.source = chosen, b.key
        self._switch(b, chosen)
        for other in self._buckets.values() if self.adopts else ():
            self._adopt(other)  # those still exploring (met before any chose)

    def _hopeless(self, b: Bucket) -> bool | None:
        """No mode but the plain one could have beaten it even at its best: each one's
        `ceiling` below the plain mode's rate (with the margin). None where one's is not known."""
        plain = len(self.modes) - 1
        plain_rate = b.rate(plain)
        ceilings = [b.ceiling(mode) for mode in range(plain)]
        if plain_rate is None or any(c is None for c in ceilings):
            return None
        return all(c is not None and c < plain_rate * self.margin for c in ceilings)

    def _log_hopeless(self, b: Bucket) -> None:
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

    def _switch(self, b: Bucket, mode: int) -> None:
        if mode != b.mode:
            self.num_switches += 1
            b.settle = SETTLE
        b.mode = mode
        b.rounds_in_mode = 0
        b.seconds_in_mode = 0.0
        b.visit = []

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
