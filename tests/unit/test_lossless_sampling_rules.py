"""Sampling under a logit bias and penalties draws from the target's bent distribution while the
drafter bends its own drafts by the same rules (drafter/draft_rules.py: its sampled chains draw
from, and report, the bent draft distribution; a tree drafts from the bent rows): test_lossless_
sampling's tiny 16-token target, its random draft model and EAGLE head; seeded requests generate
three tokens each (so that the second is drafted: a round is never deeper than the tokens left
after its bonus), and the first token's, the second's and the pair's empirical distributions are
compared with the exact ones (the first row bent by the bias and the prompt's repetition, the
second also by presence, frequency and repetition of the first token), as the guided test does."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM

from gateway.request import GenerationRequest
from specsplit.logit_rules import Penalties, bend_row, distinct
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams, target_probs
from tests.rules_reference import rules_for
from tests.support import generate_all, generated_ids
from tests.unit.test_lossless_sampling import (  # noqa: F401  (a fixture)
    NUM_SAMPLES,
    PROMPT,
    VOCAB,
    _stack,
    assert_pairs_follow,
    models,
)

# strong enough to move the draws: a token made likely, one banned, the prompt's tokens and the
# first token pushed down
PENALTIES = Penalties(((4, -100.0), (9, 2.0)), presence=1.0, frequency=0.5, repetition=1.8)


def _exact_bent_pairs(target, sampling: SamplingParams) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[V, V] probability of (first, second) under target sampling of the bent rows."""
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float64)

    def bent(tokens: list[int], output: list[int]) -> torch.Tensor:
        row = model(torch.tensor([tokens])).logits[0, -1].float()
        rules = rules_for(PENALTIES, distinct(PROMPT), Counter(output))
        assert rules is not None
        return bend_row(row, rules, [])

    with torch.no_grad():
        first = target_probs(bent(PROMPT, [])[None], sampling)[0].double()
        pairs = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        for t in range(VOCAB):
            if first[t] > 0:
                second = target_probs(bent(PROMPT + [t], [t])[None], sampling)[0].double()
                pairs[t] = first[t] * second
    return pairs


@pytest.mark.parametrize(
    ("drafter", "spec", "sampling"),
    [
        ("model", SpecParams(3, 1, 3), SamplingParams(temperature=1.0)),
        ("eagle3", SpecParams(3, 1, 3), SamplingParams(temperature=0.9)),
        ("model", SpecParams(2, 2, 4), SamplingParams(temperature=0.8, top_p=0.9)),
    ],
    ids=["chain_with_draft_probs", "eagle3_chain", "tree_topk2_top_p"],
)
def test_tokens_under_rules_follow_the_bent_target_distribution(
    models,  # noqa: F811
    smollm2_tokenizer,
    drafter: str,
    spec: SpecParams,
    sampling: SamplingParams,
) -> None:
    stack = _stack(models, smollm2_tokenizer, drafter, spec, "serial", num_pages=2048)
    requests = [
        GenerationRequest(
            list(PROMPT), 3, replace(sampling, seed=i), ignore_eos=True, penalties=PENALTIES
        )
        for i in range(NUM_SAMPLES)
    ]
    outs = generate_all(stack, requests)
    assert all(len(generated_ids(chunks)) == 3 for chunks in outs)
    pairs = [tuple(generated_ids(chunks)[:2]) for chunks in outs]
    assert sum(chunks[-1].stats.num_accepted_drafts for chunks in outs) > 0  # type: ignore[union-attr]
    assert 4 not in {t for p in pairs for t in p}  # (banned)
    assert_pairs_follow(pairs, _exact_bent_pairs(models["target"], sampling))
