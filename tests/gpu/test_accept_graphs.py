"""On a CUDA device: greedy acceptance, the bonus token and the accepted path's K/V compaction
replayed from CUDA graphs (verifier/accept_graphs.py, the accept-walk kernel in them) give
exactly what the eager torch ops give, round after round (a wrong compaction would change every
later round's logits), for chains and trees drafted partly right, ragged batches of 1 to 5
sequences, page sizes 1 and 16. Skipped where there is no GPU (CI)."""

from __future__ import annotations

import random
from pathlib import Path
from unittest import mock

import pytest
import torch

from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from specsplit.tree import DRAFT_SUPPORT, DraftProbs, DraftTree
from tests.support import TINY_VOCAB, save_tiny_llama
from verifier import accept_graphs
from verifier.engine import VerifierEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("accept_graphs") / "target", seed=2)


def _engine(target: Path, page_size: int, graphs: bool) -> VerifierEngine:
    model, config = load_model(str(target), torch.float32, "cuda")
    kv = make_kv_cache(config, 256, page_size, torch.float32, "cuda")
    engine = VerifierEngine(
        model, kv, 512, config.vocab_size, graph_query_lens=(1, 4, 5, 9), max_batch_size=8
    )
    if not graphs:
        engine.accept_graphs = None
    return engine


def _verify_torch_ops(engine: VerifierEngine, inputs: list[VerifyInput]) -> list[VerifyOutput]:
    """engine.verify with greedy acceptance as the torch ops (the accept-walk kernel's
    reference) wherever it runs eagerly."""
    with mock.patch.object(accept_graphs, "TRITON_ACCEPT", False):
        return engine.verify(inputs)


def _greedy(engine: VerifierEngine, prompt: list[int], n: int) -> list[int]:
    """The target's own next n greedy tokens after `prompt` (a throwaway sequence)."""
    out = engine.verify([VerifyInput("g", True, 0, prompt, DraftTree())])[0]
    tokens, committed = [out.bonus_token], out.kv_committed_len
    while len(tokens) < n:
        out = engine.verify([VerifyInput("g", False, committed, tokens[-1:], DraftTree())])[0]
        tokens.append(out.bonus_token)
        committed = out.kv_committed_len
    engine.release(["g"])
    return tokens


def _tree(rng: random.Random, right: list[int], shape: str) -> DraftTree:
    """Drafts whose first `k` tokens are the target's next ones, then wrong; a tree adds a
    random sibling under each chain node."""
    depth = 3 if shape == "chain" else 2
    k = rng.randint(0, depth)
    chain = [right[i] if i < k else rng.randrange(3, TINY_VOCAB) for i in range(depth)]
    if shape == "chain":
        return DraftTree(chain, list(range(-1, depth - 1)))
    tokens, parents = [], []
    for d, token in enumerate(chain):
        parent = -1 if d == 0 else len(tokens) - 2
        sibling = token
        while sibling == token:
            sibling = rng.randrange(3, TINY_VOCAB)
        tokens += [token, sibling]
        parents += [parent, parent]
    return DraftTree(tokens, parents)


@pytest.mark.parametrize("page_size", [1, 16])
def test_accept_graphs_equal_the_eager_ops(target: Path, page_size: int) -> None:
    graphs, eager = _engine(target, page_size, True), _engine(target, page_size, False)
    assert graphs.accept_graphs is not None
    rng = random.Random(page_size)
    prompts = {f"s{i}": [rng.randrange(3, TINY_VOCAB) for _ in range(4 + 3 * i)] for i in range(5)}
    tokens = {seq_id: list(p) for seq_id, p in prompts.items()}
    committed = dict.fromkeys(prompts, 0)
    num_accepted = 0
    for round_number in range(12):
        batch = rng.sample(sorted(prompts), rng.randint(1, 5))
        inputs = []
        for seq_id in batch:
            right = _greedy(eager, tokens[seq_id], 3) if committed[seq_id] else []
            draft = _tree(rng, right, rng.choice(["chain", "tree"])) if right else DraftTree()
            pending = tokens[seq_id][committed[seq_id] :]
            inputs.append(
                VerifyInput(seq_id, committed[seq_id] == 0, committed[seq_id], pending, draft)
            )
        got, want = graphs.verify(inputs), _verify_torch_ops(eager, inputs)
        assert got == want, round_number
        for out in want:
            num_accepted += len(out.accepted_tokens)
            tokens[out.seq_id][out.kv_committed_len :] = [*out.accepted_tokens, out.bonus_token]
            committed[out.seq_id] = out.kv_committed_len
    assert num_accepted > 0  # the right drafts were accepted: compaction moved K/V
    assert len(graphs.accept_graphs.graphs) > 1  # several layouts, each captured once
    for engine in (graphs, eager):
        engine.release(sorted(prompts))
        engine.check_integrity()
        assert engine.num_pages_used == 0


def test_synthetic_acceptance_runs_on_the_graphs(target: Path) -> None:
    """The benchmark-only synthetic acceptance bends the logits and then runs the round's own
    acceptance: on the greedy acceptance graphs, with the same outcome as the eager ops; each
    sequence accepts a prefix of its first children."""
    engines = [_engine(target, 16, graphs) for graphs in (True, False)]
    for engine in engines:
        engine.synthetic_acceptance = (0.7, 0.6)
    rng = random.Random(5)
    tokens = {f"s{i}": [rng.randrange(3, TINY_VOCAB) for _ in range(6 + i)] for i in range(4)}
    committed = dict.fromkeys(tokens, 0)
    lengths = set()
    for _ in range(10):
        inputs = []
        for seq_id in tokens:
            shape = rng.choice(["chain", "tree"])
            draft = _tree(rng, [3, 4, 5], shape) if committed[seq_id] else None
            pending = tokens[seq_id][committed[seq_id] :]
            inputs.append(
                VerifyInput(seq_id, committed[seq_id] == 0, committed[seq_id], pending,
                            draft or DraftTree())
            )  # fmt: skip
        got, want = (engine.verify(inputs) for engine in engines)
        assert got == want
        for item, out in zip(inputs, want, strict=True):
            first_children, node = [], -1
            while kids := item.tree.children(node):
                node = kids[0]
                first_children.append(item.tree.tokens[node])
            n = len(out.accepted_tokens)
            assert out.accepted_tokens == first_children[:n]
            lengths.add(n)
            tokens[out.seq_id][out.kv_committed_len :] = [*out.accepted_tokens, out.bonus_token]
            committed[out.seq_id] = out.kv_committed_len
    assert len(lengths) > 1  # the rates gave different accepted lengths
    assert engines[0].accept_graphs is not None and engines[0].accept_graphs.graphs
    for engine in engines:
        engine.release(sorted(tokens))
        engine.check_integrity()
        assert engine.num_pages_used == 0


def _draft_probs(rng: random.Random, tree: DraftTree) -> DraftProbs:
    """A draft distribution per node on a support of DRAFT_SUPPORT distinct tokens (the
    drafter's cut), the node's own token first."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    rows = []
    for token in tree.tokens:
        others = torch.randperm(TINY_VOCAB, generator=gen)
        rows.append(
            torch.cat([torch.tensor([token]), others[others != token][: DRAFT_SUPPORT - 1]])
        )
    weights = torch.rand(len(tree), DRAFT_SUPPORT, generator=gen) ** 4
    return DraftProbs(torch.stack(rows), weights / weights.sum(dim=1, keepdim=True), TINY_VOCAB)


@pytest.mark.parametrize("page_size", [1, 16])
def test_sampled_accept_graphs_equal_the_eager_ops(target: Path, page_size: int) -> None:
    """Sampled rounds (temperatures, top-k, top-p, greedy sequences beside them; sampled
    chains with their draft distributions, trees, decode steps; 1 to 5 sequences) on the
    sampled acceptance graphs: the same tokens as the eager ops, round after round (each
    sequence's uniforms come from its own seeded generator on the host, the same in both)."""
    graphs, eager = _engine(target, page_size, True), _engine(target, page_size, False)
    assert graphs.accept_graphs is not None
    rng = random.Random(10 + page_size)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, seed=2),
        SamplingParams(temperature=1.0, top_k=20, seed=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=4),
    ]
    prompts = {f"s{i}": [rng.randrange(3, TINY_VOCAB) for _ in range(4 + 3 * i)] for i in range(5)}
    tokens = {seq_id: list(p) for seq_id, p in prompts.items()}
    committed = dict.fromkeys(prompts, 0)
    lengths = set()
    for round_number in range(16):
        batch = rng.sample(sorted(prompts), rng.randint(1, 5))
        inputs = []
        for seq_id in batch:
            sampling = params[int(seq_id[1:])]
            right = _greedy(eager, tokens[seq_id], 3) if committed[seq_id] else []
            shape = rng.choice(["chain", "tree", "none"])
            draft = _tree(rng, right, shape) if right and shape != "none" else DraftTree()
            if shape == "chain" and not sampling.greedy and draft.tokens:
                draft.draft_probs = _draft_probs(rng, draft)
            pending = tokens[seq_id][committed[seq_id] :]
            inputs.append(
                VerifyInput(
                    seq_id, committed[seq_id] == 0, committed[seq_id], pending, draft, sampling
                )
            )
        got, want = graphs.verify(inputs), _verify_torch_ops(eager, inputs)
        assert got == want, round_number
        for out in want:
            lengths.add(len(out.accepted_tokens))
            tokens[out.seq_id][out.kv_committed_len :] = [*out.accepted_tokens, out.bonus_token]
            committed[out.seq_id] = out.kv_committed_len
    assert len(lengths) > 1
    sampled = [key for key in graphs.accept_graphs.graphs if key[1] is not None]
    assert any(s.filters for _, s in sampled) and any(not s.filters for _, s in sampled)
    for engine in (graphs, eager):
        engine.release(sorted(prompts))
        engine.check_integrity()
        assert engine.num_pages_used == 0


def test_warm_up_captures_the_sampled_graphs_with_top_p(target: Path) -> None:
    """The warm-up's captures (`capture_all`) hold every sampled round up to the largest
    graph's trees, top-k / top-p included (temperature and top-p: what most clients send), so
    that no such round captures an acceptance graph in the middle of traffic: plain decode
    steps and chains of 3 at batch 1, 3 and 8, with top-p and top-k, capture nothing more."""
    engine = _engine(target, 16, graphs=True)
    graphs = engine.accept_graphs
    assert graphs is not None
    graphs.capture_all(max(engine.graph_query_lens) - 1)
    captured = set(graphs.graphs)
    rng = random.Random(5)
    for params in (
        SamplingParams(temperature=0.7, top_p=0.95, seed=1),
        SamplingParams(temperature=1.0, top_k=20, seed=2),
    ):
        for batch in (1, 3, 8):
            seq_ids = [f"s{i}" for i in range(batch)]
            tokens = {s: [rng.randrange(3, TINY_VOCAB) for _ in range(5)] for s in seq_ids}
            committed = dict.fromkeys(seq_ids, 0)
            for shape in ("none", "chain", "none", "chain"):
                inputs = []
                for seq_id in seq_ids:
                    draft = DraftTree()
                    if committed[seq_id] and shape == "chain":
                        chain = [rng.randrange(3, TINY_VOCAB) for _ in range(3)]
                        draft = DraftTree(chain, [-1, 0, 1])
                    pending = tokens[seq_id][committed[seq_id] :]
                    first = committed[seq_id] == 0
                    inputs.append(
                        VerifyInput(seq_id, first, committed[seq_id], pending, draft, params)
                    )
                for out in engine.verify(inputs):
                    tokens[out.seq_id][out.kv_committed_len :] = [
                        *out.accepted_tokens,
                        out.bonus_token,
                    ]
                    committed[out.seq_id] = out.kv_committed_len
            engine.release(seq_ids)
    assert set(graphs.graphs) == captured
    engine.check_integrity()
    assert engine.num_pages_used == 0
