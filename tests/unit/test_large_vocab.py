"""A Llama-3-sized vocabulary (128,256 rows, as Llama 3's) through the in-process stack: ids past
2**16 and past the tokenizer's own (SmolLM2's 49,152: the embedding's extra rows, as models pad
theirs) in prompts, drafts, logit rules, guides and log-probabilities. Speculative greedy output
equals the target alone under each, token for token; every request ends and leaves nothing
behind (`generate_all`: no KV page, rules slot or sequence); ids the tokenizer lacks stream
as no text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.request import GenerationRequest
from specsplit.guide.bad_words import BadWords
from specsplit.guide.tokens import FixedTokens
from specsplit.logit_rules import Penalties
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams
from tests.support import generate_all, generated_ids, make_stack, save_tiny_llama

VOCAB = 128_256
HIGH = (70_000, 100_003, 128_255)  # past 2**16 and past the tokenizer's 49,152 ids
MAX_NEW_TOKENS = 10
TREE = SpecParams(3, 2, 6)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("large_vocab")
    return {
        "target": save_tiny_llama(root / "target", seed=5, vocab_size=VOCAB),
        "draft": save_tiny_llama(root / "draft", seed=6, vocab_size=VOCAB, num_layers=1),
    }


def _requests() -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (6 + 3 * i,), generator=gen).tolist() for i in range(6)]
    prompts[0][1:4] = HIGH  # (the last id of the vocabulary among them)
    bias = tuple((token, 8.0) for token in HIGH)
    allowed = (*HIGH, *range(120_000, 120_040))

    def request(i: int, **options: object) -> GenerationRequest:
        return GenerationRequest(prompts[i], MAX_NEW_TOKENS, ignore_eos=True, **options)  # type: ignore[arg-type]

    return [
        request(0),
        request(1, penalties=Penalties(bias=bias, presence=0.5, frequency=0.5)),
        request(2, penalties=Penalties(repetition=1.3)),
        request(3, guide=FixedTokens(allowed, VOCAB)),
        request(4, guide=BadWords([(HIGH[0],), (HIGH[1], HIGH[2])], VOCAB), logprobs=3),
        request(5, penalties=Penalties(bias=bias)),
    ]


@pytest.mark.parametrize("draft", ["target", "draft"], ids=["drafts-accepted", "drafts-rejected"])
def test_speculative_greedy_equals_the_target_alone_past_two_to_the_sixteen(
    models: dict[str, Path], smollm2_tokenizer, draft: str
) -> None:
    """The target drafting for itself (its drafts accepted) and another model (rejected)."""
    target = make_stack(models["target"], "ngram", smollm2_tokenizer, SpecParams(0, 1, 0))
    expected = [generated_ids(chunks) for chunks in generate_all(target, _requests())]
    spec = make_stack(models["target"], "model", smollm2_tokenizer, TREE, draft_dir=models[draft])
    got = generate_all(spec, _requests())
    assert [generated_ids(chunks) for chunks in got] == expected
    accepted = sum(c.stats.num_accepted_drafts for chunks in got for c in chunks if c.stats)
    half = 6 * MAX_NEW_TOKENS // 2  # (of the 60 tokens; 36 and 9 accepted when written)
    assert accepted >= half if draft == "target" else 0 < accepted < half
    assert all(len(ids) == MAX_NEW_TOKENS for ids in expected)
    assert all(t in HIGH for t in expected[5]), expected[5]  # the bias picked them
    assert "".join(c.text for c in got[5]) == ""  # (none of them in SmolLM2's tokenizer)
    assert set(expected[3]) <= {*HIGH, *range(120_000, 120_040)}
    assert any(t >= 1 << 16 for ids in expected for t in ids)
    tops = [ids for c in got[4] if c.logprobs for ids in c.logprobs.top_ids]
    assert len(tops) == MAX_NEW_TOKENS and all(len(ids) == 3 for ids in tops)


def test_seeded_sampling_with_a_large_vocabulary_ends_and_leaves_nothing(
    models: dict[str, Path], smollm2_tokenizer
) -> None:
    spec = make_stack(models["target"], "model", smollm2_tokenizer, TREE, draft_dir=models["draft"])
    sampled = [
        GenerationRequest(r.prompt_ids, MAX_NEW_TOKENS, SamplingParams(temperature=1.0, seed=3),
                          ignore_eos=True, penalties=r.penalties, guide=r.guide)
        for r in _requests()
    ]  # fmt: skip
    got = [generated_ids(chunks) for chunks in generate_all(spec, sampled)]
    assert all(len(ids) == MAX_NEW_TOKENS and max(ids) < VOCAB for ids in got)
    assert set(got[3]) <= {*HIGH, *range(120_000, 120_040)}
