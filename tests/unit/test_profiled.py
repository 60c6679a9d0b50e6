"""$SPECSPLIT_PROFILE_DIR: a command's main thread under cProfile from one SIGUSR2 to the next,
its stats written at the stop and when it returns (bench/profile_services.py reads them)."""

from __future__ import annotations

import argparse
import os
import pstats
import signal
from pathlib import Path

import pytest

from specsplit import cli


def _inside() -> int:
    return sum(i * i for i in range(20000))


def _outside() -> int:
    return sum(i for i in range(20000))


def _command(args: argparse.Namespace) -> int:
    _outside()  # before the start: not profiled
    os.kill(os.getpid(), signal.SIGUSR2)
    _inside()
    os.kill(os.getpid(), signal.SIGUSR2)
    _outside()
    return 0


def test_the_window_between_the_signals_is_profiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(cli.COMMANDS, "generate", _command)
    monkeypatch.setenv("SPECSPLIT_PROFILE_DIR", str(tmp_path / "prof"))
    before = signal.getsignal(signal.SIGUSR2)
    assert cli.main(["generate", "hello"]) == 0
    (file,) = (tmp_path / "prof").glob("generate-*.prof")
    functions = {name for _, _, name in pstats.Stats(str(file)).stats}  # type: ignore[attr-defined]
    assert "_inside" in functions and "_outside" not in functions
    assert signal.getsignal(signal.SIGUSR2) == before


def test_without_the_variable_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(cli.COMMANDS, "generate", lambda args: 0)
    monkeypatch.delenv("SPECSPLIT_PROFILE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["generate", "hello"]) == 0
    assert not list(tmp_path.rglob("*.prof"))


def test_a_profile_that_cannot_start_says_why_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another tool holding the interpreter's profiler hook (Python 3.12: sys.monitoring's
    profiler id) leaves an empty profile; the reason goes beside it, for profile_services."""
    import cProfile

    def taken(self: cProfile.Profile) -> None:
        raise ValueError("Another profiling tool is already active")

    monkeypatch.setattr(cProfile.Profile, "enable", taken)
    monkeypatch.setitem(cli.COMMANDS, "generate", _command)
    monkeypatch.setenv("SPECSPLIT_PROFILE_DIR", str(tmp_path / "prof"))
    assert cli.main(["generate", "hello"]) == 0
    (error,) = (tmp_path / "prof").glob("generate-*.error")
    assert error.read_text().startswith(
        "profile not started: Another profiling tool is already active (the profiler hook's "
    )
    assert error.with_suffix(".prof").exists()
