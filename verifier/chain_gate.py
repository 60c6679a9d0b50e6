"""Whether chaining a hinted round on the device behind the round in flight pays
(`--chain-rounds auto`, `ChainGate`).

A chained round's host work starts when the hint comes, mid-round. Where it ends after the
device is done with the round in flight, it holds that round's answer back and the next round
starts no sooner than a launch after the answer would. So chaining pays where a round keeps
the device busy well past the chain's host work: an 8B target's round (~6.5 ms on the
device against 1.5-2.1 ms of chaining, 1.07x-1.12x at batch 1 on two H100s), not SmolLM2's
(~1.0-1.4 ms against ~2.0-2.1 ms as the gate measured it on two H200s, where chaining ran
0.83x of launching after the answer, forty-fifth session; bench/RESULTS.md). The gate
compares the two, measured: the median device time of the last rounds that may chain and the
median host time of the last chains.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

log = logging.getLogger(__name__)

# chain while a round's device time is at least this many times the chain's host work: the
# hint comes about midway through the round, and the chain's host work must fit in what is left
CHAIN_PAYS_MARGIN = 2.0
CHAIN_WINDOW = 16  # the last rounds and chains measured
CHAIN_MIN_SAMPLES = 4  # chains (and rounds) measured before the gate decides: it chains till then
# while chaining does not pay, one hint in this many chains all the same, so the chain's host
# work stays measured (it changes with the trees' shape and the host's load)
CHAIN_PROBE_EVERY = 64


class ChainGate:
    """`--chain-rounds auto`'s choice, from what the engine measures: `round_ran` (a round's
    device time, of rounds small enough to chain) and `chained` (a chain's host time). With
    `auto` off every chain the other conditions allow goes ahead (`--chain-rounds on`). Its
    first choice is logged at info, later changes at debug."""

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto
        self.chain_ns: deque[int] = deque(maxlen=CHAIN_WINDOW)
        self.device_ns: deque[int] = deque(maxlen=CHAIN_WINDOW)
        self.num_held_back = 0  # hints not chained since the last probe
        self.paying: bool | None = None  # the last choice, for its log line

    def round_ran(self, device_ns: int) -> None:
        """A finished round's device time (0 off a GPU: not counted)."""
        if device_ns > 0:
            self.device_ns.append(device_ns)

    def chained(self, host_ns: int) -> None:
        """A chain's host work, from the hint to the chained round queued."""
        self.chain_ns.append(host_ns)

    def pays(self) -> bool:
        """Whether to chain on the hint that came: with `auto`, while too few are measured,
        while the rounds' device time is at least CHAIN_PAYS_MARGIN times the chain's host work,
        and once in CHAIN_PROBE_EVERY hints otherwise."""
        if not self.auto:
            return True
        if len(self.chain_ns) < CHAIN_MIN_SAMPLES or len(self.device_ns) < CHAIN_MIN_SAMPLES:
            return True
        device, chain = statistics.median(self.device_ns), statistics.median(self.chain_ns)
        paying = device >= CHAIN_PAYS_MARGIN * chain
        if paying != self.paying:  # the first choice at info, later changes (near the margin
            # they may come with each probe) at debug
            (log.info if self.paying is None else log.debug)(
                "chained rounds %s: a round %.2f ms on the device, a chain's host work %.2f ms"
                " (--chain-rounds auto chains at %.1fx or more)",
                "on" if paying else "off", device / 1e6, chain / 1e6, CHAIN_PAYS_MARGIN,
            )  # fmt: skip
            self.paying = paying
        if paying:
            return True
        self.num_held_back += 1
        if self.num_held_back < CHAIN_PROBE_EVERY:
            return False
        self.num_held_back = 0
        return True
