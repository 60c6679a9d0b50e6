"""The Scheduler's round as the gates see it (a mixin of the Scheduler that declares what it
uses): before a round, what to run (`_plan_round`: the speculation gate's choice, the features
restarted where speculation resumes, whether the gates measure the round, and its kind,
`_round_mode`); the round itself in that kind (`_run_round`); after it, what it measured
(`_observe_round`: the round's metrics, the adaptive decode steps, both gates)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.clients import VerifierClient
from gateway.decode_steps import DecodeSteps
from gateway.gate import OverlapGate, SpeculationGate
from gateway.sequence import Sequence
from specsplit import metrics

# The gates measure a round in which at most one sequence in NEW_SHARE is new (in its first two
# rounds after a prefill: the prefill, then the drafter's catch-up of it; none below NEW_SHARE
# sequences). Under steady arrivals at a full batch some always are: each finished request's
# place goes to a newcomer (an 8B-shaped target at 80 requests a second on two H200s: 64
# sequences of 128 tokens committing ~2.7 each a round, so ~1.3 finish and join a round), and a
# gate that measured no such round never measured at all, keeping its first mode (there
# speculation, at 0.69x the target alone's tokens a second, sixty-second session). Both modes
# pay for the prefills alike; a speculating round pays for the catch-up too: speculation's cost.
NEW_SHARE = 8


@dataclass
class RoundPlan:
    """What `_plan_round` decided, for the round and for `_observe_round` after it."""

    start: float  # time.perf_counter() at the round's start
    batch_size: int
    committed: int  # the scheduler's tokens committed before the round
    speculate: bool  # the speculation gate lets default-spec requests draft
    drafting: bool  # some sequence drafts (else the round has nothing to overlap: serial)
    drafter_up: bool  # at the round's start
    resuming: bool  # features restarted for some sequence first
    measured: bool  # the speculation gate measures the round
    settled: bool  # the overlap gate may measure it
    best: list[tuple[Sequence, int, int]] | None  # `_best_commits` where measured speculating
    mode: str  # `_round_mode`


class RoundGates:
    # the Scheduler's, which the round uses
    running: list[Sequence]
    verifier: VerifierClient
    gate: SpeculationGate | None
    overlap_gate: OverlapGate | None
    overlap: str
    early_verify: bool
    ahead_max_batch: int
    ahead_miss: str
    steps_policy: DecodeSteps | None
    num_tokens_committed: int
    _plain_round: tuple[int, int] | None
    _drafter_resting: Callable[[], bool]
    _resumes_features: Callable[[Sequence], bool]
    _restart_features: Callable[[list[Sequence]], Awaitable[None]]
    _leave_groups: Callable[[], Awaitable[bool]]
    step: Callable[[list[Sequence]], Awaitable[None]]
    step_groups: Callable[..., Awaitable[None]]
    step_ahead: Callable[..., Awaitable[None]]

    async def _plan_round(self) -> RoundPlan:
        """The speculation gate's choice for this batch (default-spec requests' drafts held
        back or not), their features restarted where speculation resumes, and what the gates
        measure of the round."""
        start = time.perf_counter()
        self._plain_round = None  # (_verify_inputs)
        batch_size, committed = len(self.running), self.num_tokens_committed
        speculate = self.gate is None or self.gate.speculate(batch_size)
        for seq in self.running:  # the gate holds back default-spec drafts only
            seq.drafts_held = not speculate and seq.request.spec is None
        drafter_up = not self._drafter_resting()
        resuming = [s for s in self.running if self._resumes_features(s)]
        await self._restart_features(resuming)
        # a round in which no sequence drafts has nothing to overlap: serial
        drafting = any(not (s.never_drafts or s.drafts_held) for s in self.running)
        measured = self.gate is not None and self._gated(self.running)
        # speculation's speed (and its best) is its round kind's that the overlap gate
        # chose: a speculating round of a kind it explores or probes is not measured
        if measured and speculate and drafting and self.overlap_gate is not None:
            measured = self.overlap_gate.settled(batch_size)
        best = self._best_commits(self.running) if measured and speculate else None
        # a round the overlap gate measures: few of its sequences just prefilled
        settled = self.overlap_gate is not None and self._steady(self.running)
        return RoundPlan(
            start=start,
            batch_size=batch_size,
            committed=committed,
            speculate=speculate,
            drafting=drafting,
            drafter_up=drafter_up,
            resuming=bool(resuming),
            measured=measured,
            settled=settled,
            best=best,
            mode=self._round_mode(speculate and drafting),
        )

    async def _run_round(self, mode: str) -> None:
        """One round of the running batch as `mode` (`_round_mode`)."""
        if mode in ("groups", "groups-early"):
            await self.step_groups(self.running, early_verify=mode == "groups-early")
            return
        batch = self.running
        if await self._leave_groups():
            # the group committed just now may have finished: verify the others
            batch = [s for s in batch if not (s.finished or s.cancelled)]
        if batch and mode == "serial":
            await self.step(batch)
        elif batch:  # "ahead", or the overlap gate's "ahead-plain" (misses plain)
            # or "ahead-unhinted" (no hints)
            plain = mode == "ahead-plain" or self.ahead_miss == "plain"
            await self.step_ahead(batch, plain, hint=mode != "ahead-unhinted")

    def _observe_round(self, plan: RoundPlan) -> None:
        """The round's time and tokens to the metrics, the adaptive decode steps (a plain
        serial round) and the gates (where `plan` says they measure it)."""
        seconds = time.perf_counter() - plan.start
        verifier = self.verifier
        round_kind = plan.mode if plan.speculate and plan.drafting else "plain"
        metrics.observe_round(
            round_kind, seconds, verifier.last_engine_seconds, verifier.last_device_seconds
        )
        batch_size = plan.batch_size
        if self.steps_policy is not None and plan.mode == "serial" and self._plain_round:
            batch_size, steps = self._plain_round
            device_seconds = verifier.last_device_seconds
            self.steps_policy.observe(batch_size, steps, seconds, device_seconds)
        tokens = self.num_tokens_committed - plan.committed
        # a round the drafter was down for (at its start or since) decoded without
        # drafts: not a speculating round's speed, for either gate
        drafted = plan.drafter_up and not self._drafter_resting()
        measured = plan.measured and (drafted or not plan.speculate)
        if self.gate is not None:
            kind = "resuming" if plan.resuming else "speculating" if plan.speculate else "plain"
            metrics.observe_gated_round(kind, seconds)
            most = None
            if plan.best is not None:  # the sequences this round committed (one group's)
                most = max(tokens, sum(m for seq, r, m in plan.best if seq.stats.rounds > r))
            self.gate.observe(batch_size, plan.speculate, tokens, seconds, measured, most)
        if self.overlap_gate is not None and plan.speculate and plan.drafting:
            self.overlap_gate.observe_mode(
                batch_size, plan.mode, tokens, seconds, plan.settled and drafted
            )

    def _round_mode(self, speculate: bool) -> str:
        """This round's kind: "serial", "groups", "groups-early" (groups whose other group's
        Verify goes out early), "ahead", "ahead-plain" (its misses plain) or "ahead-unhinted"
        (no hints to the verifier).
        Overlap "both" drafts ahead while at most `ahead_max_batch` sequences run (one sequence
        makes no two groups, and small batches verify in about the time of one), groups above;
        groups are "groups-early" with `early_verify`. "gated": the overlap gate's choice at
        this batch size (groups-early where `early_verify` is on, groups, ahead, ahead-plain,
        ahead-unhinted or serial). Rounds the speculation gate holds back from drafting are
        serial, and so are rounds in which no sequence drafts (`speculate` false for both)."""
        if not speculate or self.overlap == "serial":
            return "serial"
        if self.overlap_gate is not None:
            return self.overlap_gate.mode(len(self.running))
        mode = self.overlap
        if mode == "both":
            mode = "ahead" if len(self.running) <= self.ahead_max_batch else "groups"
        return "groups-early" if mode == "groups" and self.early_verify else mode

    @staticmethod
    def _best_commits(batch: list[Sequence]) -> list[tuple[Sequence, int, int]]:
        """Before a speculating round, for the speculation gate's `most`: each sequence, its
        committed rounds so far (those it commits in this round are the ones whose count
        grows: a groups round commits one group) and the most tokens it could commit (its
        whole draft path accepted and its bonus token, at the deepest shape its adaptive
        ladder may reach)."""
        best = []
        for seq in batch:
            depth = seq.round_spec().num_steps
            if seq.adaptive is not None:
                depth = max(depth, *(rung.num_steps for rung in seq.adaptive.ladder))
            best.append((seq, seq.stats.rounds, depth + 1))
        return best

    def _gated(self, batch: list[Sequence]) -> bool:
        """A round the speculation gate measures: every sequence follows the gateway's default
        spec (the gate's to hold back) and the round is `_steady`."""
        return all(seq.request.spec is None for seq in batch) and self._steady(batch)

    @staticmethod
    def _steady(batch: list[Sequence]) -> bool:
        """At most one sequence in NEW_SHARE is prefilled in this round or has the drafter catch
        up its prefill (the two rounds after a sequence's prefill, or its features' re-verify,
        cost what steady rounds do not); none in a batch of fewer than NEW_SHARE."""
        new = sum(seq.rounds_since_prefill < 2 for seq in batch)
        return new <= len(batch) // NEW_SHARE
