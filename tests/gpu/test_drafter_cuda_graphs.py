"""On a CUDA device: the drafter's steps replayed from CUDA graphs (a chain's one-token steps and
catch-ups padded to a captured length), for a draft model and an EAGLE-3 head. The output is the
target's greedy output, the graphs ran, and the drafts are those of the same padded steps run
eagerly; so too under logit rules and under a guide (the drafts bent inside the expansion's
graphs by the rules and by the root's mask each Draft carries). Skipped where there is no GPU
(CI)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from drafter.tree_draft import CATCH_UP_LENS, TreeProposer
from gateway.request import GenerationRequest
from specsplit.guide.tokens import FixedTokens
from specsplit.logit_rules import Penalties
from specsplit.messages import SpecParams
from tests.eagle_random import save_target_and_drafters
from tests.support import TINY_VOCAB, check_no_leaks, generated_ids, stack_on

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_target_and_drafters(tmp_path_factory.mktemp("drafter_graphs"))


def _run(
    models, tokenizer, drafter: str, spec: SpecParams, graphs: bool, penalties=None, guide=None
):  # type: ignore[no-untyped-def]
    """Outputs, final stats and graph replays of four requests (catch-ups from their own graphs
    or inside the expansion's); `graphs` False runs the same padded steps eagerly. `penalties`:
    the first three requests' logit rules (the drafter bends its drafts by them too); `guide`:
    the first three requests' guide (each Draft carries its root's mask)."""
    stack = stack_on("cuda", models, tokenizer, drafter, spec, graphs)
    proposer = stack.drafter.proposer
    replays = {"n": 0}
    if not isinstance(proposer, TreeProposer):  # the n-gram reference
        pass
    elif graphs:
        assert proposer.graphs is not None
        runner, forward = proposer.graphs, proposer.graphs.forward

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = forward(*args, **kwargs)
            replays["n"] += out is not None
            return out

        runner.forward = counted  # type: ignore[method-assign]
        fused = proposer._fused_expand  # a Draft's catch-up inside its expansion's graph

        def counted_fused(*args):  # type: ignore[no-untyped-def]
            out = fused(*args)
            replays["n"] += out is not None
            return out

        proposer._fused_expand = counted_fused  # type: ignore[method-assign]
    else:
        proposer.catch_up_lens = CATCH_UP_LENS
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (9, 12, 17, 6)]
    requests = [GenerationRequest(p + p[:4], 24, ignore_eos=True) for p in prompts]
    for i in range(3 if penalties is not None or guide is not None else 0):
        requests[i] = replace(requests[i], penalties=penalties, guide=guide)
    out = stack.generate_all(requests)
    if (penalties is not None or guide is not None) and isinstance(proposer, TreeProposer):
        assert proposer.rule_tables is not None and proposer.rule_tables.num_used == 0
        expansion = proposer.device_expansion_runner
        assert expansion is not None
        bent = [key for key, _ in expansion.captured if getattr(key, "rules", False)]
        assert bool(bent) == graphs  # (the bent expansion's graphs captured and replayed)
    check_no_leaks(stack)
    return [generated_ids(c) for c in out], [c[-1].stats for c in out], replays["n"]


@pytest.mark.parametrize("drafter", ["model", "eagle3"])
@pytest.mark.parametrize("spec", [SpecParams(3, 1, 3), SpecParams(2, 2, 4)], ids=["chain", "tree"])
def test_drafter_graph_rounds_equal_target_greedy(
    models, smollm2_tokenizer, drafter: str, spec: SpecParams
) -> None:
    expected, _, _ = _run(models, smollm2_tokenizer, "ngram", SpecParams(0, 1, 0), False)
    got, stats, replays = _run(models, smollm2_tokenizer, drafter, spec, True)
    assert got == expected
    assert replays > 0  # catch-ups ran from graphs (their own, or inside the expansion's)
    _, eager_stats, _ = _run(models, smollm2_tokenizer, drafter, spec, False)
    assert stats == eager_stats  # the same drafts as the same steps run eagerly


# the drafter bends its drafts by these (drafter/draft_rules.py), inside the expansion's graphs
PENALTIES = Penalties(((7, 3.0), (40, -100.0)), presence=0.8, frequency=0.5, repetition=1.3)


@pytest.mark.parametrize("drafter", ["model", "eagle3"])
@pytest.mark.parametrize("spec", [SpecParams(3, 1, 3), SpecParams(2, 2, 4)], ids=["chain", "tree"])
def test_bent_drafts_from_graphs_equal_the_eager_ones_and_the_output_the_targets(
    models, smollm2_tokenizer, drafter: str, spec: SpecParams
) -> None:
    expected, _, _ = _run(models, smollm2_tokenizer, "ngram", SpecParams(0, 1, 0), False, PENALTIES)
    got, stats, replays = _run(models, smollm2_tokenizer, drafter, spec, True, PENALTIES)
    assert got == expected
    assert replays > 0
    _, eager_stats, _ = _run(models, smollm2_tokenizer, drafter, spec, False, PENALTIES)
    assert stats == eager_stats


# a guide of allowed tokens (every other id): each Draft carries the root's mask, which the
# drafter bends its roots' logits by inside the expansion's graphs
GUIDE = FixedTokens(tuple(range(3, TINY_VOCAB, 2)), TINY_VOCAB)


@pytest.mark.parametrize("penalties", [None, PENALTIES], ids=["guide", "guide-rules"])
@pytest.mark.parametrize("drafter", ["model", "eagle3"])
def test_guided_drafts_from_graphs_equal_the_eager_ones_and_the_output_the_targets(
    models, smollm2_tokenizer, drafter: str, penalties: Penalties | None
) -> None:
    alone = SpecParams(0, 1, 0)
    expected, _, _ = _run(models, smollm2_tokenizer, "ngram", alone, False, penalties, GUIDE)
    assert all(t in GUIDE.allowed for ids in expected[:3] for t in ids)
    spec = SpecParams(3, 1, 3)
    got, stats, replays = _run(models, smollm2_tokenizer, drafter, spec, True, penalties, GUIDE)
    assert got == expected
    assert replays > 0
    _, eager_stats, _ = _run(models, smollm2_tokenizer, drafter, spec, False, penalties, GUIDE)
    assert stats == eager_stats
