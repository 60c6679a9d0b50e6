"""How long the verifier's device waits between rounds, as the engine reports it
(`DeviceWaits`, the base of VerifierEngine's mixins, declaring what it uses of the engine): the
host's wait from a round's finish to the next work for its sequences (`on_wait`), that wait's
host parts by phase (`on_gap`, `GAP_PHASES`), and on a GPU the device's own idle time between
two rounds' CUDA events (`on_idle`, `on_step_idle`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

# the host work in the device's wait between rounds (VerifierEngine.on_gap): "finish" (a round's
# results read and committed), then where a hinted round follows, the time until its launch
# began, "answer" where its hint had come before the finish (the answer built and written
# first) or "hint" where the hint came after it (the wait for the hint: how late it was), and
# "launch" (its host work); and "chain": a hinted round chained on the device behind the round
# in flight (its host work, done while the device runs that round: it leaves no wait)
GAP_PHASES = ("finish", "answer", "hint", "launch", "chain")


class DeviceWaits:
    # the engine's callbacks (None: not reported) and the wait under way
    on_wait: Callable[[float], None] | None
    on_gap: Callable[[str, float], None] | None
    on_idle: Callable[[float], None] | None
    on_step_idle: Callable[[float], None] | None
    _waiting: tuple[int, set[str]] | None

    def _report_gap(self, phase: str, nanoseconds: int) -> None:
        if self.on_gap is not None:
            self.on_gap(phase, nanoseconds / 1e9)

    def _report_idle(
        self, ended: torch.cuda.Event, started: torch.cuda.Event, further: bool = False
    ) -> None:
        """The device's idle time from a round's end to the next round's start (both run);
        further: the next is a round's further decode step."""
        wanted = (self.on_idle, self.on_step_idle if further else None)
        reports = [report for report in wanted if report is not None]
        if reports:
            seconds = max(0.0, ended.elapsed_time(started)) / 1e3
            for report in reports:
                report(seconds)

    def _report_wait(self, nanoseconds: int) -> None:
        if self.on_wait is not None:
            self.on_wait(nanoseconds / 1e9)

    def _end_wait(self, seq_ids: Iterable[str]) -> None:
        """Work for `seq_ids` is queued on the device: the wait since the last finish ends
        (reported where it was for any of them; forgotten either way)."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None and not waiting[1].isdisjoint(seq_ids):
            self._report_wait(time.perf_counter_ns() - waiting[0])
