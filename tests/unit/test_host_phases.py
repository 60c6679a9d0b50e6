"""bench/host_phases.py's clock, and the bench scripts' phase lists naming what the code calls
today (a rename broke bench/profile_step.py once, unnoticed until a GPU run)."""

from __future__ import annotations

import importlib
import types

import pytest

from bench.hinted_launch import PHASE_TARGETS, Phases
from bench.host_phases import clock


def test_a_clocked_function_reports_each_call_and_is_put_back() -> None:
    def work(x: int) -> int:
        if x < 0:
            raise ValueError(x)
        return 2 * x

    owner = types.SimpleNamespace(work=work)
    seconds: list[float] = []
    starts: list[None] = []
    restore = clock(owner, "work", seconds.append, on_start=lambda: starts.append(None))
    assert owner.work(3) == 6
    with pytest.raises(ValueError):  # a call that raises is timed too
        owner.work(-1)
    assert len(seconds) == len(starts) == 2 and all(s >= 0 for s in seconds)
    restore()
    assert owner.work is work


def test_hinted_launchs_phases_name_what_exists_and_close_restores() -> None:
    phases = Phases()  # getattr of each target: an AttributeError for a name gone
    wrapped = [getattr(phases_owner(path), name) for path, name, _ in PHASE_TARGETS]
    phases.close()
    for (path, name, _), before in zip(PHASE_TARGETS, wrapped, strict=True):
        now = getattr(phases_owner(path), name)
        assert now is not before, name  # the clock's wrapper was there, the original is back


def phases_owner(path: str) -> object:
    module_name, _, cls = path.partition(":")
    owner: object = importlib.import_module(module_name)
    return getattr(owner, cls) if cls else owner
