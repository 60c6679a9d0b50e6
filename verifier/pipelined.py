"""Verify rounds launched beside a round in flight (`VerifierEngine.launch` / `finish`), for
the verifier service on a GPU and the in-process verifier client.

A round is launched, the event loop polls until the device is done with it (every other task
runs meanwhile), then it is finished. A second round that arrives meanwhile (the gateway's other
group, drafted while this one verifies) launches right away when the engine allows it
(`can_launch`: disjoint sequences, one decode step) and waits for the rounds in flight to
change otherwise; the GPU then runs the two back to back while the host finishes the first.
Release and Truncate wait until no round in flight holds their sequences (`settle`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from specsplit.messages import VerifyInput, VerifyOutput
from verifier.engine import VerifierEngine
from verifier.rounds import VerifyRound

log = logging.getLogger(__name__)

# runs fn(*args) where the engine's calls run (its thread, or the event loop's)
EngineCall = Callable[..., Awaitable[Any]]


class PipelinedRounds:
    def __init__(
        self,
        engine: VerifierEngine,
        call: EngineCall,
        wait: Callable[[VerifyRound], Awaitable[None]] | None = None,
    ) -> None:
        """call: runs an engine method where its calls run. wait: until the device is done
        with a round, off the engine's thread (None: the event loop polls; the service, whose
        loop thread is its only Python thread at work)."""
        self.engine = engine
        self._call = call
        self._wait = wait or _poll
        self._changed = asyncio.Condition()  # a round finished
        self._after: set[asyncio.Task[None]] = set()  # `_answered` tasks running

    async def verify(self, inputs: list[VerifyInput]) -> tuple[list[VerifyOutput], int, int]:
        """The round's outputs, its nanoseconds from launch to finish (the wait for the rounds
        before it to allow the launch excluded) and its device time (`VerifyRound.device_ns`)."""
        engine = self.engine
        queues = engine.decode_ahead and engine.ahead_depth.queues  # steps behind the one ahead
        async with self._changed:
            await self._changed.wait_for(lambda: engine.can_launch(inputs))
        start = time.perf_counter_ns()
        launched: VerifyRound = await self._call(engine.launch, inputs)
        try:
            if queues:  # as the GPU works
                await self._call(engine.top_up, launched)
            await self._wait(launched)
        finally:  # cancelled while it waited: still committed, as one call would have been
            try:
                outputs: list[VerifyOutput] = await asyncio.shield(
                    self._call(engine.finish, launched)
                )
            finally:
                async with self._changed:
                    self._changed.notify_all()
        if engine.launch_on_hint or queues:
            task = asyncio.get_running_loop().create_task(self._answered(queues))
            self._after.add(task)  # (a task the loop holds weakly only)
            task.add_done_callback(self._after.discard)
        return outputs, time.perf_counter_ns() - start, launched.device_ns

    async def _answered(self, queues: bool) -> None:
        """Once this task has answered (from the loop's next turn), where the engine's calls
        run: the hinted next rounds (`launch_parked`), then with `queues` the decode steps
        behind the one run ahead, one a turn of the loop while more are wanted (a request that
        arrives meanwhile is taken after one)."""
        engine = self.engine
        try:
            if engine.launch_on_hint:
                await self._call(engine.launch_parked)
            if queues:
                while await self._call(engine.extend_ahead):
                    await asyncio.sleep(0)
        except Exception:  # the round was answered; the next is launched on its request
            log.exception("launching rounds ahead after an answer failed")

    async def settle(self, seq_ids: list[str] | None) -> None:
        """Wait until no round in flight holds any of `seq_ids` (None: any sequence)."""
        engine = self.engine

        def settled() -> bool:
            return not engine.in_flight(list(engine.seqs) if seq_ids is None else seq_ids)

        async with self._changed:
            await self._changed.wait_for(settled)


async def _poll(launched: VerifyRound) -> None:
    while not launched.ready():
        await asyncio.sleep(0)
