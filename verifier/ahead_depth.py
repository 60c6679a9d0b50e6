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
request read while steps are queued waits for them), and on two H200s auto settled at 3 at every
batch size. There, at 32 streams, the round's time outside the GPU fell to <= 0.1-0.2 ms p50 in
3 of 6 `up`s (depth 1: 1-5 ms), at the same tokens a second (bench/RESULTS.md, fifty-seventh
session). A step the next round does not take (a sequence joined, left or stopped) is dropped
and gives its room and draws back, as one step always could; it cost the device its time and a
wait, which is why the default stays 1. Newer than those runs, and not yet on a GPU: the steps
queued while the host waits (fewer left to launch after the answer, for a request to wait
behind), the trip measured from the results' read (not the finish's end), and the inputs' host
mirrors that no longer make a queued step's launch wait for the device
(specsplit/model/graph_buffers.py).
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


class AheadDepth:
    """Decode steps to run ahead after a round's last step, by batch size: `fixed` (1 to
    MAX_DEPTH), or with fixed 0 (auto) the fewest whose device time covers the trip between
    rounds and the next step's launch (`observe_trip`: from a round's results read to the next
    request's launch on the host; `observe_launch`: the host's time to take a step run ahead and
    launch the next; `observe_step`: a decode step's device time), 1 until the trip and a step
    are measured (on the CPU, where nothing runs beside the host, always 1)."""

    def __init__(self, fixed: int = 0) -> None:
        if not 0 <= fixed <= MAX_DEPTH:
            raise ValueError(f"decode-ahead depth {fixed}: want 0 (auto) to {MAX_DEPTH}")
        self.fixed = fixed
        self._trip_ns: dict[int, float] = {}
        self._step_ns: dict[int, float] = {}
        self._launch_ns: dict[int, float] = {}
        self._chosen: dict[int, int] = {}  # auto's last depth by batch size (logged on change)

    @property
    def auto(self) -> bool:
        """Whether the depth follows what is measured (the only use of `observe_*`)."""
        return not self.fixed

    @property
    def queues(self) -> bool:
        """Whether steps may be queued behind the one run ahead (any depth but a fixed 1)."""
        return self.fixed != 1

    def observe_trip(self, batch_size: int, nanoseconds: int) -> None:
        if 0 <= nanoseconds <= MAX_TRIP_NS:
            _smooth(self._trip_ns, batch_size, nanoseconds)

    def observe_step(self, batch_size: int, nanoseconds: int) -> None:
        if nanoseconds > 0:
            _smooth(self._step_ns, batch_size, nanoseconds)

    def observe_launch(self, batch_size: int, nanoseconds: int) -> None:
        if 0 <= nanoseconds <= MAX_TRIP_NS:
            _smooth(self._launch_ns, batch_size, nanoseconds)

    def depth(self, batch_size: int) -> int:
        if self.fixed:
            return self.fixed
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
