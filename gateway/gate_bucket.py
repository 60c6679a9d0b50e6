"""One batch-size bucket of a gate (gateway/mode_gate.py's `ModeGate`): its modes' measured
rounds, the window each mode's rate is read over, and where it stands (the mode running, the
one chosen, its probes)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypeVar

STALL = 4.0  # a window's slowest round past this x its median round is a stall, left out

Round = TypeVar("Round", bound=tuple[Any, ...])  # a measured round, its seconds at [1]


def without_stall(rounds: list[Round]) -> list[Round]:
    """`rounds` less the slowest where it stalled: past STALL x their median (a one-off stall,
    as a kernel built or a graph captured on a mode's first use, or a collection, does not
    decide)."""
    rounds = list(rounds)
    slowest = max(rounds, key=lambda r: r[1])
    if len(rounds) > 2 and slowest[1] > STALL * statistics.median(r[1] for r in rounds):
        rounds.remove(slowest)
    return rounds


@dataclass
class Bucket:
    """One batch-size bucket's measurements and state; modes by their index."""

    key: int  # the batch-size bucket
    window: int
    num_modes: int
    # per mode: (tokens, seconds, most, batch size) of its measured rounds, the last `window`;
    # most: the tokens the round could have committed at best (None: not known)
    rounds: list[deque[tuple[int, float, int | None, int]]] = field(init=False)
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
    # the bucket whose own measurements made its choice: its key once it chose, else the
    # source of the bucket it took the choice from (`ModeGate._adopt`)
    source: int = 0
    # (tokens, seconds) of the measured rounds since the last switch (`ModeGate._cut`)
    visit: list[tuple[int, float]] = field(default_factory=list)
    # the modes whose rounds were taken from another bucket (`ModeGate._adopt`), until one of
    # their own is measured (`measure`)
    adopted: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.rounds = [deque(maxlen=self.window) for _ in range(self.num_modes)]

    def measure(self, mode: int, entry: tuple[int, float, int | None, int]) -> None:
        """A measured round of `mode` here. Its first drops the rounds taken from another
        bucket: a window that mixes them reads mostly the other batch size's rate (two H200s,
        8B-shaped target: batch <= 8's plain rounds, cut after 3 of their own at 1514 tokens/s,
        kept 5 of batch 64's and read 5569, over speculation's 3381 at batch 8, and won)."""
        if mode in self.adopted:
            self.rounds[mode].clear()
            self.adopted.discard(mode)
        self.rounds[mode].append(entry)

    def measured_here(self, mode: int) -> bool:
        """The mode's window is full of rounds measured in this bucket (none taken)."""
        return mode not in self.adopted and len(self.rounds[mode]) == self.window

    def _window(self, mode: int) -> list[tuple[int, float, int | None, int]] | None:
        """The mode's measured rounds less a stall (`without_stall`), None until the window is
        full."""
        rounds = list(self.rounds[mode])
        return without_stall(rounds) if len(rounds) == self.window else None

    def visit_rate(self) -> float:
        """Committed tokens per second of the measured rounds since the last switch, less a
        stall (`without_stall`)."""
        rounds = without_stall(self.visit)
        return sum(r[0] for r in rounds) / max(sum(r[1] for r in rounds), 1e-9)

    def shape(self, mode: int) -> str:
        """The window's mean batch size and round time (what the log says of a rate: a
        bucket spans sizes up to twice each other, and a mode measured at other sizes than
        another is not compared like for like); "" until the window is full."""
        rounds = self._window(mode)
        if rounds is None:
            return ""
        batch = statistics.fmean(r[3] for r in rounds)
        return f" ({statistics.fmean(r[1] for r in rounds) * 1e3:.1f} ms at batch {batch:.0f})"

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
