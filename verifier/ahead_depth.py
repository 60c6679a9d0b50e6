"""How many decode steps the verifier runs ahead after a round's last step (`AheadDepth`).

After a round of decode steps the verifier launches the same sequences' next step before the
gateway asks for it (`RunAhead._launch_ahead`): the GPU computes it while the answer travels,
the gateway commits and streams, and the next request comes back. The GPU idles unless the steps
queued ahead last until the host has launched the next new step: the trip (from the round's
results read, its last step done on the device, to the next request's launch on the host: the
commit, the answer, the gateway's work, the request) plus the host's time to launch a step once
the request is in (take the step run ahead, launch the one after it: ~0.4 ms at 8 streams,
~0.6-0.8 ms at 32 on an H200 host, random SmolLM2). So the steps after it are launched too, each
behind the one before (`Launched.follower`; while the host waits for the device,
`RunAhead.top_up`, else one a turn of the service's loop once the answer went out): depth =
ceil((trip + launch) / step), all three measured per batch size, at most MAX_DEPTH, changed only
once the ratio leaves the current depth's range by HYSTERESIS (a ratio near an integer flipped it
round by round).

The trip is measured whole, with any launch it waited for: less those launches it came out
shorter at depth 2 than at 1, and the depth flipped. Measured whole it grows with the depth (a
request read while steps are queued waits for them). On two H200s (fifty-eighth session, the
inputs' host mirrors no longer making a queued launch wait for the device) auto settled at 3
(2-3 at 8 streams) and kept the round's time outside the GPU at <= 0.1-0.4 ms p50 at 1, 8 and 32
closed streams, with 1.10x depth 1's tokens a second at 8 and 32 and 0.91x at 1, where a step's
launch takes the host about a step's device time. Under Poisson arrivals its three queued steps
cost the newcomers that dropped them, where 2 (the default since) did best: so while batches
change auto queues at most CHURN_DEPTH (`observe_drop`; on two H200s in the fifty-ninth session
that took its TTFT p90 at 80 requests a second to 15.6-17.0 ms).
"""

from __future__ import annotations

import logging
import math

from specsplit.cli_flags import MAX_AHEAD_DEPTH as MAX_DEPTH  # steps run ahead, at most

log = logging.getLogger(__name__)

SMOOTHING = 0.2  # each observation's weight in the running means (the first's: all)
# a trip longer than this is not the gateway's round trip (the streams paused, a client came
# back later): not measured
MAX_TRIP_NS = 20_000_000
HYSTERESIS = 0.1  # steps the ratio must pass the current depth's range by to change it
# while batches change (a step run ahead dropped: a sequence joined with more than 2 queued, or
# one sent what the step is not; one that left no longer drops it, `Launched.part`, nor one that
# joined at depth 2, `RunAhead._join_ahead`) at most CHURN_DEPTH steps, until
# STABLE_ROUNDS trips in a row came with no drop: under Poisson arrivals on two H200s auto's three
# queued steps cost newcomers (TTFT p90 38 ms against 18 at 80 requests a second), where two
# streamed the most tokens (fifty-eighth session)
CHURN_DEPTH = 2
STABLE_ROUNDS = 16


class AheadDepth:
    """Decode steps to run ahead after a round's last step, by batch size: `fixed` (1 to
    MAX_DEPTH), or with fixed 0 (auto) the fewest whose device time covers the trip between
    rounds and the next step's launch (`observe_trip`: from a round's results read to the next
    request's launch on the host; `observe_launch`: the host's time to take a step run ahead and
    launch the next; `observe_step`: a decode step's device time), 1 until the trip and a step
    are measured (on the CPU, where nothing runs beside the host, always 1); at most
    CHURN_DEPTH while batches change (`observe_drop`: a step run ahead was dropped, fewer than
    STABLE_ROUNDS trips ago)."""

    def __init__(self, fixed: int = 0) -> None:
        if not 0 <= fixed <= MAX_DEPTH:
            raise ValueError(f"decode-ahead depth {fixed}: want 0 (auto) to {MAX_DEPTH}")
        self.fixed = fixed
        self._trip_ns: dict[int, float] = {}
        self._step_ns: dict[int, float] = {}
        self._launch_ns: dict[int, float] = {}
        self._chosen: dict[int, int] = {}  # auto's last depth by batch size (logged on change)
        self._stable = STABLE_ROUNDS  # trips since a step run ahead was dropped

    @property
    def auto(self) -> bool:
        """Whether the depth follows what is measured (the only use of `observe_*`)."""
        return not self.fixed

    @property
    def queues(self) -> bool:
        """Whether steps may be queued behind the one run ahead (any depth but a fixed 1)."""
        return self.fixed != 1

    def observe_trip(self, batch_size: int, nanoseconds: int) -> None:
        self._stable += 1
        if 0 <= nanoseconds <= MAX_TRIP_NS:
            _smooth(self._trip_ns, batch_size, nanoseconds)

    def observe_drop(self) -> None:
        """A decode step run ahead was dropped (its round had a sequence the step did not cover)."""
        if self._stable >= STABLE_ROUNDS and any(d > CHURN_DEPTH for d in self._chosen.values()):
            log.info("decode-ahead depth at most %d: batches change", CHURN_DEPTH)
        self._stable = 0

    def observe_step(self, batch_size: int, nanoseconds: int) -> None:
        if nanoseconds > 0:
            _smooth(self._step_ns, batch_size, nanoseconds)

    def observe_launch(self, batch_size: int, nanoseconds: int) -> None:
        if 0 <= nanoseconds <= MAX_TRIP_NS:
            _smooth(self._launch_ns, batch_size, nanoseconds)

    def depth(self, batch_size: int) -> int:
        if self.fixed:
            return self.fixed
        depth = self._covering(batch_size)
        return depth if self._stable >= STABLE_ROUNDS else min(depth, CHURN_DEPTH)

    def _covering(self, batch_size: int) -> int:
        """The fewest steps that cover the trip and the next launch at `batch_size`."""
        trip, step = self._trip_ns.get(batch_size), self._step_ns.get(batch_size)
        if trip is None or not step:
            return 1
        launch = self._launch_ns.get(batch_size, 0.0)
        ratio = (trip + launch) / step  # depth d covers a ratio in (d - 1, d]
        current = self._chosen.get(batch_size, 1)
        if current - 1 - HYSTERESIS <= ratio <= current + HYSTERESIS:
            return current
        depth = max(1, min(MAX_DEPTH, math.ceil(ratio)))
        if depth != current:
            self._chosen[batch_size] = depth
            log.info(
                "decode-ahead depth %d at %d sequences: the trip between rounds %.3f ms, a"
                " step's launch %.3f ms on the host, a step %.3f ms on the device",
                depth, batch_size, trip / 1e6, launch / 1e6, step / 1e6,
            )  # fmt: skip
        return depth


def _smooth(means: dict[int, float], key: int, value: float) -> None:
    mean = means.get(key)
    means[key] = value if mean is None else mean + SMOOTHING * (value - mean)
