"""The tree expansion on the device (drafter/expansion.py; a CUDA graph on a GPU, eager here)
drafts the trees the host expansion drafts, a step at a time: same tokens, same parents, for
chains and trees, page sizes 1 and 16, draft models and EAGLE heads, batches whose sequences
ask for different shapes; and it leaves the KV pages as the host expansion does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import drafter.eagle
import specsplit.model.llama
from drafter.eagle import load_eagle3
from drafter.eagle_proposer import Eagle3Proposer
from drafter.engine import DrafterEngine
from drafter.expansion import FUSED_CAPTURE_AFTER, DeviceExpansion
from drafter.expansion_inputs import Candidates, Shape
from drafter.expansion_maps import draw_mapped
from drafter.host_expansion import select_tree
from drafter.model_proposer import ModelProposer
from drafter.tree_draft import CATCH_UP_LENS, TreeProposer
from specsplit.kernels.paged_attention import _check_inputs
from specsplit.messages import DraftInput, DraftOutput, SpecParams
from specsplit.model.attention import attend
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from specsplit.tree import DRAFT_SUPPORT, DraftProbs
from tests.eagle_random import save_random_eagle3
from tests.support import TINY_VOCAB, save_tiny_llama

SPECS = [SpecParams(3, 1, 3), SpecParams(3, 2, 5), SpecParams(4, 3, 12), SpecParams(1, 4, 4)]
# the EAGLE head's own vocabulary: 300 of the target's 512 ids, more than a sampled draw's
# support (DRAFT_SUPPORT), so its draws read these columns alone (`draw_columns`)
DRAFT_VOCAB = 300


@pytest.fixture(autouse=True)
def kernel_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attention call (the head's, the draft model's) also passes the GPU kernel's input
    checks (shapes, dtypes, strides), which the CPU path does not run."""

    def checked(q, k_cache, v_cache, batch):  # type: ignore[no-untyped-def]
        _check_inputs(  # float32: the kernel takes no float64 (these models are float64)
            q.float(), k_cache.float(), v_cache.float(), batch.cu_seqlens_q, batch.kv_lens,
            batch.prefix_lens, batch.block_table, batch.page_size, batch.tree_mask,
            batch.max_q_len, None, True,
        )  # fmt: skip
        return attend(q, k_cache, v_cache, batch)

    monkeypatch.setattr(drafter.eagle, "attend", checked)
    monkeypatch.setattr(specsplit.model.llama, "attend", checked)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("expansion")
    target = save_tiny_llama(root / "target", seed=5, num_layers=3)
    _, config = load_model(str(target), dtype=torch.float64, device="cpu")
    head = save_random_eagle3(root / "head", config, seed=9, draft_vocab_size=DRAFT_VOCAB)
    return {"target": target, "head": head, "draft": save_tiny_llama(root / "draft", seed=21)}


def _engine(models: dict[str, Path], kind: str, page_size: int, on_device: bool) -> DrafterEngine:
    proposer: TreeProposer
    if kind == "model":
        model, config = load_model(str(models["draft"]), dtype=torch.float64, device="cpu")
        kv = make_kv_cache(config, 512, page_size, torch.float64, "cpu")
        proposer = ModelProposer(model, kv, config.vocab_size, config.max_position_embeddings)
    else:
        head = load_eagle3(str(models["head"]), str(models["target"]), torch.float64, "cpu")
        proposer = Eagle3Proposer(head, head.make_kv_cache(512, page_size))
    proposer.device_expansion = on_device
    return DrafterEngine(proposer)


def _rounds(
    engine: DrafterEngine, specs: list[SpecParams], sampling: list[SamplingParams] | None = None
) -> tuple[list[list[DraftOutput]], int]:
    """One sequence per spec, six rounds of 1..4 new tokens each (ragged catch-ups); an EAGLE
    head gets the target's features (random) of every new token but the root. Returns the
    drafts and the KV pages held after the last round (all released after)."""
    width = getattr(engine.proposer, "feature_width", None)
    gen = torch.Generator().manual_seed(11)
    tokens = [
        torch.randint(3, TINY_VOCAB, (7 + 3 * b,), generator=gen).tolist()
        for b in range(len(specs))
    ]
    held: dict[int, int] = {}
    outs = []
    for r in range(6):
        inputs = []
        for b, spec in enumerate(specs):
            if r:
                tokens[b] += torch.randint(
                    3, TINY_VOCAB, (1 + (r + b) % 4,), generator=gen
                ).tolist()
            start = min(held.get(b, 0), len(tokens[b]) - 1)
            rows = None
            if width is not None:
                rows = torch.randn(len(tokens[b]) - start - 1, width, generator=gen)
            item = DraftInput(
                f"s{b}", r == 0, start, tokens[b][start:], spec, target_hidden_states=rows
            )
            if sampling is not None:
                item.sampling = sampling[b]
            inputs.append(item)
            held[b] = len(tokens[b]) - (1 if width is not None else 0)
        outs.append(engine.draft(inputs))
        engine.check_integrity()
    pages = engine.num_pages_used
    engine.release([f"s{b}" for b in range(len(specs))])
    assert engine.num_pages_used == 0 < pages
    return outs, pages


def _same(
    host: tuple[list[list[DraftOutput]], int], device: tuple[list[list[DraftOutput]], int]
) -> None:
    assert device[1] == host[1]  # KV pages held
    for want, got in zip(host[0], device[0], strict=True):
        assert [o.tree.tokens for o in got] == [o.tree.tokens for o in want]
        assert [o.tree.parents for o in got] == [o.tree.parents for o in want]
        assert [o.kv_committed_len for o in got] == [o.kv_committed_len for o in want]


@pytest.mark.parametrize("kind", ["model", "eagle3"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "spec", SPECS, ids=lambda s: f"{s.num_steps}x{s.topk}x{s.num_draft_tokens}"
)
def test_device_expansion_drafts_the_host_expansions_trees(
    models: dict[str, Path], kind: str, page_size: int, spec: SpecParams
) -> None:
    host = _engine(models, kind, page_size, on_device=False)
    device = _engine(models, kind, page_size, on_device=True)
    specs = [spec] * 3
    want, got = _rounds(host, specs), _rounds(device, specs)
    assert sum(len(o.tree) for o in want[0][-1]) == 3 * spec.num_draft_tokens
    _same(want, got)


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_a_batch_of_different_shapes_and_sampled_chains(models: dict[str, Path], kind: str) -> None:
    """Each shape is one device expansion, sampled chains theirs: each draws what the host
    path draws (the same uniforms from its own generator, the same cut distribution), and
    keeps its distribution: DRAFT_SUPPORT tokens a node, its draft among them."""
    specs = [
        SpecParams(3, 1, 3),
        SpecParams(2, 2, 4),
        SpecParams(3, 1, 3),
        SpecParams(3, 2, 6),
        SpecParams(2, 1, 2),
        SpecParams(3, 1, 3),
        SpecParams(3, 1, 3),
    ]
    sampling = [SamplingParams()] * 4 + [
        SamplingParams(temperature=0.8, seed=4),
        SamplingParams(temperature=1.0, top_k=40, seed=5),
        SamplingParams(temperature=1.2, top_p=0.8, seed=6),
    ]
    host = _engine(models, kind, 4, on_device=False)
    device = _engine(models, kind, 4, on_device=True)
    want, got = _rounds(host, specs, sampling), _rounds(device, specs, sampling)
    _same(want, got)
    for round_want, round_got in zip(want[0], got[0], strict=True):
        for w, g, params in zip(round_want, round_got, sampling, strict=True):
            assert (w.tree.draft_probs is None) == (g.tree.draft_probs is None) == params.greedy
            if g.tree.draft_probs is None:
                continue
            _same_supports(w.tree.draft_probs, g.tree.draft_probs, len(g.tree))
            dense = g.tree.draft_probs.dense()
            drafted = dense[torch.arange(len(g.tree)), torch.tensor(g.tree.tokens)]
            assert (drafted > 0).all()  # each draft inside its distribution
            if params.top_k:
                assert ((dense > 0).sum(dim=1) <= params.top_k).all()
    assert device.proposer.device_expansion_runner is not None
    shapes = {shape for shape, _ in device.proposer.device_expansion_runner.captured}
    assert not shapes  # on the CPU every expansion runs eagerly


@pytest.mark.parametrize("ascending", [True, False], ids=["ascending", "shuffled"])
def test_a_draft_vocabulary_is_scored_alone_where_its_target_ids_ascend(
    models: dict[str, Path], ascending: bool
) -> None:
    """An EAGLE head with a draft vocabulary of its own (DRAFT_VOCAB of the target's ids):
    where its target ids ascend, the device expansion's argmax, draft-ahead's guesses and
    sampled draws read its columns (`scored_ids`) and map what they pick; where they do not
    (a shuffled map), every step's logits are the target's vocabulary as before. Either way
    the device drafts the host expansion's trees, and samples its draws."""

    def engine(on_device: bool) -> DrafterEngine:
        head = load_eagle3(str(models["head"]), str(models["target"]), torch.float64, "cpu")
        assert head.target_ids is not None and head.d2t is not None
        if not ascending:
            order = torch.randperm(DRAFT_VOCAB, generator=torch.Generator().manual_seed(2))
            ids = head.target_ids[order]
            head.target_ids, head.d2t = ids, ids - torch.arange(DRAFT_VOCAB)
        proposer = Eagle3Proposer(head, head.make_kv_cache(512, 4))
        proposer.device_expansion = on_device
        return DrafterEngine(proposer)

    device = engine(on_device=True)
    assert (device.proposer.scored_ids is not None) == ascending
    head_ids = device.proposer.head.target_ids
    for spec in SPECS:
        _same(_rounds(engine(on_device=False), [spec] * 2), _rounds(device, [spec] * 2))
    sampled = [
        SamplingParams(temperature=0.9, seed=3),
        SamplingParams(temperature=1.0, top_p=0.9, seed=4),
    ]
    want = _rounds(engine(on_device=False), [SpecParams(3, 1, 3)] * 2, sampled)
    got = _rounds(device, [SpecParams(3, 1, 3)] * 2, sampled)
    _same(want, got)
    for round_want, round_got in zip(want[0], got[0], strict=True):
        for w, g in zip(round_want, round_got, strict=True):
            assert g.tree.draft_probs is not None and w.tree.draft_probs is not None
            _same_supports(w.tree.draft_probs, g.tree.draft_probs, len(g.tree))
            kept = g.tree.draft_probs.tokens[g.tree.draft_probs.probs > 0]
            assert torch.isin(kept, head_ids).all()  # only the head's own ids are drafted
    runner = device.proposer.device_expansion_runner
    assert runner is not None and runner.scored == (DRAFT_VOCAB if ascending else TINY_VOCAB)


def _same_supports(want: DraftProbs, got: DraftProbs, n: int) -> None:
    """The same rows at the same widths (the device's come cut to them, as they cross the wire;
    the host's padded to DRAFT_SUPPORT), each at most DRAFT_SUPPORT wide."""
    w, g = want.flat(), got.flat()
    assert len(got) == n and g.widths.max() <= DRAFT_SUPPORT
    assert np.array_equal(w.widths, g.widths) and np.array_equal(w.tokens, g.tokens)
    np.testing.assert_allclose(w.probs, g.probs, rtol=1.3e-6, atol=1e-5)


def test_select_tree_keeps_the_best_nodes_and_renumbers_parents() -> None:
    # candidates 0..4: 0 and 1 at depth 1, 2..4 children of 0 (2, 3) and 1 (4)
    found = Candidates(
        tokens=[10, 11, 12, 13, 14], parents=[-1, -1, 0, 0, 1], order=[0, 2, 1, 4, 3]
    )
    tree = select_tree(found, SpecParams(2, 2, 3))
    assert tree.tokens == [10, 11, 12] and tree.parents == [-1, -1, 0]
    tree = select_tree(found, SpecParams(2, 2, 4))
    assert tree.tokens == [10, 11, 12, 14] and tree.parents == [-1, -1, 0, 1]
    chain = select_tree(Candidates([5, 6, 7], [-1, 0, 1], [0, 1, 2]), SpecParams(3, 1, 3))
    assert chain.tokens == [5, 6, 7] and chain.parents == [-1, 0, 1]


def test_shape_counts_the_host_expansions_candidates() -> None:
    for spec in SPECS:
        assert Shape(spec.topk, spec.num_steps).num_candidates == spec.max_draft_tokens


@pytest.fixture
def expansions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Shape, int]]:
    """(shape, sequences) of every DeviceExpansion.expand call, in order."""
    calls: list[tuple[Shape, int]] = []
    expand = DeviceExpansion.expand

    def counted(self, shape, seqs, *args):  # type: ignore[no-untyped-def]
        calls.append((shape, len(seqs)))
        return expand(self, shape, seqs, *args)

    monkeypatch.setattr(DeviceExpansion, "expand", counted)
    return calls


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_capped_chains_ride_the_rounds_longest_chain(
    models: dict[str, Path], kind: str, expansions: list[tuple[Shape, int]]
) -> None:
    """Chains the gateway capped near max_new_tokens (1 and 2 steps beside 3) are drafted in the
    3-step chain's expansion and cut to their own length: the host expansion's trees, the same
    KV pages, one expansion of Shape(1, 3) for every round's chains (a tree beside them keeps
    its own)."""
    specs = [SpecParams(3, 1, 3), SpecParams(1, 1, 1), SpecParams(2, 1, 2), SpecParams(2, 2, 4)]
    host = _engine(models, kind, 4, on_device=False)
    device = _engine(models, kind, 4, on_device=True)
    want, got = _rounds(host, specs), _rounds(device, specs)
    _same(want, got)
    assert [len(o.tree) for o in got[0][-1]] == [3, 1, 2, 4]
    drafting_rounds = [expansions[i : i + 2] for i in range(0, len(expansions), 2)]
    assert drafting_rounds and all(
        sorted(r, key=str) == sorted([(Shape(1, 3), 3), (Shape(2, 2), 1)], key=str)
        for r in drafting_rounds
    ), expansions


def test_a_chain_without_room_for_the_longest_keeps_its_own_length(
    models: dict[str, Path], expansions: list[tuple[Shape, int]]
) -> None:
    """A chain capped by its context (no room for the round's longest chain) expands alone, at
    its own length: the host expansion's trees, the KV intact."""
    host = _engine(models, "model", 1, on_device=False)
    device = _engine(models, "model", 1, on_device=True)
    for engine in (host, device):  # s1 starts 3 tokens longer than s0: room 2 < 3 steps
        engine.proposer.max_context = 12  # type: ignore[misc]
    specs = [SpecParams(3, 1, 3), SpecParams(3, 1, 3)]
    want, got = _one_round(host, specs), _one_round(device, specs)
    assert [o.tree.tokens for o in got] == [o.tree.tokens for o in want]
    assert [len(o.tree) for o in got] == [3, 2]
    assert sorted((shape for shape, _ in expansions), key=str) == [Shape(1, 2), Shape(1, 3)]
    for engine in (host, device):
        engine.check_integrity()
        engine.release(["s0", "s1"])


def _one_round(engine: DrafterEngine, specs: list[SpecParams]) -> list[DraftOutput]:
    """A first round for sequences of 7 and 10 tokens (a draft model: no features needed)."""
    gen = torch.Generator().manual_seed(2)
    inputs = [
        DraftInput(
            f"s{b}",
            True,
            0,
            torch.randint(3, TINY_VOCAB, (7 + 3 * b,), generator=gen).tolist(),
            spec,
        )
        for b, spec in enumerate(specs)
    ]
    return engine.draft(inputs)


@pytest.mark.parametrize("kind", ["model", "eagle3"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("spec", "sampled"),
    [(spec, False) for spec in SPECS] + [(SpecParams(3, 1, 3), True)],
    ids=[f"{s.num_steps}x{s.topk}x{s.num_draft_tokens}" for s in SPECS] + ["sampled-3x1x3"],
)
@pytest.mark.parametrize("padded", [False, True], ids=["one-sequence", "padded-three"])
def test_a_drafts_catch_up_in_its_expansions_run_drafts_the_same_trees(
    models: dict[str, Path],
    kind: str,
    page_size: int,
    spec: SpecParams,
    padded: bool,
    sampled: bool,
) -> None:
    """A Draft whose catch-up runs in its expansion's own device run (`_fused_expand`: one
    graph replay on a GPU) drafts what the catch-up run first drafts (the same trees, a sampled
    chain's same distributions, the same KV pages): one sequence (always one catch-up length),
    or three whose catch-ups are padded to one length as on a GPU (CATCH_UP_LENS)."""
    specs = [spec] * (3 if padded else 1)
    sampling = [SamplingParams(temperature=0.8, seed=b) for b in range(len(specs))]
    found, fused_rounds = [], []
    for fused in (True, False):
        engine = _engine(models, kind, page_size, on_device=True)
        proposer = engine.proposer
        assert isinstance(proposer, TreeProposer)
        proposer.fused_catch_up = fused
        if padded:
            proposer.catch_up_lens = CATCH_UP_LENS
        calls: list[bool] = []
        original = proposer._fused_expand

        def counted(*args, original=original, calls=calls):  # type: ignore[no-untyped-def]
            out = original(*args)
            calls.append(out is not None)
            return out

        proposer._fused_expand = counted  # type: ignore[method-assign]
        found.append(_rounds(engine, specs, sampling if sampled else None))
        fused_rounds.append(sum(calls))
    _same(found[1], found[0])
    for want, got in zip(found[1][0], found[0][0], strict=True):
        for w, g in zip(want, got, strict=True):
            probs = (w.tree.draft_probs, g.tree.draft_probs)
            assert (probs[0] is None) == (probs[1] is None) == (not sampled)
            if sampled:
                assert torch.equal(probs[0].dense(), probs[1].dense())  # type: ignore[union-attr]
    # every round runs fused; with three sequences but the first (their prompts' catch-ups,
    # of 6-13 entries, are longer than the longest padded length)
    assert fused_rounds == [5 if padded else 6, 0]


def test_a_fused_key_missed_at_warm_up_is_captured_once_it_keeps_coming(
    models: dict[str, Path],
) -> None:
    """Where graphs run, a fused catch-up's key that warm-up did not capture (a client's own
    spec, other draft-ahead guesses) takes the unfused path until it has been asked for
    FUSED_CAPTURE_AFTER times at one batch bucket, then runs (its `expand` captures it): a
    one-off costs no capture in traffic, a shape that keeps coming gets the one-replay run.
    Each bucket counts its own; a captured key, or no graphs (the CPU), runs at once; a
    catch-up of a length outside the proposer's padded ones never does where graphs run."""
    proposer = _engine(models, "model", 16, on_device=True).proposer
    assert isinstance(proposer, TreeProposer)
    runner = proposer._expansion()
    key = Shape(1, 2, catch_up=2)
    assert all(runner.ready(key, 1) for _ in range(2 * FUSED_CAPTURE_AFTER))  # no graphs: eager
    runner.graphs = True  # as on a GPU: `ready` only counts, nothing is captured here
    runner.asked.clear()
    answers = [runner.ready(key, 1) for _ in range(FUSED_CAPTURE_AFTER)]
    assert answers == [False] * (FUSED_CAPTURE_AFTER - 1) + [True]
    assert not runner.ready(key, 3)  # batch 3's bucket counts its own
    assert not runner.ready(Shape(1, 2, catch_up=4), 1)  # so does another catch-up length
    # a catch-up of a length the proposer does not pad to (tens of tokens after plain rounds):
    # never captured in traffic, one graph per length as they came
    runner.catch_up_lens = CATCH_UP_LENS
    assert not any(
        runner.ready(Shape(1, 3, catch_up=44), 1) for _ in range(3 * FUSED_CAPTURE_AFTER)
    )
    warmed = Shape(1, 3, catch_up=2)
    runner.captured[(warmed, 1)] = (None, None)  # type: ignore[assignment]  # as warm-up leaves it
    assert runner.ready(warmed, 1)


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_the_drafter_counts_its_forwards_by_path(models: dict[str, Path], kind: str) -> None:
    """`specsplit_drafter_forwards_total{path}`: each catch-up or root forward and each
    expansion run (on the CPU eager, `specsplit_drafter_eager_forwards_total{why="no graphs"}`
    beside it)."""
    from prometheus_client import REGISTRY

    def counts() -> tuple[float, float]:
        path = "specsplit_drafter_forwards_total", {"path": "eager"}
        why = "specsplit_drafter_eager_forwards_total", {"why": "no graphs"}
        return REGISTRY.get_sample_value(*path) or 0.0, REGISTRY.get_sample_value(*why) or 0.0

    before = counts()
    _rounds(_engine(models, kind, 16, on_device=True), [SpecParams(3, 1, 3)])
    grown = [n - b for n, b in zip(counts(), before, strict=True)]
    assert grown[0] == grown[1] >= 6  # an expansion run a round at least, every one eager


def test_a_drafters_draw_keeps_a_peaked_rows_few_tokens() -> None:
    """Both expansions draw through `draw_mapped`: a row whose likeliest tokens hold all but
    DRAFT_TAIL (1e-3) of the mass keeps those alone (the wire then sends them alone), a flat row its
    whole DRAFT_SUPPORT; each draws from what it keeps."""
    logits = torch.zeros(2, 4 * DRAFT_SUPPORT)
    logits[0, :3] = torch.tensor([20.0, 19.0, 18.0])  # the other 1021 hold ~2e-6 < DRAFT_TAIL
    params = torch.tensor([[1.0, 1.0, 0.0]] * 2)
    token, ids, probs = draw_mapped(logits, params, torch.tensor([0.99, 0.5]), None)
    kept = (probs > 0).sum(dim=1).tolist()
    assert kept == [3, DRAFT_SUPPORT] and ids.shape == (2, DRAFT_SUPPORT)
    assert ids[0, :3].tolist() == [0, 1, 2] and int(token[0]) == 2  # its cdf: 0.67, 0.91, 1
    torch.testing.assert_close(probs[0, :3], torch.softmax(logits[0, :3], dim=0))
    torch.testing.assert_close(probs[1], torch.full((DRAFT_SUPPORT,), 1 / DRAFT_SUPPORT))
