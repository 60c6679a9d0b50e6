"""The two gates (`ModeGate`, gateway/mode_gate.py: how a gate measures, chooses and probes):
the speculation gate (speculate or plain rounds) and the overlap gate (`OverlapGate`: a
speculating round as pipelined groups, draft-ahead or a serial round).

The speculation gate: speculate only while it pays, measured.

Speculation pays when the tokens a round commits per second of round beat plain decoding's (one
token per sequence per round). Which one wins depends on what the gateway cannot know in
advance: the model's size, the GPU, the drafter, the prompts, the batch size. On two H200s with
SmolLM2-135M-Instruct and the shipped EAGLE-3 head, speculation streams 0.57-0.79x of the target
alone; on the 2-core CPU 0.69x on the bundled prompts (1.7x before the packed CPU weights made a
one-token step ~6 ms), more where a prompt's drafts are accepted more. So the gate measures
both, per batch size, over the gateway's rounds in which every sequence follows the gateway's
default spec (a request that asks for its own spec always gets it, and rounds with one in them
are not measured), and in which at most one sequence in eight (none below eight: the scheduler's
NEW_SHARE) is in its first two rounds after a prefill (the prefill, then the drafter's catch-up
of it: under steady arrivals at a full batch some always are), and, for a speculating round, the
drafter was up (down or still loading, rounds decode without drafts: as fast as plain ones; on
two H200s such rounds read 3x plain rounds' speed) and, with the overlap gate, the round ran the
kind it chose (not one it explores or probes: the scheduler's). Plain rounds ask the verifier
for no target features, so they cost what the target alone does; on resuming, the verifier takes
back a sequence's tokens past its last features and verifies them again with them (the
scheduler's `_restart_features`). Only the draft trees change, so the output is the target's in
either mode.
"""

from __future__ import annotations

from gateway.mode_gate import MARGIN, PROBE_BUDGET, PROBE_EVERY, WINDOW, ModeGate
from specsplit import metrics


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
        margin: float = MARGIN,
        probe_budget: float = PROBE_BUDGET,
    ) -> None:
        assert modes[-1:] == ("serial",) and len(set(modes)) == len(modes)
        self.modes = modes
        super().__init__(window, probe_every, margin, probe_budget)

    def report(self, batch_bucket: int, mode: str) -> None:
        metrics.observe_overlap_gate(batch_bucket, mode, self.modes)
