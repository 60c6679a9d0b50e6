"""On a CUDA device: draft-ahead (overlap "ahead") with the drafter's and the verifier's CUDA
graphs, for a draft model and an EAGLE-3 head, misses drafted first or run plain: the output is
the target's greedy output, trees were drafted ahead and used, and no KV is left; sampled chains
draft ahead from the warm-up's graphs, seeded alike run after run. Skipped where
there is no GPU (CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drafter.expansion_inputs import Ahead
from gateway.request import GenerationRequest
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams
from tests.eagle_random import save_target_and_drafters
from tests.support import TINY_VOCAB, check_no_leaks, generated_ids, stack_on

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_target_and_drafters(tmp_path_factory.mktemp("draft_ahead"))


def _outputs(stack) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (9, 12, 17)]
    requests = [GenerationRequest(p + p[:4], 24, ignore_eos=True) for p in prompts]
    out = [generated_ids(c) for c in stack.generate_all(requests)]
    check_no_leaks(stack)
    return out


@pytest.mark.parametrize("miss", ["draft", "plain"])
@pytest.mark.parametrize("drafter", ["model", "eagle3"])
def test_draft_ahead_with_graphs_equals_target_greedy(
    models, smollm2_tokenizer, drafter: str, miss: str
) -> None:
    """miss "plain": a round not guessed is verified with no tree, and the drafter drafts
    ahead from that step (an empty chain being verified: its own graphs)."""
    spec = SpecParams(3, 1, 3)
    target = stack_on("cuda", models, smollm2_tokenizer, "ngram", SpecParams(0, 1, 0), False)
    stack = stack_on("cuda", models, smollm2_tokenizer, drafter, spec, True, overlap="ahead")
    stack.scheduler.ahead_miss = miss
    assert _outputs(stack) == _outputs(target)
    scheduler = stack.scheduler
    assert scheduler.num_ahead_hits + scheduler.num_ahead_misses > 0


@pytest.mark.parametrize("drafter", ["self", "eagle3"])
def test_sampled_draft_ahead_replays_the_warm_up_graphs_and_is_seeded(
    models, smollm2_tokenizer, drafter: str
) -> None:
    """Sampled chains draft ahead from the drafter's graphs as greedy ones do (the warm-up
    captured their keys: no draft-ahead graph is captured in traffic); a seeded request
    streams the same tokens run after run, and no KV is left. With the target drafting for
    itself ("self") rounds take the chains drafted ahead; the random head's guesses need not
    hit. (Their distribution: tests/unit/test_lossless_sampling.py on the CPU.)"""
    spec = SpecParams(3, 1, 3)
    kind, drafters = drafter, models
    if drafter == "self":
        kind, drafters = "model", {**models, "model": models["target"]}
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (9, 12, 17)]
    runs = []
    for _ in range(2):
        stack = stack_on("cuda", drafters, smollm2_tokenizer, kind, spec, True, overlap="ahead")
        runner = stack.drafter.proposer.device_expansion_runner
        warmed = set(runner.captured)
        requests = [
            GenerationRequest(
                p + p[:4], 24, SamplingParams(temperature=0.3, seed=b), ignore_eos=True
            )
            for b, p in enumerate(prompts)
        ]
        runs.append([generated_ids(c) for c in stack.generate_all(requests)])
        check_no_leaks(stack)
        scheduler = stack.scheduler
        assert scheduler.num_ahead_hits > 0 if drafter == "self" else scheduler.num_ahead_misses
        new = [key for key, _ in set(runner.captured) - warmed if isinstance(key, Ahead)]
        assert not new, new
    assert runs[0] == runs[1] and all(len(out) == 24 for out in runs[0])
