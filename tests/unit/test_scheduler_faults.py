"""The scheduler under faults: a failing drafter means plain decoding, a bug fails requests
instead of stalling them, a verifier that lost a kept rules context gets it again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.request import GenerationRequest
from specsplit.errors import Code, ServiceError
from specsplit.logit_rules import Penalties
from specsplit.messages import SpecParams, VerifyInput, VerifyOutput
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


def test_a_verifier_lacking_a_kept_rules_context_gets_it_again(
    target_dir, smollm2_tokenizer
) -> None:
    """The verifier loses the logit rules' context it kept (verifier/kept_rules.py) before a
    round that says it keeps it: FAILED_PRECONDITION, nothing of the round ran, and the gateway
    sends the round again with every context. The same tokens as a run undisturbed."""
    penalties = Penalties(presence=0.8, frequency=1.5, repetition=1.3)
    requests = [GenerationRequest([5, 6, 7, 8], 12, ignore_eos=True, penalties=penalties)]
    spec = SpecParams(3, 1, 3)
    expected = generated_ids(
        make_stack(target_dir, "ngram", smollm2_tokenizer, spec).generate_all(requests)[0]
    )
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, spec)
    client, calls, said = stack.scheduler.verifier, [0], []
    verify = client.verify

    async def forgetting(inputs: list[VerifyInput]) -> list[VerifyOutput]:
        calls[0] += 1
        said.extend(item.rules.kept for item in inputs if item.rules is not None)
        if calls[0] == 3:  # (the verifier lost what it kept)
            for seq in stack.verifier.seqs.values():
                seq.rules = None
        return await verify(inputs)

    client.verify = forgetting  # type: ignore[method-assign]
    assert generated_ids(stack.generate_all(requests)[0]) == expected
    assert said[0] == -1 and said[2] >= 0 and said[3] == -1  # (refused, then sent again)
    assert any(k >= 0 for k in said[4:])  # (and kept again after)
    check_no_leaks(stack)
