"""On a machine with two GPUs: engines on cuda:1 (Triton launches on the current device, and an
engine's calls run on worker threads that start on cuda:0) give the target's greedy tokens, eager
and from CUDA graphs, with a draft model and an EAGLE-3 head. Skipped with fewer than two GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.request import GenerationRequest
from specsplit.messages import SpecParams
from tests.eagle_random import save_target_and_drafters
from tests.support import TINY_VOCAB, check_no_leaks, generated_ids, stack_on

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_target_and_drafters(tmp_path_factory.mktemp("second_device"))


def _generate(models, tokenizer, drafter: str, spec: SpecParams, graphs: bool) -> list[list[int]]:
    stack = stack_on("cuda:1", models, tokenizer, drafter, spec, graphs)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (7, 12, 5)]
    out = stack.generate_all([GenerationRequest(p, 20, ignore_eos=True) for p in prompts])
    check_no_leaks(stack)
    return [generated_ids(chunks) for chunks in out]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("drafter", ["model", "eagle3"])
def test_engines_on_the_second_gpu_give_the_targets_tokens(
    models, smollm2_tokenizer, drafter: str, graphs: bool
) -> None:
    expected = _generate(models, smollm2_tokenizer, "ngram", SpecParams(0, 1, 0), False)
    assert _generate(models, smollm2_tokenizer, drafter, SpecParams(3, 1, 3), graphs) == expected
