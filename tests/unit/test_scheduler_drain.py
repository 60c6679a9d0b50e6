"""Shutting down (Scheduler.drain, then stop): requests that finish within the grace finish as
usual; the rest end with UNAVAILABLE and the shutdown's message after the tokens they got, and
their KV is freed even when a service no longer answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.health import Health
from gateway.request import Chunk, GenerationRequest
from inprocess.clients import LocalVerifierClient
from specsplit.errors import Code, ServiceError
from specsplit.messages import SpecParams, VerifyInput, VerifyOutput
from tests.support import check_no_leaks, generated_ids, make_stack, save_tiny_llama


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("drain") / "target", seed=21)


class _StallingVerifier:
    """The real verifier, whose rounds hang once `stall` is set (a stuck backend)."""

    def __init__(self, inner: LocalVerifierClient) -> None:
        self.inner = inner
        self.stall = False

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        while self.stall:
            await asyncio.sleep(0.01)
        return await self.inner.verify(inputs)

    @property
    def last_engine_seconds(self) -> float:
        return self.inner.last_engine_seconds

    @property
    def last_device_seconds(self) -> float:
        return self.inner.last_device_seconds

    async def release(self, seq_ids: list[str]) -> None:
        if self.stall:
            await asyncio.Event().wait()  # never answers
        await self.inner.release(seq_ids)

    async def health(self) -> Health:
        return Health.SERVING


def test_drain_waits_for_the_running_requests_to_finish(
    target_dir: Path, smollm2_tokenizer
) -> None:
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SpecParams(3, 1, 3))
    scheduler = stack.scheduler

    async def main() -> None:
        await scheduler.start()
        try:
            short = scheduler.generate(GenerationRequest([5, 6, 7], 6, ignore_eos=True))
            long = scheduler.generate(GenerationRequest([9, 10, 11], 200, ignore_eos=True))
            first = [await anext(short), await anext(long)]
            async with asyncio.timeout(30):
                assert await scheduler.drain(30.0) is True
            assert scheduler.draining and not scheduler.running and not scheduler.waiting
            rest = [[c async for c in short], [c async for c in long]]
            assert [len(generated_ids([f, *r])) for f, r in zip(first, rest, strict=True)] == [
                6,
                200,
            ]
            assert all(r[-1].finish_reason == "length" for r in rest)
        finally:
            await scheduler.stop()

    asyncio.run(main())
    check_no_leaks(stack)


def test_stop_after_the_grace_ends_a_stuck_request_with_unavailable_after_its_tokens(
    target_dir: Path, smollm2_tokenizer
) -> None:
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SpecParams(3, 1, 3))
    assert isinstance(stack.scheduler.verifier, LocalVerifierClient)
    verifier = _StallingVerifier(stack.scheduler.verifier)
    stack.scheduler.verifier = verifier
    scheduler = stack.scheduler

    async def main() -> None:
        await scheduler.start()
        stuck = scheduler.generate(GenerationRequest([12, 13], 400, ignore_eos=True))
        got: list[Chunk] = [await anext(stuck)]
        verifier.stall = True
        async with asyncio.timeout(10):  # the verifier never answers Release: bounded
            assert await scheduler.drain(0.2) is False
            await scheduler.stop("the gateway is shutting down: grace over")
        with pytest.raises(ServiceError) as ended:
            async for chunk in stuck:
                got.append(chunk)
        assert ended.value.code == Code.UNAVAILABLE
        assert ended.value.message == "the gateway is shutting down: grace over"
        assert 0 < len(generated_ids(got)) < 400

    asyncio.run(main())
    verifier.stall = False
    engine = stack.verifier
    engine.release(list(engine.seqs))  # the Release that never came (the process would be gone)
    check_no_leaks(stack)
