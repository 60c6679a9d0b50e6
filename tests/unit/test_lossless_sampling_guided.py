"""Sampling under a guide draws from the target's distribution masked to what the guide allows:
test_lossless_sampling's tiny 16-token target and random draft, each token id given a letter,
a guide that allows a few letters first and others after it; seeded requests generate two tokens
each, and the first token's, the second's and the pair's empirical distributions are compared
with the exact masked ones (the same total-variation bound)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM

from gateway.request import GenerationRequest
from specsplit.guide.regex_dfa import compile_regex
from specsplit.guide.tokens import DEAD, TokenAutomaton
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams, target_probs
from tests.support import generate_all, generated_ids
from tests.unit.test_lossless_sampling import (  # noqa: F401  (a fixture)
    NUM_SAMPLES,
    PROMPT,
    VOCAB,
    _stack,
    assert_pairs_follow,
    models,
)

EOS = 2
# token t is the letter chr(ord("a") + t); EOS none
LETTERS: list[bytes | None] = [None if t == EOS else bytes([97 + t]) for t in range(VOCAB)]
PATTERN = "[abdfhk][d-p]{1,3}"  # first one of 6 letters, then 1-3 of the last 13


def _exact_masked_pairs(target, guide: TokenAutomaton, sampling: SamplingParams) -> torch.Tensor:
    """[V, V] probability of (first, second) under target sampling of the masked rows."""
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float64)

    def masked(logits: torch.Tensor, state: int) -> torch.Tensor:
        allowed = torch.from_numpy(guide.next_states(state) != DEAD)
        return torch.where(allowed, logits, -torch.inf)

    with torch.no_grad():
        row = masked(model(torch.tensor([PROMPT])).logits[0, -1], 0)
        first = target_probs(row[None], sampling)[0].double()
        pairs = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        for t in range(VOCAB):
            if first[t] > 0:
                state = guide.step(0, t)
                row = masked(model(torch.tensor([PROMPT + [t]])).logits[0, -1], state)
                pairs[t] = first[t] * target_probs(row[None], sampling)[0].double()
    return pairs


@pytest.mark.parametrize(
    ("spec", "sampling"),
    [
        (SpecParams(3, 1, 3), SamplingParams(temperature=1.0)),
        (SpecParams(2, 2, 4), SamplingParams(temperature=0.8, top_p=0.9)),
    ],
    ids=["chain_with_draft_probs", "tree_topk2_top_p"],
)
def test_guided_tokens_follow_the_masked_target_distribution(
    models,  # noqa: F811
    smollm2_tokenizer,
    spec: SpecParams,
    sampling: SamplingParams,
) -> None:
    guide = TokenAutomaton(compile_regex(PATTERN), LETTERS, (EOS,))
    stack = _stack(models, smollm2_tokenizer, "model", spec, "serial", num_pages=2048)
    requests = [
        GenerationRequest(list(PROMPT), 2, replace(sampling, seed=i), guide=guide)
        for i in range(NUM_SAMPLES)
    ]
    pairs = [tuple(generated_ids(chunks)) for chunks in generate_all(stack, requests)]
    assert all(len(p) == 2 for p in pairs)
    assert_pairs_follow(pairs, _exact_masked_pairs(models["target"], guide, sampling))
