"""A seeded sampled request emits the same tokens alone or in a batch with other requests
(greedy and sampled, other seeds): each sequence draws its acceptance uniforms from its own
generator, whatever the batched acceptance runs beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.request import GenerationRequest
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams
from tests.support import generate_all, generated_ids, make_stack, save_tiny_llama


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("batch_indep") / "target", seed=21)


@pytest.mark.parametrize("spec", [SpecParams(3, 1, 3), SpecParams(2, 2, 4)], ids=["chain", "tree"])
def test_seeded_request_is_the_same_alone_and_in_a_batch(
    target_dir, smollm2_tokenizer, spec: SpecParams
) -> None:
    seeded = GenerationRequest([5, 6, 7, 5, 6], 24, SamplingParams(0.8, seed=7), ignore_eos=True)
    others = [
        GenerationRequest([9, 10, 11], 20, SamplingParams(), ignore_eos=True),
        GenerationRequest([4, 4, 4, 4], 16, SamplingParams(1.0, top_k=20, seed=3), ignore_eos=True),
        GenerationRequest([12, 13], 30, SamplingParams(0.7, top_p=0.9, seed=99), ignore_eos=True),
    ]
    alone = generate_all(make_stack(target_dir, "model", smollm2_tokenizer, spec), [seeded])
    batched = generate_all(
        make_stack(target_dir, "model", smollm2_tokenizer, spec), [others[0], seeded, *others[1:]]
    )
    assert generated_ids(alone[0]) == generated_ids(batched[1])
    assert len(generated_ids(batched[1])) == 24
