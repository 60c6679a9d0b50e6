"""Draft-ahead on the drafter: while a chain is verified, the next round's trees for its likely
outcomes (each accept length, then each guessed bonus token), drafted in forks of the sequence's
KV. Named invariants:
- a plain draft model's tree drafted ahead for an outcome is the tree a normal draft gives once
  that outcome is committed (the fork holds what a catch-up would compute);
- an EAGLE head's tree drafted ahead for "all accepted, bonus = the draft's top-1" continues the
  head's own chain (node outputs as features where the target's do not exist yet);
- the guesses never repeat the chain's own next node (the verifier rejected it there);
- a sampled chain's trees drafted ahead are the next round's Draft at the same uniforms (one
  draw from its generator a call, whatever the outcome), with their draft distributions, on
  the device as in the forks;
- draft-ahead changes nothing the drafter keeps: no pages left, the same next normal draft.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drafter.engine import DrafterEngine
from drafter.expansion import DeviceExpansion
from drafter.model_proposer import ModelProposer
from specsplit.errors import Code, ServiceError
from specsplit.kv_cache import KVCache
from specsplit.messages import DraftInput, DraftOutput, SpecParams
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.eagle_random import save_random_eagle3
from tests.support import save_tiny_llama

TOKENS = [5, 17, 99, 3, 250, 41, 8, 77, 12]
CHAIN = SpecParams(3, 1, 3)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ahead")
    target = save_tiny_llama(root / "target", seed=0, num_layers=4)
    _, config = load_model(str(target), dtype=torch.float64, device="cpu")
    return {
        "draft": save_tiny_llama(root / "draft", seed=21),
        "target": target,
        "head": save_random_eagle3(root / "head", config, seed=3, draft_vocab_size=200),
    }


def _model_engine(models: dict[str, Path], page_size: int) -> DrafterEngine:
    model, config = load_model(str(models["draft"]), dtype=torch.float64, device="cpu")
    kv = make_kv_cache(config, 256, page_size, torch.float64, "cpu")
    return DrafterEngine(
        ModelProposer(model, kv, config.vocab_size, config.max_position_embeddings)
    )


def _eagle_engine(models: dict[str, Path], page_size: int) -> DrafterEngine:
    return DrafterEngine.load(
        "eagle3",
        str(models["head"]),
        dtype=torch.float64,
        num_pages=256,
        page_size=page_size,
        target_path=str(models["target"]),
    )


def _features(engine: DrafterEngine, rows: int, seed: int = 0) -> torch.Tensor | None:
    width = getattr(engine.proposer, "feature_width", None)
    if width is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen, dtype=torch.float64)


SAMPLED = SamplingParams(temperature=0.9, seed=4)


def _begin(
    engine: DrafterEngine, seq_id: str, spec: SpecParams, sampling: SamplingParams | None = None
) -> DraftOutput:
    """A first draft of TOKENS (EAGLE: with the target's features of every token but the
    root)."""
    rows = _features(engine, len(TOKENS) - 1)
    item = DraftInput(seq_id, True, 0, TOKENS, spec, target_hidden_states=rows)
    item.sampling = sampling or item.sampling
    return engine.draft([item])[0]


def _ahead(
    engine: DrafterEngine,
    seq_id: str,
    verifying: DraftTree,
    guesses: int,
    spec: SpecParams,
    sampling: SamplingParams | None = None,
) -> DraftOutput:
    """The draft-ahead call the gateway sends beside the Verify of `verifying`: the root again
    (the drafter holds every token before it), no new features."""
    start = len(TOKENS) - 1
    item = DraftInput(
        seq_id, False, start, TOKENS[start:], spec, verifying=verifying, ahead_guesses=guesses
    )
    item.sampling = sampling or item.sampling
    return engine.draft([item])[0]


def _rows(tree: DraftTree) -> torch.Tensor:
    """A tree's draft distributions, dense over the vocabulary [nodes, vocab] (none: 0 rows)."""
    return torch.zeros(0) if tree.draft_probs is None else tree.draft_probs.dense()


@pytest.mark.parametrize("device_expansion", [True, False], ids=["device", "forks"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_sampled_chain_ahead_is_the_next_rounds_draft_at_the_same_uniforms(
    models: dict[str, Path], page_size: int, device_expansion: bool
) -> None:
    """Every outcome's chain drafted ahead is what the next round's Draft draws once that
    outcome is committed: the same uniforms (its generator moved on once by the call), so the
    same tokens and the same draft distributions."""
    engine = _model_engine(models, page_size)
    engine.proposer.device_expansion = device_expansion  # type: ignore[attr-defined]
    chain = _begin(engine, "s", CHAIN, SAMPLED).tree
    assert chain.draft_probs is not None
    out = _ahead(engine, "s", chain, 2, CHAIN, SAMPLED)
    assert len(out.ahead) == (len(chain) + 1) * 2
    for i, ahead in enumerate(out.ahead):
        fresh = _model_engine(models, page_size)
        assert _begin(fresh, "n", CHAIN, SAMPLED).tree.tokens == chain.tokens  # its first draw
        start = len(TOKENS) - 1
        item = DraftInput("n", False, start, TOKENS[start:] + ahead.tokens, CHAIN, SAMPLED)
        normal = fresh.draft([item])[0].tree
        assert ahead.tree.tokens == normal.tokens, (i, ahead.tokens)
        assert ahead.tree.parents == normal.parents
        torch.testing.assert_close(_rows(ahead.tree), _rows(normal), rtol=0, atol=1e-12)
        assert len(_rows(ahead.tree)) == CHAIN.num_steps
        fresh.release(["n"])
    engine.release(["s"])
    assert engine.num_pages_used == 0


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("spec", [CHAIN, SpecParams(3, 2, 5)], ids=["chain", "tree"])
def test_model_ahead_tree_is_the_next_rounds_draft(
    models: dict[str, Path], page_size: int, spec: SpecParams
) -> None:
    engine = _model_engine(models, page_size)
    chain = _begin(engine, "s", CHAIN).tree
    out = _ahead(engine, "s", chain, 2, spec)
    assert out.tree.tokens == []  # draft-ahead drafts no tree for the root
    assert len(out.ahead) == (len(chain) + 1) * 2
    fresh = _model_engine(models, page_size)
    for i, ahead in enumerate(out.ahead):
        k = len(ahead.tokens) - 1
        assert ahead.tokens[:k] == chain.tokens[:k]
        normal = fresh.draft([DraftInput(f"n{i}", True, 0, TOKENS + ahead.tokens, spec)])[0]
        assert ahead.tree.tokens == normal.tree.tokens, ahead.tokens
        assert ahead.tree.parents == normal.tree.parents
        fresh.release([f"n{i}"])
    engine.release(["s"])
    assert engine.num_pages_used == 0
    engine.check_integrity()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "catch-up-first"])
@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_a_round_of_draft_ahead_alone_runs_one_catch_up_forward(
    models: dict[str, Path], kind: str, fused: bool
) -> None:
    """A Draft whose every item drafts ahead (a round whose outcome was guessed) runs the
    catch-up to the root and the expansion, and no forward for an empty batch of normal
    drafts (it ran before: one eager forward of the whole draft model, for nothing). Fused
    (the default), the catch-up runs inside the expansion's one device run: no forward of its
    own; else one forward of the one sequence, then the expansion."""
    engine = _model_engine(models, 4) if kind == "model" else _eagle_engine(models, 4)
    engine.proposer.fused_catch_up = fused  # type: ignore[attr-defined]
    chain = _begin(engine, "s", CHAIN).tree
    forwards: list[int] = []
    run = engine.proposer._run  # type: ignore[attr-defined]
    engine.proposer._run = lambda steps, *args: forwards.append(len(steps)) or run(steps, *args)  # type: ignore[attr-defined]
    expansion = engine.proposer._expansion()  # type: ignore[attr-defined]
    catch_ups: list[int] = []
    catch_up = expansion.catch_up
    expansion.catch_up = lambda batch: catch_ups.append(batch.num_seqs) or catch_up(batch)
    out = _ahead(engine, "s", chain, 2, CHAIN)
    assert len(out.ahead) == (len(chain) + 1) * 2
    assert (forwards, catch_ups) == (([], [1]) if fused else ([1], []))
    engine.release(["s"])
    assert engine.num_pages_used == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_eagle_ahead_continues_the_heads_own_chain(models: dict[str, Path], page_size: int) -> None:
    """All drafts accepted and the bonus the head's top-1 after them: the tree drafted ahead is
    what a deeper chain from the same root drafts next (node outputs as features)."""
    engine = _eagle_engine(models, page_size)
    chain = _begin(engine, "s", CHAIN).tree
    deep = _begin(engine, "deep", SpecParams(7, 1, 7)).tree
    assert deep.tokens[:3] == chain.tokens
    out = _ahead(engine, "s", chain, 2, CHAIN)
    assert len(out.ahead) == (len(chain) + 1) * 2
    guessed = {tuple(a.tokens): a.tree for a in out.ahead}
    assert guessed[tuple(deep.tokens[:4])].tokens == deep.tokens[4:]
    engine.release(["s", "deep"])
    assert engine.num_pages_used == 0


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_guesses_skip_the_chains_own_next_node(models: dict[str, Path], kind: str) -> None:
    engine = _model_engine(models, 4) if kind == "model" else _eagle_engine(models, 4)
    chain = _begin(engine, "s", CHAIN).tree
    out = _ahead(engine, "s", chain, 3, CHAIN)
    by_k: dict[int, list[int]] = {}
    for ahead in out.ahead:
        by_k.setdefault(len(ahead.tokens) - 1, []).append(ahead.tokens[-1])
        assert len(ahead.tree) == CHAIN.num_draft_tokens
    assert sorted(by_k) == [0, 1, 2, 3]
    for k, bonuses in by_k.items():
        assert len(bonuses) == len(set(bonuses)) == 3
        if k < len(chain):
            assert chain.tokens[k] not in bonuses
    engine.release(["s"])


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_ahead_leaves_the_drafter_as_a_plain_catch_up_would(
    models: dict[str, Path], kind: str
) -> None:
    """After a draft-ahead call, the next normal round drafts exactly what it drafts without
    one, and no page is left over."""
    make = _model_engine if kind == "model" else _eagle_engine
    with_ahead, without = make(models, 4), make(models, 4)
    chain = _begin(with_ahead, "s", CHAIN).tree
    assert _begin(without, "s", CHAIN).tree.tokens == chain.tokens
    used = with_ahead.num_pages_used
    _ahead(with_ahead, "s", chain, 2, CHAIN)
    assert with_ahead.num_pages_used == used
    # the round's outcome: two drafts accepted and a bonus; the features of the root and the
    # two accepted tokens arrive with it
    tokens = [*TOKENS, *chain.tokens[:2], 7]
    rows = _features(with_ahead, 3, seed=1)
    start = len(TOKENS) - 1 if rows is not None else len(TOKENS)  # EAGLE: where features end
    items = [DraftInput("s", False, start, tokens[start:], CHAIN, target_hidden_states=rows)]
    after = [engine.draft(items)[0].tree.tokens for engine in (with_ahead, without)]
    assert after[0] == after[1]
    for engine in (with_ahead, without):
        engine.release(["s"])
        assert engine.num_pages_used == 0


def test_ahead_refusals(models: dict[str, Path]) -> None:
    engine = _model_engine(models, 4)
    chain = _begin(engine, "s", CHAIN).tree
    with pytest.raises(ServiceError) as err:
        _ahead(engine, "s", chain, 99, CHAIN)
    assert err.value.code is Code.INVALID_ARGUMENT
    with pytest.raises(ServiceError) as err:
        _ahead(engine, "s", DraftTree([1, 1], [-1, -1]), 2, CHAIN)  # repeated siblings
    assert err.value.code is Code.INVALID_ARGUMENT
    # a tree that is not a chain: nothing drafted ahead (the gateway drafts normally next)
    assert _ahead(engine, "s", DraftTree([1, 2], [-1, -1]), 2, CHAIN).ahead == []
    engine.release(["s"])
    assert engine.num_pages_used == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_kv_fork_shares_full_pages_and_copies_the_partial_one(page_size: int) -> None:
    kv = KVCache(1, 1, 2, 16, page_size, torch.float32, "cpu")
    seq = kv.new_seq()
    kv.reserve(seq, 10)
    kv.data[:, :, : kv.scratch_slot] = torch.arange(kv.scratch_slot, dtype=torch.float32)[
        None, None, :, None, None
    ]
    seq.kv_committed_len = 10
    fork = kv.fork(seq, 6)
    full = 6 // page_size
    assert fork.page_table[:full] == seq.page_table[:full]
    assert fork.num_shared_pages == full and fork.kv_committed_len == 6
    assert torch.equal(kv.data[:, :, fork.slots(0, 6)], kv.data[:, :, seq.slots(0, 6)])
    kv.reserve(fork, 9)
    assert set(fork.page_table[full:]).isdisjoint(seq.page_table)
    assert kv.allocator.num_used == len(seq.page_table) + len(fork.page_table) - full
    kv.release(fork)  # its own pages only
    assert kv.allocator.num_used == len(seq.page_table)
    kv.release(seq)
    assert kv.allocator.num_used == 0
    kv.check_integrity()


@pytest.mark.parametrize("kind", ["model", "eagle3"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("spec", "sampling"),
    [(CHAIN, None), (SpecParams(3, 2, 5), None), (CHAIN, SAMPLED)],
    ids=["chain", "tree", "sampled-chain"],
)
def test_one_device_run_drafts_what_the_forks_draft(
    models: dict[str, Path],
    kind: str,
    page_size: int,
    spec: SpecParams,
    sampling: SamplingParams | None,
) -> None:
    """DeviceExpansion.expand_ahead (every outcome in the sequence's own storage, one run) and
    its reference, a fork of the KV per outcome expanded a step at a time on the host; a
    sampled chain's outcomes at the same uniforms, with the same draft distributions."""
    make = _model_engine if kind == "model" else _eagle_engine
    found, probs = [], []
    for device_expansion in (True, False):
        engine = make(models, page_size)
        engine.proposer.device_expansion = device_expansion  # type: ignore[attr-defined]
        chain = _begin(engine, "s", CHAIN, sampling).tree
        out = _ahead(engine, "s", chain, 2, spec, sampling)
        found.append([(a.tokens, a.tree.tokens, a.tree.parents) for a in out.ahead])
        probs.append([_rows(a.tree) for a in out.ahead])
        engine.release(["s"])
        assert engine.num_pages_used == 0
    assert found[0] == found[1]
    assert len(found[0]) == 8
    for device_rows, fork_rows in zip(*probs, strict=True):
        torch.testing.assert_close(device_rows, fork_rows, rtol=0, atol=1e-9)
    assert all(len(rows) == (spec.num_steps if sampling else 0) for rows in probs[0])


def test_no_draft_ahead_past_the_context(models: dict[str, Path]) -> None:
    """Outcomes' trees that would pass the drafter's context are not drafted (their positions
    would not exist); the call still takes the sequence's new tokens."""
    engine = _model_engine(models, 4)
    chain = _begin(engine, "s", CHAIN).tree
    room = engine.proposer.max_context - len(TOKENS)
    assert _ahead(engine, "s", chain, 2, CHAIN).ahead
    engine.proposer.max_context = len(TOKENS) + len(chain) + CHAIN.num_steps  # one short
    assert room > 0 and _ahead(engine, "s", chain, 2, CHAIN).ahead == []
    engine.release(["s"])
    assert engine.num_pages_used == 0


def _ahead_after_a_round(
    engine: DrafterEngine, new: list[int], spec: SpecParams, sampling: SamplingParams | None
) -> list[list[tuple[list[int], list[int], list[int]]]]:
    """Two sequences drafted a chain each; then a draft-ahead call as the gateway sends it
    after a Verify: each sequence's new tokens (new[i] - 1 of its chain's drafts accepted, then
    a bonus), the target's features of the tokens before them (EAGLE), and the chain it
    verifies next (its tree drafted ahead: here its first chain again). Then the next round
    for the outcome "all accepted, bonus 7". Per sequence its outcomes (tokens, tree), then
    the next round's trees. `sampling`: every call's (None: greedy)."""
    prompts = {"a": TOKENS, "b": TOKENS[::-1]}
    chains = {}
    for seq_id, prompt in prompts.items():
        rows = _features(engine, len(prompt) - 1, seed=len(chains))
        item = DraftInput(seq_id, True, 0, prompt, CHAIN, target_hidden_states=rows)
        item.sampling = sampling or item.sampling
        chains[seq_id] = engine.draft([item])[0].tree
    items, after = [], []
    for (seq_id, prompt), count in zip(prompts.items(), new, strict=True):
        chain = chains[seq_id]
        tokens = [*prompt, *chain.tokens[: count - 1], 300 + count]
        rows = _features(engine, count, seed=count)
        eagle = rows is not None
        start = len(prompt) - 1 if eagle else len(prompt)  # EAGLE: where features end
        items.append(
            DraftInput(seq_id, False, start, tokens[start:], spec, target_hidden_states=rows,
                       verifying=chain, ahead_guesses=2)
        )  # fmt: skip
        # the next round: the chain all accepted, bonus 7
        rows = _features(engine, len(chain) + 1, seed=9) if eagle else None
        start = len(tokens) - 1 if eagle else len(tokens)
        grown = [*tokens, *chain.tokens, 7]
        after.append(
            DraftInput(seq_id, False, start, grown[start:], CHAIN, target_hidden_states=rows)
        )
    for item in items + after:
        item.sampling = sampling or item.sampling
    outs = engine.draft(items)
    found = [[(a.tokens, a.tree.tokens, a.tree.parents) for a in out.ahead] for out in outs]
    found.append([(out.tree.tokens, out.tree.parents, []) for out in engine.draft(after)])
    engine.release(list(prompts))
    assert engine.num_pages_used == 0
    engine.check_integrity()
    return found


@pytest.mark.parametrize("kind", ["model", "eagle3"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("new", [[3, 3], [1, 1], [2, 4]], ids=["3-3", "1-1", "2-4"])
@pytest.mark.parametrize(
    ("spec", "sampling"),
    [(CHAIN, None), (SpecParams(3, 2, 5), None), (CHAIN, SAMPLED)],
    ids=["chain", "tree", "sampled-chain"],
)
def test_the_fused_catch_up_drafts_what_the_catch_up_first_drafts(
    models: dict[str, Path],
    kind: str,
    page_size: int,
    new: list[int],
    spec: SpecParams,
    sampling: SamplingParams | None,
) -> None:
    """A draft-ahead call whose catch-up runs in the expansion's own run (`_fused_ahead`; the
    two sequences' catch-ups of one length) drafts the outcomes and leaves the drafter as the
    catch-up run first does; catch-ups of different lengths (2-4, not padded on the CPU) run
    first in either case. An EAGLE head's fused runs write the round's target features into its
    pool in their own run (`PoolRows`), and the pool ends as the unfused calls leave it."""
    make = _model_engine if kind == "model" else _eagle_engine
    found, fused_runs, carried, pools = [], [], [], []
    for fused in (True, False):
        engine = make(models, page_size)
        proposer = engine.proposer
        proposer.fused_catch_up = fused  # type: ignore[attr-defined]
        calls: list[int] = []
        taken: list[int] = []
        original = proposer._fused_ahead  # type: ignore[attr-defined]
        original_rows = proposer._carried_rows  # type: ignore[attr-defined]

        def counted(*args: object, original: object = original, calls: list[int] = calls) -> object:
            out = original(*args)  # type: ignore[operator]
            calls.append(out is not None)
            return out

        def rows(q: int, original: object = original_rows, taken: list[int] = taken) -> object:
            out = original(q)  # type: ignore[operator]
            taken.append(out is not None)
            return out

        proposer._fused_ahead = counted  # type: ignore[attr-defined]
        proposer._carried_rows = rows  # type: ignore[attr-defined]
        found.append(_ahead_after_a_round(engine, new, spec, sampling))
        fused_runs.append(sum(calls))
        carried.append(sum(taken))
        if kind == "eagle3":  # the target features every call wrote, wherever it wrote them
            pools.append(proposer.features[: proposer.kv.scratch_slot].clone())  # type: ignore[attr-defined]
    assert found[0] == found[1]
    assert all(len(per_seq) == 8 for per_seq in found[0][:2])
    assert fused_runs == [int(new[0] == new[1]), 0]
    if kind == "eagle3":
        assert torch.equal(pools[0], pools[1]) and pools[0].abs().sum() > 0
        # fused, every call but an unfused draft-ahead took its new rows into its device run:
        # each prompt's first Draft, the draft-ahead call, the next round's Draft
        assert carried == [3 + fused_runs[0], 0]
    else:  # no row pool: nothing to carry
        assert carried == [0, 0]


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_fused_run_that_fails_still_leaves_its_target_features_in_the_pool(
    models: dict[str, Path], page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target features a fused Draft carries into its device run (`PoolRows`) are in the
    head's pool even when that run fails: the proposer has counted them as kept (a failed call
    leaves the rest of its catch-up to the gateway, which forgets the sequence on the drafter)."""
    failing = _eagle_engine(models, page_size)
    taken: list[bool] = []

    def carried(q: int, original: object = failing.proposer._carried_rows) -> object:  # type: ignore[attr-defined]
        out = original(q)  # type: ignore[operator]
        taken.append(out is not None)
        return out

    failing.proposer._carried_rows = carried  # type: ignore[attr-defined]

    def fail(*args: object, **kwargs: object) -> object:
        raise RuntimeError("the device run failed")

    monkeypatch.setattr(DeviceExpansion, "_run", fail)
    with pytest.raises(RuntimeError, match="device run failed"):
        _begin(failing, "a", CHAIN)
    assert taken == [True]  # the failing run had carried the rows
    proposer = failing.proposer
    seq = failing.seqs["a"]
    rows = _features(failing, len(TOKENS) - 1)
    assert rows is not None
    assert torch.equal(proposer.feature_rows(seq, 0, len(TOKENS) - 1), rows)  # type: ignore[attr-defined]
    failing.release(["a"])
    assert failing.num_pages_used == 0
    failing.check_integrity()
