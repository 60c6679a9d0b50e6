"""Memory pressure: when the verifier's KV is full, the newest running request is preempted
(its KV freed in both services) and resumed later from the gateway's tokens, with the same
greedy output as a run with room for everyone; nothing leaks. A request that cannot fit even
alone still fails with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from gateway.request import GenerationRequest
from specsplit.errors import Code, ServiceError
from specsplit.messages import SpecParams
from tests.support import (
    TINY_VOCAB,
    check_no_leaks,
    generate_all,
    generated_ids,
    make_stack,
    save_tiny_llama,
)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("preempt") / "target", seed=6)


def _requests(n: int, max_new_tokens: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, TINY_VOCAB, (10,), generator=gen).tolist() for _ in range(n)]
    return [GenerationRequest(p, max_new_tokens, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("overlap", ["serial", "groups"])
@pytest.mark.parametrize("spec", [SpecParams(0, 1, 0), SpecParams(3, 1, 3)], ids=["plain", "chain"])
def test_kv_full_preempts_and_resumes_with_the_same_tokens(
    target_dir, smollm2_tokenizer, spec: SpecParams, overlap: str
) -> None:
    requests = _requests(4, max_new_tokens=40)
    roomy = make_stack(target_dir, "model", smollm2_tokenizer, spec, page_size=4, num_pages=256)
    expected = [generated_ids(c) for c in generate_all(roomy, requests)]
    # 4 requests x (10 + 40 tokens + the tree) need ~52 pages of 4; 30 pages hold about two
    tight = make_stack(
        target_dir, "model", smollm2_tokenizer, spec, page_size=4, num_pages=30, overlap=overlap
    )
    out = generate_all(tight, requests)  # checks no KV is left in either service
    assert [generated_ids(c) for c in out] == expected
    assert all(c[-1].finish_reason == "length" for c in out)
    assert tight.scheduler.num_preemptions > 0


def test_a_request_too_big_for_the_cache_alone_fails_with_resource_exhausted(
    target_dir, smollm2_tokenizer
) -> None:
    stack = make_stack(
        target_dir, "model", smollm2_tokenizer, SpecParams(0, 1, 0), page_size=4, num_pages=5
    )

    async def run() -> None:
        await stack.scheduler.start()
        try:
            with pytest.raises(ServiceError) as err:
                async with asyncio.timeout(30):
                    async for _ in stack.scheduler.generate(_requests(1, 40)[0]):
                        pass
            assert err.value.code == Code.RESOURCE_EXHAUSTED
        finally:
            await stack.scheduler.stop()

    asyncio.run(run())
    check_no_leaks(stack)
