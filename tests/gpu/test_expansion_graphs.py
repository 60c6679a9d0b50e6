"""On a CUDA device: the tree expansion replayed from CUDA graphs (drafter/expansion.py) drafts
what the host expansion drafts, a step at a time, for a draft model and an EAGLE-3 head, chains
and trees, batch sizes on and between the graphs' buckets (padding rows on the scratch page);
each round is one replay and the KV pages end as the host expansion leaves them. Skipped where
there is no GPU (CI)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from drafter.eagle import load_eagle3
from drafter.eagle_proposer import Eagle3Proposer
from drafter.engine import DrafterEngine
from drafter.expansion import FUSED_CAPTURE_AFTER
from drafter.expansion_inputs import Ahead, Shape
from drafter.model_proposer import ModelProposer
from drafter.tree_draft import AHEAD_NEAR_END, AHEAD_SHAPES, CATCH_UP_LENS, TreeProposer
from specsplit.logit_rules import Penalties
from specsplit.messages import DraftInput, DraftRules, SpecParams
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.eagle_random import save_target_and_drafters
from tests.support import TINY_VOCAB

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_target_and_drafters(tmp_path_factory.mktemp("expansion_graphs"))


def _engine(
    models: dict[str, Path], kind: str, graphs: bool, device_expansion: bool
) -> DrafterEngine:
    proposer: TreeProposer
    if kind == "model":
        model, config = load_model(str(models["model"]), dtype=torch.float32, device="cuda")
        kv = make_kv_cache(config, 512, 16, torch.float32, "cuda")
        proposer = ModelProposer(model, kv, config.vocab_size, config.max_position_embeddings)
    else:
        head = load_eagle3(str(models["eagle3"]), str(models["target"]), torch.float32, "cuda")
        proposer = Eagle3Proposer(head, head.make_kv_cache(512, 16))
    proposer.device_expansion = device_expansion
    if graphs:
        proposer.capture_cuda_graphs(CATCH_UP_LENS, max_batch_size=8)
    return DrafterEngine(proposer)


def _rounds(
    engine: DrafterEngine,
    batch: int,
    spec: SpecParams,
    sampling: SamplingParams | None = None,  # each sequence's, seeded by its index
    rounds: int = 4,
    penalties: Penalties | None = None,  # every sequence's logit rules (from its prompt's end)
) -> tuple[list[list[tuple]], int]:
    width = getattr(engine.proposer, "feature_width", None)
    gen = torch.Generator().manual_seed(batch)
    tokens = [
        torch.randint(3, TINY_VOCAB, (20 + 5 * b,), generator=gen).tolist() for b in range(batch)
    ]
    held: dict[int, int] = {}
    trees = []
    for r in range(rounds):
        inputs = []
        for b in range(batch):
            if r:
                tokens[b] += torch.randint(3, TINY_VOCAB, (2,), generator=gen).tolist()
            start = min(held.get(b, 0), len(tokens[b]) - 1)
            rows = (
                None
                if width is None
                else torch.randn(len(tokens[b]) - start - 1, width, generator=gen)
            )
            item = DraftInput(
                f"s{b}", r == 0, start, tokens[b][start:], spec, target_hidden_states=rows
            )
            if sampling is not None:
                item.sampling = dataclasses.replace(sampling, seed=b)
            if penalties is not None and r == 0:
                item.rules = DraftRules(penalties, len(tokens[b]))
            inputs.append(item)
            held[b] = len(tokens[b]) - (1 if width is not None else 0)
        trees.append([_drafted(o.tree) for o in engine.draft(inputs)])
        engine.check_integrity()
    pages = engine.num_pages_used
    engine.release([f"s{b}" for b in range(batch)])
    assert engine.num_pages_used == 0
    return trees, pages


def _drafted(tree: DraftTree) -> tuple:
    """A tree's tokens and parents, and a sampled chain's distributions (dense, float64)."""
    probs = tree.draft_probs
    if probs is None:
        return tree.tokens, tree.parents
    return tree.tokens, tree.parents, probs.dense().double()


def _same_drafts(got: tuple[list[list[tuple]], int], want: tuple[list[list[tuple]], int]) -> None:
    """The same drafts and KV pages; the same distributions to float32's rounding (the
    graph's batched forward and the host's step by step round a logit differently)."""
    assert got[1] == want[1]
    for round_got, round_want in zip(got[0], want[0], strict=True):
        for g, w in zip(round_got, round_want, strict=True):
            assert g[:2] == w[:2]
            torch.testing.assert_close(g[2], w[2], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("kind", ["model", "eagle3"])
@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.05), SamplingParams(temperature=0.1, top_k=50, top_p=0.9)],
    ids=["plain", "cut"],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_sampled_chains_expansion_graph_draws_the_host_drafts(
    models, kind: str, sampling: SamplingParams, batch: int
) -> None:
    """Sampled chains replay their own graph (a draw per step at uniforms drawn on the host)
    and draw what the host expansion draws, with the same distributions. Low temperatures: a
    random model's near-flat distribution orders its support by logits within float32's
    rounding of each other, so a draw at the same uniform can differ between two forwards
    that round differently (both are draws from the distribution they send)."""
    spec = SpecParams(3, 1, 3)
    graphs = _engine(models, kind, graphs=True, device_expansion=True)
    got = _rounds(graphs, batch, spec, sampling)
    runner = graphs.proposer.device_expansion_runner  # type: ignore[attr-defined]
    assert any(shape.sampled for shape, _ in runner.captured)
    want = _rounds(_engine(models, kind, False, False), batch, spec, sampling)
    _same_drafts(got, want)


@pytest.mark.parametrize("kind", ["model", "eagle3"])
@pytest.mark.parametrize(
    "spec", [SpecParams(3, 1, 3), SpecParams(4, 2, 8), SpecParams(3, 4, 16)], ids=str
)
@pytest.mark.parametrize("batch", [1, 3, 4])
def test_expansion_graph_drafts_the_host_trees(
    models, kind: str, spec: SpecParams, batch: int
) -> None:
    graphs = _engine(models, kind, graphs=True, device_expansion=True)
    proposer = graphs.proposer
    assert isinstance(proposer, TreeProposer)
    got = _rounds(graphs, batch, spec)
    runner = proposer.device_expansion_runner
    assert runner is not None and runner.graphs and runner.captured  # the rounds replayed graphs
    want = _rounds(_engine(models, kind, graphs=False, device_expansion=False), batch, spec)
    assert got == want


@pytest.mark.parametrize("ruled", [False, True], ids=["plain", "ruled"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_warm_up_captures_the_default_chain_and_the_shorter_ones_near_the_end(
    models, sampled: bool, ruled: bool
) -> None:
    """A lone stream's last rounds ask for chains of 2 and 1 (capped near max_new_tokens): their
    graphs come from the warm-up, not from a capture in the middle of traffic (a round 10-50
    ms slower, once per shape and batch bucket); under logit rules (a repetition penalty) too."""
    graphs = _engine(models, "eagle3", graphs=True, device_expansion=True)
    runner = graphs.proposer.device_expansion_runner  # type: ignore[attr-defined]
    before = set(runner.captured)
    sampling = SamplingParams(temperature=0.8) if sampled else None
    penalties = Penalties(presence=0.5, repetition=1.2) if ruled else None
    for steps in (3, 2, 1):
        for batch in (1, 3):
            _rounds(graphs, batch, SpecParams(steps, 1, steps), sampling, penalties=penalties)
    assert set(runner.captured) == before
    chains = [key for key, _ in before if not isinstance(key, Ahead) and key.rules == ruled]
    assert {shape.num_steps for shape in chains if shape.sampled == sampled} == {1, 2, 3}


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_a_shape_that_keeps_coming_gets_its_fused_graph_and_drafts_the_same(
    models, kind: str
) -> None:
    """A chain of 2 in every round (a client's own spec): warm-up captured its expansion but not
    with the catch-up inside, so its first rounds catch up first; from its FUSED_CAPTURE_AFTER-th
    round at a batch bucket the catch-up runs inside the expansion's graph, captured then, and
    the drafts are still the host expansion's."""
    spec = SpecParams(2, 1, 2)
    rounds = FUSED_CAPTURE_AFTER + 4
    graphs = _engine(models, kind, graphs=True, device_expansion=True)
    runner = graphs.proposer.device_expansion_runner  # type: ignore[attr-defined]
    before = set(runner.captured)
    got = _rounds(graphs, 1, spec, rounds=rounds)
    new = {key for key, _ in set(runner.captured) - before}
    assert new and all(
        isinstance(key, Shape) and key.num_steps == 2 and key.catch_up for key in new
    ), new
    want = _rounds(_engine(models, kind, False, False), 1, spec, rounds=rounds)
    assert got == want


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_warm_up_captures_the_gateways_default_draft_ahead(models, kind: str) -> None:
    """The gateway's default draft-ahead rounds (2 bonus guesses at each accept length of a
    chain of 3 being verified; a plain round's 8 at the root), which its overlap gate probes
    at every batch size, replay graphs from the warm-up: nothing is captured in traffic, every
    outcome gets its tree, and no KV is left."""
    engine = _engine(models, kind, graphs=True, device_expansion=True)
    runner = engine.proposer.device_expansion_runner  # type: ignore[attr-defined]
    before = set(runner.captured)
    fused = {dataclasses.replace(key, catch_up=q) for key in AHEAD_SHAPES for q in CATCH_UP_LENS}
    warmed = set(AHEAD_SHAPES) | fused | set(AHEAD_NEAR_END)  # and the shorter chains' plain
    assert {key for key, _ in before if isinstance(key, Ahead)} == warmed
    width = getattr(engine.proposer, "feature_width", None)
    gen = torch.Generator().manual_seed(0)
    spec = SpecParams(3, 1, 3)
    for batch in (1, 3):
        ids = [f"s{batch}.{b}" for b in range(batch)]
        tokens = [
            torch.randint(3, TINY_VOCAB, (20 + b,), generator=gen).tolist() for b in range(batch)
        ]
        held = [0] * batch
        verifying = [DraftTree()] * batch
        for guesses in (0, 2, 8):  # a normal Draft, then a chain's draft-ahead, then a plain one
            inputs = []
            for b in range(batch):
                if guesses:
                    tokens[b] += torch.randint(3, TINY_VOCAB, (2,), generator=gen).tolist()
                new = tokens[b][held[b] :]
                rows = None if width is None else torch.randn(len(new) - 1, width, generator=gen)
                item = DraftInput(
                    ids[b], not guesses, held[b], new, spec, target_hidden_states=rows
                )
                item.verifying = verifying[b] if guesses == 2 else DraftTree()
                item.ahead_guesses = guesses
                inputs.append(item)
                held[b] = len(tokens[b]) - (1 if width is not None else 0)
            outputs = engine.draft(inputs)
            engine.check_integrity()
            if guesses:
                assert [len(out.ahead) for out in outputs] == [8] * batch
            verifying = [out.tree for out in outputs]
            assert guesses or all(len(tree) == 3 for tree in verifying)
        engine.release(ids)
        assert engine.num_pages_used == 0
    assert set(runner.captured) == before


def _ahead_rounds(engine: DrafterEngine) -> list[list[tuple]]:
    """At batch 1 and 3: a first Draft, then four draft-ahead calls as the gateway sends them
    after each Verify (each sequence's 1-4 new tokens, their features, the chain it verifies
    next: its first outcome's tree drafted ahead last call), then a normal round. Every
    outcome's tokens and tree, and the last round's trees."""
    width = getattr(engine.proposer, "feature_width", None)
    gen = torch.Generator().manual_seed(0)
    spec = SpecParams(3, 1, 3)
    found: list[list[tuple]] = []
    for batch in (1, 3):
        ids = [f"s{batch}.{b}" for b in range(batch)]
        tokens = [
            torch.randint(3, TINY_VOCAB, (20 + b,), generator=gen).tolist() for b in range(batch)
        ]
        held = [0] * batch
        verifying: list[DraftTree] = []
        for r in range(6):
            inputs = []
            for b in range(batch):
                if r:
                    new = 1 + (r + b) % 4
                    tokens[b] += torch.randint(3, TINY_VOCAB, (new,), generator=gen).tolist()
                new_tokens = tokens[b][held[b] :]
                rows = (
                    None
                    if width is None
                    else torch.randn(len(new_tokens) - 1, width, generator=gen)
                )
                item = DraftInput(
                    ids[b], r == 0, held[b], new_tokens, spec, target_hidden_states=rows
                )
                if 0 < r < 5:
                    item.verifying, item.ahead_guesses = verifying[b], 2
                inputs.append(item)
                held[b] = len(tokens[b]) - (1 if width is not None else 0)
            outputs = engine.draft(inputs)
            engine.check_integrity()
            if 0 < r < 5:
                assert [len(out.ahead) for out in outputs] == [8] * batch
                verifying = [out.ahead[0].tree for out in outputs]
                found.append([[(a.tokens, a.tree.tokens) for a in out.ahead] for out in outputs])
            else:
                verifying = [out.tree for out in outputs]
                found.append([out.tree.tokens for out in outputs])
        engine.release(ids)
        assert engine.num_pages_used == 0
    return found


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_the_fused_draft_ahead_graph_drafts_what_the_catch_up_first_drafts(models, kind) -> None:
    """A draft-ahead call's catch-up run in the expansion's graph itself (one replay,
    `TreeProposer._fused_ahead`) drafts every outcome's tree, and the next round, as the
    catch-up's own graph run first does: batch 1 and 3 (a padding row), catch-ups of 1-4 new
    tokens padded to 1, 2 or 4, and nothing is captured in traffic."""
    found = []
    for fused in (True, False):
        engine = _engine(models, kind, graphs=True, device_expansion=True)
        engine.proposer.fused_catch_up = fused  # type: ignore[attr-defined]
        runner = engine.proposer.device_expansion_runner  # type: ignore[attr-defined]
        before = set(runner.captured)
        calls: list[bool] = []
        original = engine.proposer._fused_ahead  # type: ignore[attr-defined]

        def counted(*args, original=original, calls=calls):
            out = original(*args)
            calls.append(out is not None)
            return out

        engine.proposer._fused_ahead = counted  # type: ignore[attr-defined]
        found.append(_ahead_rounds(engine))
        assert set(runner.captured) == before
        assert calls == [fused] * 8
    assert found[0] == found[1]
