"""A clock around a chosen function or method, in place: where a step's host time goes, call by
call, without a profiler's cost per call (bench/profile_step.py's EngineTime,
bench/draft_step.py's and bench/hinted_launch.py's Phases). Wrap the name where the caller
looks it up: a module's function imported by name elsewhere is wrapped in that module."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any


def clock(
    owner: object,
    name: str,
    add: Callable[[float], None],
    on_start: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """Replace `owner.name` with a wrapper that hands each call's host seconds to `add` (after
    it returns or raises; nested clocked calls count in each) and calls `on_start` first if
    given. Returns what puts the original back. An AttributeError here: the code renamed it."""
    fn = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        if on_start is not None:
            on_start()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            add(time.perf_counter() - start)

    setattr(owner, name, timed)
    return functools.partial(setattr, owner, name, fn)
