"""On a CUDA device the split argmax (`specsplit.kernels.argmax.argmax_rows`) equals torch.argmax
exactly on SmolLM2's and its head's vocabularies at batch 1 to 64 (bf16 logits, whose many ties
go to the lowest column; float32 as the graphs keep them), replays right from a CUDA graph as
the logits change, and the verifier's forward graphs hand out each row's argmax beside its
logits. Skipped where there is no GPU (CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.kernels.argmax import argmax_rows, greedy_tokens
from specsplit.messages import VerifyInput
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.tree import DraftTree
from tests.support import save_tiny_llama
from verifier.engine import VerifierEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 32, 64])
@pytest.mark.parametrize("vocab", [49152, 32000, 128256])
def test_argmax_rows_equals_torch_argmax(vocab: int, rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(vocab + rows)
    logits = (torch.randn(rows, vocab, device=CUDA, generator=gen) * 4).to(dtype)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    ties = torch.randint(0, 50, (rows, vocab), device=CUDA, generator=gen).to(dtype)
    assert torch.equal(argmax_rows(ties), ties.argmax(dim=-1))


def test_a_captured_argmax_follows_new_logits() -> None:
    logits = torch.randn(8, 49152, device=CUDA)
    out = torch.empty(8, dtype=torch.int64, device=CUDA)
    argmax_rows(logits, out=out)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_rows(logits, out=out)
    for seed in range(3):
        logits.copy_(
            torch.randn(8, 49152, device=CUDA, generator=torch.Generator(CUDA).manual_seed(seed))
        )
        graph.replay()
        assert torch.equal(out, logits.argmax(dim=-1))


def test_the_verifiers_graphs_give_each_rows_argmax(tmp_path: Path) -> None:
    """Every forward graph takes its logits rows' argmax beside them; the greedy rounds' bonus
    tokens then come from it, equal to the eager engine's (the graphs set aside)."""
    model, config = load_model(str(save_tiny_llama(tmp_path / "t", seed=3)), torch.float32, "cuda")
    kv = make_kv_cache(config, 256, 16, torch.float32, "cuda")
    engine = VerifierEngine(
        model, kv, 512, config.vocab_size, graph_query_lens=(1, 4), max_batch_size=8
    )
    assert engine.graphs is not None and engine.graphs.greedy
    prompts = [[5, 9, 2, 7], [3, 3, 8], [1, 2, 3, 4, 5, 6]]
    graphed = _decode(engine, prompts, steps=6)
    for key, buffers in engine.graphs.buffers.items():
        assert buffers.greedy is not None and buffers.logits is not None, key
        assert torch.equal(buffers.greedy, buffers.logits.argmax(dim=-1)), key
    engine.graphs, engine.accept_graphs = None, None
    assert _decode(engine, prompts, steps=6) == graphed


def _decode(engine: VerifierEngine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Each prompt's next `steps` greedy tokens, decoded together (released after)."""
    ids = [f"s{i}" for i in range(len(prompts))]
    outs = engine.verify(
        [VerifyInput(i, True, 0, p, DraftTree()) for i, p in zip(ids, prompts, strict=True)]
    )
    tokens = [[o.bonus_token] for o in outs]
    for _ in range(steps - 1):
        outs = engine.verify(
            [
                VerifyInput(i, False, o.kv_committed_len, t[-1:], DraftTree())
                for i, o, t in zip(ids, outs, tokens, strict=True)
            ]
        )
        for t, o in zip(tokens, outs, strict=True):
            t.append(o.bonus_token)
    engine.release(ids)
    return tokens
