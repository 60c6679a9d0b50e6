"""Greedy generation under a logit bias and penalties through the whole stack (gateway, drafter,
verifier in process): speculative output == target-only output under the same rules, token for
token, whatever drafts (the drafter proposes from its own unbent distribution), batched beside a
request without rules, with the gateway's several decode steps a round; and it is the target's
greedy decoding under those rules, one full forward a token, not what it gives without them."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from gateway.request import GenerationRequest
from specsplit.logit_rules import Penalties, bend_row, distinct, rules_for
from specsplit.messages import SpecParams
from tests.support import generate_all, generated_ids, make_stack
from tests.unit.test_lossless_greedy import _prompts, models  # noqa: F401  (a fixture)

MAX_NEW_TOKENS = 12
PENALTIES = Penalties(bias=((7, 2.0), (300, -100.0)), presence=0.8, frequency=1.5, repetition=1.3)


def _requests(prompts: list[list[int]]) -> list[GenerationRequest]:
    """Every request but the last with the rules (the last: none, beside them)."""
    return [
        GenerationRequest(p, MAX_NEW_TOKENS, ignore_eos=True, penalties=PENALTIES)
        for p in prompts[:-1]
    ] + [GenerationRequest(prompts[-1], MAX_NEW_TOKENS, ignore_eos=True)]


def _reference(target: Path, request: GenerationRequest) -> list[int]:
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    out: list[int] = []
    for _ in range(request.max_new_tokens):
        with torch.no_grad():
            row = hf(torch.tensor([request.prompt_ids + out])).logits[0, -1].float()
        rules = rules_for(request.penalties, distinct(request.prompt_ids), Counter(out))
        out.append(int((row if rules is None else bend_row(row, rules, [])).argmax()))
    return out


@pytest.fixture(scope="module")
def expected(models: dict[str, Path], smollm2_tokenizer) -> list[list[int]]:  # noqa: F811
    stack = make_stack(models["target"], "ngram", smollm2_tokenizer, SpecParams(0, 1, 0))
    requests = _requests(_prompts(3, seed=5))
    out = [generated_ids(chunks) for chunks in generate_all(stack, requests)]
    assert out[0] == _reference(models["target"], requests[0])
    assert out[0] != _reference(models["target"], replace(requests[0], penalties=None))
    return out


@pytest.mark.parametrize(
    ("drafter", "topk", "num_steps", "decode_steps"),
    [
        ("self", 1, 3, 1),
        ("self", 2, 3, 1),
        ("random", 1, 4, 1),
        ("ngram", 2, 2, 1),
        ("none", 1, 0, 4),
    ],
)
def test_speculative_greedy_under_rules_equals_target_greedy_under_them(
    models: dict[str, Path],  # noqa: F811
    smollm2_tokenizer,
    expected: list[list[int]],
    drafter: str,
    topk: int,
    num_steps: int,
    decode_steps: int,
) -> None:
    nodes = num_steps if topk == 1 else 2 * num_steps + topk
    stack = make_stack(
        models["target"],
        "ngram" if drafter in ("ngram", "none") else "model",
        smollm2_tokenizer,
        SpecParams(num_steps, topk, nodes),
        draft_dir=models["draft"] if drafter == "random" else None,
        decode_steps=decode_steps,
        decode_ahead=True,
    )
    out = generate_all(stack, _requests(_prompts(3, seed=5)))
    assert [generated_ids(chunks) for chunks in out] == expected
    if drafter == "self":  # (drafts of the unbent target: some the rules keep, most not)
        accepted = [chunks[-1].stats.num_accepted_drafts for chunks in out[:-1]]  # type: ignore[union-attr]
        assert sum(accepted) > 0, accepted
