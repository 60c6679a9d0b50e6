"""The scheduler under faults: a failing drafter means plain decoding, a bug fails requests
instead of stalling them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.request import GenerationRequest
from specsplit.errors import Code, ServiceError
from specsplit.messages import SpecParams
from tests.support import BrokenDrafter, check_no_leaks, generated_ids, make_stack, save_tiny_llama


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("faults") / "target", seed=9)


def _request() -> GenerationRequest:
    return GenerationRequest([5, 6, 7, 8], 10, ignore_eos=True)


def test_unavailable_drafter_gives_plain_decoding_with_the_same_tokens(
    target_dir, smollm2_tokenizer
) -> None:
    expected = generated_ids(
        make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0)).generate_all(
            [_request()]
        )[0]
    )
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SpecParams(3, 1, 3))
    broken = BrokenDrafter(ServiceError(Code.UNAVAILABLE, "drafter down"))
    stack.scheduler.drafter = broken
    chunks = stack.generate_all([_request()])[0]
    assert generated_ids(chunks) == expected
    assert chunks[-1].stats is not None and chunks[-1].stats.num_accepted_drafts == 0
    assert broken.calls >= 1
    check_no_leaks(stack)


def test_unexpected_error_fails_the_request_instead_of_hanging(
    target_dir, smollm2_tokenizer
) -> None:
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SpecParams(3, 1, 3))
    stack.scheduler.drafter = BrokenDrafter(RuntimeError("a bug"))

    async def run() -> None:
        await stack.scheduler.start()
        try:
            with pytest.raises(ServiceError) as err:
                async with asyncio.timeout(30):
                    async for _ in stack.scheduler.generate(_request()):
                        pass
            assert err.value.code == Code.INTERNAL
            # the loop survived: a healthy drafter serves the next request
            stack.scheduler.drafter = make_stack(
                target_dir, "ngram", smollm2_tokenizer, SpecParams(3, 1, 3)
            ).scheduler.drafter
            async with asyncio.timeout(30):
                chunks = [c async for c in stack.scheduler.generate(_request())]
            assert len(generated_ids(chunks)) == 10
        finally:
            await stack.scheduler.stop()

    asyncio.run(run())
    assert stack.verifier.num_pages_used == 0
