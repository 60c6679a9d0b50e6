"""Greedy generation under a logit bias and penalties through the whole stack (gateway, drafter,
verifier in process): speculative output == target-only output under the same rules, token for
token, whatever drafts (the drafter bends its own by the rules, not exactly), batched beside a
request without rules, with the gateway's several decode steps a round; and it is the target's
greedy decoding under those rules, one full forward a token, not what it gives without them."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from gateway.request import GenerationRequest, ModelInfo, build_request
from inprocess.stack import LocalStack
from specsplit.logit_rules import Penalties, bend_row, distinct
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams
from tests.rules_reference import rules_for
from tests.support import TINY_VOCAB, generate_all, generated_ids, make_stack
from tests.unit.test_lossless_greedy import _prompts, models  # noqa: F401  (a fixture)

MAX_NEW_TOKENS = 12
GREEDY = SamplingParams()
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


# the ways a round runs: drafter ("self": the target, "random": a random model, "ngram", "none":
# target-only), tree shape, the gateway's decode steps a round, overlap mode
Mode = tuple[str, int, int, int, str]
MODES: list[Mode] = [
    ("self", 1, 3, 1, "serial"),
    ("self", 2, 3, 1, "serial"),
    ("random", 1, 4, 1, "serial"),
    ("ngram", 2, 2, 1, "serial"),
    ("none", 1, 0, 4, "serial"),
    ("self", 1, 3, 1, "ahead"),  # (draft-ahead's hinted rounds read their outcome's rules)
    ("self", 1, 2, 1, "groups"),
    ("random", 1, 3, 1, "both"),
]


def mode_id(mode: Mode) -> str:
    return "-".join(map(str, mode))


def mode_stack(models: dict[str, Path], tokenizer: Any, mode: Mode) -> LocalStack:  # noqa: F811
    """A stack that runs its rounds as `mode` says, decode steps run ahead."""
    drafter, topk, num_steps, decode_steps, overlap = mode
    nodes = num_steps if topk == 1 else 2 * num_steps + topk
    return make_stack(
        models["target"],
        "ngram" if drafter in ("ngram", "none") else "model",
        tokenizer,
        SpecParams(num_steps, topk, nodes),
        draft_dir=models["draft"] if drafter == "random" else None,
        decode_steps=decode_steps,
        decode_ahead=True,
        overlap=overlap,
    )


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_speculative_greedy_under_rules_equals_target_greedy_under_them(
    models: dict[str, Path],  # noqa: F811
    smollm2_tokenizer,
    expected: list[list[int]],
    mode: Mode,
) -> None:
    stack = mode_stack(models, smollm2_tokenizer, mode)
    out = generate_all(stack, _requests(_prompts(3, seed=5)))
    assert [generated_ids(chunks) for chunks in out] == expected
    if mode[0] == "self":  # (drafts of the unbent target: some the rules keep, most not)
        accepted = [chunks[-1].stats.num_accepted_drafts for chunks in out[:-1]]  # type: ignore[union-attr]
        assert sum(accepted) > 0, accepted


def test_min_tokens_hold_a_stop_token_back_exactly_as_the_target_would(
    models: dict[str, Path],  # noqa: F811
    smollm2_tokenizer,
) -> None:
    """A stop token the target emits second: without min_tokens the generation ends there;
    with min_tokens 6 it is held back for the first 6 tokens (their logits -inf), the tokens
    are the target's greedy ones under that, speculative and target-only alike, and the stop
    token ends the generation where it first comes after them."""
    prompt = _prompts(1, seed=9)[0]
    plain = GenerationRequest(prompt, MAX_NEW_TOKENS, ignore_eos=True)
    stop = _reference(models["target"], plain)[1]
    model = ModelInfo(smollm2_tokenizer, TINY_VOCAB, 4096)
    request = build_request(
        model, "token_ids", prompt, max_new_tokens=MAX_NEW_TOKENS, sampling=GREEDY,
        stop_token_ids=[stop], ignore_eos=True, min_tokens=6,
    )  # fmt: skip
    want = _reference(models["target"], request)
    if stop in want[6:]:
        want = want[: want.index(stop, 6) + 1]
    assert stop not in want[:6] and len(want) > 2
    got = []
    for spec, drafter in ((SpecParams(0, 1, 0), "ngram"), (SpecParams(3, 1, 3), "model")):
        stack = make_stack(models["target"], drafter, smollm2_tokenizer, spec)
        early = replace(request, penalties=None, min_tokens=0)
        outs = generate_all(stack, [request, early])
        got.append(generated_ids(outs[0]))
        assert generated_ids(outs[1]) == want[:1] + [stop]  # (without min_tokens)
    assert got == [want, want]


def test_a_drafter_that_is_the_target_has_every_draft_accepted_under_a_bias(
    models: dict[str, Path],  # noqa: F811
    smollm2_tokenizer,
) -> None:
    """The drafter bends its drafts by the request's rules (drafter/draft_rules.py): a draft
    model that is the target, under a bias alone (nothing a tree's path would change), drafts
    the target's biased argmax, so every draft is accepted: as few rounds and as many accepted
    drafts as without rules, and the output is the target's greedy one under the bias."""
    prompt = _prompts(1, seed=11)[0]
    plain = GenerationRequest(prompt, MAX_NEW_TOKENS, ignore_eos=True)
    unbiased = _reference(models["target"], plain)
    bias = Penalties(bias=tuple((t, -100.0) for t in sorted(set(unbiased[:4]))))
    biased = replace(plain, penalties=bias)
    want = _reference(models["target"], biased)
    assert want != unbiased
    stack = make_stack(models["target"], "model", smollm2_tokenizer, SpecParams(3, 1, 3))
    outs = generate_all(stack, [plain, biased])
    assert [generated_ids(chunks) for chunks in outs] == [unbiased, want]
    stats = [chunks[-1].stats for chunks in outs]
    assert stats[0] is not None and stats[1] is not None
    assert stats[1].num_accepted_drafts == stats[0].num_accepted_drafts > 0
    assert stats[1].rounds == stats[0].rounds
