"""Rounds without drafts skip the drafter: a request with speculation off never calls it; a
speculative one's round with one token left skips it once the drafter has told the gateway which
target layers it reads. Outputs do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.request import GenerationRequest
from inprocess.stack import LocalStack
from specsplit.messages import DraftInput, DraftOutput, SpecParams
from specsplit.model.loader import load_model
from tests.eagle_random import save_random_eagle3
from tests.support import check_no_leaks, generate_all, generated_ids, make_stack, save_tiny_llama

MAX_NEW_TOKENS = 10
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
TARGET_ONLY = SpecParams(0, 1, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    target = save_tiny_llama(root / "target", seed=4, num_layers=4)
    _, config = load_model(str(target), dtype=torch.float64, device="cpu")
    return {"target": target, "head": save_random_eagle3(root / "head", config, seed=5)}


class _CountingDrafter:
    """The stack's own drafter, recording the num_steps of every sequence of every Draft call,
    and every Release's ids."""

    def __init__(self, stack: LocalStack) -> None:
        self.inner = stack.scheduler.drafter
        self.calls: list[list[int]] = []
        self.released: list[str] = []
        stack.scheduler.drafter = self

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        self.calls.append([item.spec.num_steps for item in inputs])
        return await self.inner.draft(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        self.released += seq_ids
        await self.inner.release(seq_ids)


def _requests(spec: SpecParams | None) -> list[GenerationRequest]:
    return [GenerationRequest(p, MAX_NEW_TOKENS, spec=spec, ignore_eos=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(models, smollm2_tokenizer) -> list[list[int]]:
    plain = make_stack(models["target"], "ngram", smollm2_tokenizer, TARGET_ONLY)
    return [generated_ids(c) for c in generate_all(plain, _requests(None))]


def _eagle_stack(models, tokenizer) -> LocalStack:
    return make_stack(
        models["target"], "eagle3", tokenizer, SpecParams(3, 1, 3), draft_dir=models["head"]
    )


def test_target_only_requests_never_ask_the_drafter(models, smollm2_tokenizer, expected) -> None:
    """Speculation off for a request's whole life: no Draft (and no Release on the drafter
    when it ends), before and after a speculative request ran beside them."""
    stack = _eagle_stack(models, smollm2_tokenizer)
    drafter = _CountingDrafter(stack)
    out = generate_all(stack, _requests(TARGET_ONLY))
    assert [generated_ids(c) for c in out] == expected
    assert drafter.calls == [] and drafter.released == []
    generate_all(stack, _requests(None)[:1])
    assert drafter.calls and stack.scheduler.hidden_state_layers != ()
    assert len(set(drafter.released)) == 1, drafter.released  # the speculative one, freed there
    drafter.calls.clear()
    out = generate_all(stack, _requests(TARGET_ONLY))
    assert [generated_ids(c) for c in out] == expected
    assert drafter.calls == []
    check_no_leaks(stack)


def test_a_round_with_one_token_left_skips_the_drafter(models, smollm2_tokenizer, expected) -> None:
    stack = _eagle_stack(models, smollm2_tokenizer)
    drafter = _CountingDrafter(stack)
    out = generate_all(stack, _requests(None))
    assert [generated_ids(c) for c in out] == expected
    assert all(num_steps > 0 for call in drafter.calls for num_steps in call)
    # the random head is never accepted: one token per round, the last with one token left
    assert [c[-1].stats.rounds for c in out if c[-1].stats] == [MAX_NEW_TOKENS] * len(PROMPTS)
    assert len(drafter.calls) == MAX_NEW_TOKENS - 1
    check_no_leaks(stack)


def test_target_only_and_speculative_requests_share_rounds(
    models, smollm2_tokenizer, expected
) -> None:
    """One round verifies both (only the speculative one asks for hidden states); only the
    speculative one is ever drafted for."""
    stack = _eagle_stack(models, smollm2_tokenizer)
    drafter = _CountingDrafter(stack)
    requests = [_requests(TARGET_ONLY)[0], _requests(None)[1]]
    out = generate_all(stack, requests)
    assert [generated_ids(c) for c in out] == expected
    assert drafter.calls and all(len(call) == 1 and call[0] > 0 for call in drafter.calls)
    check_no_leaks(stack)
