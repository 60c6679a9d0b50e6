"""Greedy speculative output == greedy target-only output, token for token (DESIGN.md §2).

Tiny random float64 models (ties practically impossible), the real engines in-process, the
invariants checked after every round (the local clients call check_integrity; the gateway's
commit asserts kv_committed_len == len(tokens) - 1) and no KV pages left after each run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from gateway.request import GenerationRequest
from specsplit.messages import SpecParams
from tests.support import TINY_VOCAB, generate_all, generated_ids, make_stack, save_tiny_llama

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "target": save_tiny_llama(root / "target", seed=0),
        "draft": save_tiny_llama(root / "draft", seed=1, num_layers=1),
    }


def _prompts(batch_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3 + (5 * i) % 11 for i in range(batch_size)]  # mixed prompt lengths
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in lengths]
    # a repeated chunk gives the n-gram proposer something to find
    return [p + p[:3] for p in prompts]


def _requests(prompts: list[list[int]]) -> list[GenerationRequest]:
    return [GenerationRequest(p, MAX_NEW_TOKENS, ignore_eos=True) for p in prompts]


_baseline_cache: dict[tuple[int, int], list[list[int]]] = {}


def _target_only(models: dict[str, Path], tokenizer: object, batch_size: int, seed: int):
    key = (batch_size, seed)
    if key not in _baseline_cache:
        stack = make_stack(models["target"], "ngram", tokenizer, SpecParams(0, 1, 0))
        out = generate_all(stack, _requests(_prompts(batch_size, seed)))
        _baseline_cache[key] = [generated_ids(chunks) for chunks in out]
    return _baseline_cache[key]


def test_target_only_matches_transformers_generate(models, smollm2_tokenizer) -> None:
    prompts = _prompts(2, seed=7)
    ours = _target_only(models, smollm2_tokenizer, 2, 7)
    hf = LlamaForCausalLM.from_pretrained(models["target"], dtype=torch.float64)
    for prompt, got in zip(prompts, ours, strict=True):
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            min_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=0,
        )
        assert got == out[0, len(prompt) :].tolist()


CASES = [
    # (drafter, topk, num_steps, batch_size, page_size)
    *[("self", 1, steps, 1 + steps % 3, 16) for steps in range(1, 6)],
    *[("self", 2, steps, 3, 1) for steps in range(1, 6)],
    *[("self", 4, steps, 2, 16) for steps in (1, 2, 3, 5)],
    *[("random", 1, steps, 8, 1) for steps in (1, 3, 5)],
    *[("random", 2, steps, 4, 16) for steps in (2, 4)],
    *[("random", 4, steps, 5, 1) for steps in (1, 3)],
    *[("ngram", 1, steps, 6, 16) for steps in (1, 2, 5)],
    *[("ngram", 2, steps, 3, 1) for steps in (2, 3)],
    ("ngram", 4, 4, 8, 16),
]


def _num_draft_tokens(topk: int, steps: int) -> int:
    return steps if topk == 1 else min(topk + (steps - 1) * topk * topk, 2 * steps + topk)


@pytest.mark.parametrize(("drafter", "topk", "num_steps", "batch_size", "page_size"), CASES)
def test_speculative_greedy_equals_target_greedy(
    models,
    smollm2_tokenizer,
    drafter: str,
    topk: int,
    num_steps: int,
    batch_size: int,
    page_size: int,
) -> None:
    seed = 100 + batch_size
    expected = _target_only(models, smollm2_tokenizer, batch_size, seed)
    spec = SpecParams(num_steps, topk, _num_draft_tokens(topk, num_steps))
    draft_dir = {"self": None, "random": models["draft"], "ngram": None}[drafter]
    stack = make_stack(
        models["target"],
        "ngram" if drafter == "ngram" else "model",
        smollm2_tokenizer,
        spec,
        draft_dir=draft_dir,
        page_size=page_size,
    )
    out = generate_all(stack, _requests(_prompts(batch_size, seed)))
    assert [generated_ids(chunks) for chunks in out] == expected
    for chunks in out:
        stats = chunks[-1].stats
        assert stats is not None and chunks[-1].completion_tokens == MAX_NEW_TOKENS
        assert (
            stats.num_accepted_tokens == MAX_NEW_TOKENS
        )  # every generated token came from a round
        if drafter == "self" and topk == 1:
            # the draft is the target: every chain is accepted in full (the last round is capped)
            assert stats.rounds == -(-MAX_NEW_TOKENS // (num_steps + 1))
