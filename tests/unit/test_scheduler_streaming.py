"""Serial rounds keep the text and the clients' streams off the critical path: a round's chunks
(detokenizing, stop bookkeeping, metrics, the writes to each client) are made once the next
round's first RPC is on its way, not between the verifier's answer and the next Verify. The
tokens are the same, every chunk reaches its client, and a failed round still delivers what was
committed before it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from gateway.clients import DrafterClient, VerifierClient
from gateway.request import GenerationRequest
from specsplit.errors import Code, ServiceError
from specsplit.messages import (
    DraftInput,
    DraftOutput,
    SpecParams,
    Truncated,
    Truncation,
    VerifyInput,
    VerifyOutput,
)
from tests.support import (
    TINY_VOCAB,
    PassThroughVerifier,
    check_no_leaks,
    generate_all,
    generated_ids,
    make_stack,
    save_tiny_llama,
)

MAX_NEW_TOKENS = 9
TARGET_ONLY = SpecParams(0, 1, 0)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("streaming") / "target", seed=0)


def _requests(batch_size: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(batch_size)
    return [
        GenerationRequest(
            torch.randint(3, TINY_VOCAB, (4 + i,), generator=gen).tolist(),
            MAX_NEW_TOKENS,
            ignore_eos=True,
        )
        for i in range(batch_size)
    ]


def _streamed_tokens() -> float:
    return REGISTRY.get_sample_value("specsplit_generated_tokens_total") or 0.0


async def _in_flight(calls: list[tuple[float, float]]) -> None:
    """A call's request on its way and the service at work (5 ms): the tokens streamed to
    clients when it was sent and when it answered, into `calls`."""
    sent = _streamed_tokens()
    await asyncio.sleep(0.005)
    calls.append((sent, _streamed_tokens()))


class _Watching(PassThroughVerifier):
    """The real verifier client; for each Verify, the tokens streamed to clients (the gateway's
    counter) when it was sent and when it answered."""

    def __init__(self, inner: VerifierClient, fail_at: int | None = None) -> None:
        super().__init__(inner)
        self.fail_at = fail_at
        self.calls: list[tuple[float, float]] = []

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        await _in_flight(self.calls)
        if len(self.calls) == self.fail_at:
            raise ServiceError(Code.INVALID_ARGUMENT, "refused")
        return await self.inner.verify(inputs)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_serial_round_streams_while_the_next_verify_is_in_flight(
    target: Path, smollm2_tokenizer, drafter: str
) -> None:
    expected_stack = make_stack(target, "ngram", smollm2_tokenizer, TARGET_ONLY)
    expected = [generated_ids(c) for c in generate_all(expected_stack, _requests(3))]
    spec = TARGET_ONLY if drafter == "ngram" else SpecParams(2, 1, 2)
    stack = make_stack(target, drafter, smollm2_tokenizer, spec)
    watching = _Watching(stack.scheduler.verifier)
    stack.scheduler.verifier = watching
    out = generate_all(stack, _requests(3))
    assert [generated_ids(c) for c in out] == expected
    # the first Verify follows no committed round; every later one (while the sequences run)
    # is sent before the last round's tokens stream, and they stream while it is in flight
    # (with a drafter the Draft is the round's first RPC: its tokens stream during that one)
    later = watching.calls[1:]
    if drafter == "ngram":
        assert all(after > sent for sent, after in later[: MAX_NEW_TOKENS - 2])
    else:
        assert all(after == sent for sent, after in later)  # streamed during the Draft
    assert all(chunks[-1].finish_reason == "length" for chunks in out)


def test_a_failed_round_still_streams_the_round_before(target: Path, smollm2_tokenizer) -> None:
    """The third Verify is refused: the two rounds committed before it reach the client, then
    the error."""
    stack = make_stack(target, "ngram", smollm2_tokenizer, TARGET_ONLY)
    stack.scheduler.verifier = _Watching(stack.scheduler.verifier, fail_at=3)
    scheduler = stack.scheduler
    received: list[object] = []

    async def run() -> None:
        await scheduler.start()
        try:
            with pytest.raises(ServiceError):
                async for chunk in scheduler.generate(_requests(1)[0]):
                    received.append(chunk)
        finally:
            await scheduler.stop()

    asyncio.run(run())
    assert [len(c.token_ids) for c in received] == [1, 1]  # type: ignore[attr-defined]
    check_no_leaks(stack)


class _DownOnce(_Watching):
    """The third Verify fails at once (UNAVAILABLE, before any wait: the connection was gone);
    the gateway releases its sequences there and re-prefills them."""

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        if len(self.calls) == 2:
            self.calls.append((_streamed_tokens(), _streamed_tokens()))
            raise ServiceError(Code.UNAVAILABLE, "verifier restarted")
        return await super().verify(inputs)


def test_a_verifier_failure_streams_the_committed_round_before_waiting(
    target: Path, smollm2_tokenizer
) -> None:
    expected_stack = make_stack(target, "ngram", smollm2_tokenizer, TARGET_ONLY)
    expected = [generated_ids(c) for c in generate_all(expected_stack, _requests(1))]
    stack = make_stack(target, "ngram", smollm2_tokenizer, TARGET_ONLY)
    watching = _DownOnce(stack.scheduler.verifier)
    stack.scheduler.verifier = watching
    out = generate_all(stack, _requests(1))
    assert [generated_ids(c) for c in out] == expected
    # rounds 1 and 2 committed one token each; both reached the client before the re-prefill
    # (the fourth Verify) was sent, not only once it was on its way
    first_sent, fourth_sent = watching.calls[0][0], watching.calls[3][0]
    assert fourth_sent - first_sent == 2


class _WatchingDrafter:
    """The real drafter client; for each Draft, the tokens streamed to clients when it was sent
    and when it answered."""

    def __init__(self, inner: DrafterClient) -> None:
        self.inner = inner
        self.calls: list[tuple[float, float]] = []

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        await _in_flight(self.calls)
        return await self.inner.draft(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        await self.inner.release(seq_ids)

    async def truncate(self, items: list[Truncation]) -> list[Truncated]:
        return await self.inner.truncate(items)


def test_groups_stream_the_committed_group_while_its_next_draft_is_in_flight(
    target: Path, smollm2_tokenizer
) -> None:
    """Pipelined groups: the group verified last round is committed, its next Draft sent, and
    only then its chunks made and streamed (during that Draft), not between the commit and the
    Draft (the Draft, then its Verify, are the path to the verifier's next round). Same tokens
    as the target alone."""
    expected_stack = make_stack(target, "ngram", smollm2_tokenizer, TARGET_ONLY)
    expected = [generated_ids(c) for c in generate_all(expected_stack, _requests(4))]
    stack = make_stack(
        target, "model", smollm2_tokenizer, SpecParams(2, 1, 2), overlap="groups",
        early_verify=True,
    )  # fmt: skip
    watching = _WatchingDrafter(stack.scheduler.drafter)
    stack.scheduler.drafter = watching
    out = generate_all(stack, _requests(4))
    assert [generated_ids(c) for c in out] == expected
    streamed_during = [after > sent for sent, after in watching.calls]
    # every Draft after a group's first commit streams that group's tokens while it is out
    # (the first two draft the groups' first trees, with nothing committed before them)
    assert sum(streamed_during) >= len(watching.calls) // 2, watching.calls
    assert all(chunks[-1].finish_reason == "length" for chunks in out)
    check_no_leaks(stack)
