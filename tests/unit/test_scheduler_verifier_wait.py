"""The gateway waits for a verifier that went away by its health: loading (NOT_SERVING) counts as
coming back, the limit is --verifier-wait, and only past it do streams end with UNAVAILABLE after
the tokens they already got. Time is a fake clock that each health check advances."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway import faults
from gateway.health import Health
from gateway.request import Chunk, GenerationRequest
from inprocess.clients import LocalVerifierClient
from inprocess.stack import LocalStack
from specsplit.errors import Code, ServiceError
from specsplit.messages import SpecParams, VerifyInput, VerifyOutput
from tests.support import (
    PassThroughVerifier,
    check_no_leaks,
    generated_ids,
    make_stack,
    save_tiny_llama,
)

POLL_S = 5.0  # fake seconds each health check of the away verifier takes


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("verifier_wait") / "target", seed=13)


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "VERIFIER_RETRY_S", 0.001)


class _RestartingVerifier(PassThroughVerifier):
    """The real verifier, gone after `fail_after` rounds: while away its rounds and releases
    fail UNAVAILABLE and its health says `away_health`; each health check advances the clock by
    POLL_S. After `away_polls` checks it is back with an empty cache, as a restarted one."""

    def __init__(
        self, inner: LocalVerifierClient, fail_after: int, away_polls: int, away_health: Health
    ) -> None:
        super().__init__(inner)
        self.fail_after = fail_after
        self.away_polls = away_polls
        self.away_health = away_health
        self.now = 0.0
        self.rounds = 0
        self.health_checks = 0
        self.away = False

    def clock(self) -> float:
        return self.now

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        if self.rounds == self.fail_after and self.health_checks == 0:
            self.away = True
        if self.away:
            raise ServiceError(Code.UNAVAILABLE, "verifier: UNAVAILABLE: connection refused")
        self.rounds += 1
        return await self.inner.verify(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        if self.away:
            raise ServiceError(Code.UNAVAILABLE, "verifier: UNAVAILABLE: connection refused")
        await self.inner.release(seq_ids)

    async def health(self) -> Health:
        self.health_checks += 1
        self.now += POLL_S
        if self.away and self.health_checks >= self.away_polls:
            self.come_back()
        return Health.SERVING if not self.away else self.away_health

    def come_back(self) -> None:
        """Restarted: every sequence's KV is gone."""
        engine = self.inner.verifier
        engine.release(list(engine.seqs))
        self.away = False


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest([5 + i, 6, 7, 8 + i], 24, ignore_eos=True) for i in range(3)]


def _stack(target_dir: Path, tokenizer: object) -> LocalStack:
    return make_stack(target_dir, "model", tokenizer, SpecParams(3, 1, 3))


async def _collect(
    stack: LocalStack, request: GenerationRequest
) -> tuple[list[Chunk], ServiceError | None]:
    """(chunks received, the error that ended the stream or None)."""
    chunks: list[Chunk] = []
    try:
        async for chunk in stack.scheduler.generate(request):
            chunks.append(chunk)
    except ServiceError as err:
        return chunks, err
    return chunks, None


def _run(stack: LocalStack) -> list[tuple[list[Chunk], ServiceError | None]]:
    async def main() -> list[tuple[list[Chunk], ServiceError | None]]:
        await stack.scheduler.start()
        try:
            async with asyncio.timeout(30):
                return list(await asyncio.gather(*(_collect(stack, r) for r in _requests())))
        finally:
            await stack.scheduler.stop()

    return asyncio.run(main())


def test_verifier_loading_longer_than_30_s_within_the_limit_loses_no_stream(
    target_dir: Path, smollm2_tokenizer
) -> None:
    expected = [
        generated_ids(c) for c in _stack(target_dir, smollm2_tokenizer).generate_all(_requests())
    ]
    stack = _stack(target_dir, smollm2_tokenizer)
    assert isinstance(stack.scheduler.verifier, LocalVerifierClient)
    fake = _RestartingVerifier(stack.scheduler.verifier, 2, 9, Health.LOADING)  # 45 s loading
    stack.scheduler.verifier = fake
    stack.scheduler.clock = fake.clock
    stack.scheduler.verifier_wait_s = 60.0
    results = _run(stack)
    assert fake.now > 30.0 and fake.health_checks == 9  # waited through the reload
    assert [err for _, err in results] == [None, None, None]
    assert [generated_ids(chunks) for chunks, _ in results] == expected
    check_no_leaks(stack)


def test_verifier_away_past_the_limit_ends_streams_unavailable_after_their_tokens(
    target_dir: Path, smollm2_tokenizer
) -> None:
    expected = [
        generated_ids(c) for c in _stack(target_dir, smollm2_tokenizer).generate_all(_requests())
    ]
    stack = _stack(target_dir, smollm2_tokenizer)
    assert isinstance(stack.scheduler.verifier, LocalVerifierClient)
    fake = _RestartingVerifier(stack.scheduler.verifier, 2, 1000, Health.DOWN)
    stack.scheduler.verifier = fake
    stack.scheduler.clock = fake.clock
    stack.scheduler.verifier_wait_s = 20.0
    results = _run(stack)
    assert 20.0 < fake.now <= 20.0 + 2 * POLL_S  # gave up at the limit, not before
    for (chunks, err), full in zip(results, expected, strict=True):
        assert isinstance(err, ServiceError) and err.code == Code.UNAVAILABLE
        assert "limit of 20 s" in err.message and "connection refused" in err.message
        received = generated_ids(chunks)
        assert 0 < len(received) < len(full) and received == full[: len(received)]
    fake.come_back()  # a restart frees what the gateway could not release while it was away
    check_no_leaks(stack)
