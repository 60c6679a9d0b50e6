"""The accepted-rows kernel on a GPU equals its reference exactly, bfloat16 rounding included
(the interpreter truncates), at an 8B head's feature width and at batch 64; and verifier rounds
whose drafts are accepted (synthetic acceptance: the same outcomes on both devices) give the
GPU's graphs the hidden states the CPU's reference path picks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.kernels.accepted_rows import accepted_rows, accepted_rows_reference
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.tree import DraftTree
from tests.gpu.test_cuda_graph_hidden_states import _rounds
from tests.support import TINY_VOCAB, save_tiny_llama
from tests.unit.test_accepted_rows import CASES, MANY, make_round, meta_of, num_kept
from verifier.engine import VerifierEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
CUDA = torch.device("cuda")
SHAPES = {
    **CASES,
    "more-sequences-than-a-block": MANY,
    "8b-features-batch-32": ([1] * 32, [3] * 32, [True] * 32, 3 * 4096),
    "batch-64-trees": ([1, 5] * 32, [8, 3] * 32, [True, False] * 32, 576 * 3),
    "prefill-1000-beside-31-rounds": ([1000] + [1] * 31, [0] + [3] * 31, [True] * 32, 3 * 4096),
}


@pytest.mark.parametrize("case", list(SHAPES), ids=list(SHAPES))
def test_kernel_on_the_gpu_equals_reference(case: str) -> None:
    pending, nodes, asks, width = SHAPES[case]
    for seed in range(2):
        hidden, packed, starts = make_round(pending, nodes, asks, width, seed, extra_rows=2)
        expected = accepted_rows_reference(hidden, packed, starts, pending, asks, torch.bfloat16)
        got = accepted_rows(
            hidden.to(CUDA),
            packed.to(CUDA),
            meta_of(starts, pending, asks).to(CUDA),
            torch.bfloat16,
        )
        num = num_kept(packed, pending, asks)
        assert torch.equal(got[:num].cpu(), expected), (case, seed)


def test_rounds_with_accepted_drafts_give_the_cpus_hidden_states(tmp_path: Path) -> None:
    path = save_tiny_llama(tmp_path / "target", seed=3, num_layers=4, hidden_size=128)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 7)]
    shapes = ([-1, 0, 1, 2], [-1, -1, 0, 1, 2])  # a chain, and a tree of two branches
    trees = [
        [
            DraftTree((torch.randperm(TINY_VOCAB - 3, generator=gen)[: len(s)] + 3).tolist(), s)
            for s in (shapes[(r + b) % 2] for b in range(len(prompts)))
        ]
        for r in range(6)
    ]
    engines = []
    for device, graphs in (("cpu", ()), ("cuda", (1, 5, 6))):
        model, config = load_model(str(path), torch.float32, device)
        kv = make_kv_cache(config, 64, 16, torch.float32, device)
        engine = VerifierEngine(
            model,
            kv,
            config.max_position_embeddings,
            config.vocab_size,
            graph_query_lens=graphs,
            synthetic_acceptance=(0.9, 0.8, 0.7),
        )
        engine.warmup()
        engine._synthetic_rng.seed(0)  # warm-up drew from it: the same outcomes on both
        engines.append(engine)
    want, got = (_rounds(engine, prompts, trees) for engine in engines)
    accepted = 0
    for round_want, round_got in zip(want, got, strict=True):
        for w, g in zip(round_want, round_got, strict=True):
            assert (g.accepted_tokens, g.kv_committed_len) == (
                w.accepted_tokens,
                w.kv_committed_len,
            )
            assert g.hidden_states is not None and w.hidden_states is not None
            assert g.hidden_states.shape == w.hidden_states.shape
            torch.testing.assert_close(g.hidden_states, w.hidden_states, atol=2e-2, rtol=2e-2)
            accepted += len(w.accepted_tokens)
    assert accepted >= 10  # the rounds did gather accepted nodes' rows
