"""In-process clients of the drafter and the verifier (gateway/clients.py protocols): the real
engines on one worker thread each, as the services run them, or on one thread shared by both (a
GPU: inprocess/stack.py), checking the engines' invariants after every call when asked to.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from drafter.engine import DrafterEngine
from gateway.health import Health
from specsplit.messages import (
    DraftInput,
    DraftOutput,
    NextTrees,
    Truncated,
    Truncation,
    VerifyInput,
    VerifyOutput,
)
from verifier.engine import VerifierEngine
from verifier.pipelined import PipelinedRounds
from verifier.rounds import VerifyRound

T = TypeVar("T")


class _LocalClient:
    """Runs an engine's calls on one worker thread, as the services do (`executor`: a thread
    shared with the other engine's client; None = its own)."""

    def __init__(
        self,
        engine: DrafterEngine | VerifierEngine,
        check_integrity: bool,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.engine = engine
        self.check = check_integrity
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix=type(engine).__name__)
        self.last_engine_seconds = 0.0  # the engine time of the last round, on its thread
        self.last_device_seconds = 0.0  # its device time (pipelined verify rounds; 0: none)

    def _timed(self, fn: Callable[[list[Any]], T], arg: list[Any]) -> T:
        start = time.perf_counter()
        try:
            return fn(arg)
        finally:
            self.last_engine_seconds = time.perf_counter() - start

    async def _call(self, fn: Callable[[list[Any]], T], arg: list[Any], round: bool = False) -> T:
        """fn(arg) on the engine's thread; a round (draft, verify) is timed."""
        if round:
            out = await self._on_thread(self._timed, fn, arg)
        else:
            out = await self._on_thread(fn, arg)
        if self.check:
            self.engine.check_integrity()
        return out

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the engine's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def release(self, seq_ids: list[str]) -> None:
        await self._call(self.engine.release, seq_ids)

    async def truncate(self, items: list[Truncation]) -> list[Truncated]:
        return await self._call(self.engine.truncate, items)

    async def health(self) -> Health:
        return Health.SERVING  # in process: up as long as the process is


class LocalDrafterClient(_LocalClient):
    def __init__(
        self,
        engine: DrafterEngine,
        check_integrity: bool = False,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        super().__init__(engine, check_integrity, executor)
        self.drafter = engine

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        return await self._call(self.drafter.draft, inputs, round=True)


class LocalVerifierClient(_LocalClient):
    """Pipelined (verifier/pipelined.py), as the verifier service's rounds run on a GPU: a
    round sent while another verifies launches behind it."""

    def __init__(
        self,
        engine: VerifierEngine,
        check_integrity: bool = False,
        executor: ThreadPoolExecutor | None = None,
        pipelined: bool = False,
    ) -> None:
        """pipelined: rounds launched and finished apart, for groups with the early Verify
        (Scheduler early_verify); needs a thread of its own (on one shared with the drafter, the
        wait from another thread could meet a CUDA graph's capture there). The wait costs a
        thread hand-off (~0.4 ms a round on an H100 host): off, one call a round."""
        super().__init__(engine, check_integrity, executor)
        self.verifier = engine
        assert not (pipelined and executor is not None), "pipelined rounds need their thread"
        self._pipelined = None
        if pipelined:
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix="verify-wait")
            self._pipelined = PipelinedRounds(engine, self._on_thread, self._wait)

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        if self._pipelined is None:
            return await self._call(self.verifier.verify, inputs, round=True)
        outputs, nanoseconds, device_ns = await self._pipelined.verify(inputs)
        self.last_engine_seconds = nanoseconds / 1e9
        self.last_device_seconds = device_ns / 1e9
        if self.check:  # on the engine's thread: another round may be launching there
            await self._on_thread(self.engine.check_integrity)
        return outputs

    async def hint(self, hints: list[NextTrees]) -> None:
        """Straight to the engine, beside the round its thread runs (it only stores them)."""
        self.verifier.hint_next(hints)

    async def release(self, seq_ids: list[str]) -> None:
        if self._pipelined is not None:
            await self._pipelined.settle(seq_ids)
        await super().release(seq_ids)

    async def truncate(self, items: list[Truncation]) -> list[Truncated]:
        if self._pipelined is not None:
            await self._pipelined.settle([item.seq_id for item in items])
        return await super().truncate(items)

    async def _wait(self, launched: VerifyRound) -> None:
        """Until the device is done with `launched`: on a thread of its own (blocking there,
        the GIL free), so that the engine's thread launches the next round meanwhile."""
        await asyncio.get_running_loop().run_in_executor(self._waiter, launched.wait)
