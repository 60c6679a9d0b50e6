"""On a CUDA device: verify rounds that return hidden states (for an EAGLE drafter) replay CUDA
graphs captured on first use, with the same tokens and features as eager rounds. Skipped where
there is no GPU (CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.messages import VerifyInput
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.tree import DraftTree
from tests.support import TINY_VOCAB, save_tiny_llama
from verifier.engine import VerifierEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LAYERS = (0, 2, 4)  # two decoder layers and the last hidden state after the final norm


def _engine(path: Path, graphs: tuple[int, ...]) -> VerifierEngine:
    model, config = load_model(str(path), torch.float32, "cuda")
    kv = make_kv_cache(config, 64, 16, torch.float32, "cuda")
    engine = VerifierEngine(
        model, kv, config.max_position_embeddings, config.vocab_size, graph_query_lens=graphs
    )
    engine.warmup()
    return engine


def _rounds(engine: VerifierEngine, prompts: list[list[int]], trees: list[list[DraftTree]]):
    """Prefill, then each round's chain per sequence; every output of every round."""
    outs = engine.verify(
        [
            VerifyInput(f"s{b}", True, 0, p, DraftTree(), hidden_state_layers=LAYERS)
            for b, p in enumerate(prompts)
        ]
    )
    history = [outs]
    for round_trees in trees:
        outs = engine.verify(
            [
                VerifyInput(
                    f"s{b}",
                    False,
                    o.kv_committed_len,
                    [o.bonus_token],
                    tree,
                    hidden_state_layers=LAYERS,
                )
                for b, (o, tree) in enumerate(zip(outs, round_trees, strict=True))
            ]
        )
        history.append(outs)
    engine.release([f"s{b}" for b in range(len(prompts))])
    engine.check_integrity()
    assert engine.num_pages_used == 0
    return history


def test_graph_rounds_with_hidden_states_equal_eager(tmp_path: Path) -> None:
    path = save_tiny_llama(tmp_path / "target", seed=3, num_layers=4, hidden_size=128)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 7)]
    trees = [
        [
            DraftTree(torch.randint(3, TINY_VOCAB, (4,), generator=gen).tolist(), [-1, 0, 1, 2])
            for _ in prompts
        ]
        for _ in range(6)
    ]
    graphs = _engine(path, (1, 5))
    eager = _engine(path, ())
    got, want = _rounds(graphs, prompts, trees), _rounds(eager, prompts, trees)
    assert graphs.graphs is not None and (5, LAYERS) in graphs.graphs.buffers  # captured on use
    for round_got, round_want in zip(got, want, strict=True):
        for g, w in zip(round_got, round_want, strict=True):
            assert (g.accepted_tokens, g.bonus_token, g.kv_committed_len) == (
                w.accepted_tokens,
                w.bonus_token,
                w.kv_committed_len,
            )
            assert g.hidden_states is not None and w.hidden_states is not None
            torch.testing.assert_close(g.hidden_states, w.hidden_states, atol=2e-2, rtol=2e-2)
