"""How many decode steps a plain round asks for (`--decode-steps-adaptive`): a round of N steps
pays the trip through the gateway (the answer, the gateway's commit, the next request) once
for N tokens, and on a GPU the verifier's device idles for whatever of that trip its step run
ahead does not cover. That idle time differs from machine to machine (the host's speed) and
with the batch size, so it is measured: per batch size, rounds grow from the base
(`--decode-steps`) until the device's idle time between rounds is at most IDLE_SHARE of its busy
time, up to MAX_DECODE_STEPS. More steps a round mean larger chunks streamed at once and up to
N - 1 steps past a stop decoded for nothing, so rounds stay at the base where the trip is
covered.

A request that arrives during a round is admitted after it, so long rounds cost arrivals time to
first token: under Poisson arrivals through `up` on an H200 (random SmolLM2, 128 target-only
streams of 128 tokens, bench/serving.py) rounds grown regardless of arrivals gave 2.5x / 3.4x the
TTFT p50 of rounds of 4 at 20 / 80 requests a second (19.3 / 30.6 ms against 7.7 / 9.1), and
0.92x their tokens a second at 80 (at 20 the arrivals set the tokens a second). So rounds grow
only once no request arrived for `quiet_seconds` (QUIET_SECONDS by default; 0: regardless of
arrivals): a closed batch (every request in at once) grows a moment after it starts, a stream
of arrivals keeps the base."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from specsplit.messages import MAX_DECODE_STEPS, VerifyInput

IDLE_SHARE = 0.1  # the device's idle time between rounds, at most this share of its busy time
SMOOTHING = 0.2  # each plain round's weight in the running means
MIN_ROUNDS = 4  # rounds of a batch size measured before its rounds grow
# no arrival for this long before rounds grow: ~5x a grown round at batch 32 on an H200 (16
# steps of ~1.2 ms); at 20 requests a second rounds then grow ~14% of the time (e^-2)
QUIET_SECONDS = 0.1


@dataclass
class _Measured:
    """Running means of a batch size's plain rounds."""

    num_rounds: int = 0
    idle_seconds: float = 0.0  # the round's wall time less its device time
    step_seconds: float = 0.0  # the device's time a decode step

    def add(self, idle: float, step: float) -> None:
        weight = 1.0 if self.num_rounds == 0 else SMOOTHING
        self.idle_seconds += weight * (idle - self.idle_seconds)
        self.step_seconds += weight * (step - self.step_seconds)
        self.num_rounds += 1


class DecodeSteps:
    """Decode steps a plain round asks for, by batch size (rounded up to a power of two, as
    the verifier's CUDA graph buckets are): `base` until MIN_ROUNDS rounds of that size were
    measured, then the fewest steps (at least `base`, at most `most`) whose device time holds
    the measured idle time to IDLE_SHARE of it; `base` while a request arrived (`arrived`) less
    than `quiet_seconds` ago (`clock`'s seconds)."""

    def __init__(
        self,
        base: int,
        most: int = MAX_DECODE_STEPS,
        quiet_seconds: float = QUIET_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= base <= most <= MAX_DECODE_STEPS:
            raise ValueError(
                f"decode steps {base} to {most}: want 1 <= base <= most <= {MAX_DECODE_STEPS}"
            )
        if quiet_seconds < 0:
            raise ValueError(f"quiet_seconds {quiet_seconds}: want >= 0")
        self.base, self.most = base, most
        self.quiet_seconds = quiet_seconds
        self._clock = clock
        self._last_arrival = -math.inf
        self._measured: dict[int, _Measured] = {}

    def arrived(self) -> None:
        """A request arrived: rounds keep the base until none arrived for quiet_seconds."""
        self._last_arrival = self._clock()

    def steps(self, batch_size: int) -> int:
        if self._clock() - self._last_arrival < self.quiet_seconds:
            return self.base
        measured = self._measured.get(_bucket(batch_size))
        if measured is None or measured.num_rounds < MIN_ROUNDS or measured.step_seconds <= 0:
            return self.base
        # the fewest steps whose device time is at least the idle time / IDLE_SHARE (a hair
        # under an integer ratio is that integer: floating point's, not the measure's)
        ratio = measured.idle_seconds / (IDLE_SHARE * measured.step_seconds)
        wanted = math.ceil(ratio - 1e-9)
        return max(self.base, min(self.most, wanted))

    def observe(self, batch_size: int, steps: int, seconds: float, device_seconds: float) -> None:
        """A plain round of `batch_size` sequences that asked for `steps` steps took `seconds`
        on the gateway, `device_seconds` of it on the verifier's device (VerifyResponse.device_ns;
        0 where not measured, a CPU's: nothing to learn)."""
        if device_seconds <= 0 or steps < 1:
            return
        measured = self._measured.setdefault(_bucket(batch_size), _Measured())
        measured.add(max(0.0, seconds - device_seconds), device_seconds / steps)


def is_plain(item: VerifyInput) -> bool:
    """A sequence's part of a plain round: no tree, no target features, not its first round."""
    return not item.tree and not item.hidden_state_layers and not item.begin


def _bucket(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()
