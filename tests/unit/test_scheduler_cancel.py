"""Cancellation racing the scheduler's own awaits must never leak KV (DESIGN.md §2)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.clients import DrafterClient
from gateway.request import GenerationRequest
from specsplit.messages import DraftInput, DraftOutput, SpecParams
from tests.support import check_no_leaks, make_stack, save_tiny_llama


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("cancel") / "target", seed=4)


class _SlowRelease:
    """The real drafter, whose release yields to the event loop for a while first (as an RPC
    does) and tells the test it has started."""

    def __init__(self, inner: DrafterClient) -> None:
        self.inner = inner
        self.release_started = asyncio.Event()

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        return await self.inner.draft(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        self.release_started.set()
        await asyncio.sleep(0.05)
        await self.inner.release(seq_ids)


def test_stream_cancelled_while_another_is_released_frees_its_kv(
    target_dir, smollm2_tokenizer
) -> None:
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(3, 1, 3))
    scheduler = stack.scheduler

    async def run() -> None:
        slow = _SlowRelease(scheduler.drafter)
        scheduler.drafter = slow
        await scheduler.start()
        try:
            short = scheduler.generate(GenerationRequest([5, 6, 7], 2, ignore_eos=True))
            long = scheduler.generate(GenerationRequest([9, 10, 11], 200, ignore_eos=True))
            await anext(long)  # the long stream is running and holds KV in both services
            async with asyncio.timeout(30):
                async for _ in short:  # finishes after 2 tokens: its release starts
                    pass
                await slow.release_started.wait()
            await long.aclose()  # cancelled while the short one's release is in flight
            async with asyncio.timeout(30):
                while scheduler.running or scheduler.waiting:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # the last release returns
            assert stack.verifier.num_pages_used == 0
            assert stack.drafter.num_pages_used == 0
        finally:
            await scheduler.stop()

    asyncio.run(run())
    check_no_leaks(stack)
