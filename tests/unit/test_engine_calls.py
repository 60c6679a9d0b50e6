"""Where a service's engine calls run (--engine-calls): the engine's own thread, or the event
loop's thread (a GPU's default); loading and warm-up always on the engine's thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specsplit import cli
from specsplit.engine_servicer import EngineThread, calls_on_loop
from specsplit.errors import Code, ServiceError


class Recorder:
    def __init__(self) -> None:
        self.threads: dict[str, int] = {}


def _load() -> Recorder:
    engine = Recorder()
    engine.threads["load"] = threading.get_ident()
    return engine


def _warmup(engine: Recorder) -> None:
    engine.threads["warmup"] = threading.get_ident()


def _call(engine: Recorder, value: int) -> int:
    engine.threads["call"] = threading.get_ident()
    return value + 1


@pytest.mark.parametrize("on_loop", [False, True])
def test_calls_run_where_asked_and_loading_stays_on_the_engine_thread(on_loop: bool) -> None:
    async def go() -> tuple[Recorder, int, int]:
        thread = EngineThread("test", _load, _warmup, calls_on_loop=on_loop)
        with pytest.raises(ServiceError) as refused:  # not before it is loaded and warm
            await thread.run(_call, 1)
        assert refused.value.code == Code.UNAVAILABLE
        await thread.load()
        assert await thread.run(_call, 1) == 2
        result, ns = await thread.run_timed(_call, 5)
        assert result == 6 and ns > 0
        engine = thread.loaded
        assert engine is not None
        thread.close()
        return engine, threading.get_ident(), engine.threads["call"]

    engine, loop_thread, call_thread = asyncio.run(go())
    assert engine.threads["load"] == engine.threads["warmup"] != loop_thread
    if on_loop:
        assert call_thread == loop_thread
    else:
        assert call_thread == engine.threads["load"]


def test_auto_means_the_loop_on_a_gpu_and_the_engine_thread_on_the_cpu() -> None:
    assert calls_on_loop("auto", "cuda") and calls_on_loop("auto", "cuda:1")
    assert not calls_on_loop("auto", "cpu")
    assert calls_on_loop("loop", "cpu") and not calls_on_loop("thread", "cuda:0")
    assert cli.parse_args(["serve-verifier"]).engine_calls == "auto"
    assert cli.parse_args(["serve-drafter", "--engine-calls", "loop"]).engine_calls == "loop"


def test_up_hands_engine_calls_to_the_drafter_and_the_verifier() -> None:
    from specsplit import up

    commands = up.child_commands(cli.parse_args(["up", "--engine-calls", "thread"]))
    for role in ("drafter", "verifier"):
        child = cli.parse_args(commands[role][3:])  # after python -m specsplit.cli
        assert child.engine_calls == "thread"
