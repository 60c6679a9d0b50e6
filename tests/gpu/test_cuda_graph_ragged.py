"""On a CUDA device: steps whose sequences bring different numbers of query tokens (a verify
round where some trees are shorter, ragged catch-ups, a tree's frontier with more new tokens
than queries, a q that was not captured) replay the graph of the next captured q, each sequence
padded at its end; the wanted rows' logits and hidden states equal the eager forward's. Skipped
where there is no GPU (CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.kv_cache import KVCache, SeqKV
from specsplit.model.cuda_graphs import CudaGraphRunner
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model
from specsplit.step import SeqStep, build_forward_batch, causal_step, verify_step
from specsplit.tree import DraftTree
from tests.support import TINY_VOCAB, save_tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PREFIXES = (5, 9, 13)  # committed tokens of the three sequences


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("ragged") / "target", seed=4, num_layers=3)


def _setup(target: Path, page_size: int) -> tuple[LlamaModel, KVCache, list[SeqKV]]:
    model, config = load_model(str(target), torch.float32, "cuda")
    kv = make_kv_cache(config, 128, page_size, torch.float32, "cuda")
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for n in PREFIXES:
        seq = kv.new_seq()
        kv.reserve(seq, n + 16)
        tokens = torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist()
        batch, _ = build_forward_batch([causal_step(seq, tokens, [])], page_size)
        model(batch.to("cuda"), kv)
        seq.kv_committed_len = n
        seqs.append(seq)
    return model, kv, seqs


def _frontier(seq: SeqKV) -> SeqStep:
    """A topk-2 tree's second step: 2 frontier nodes over 6 new tokens (2 + their 4 children)."""
    c = seq.kv_committed_len
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, [0, 2]] = True  # node 2 (child of 0)
    mask[1, [1, 4]] = True  # node 4 (child of 1)
    return SeqStep(seq, [11, 12], [c + 1, c + 1], [c + 2, c + 4], c + 6, c, mask, [0, 1])


def _steps(case: str, seqs: list[SeqKV]) -> list[SeqStep]:
    a, b, c = seqs
    if case == "verify":  # trees of 3, 1 and 0 nodes after one pending token: q = 4, 2, 1
        return [
            verify_step(a, [7], DraftTree([8, 9, 10], [-1, 0, 1]), [0, 1, 2, 3]),
            verify_step(b, [7], DraftTree([8], [-1]), [0, 1]),
            verify_step(c, [7], DraftTree(), [0]),
        ]
    if case == "catch_up":  # causal, 3, 1 and 2 new tokens
        return [
            causal_step(a, [4, 5, 6], [2]),
            causal_step(b, [4], [0]),
            causal_step(c, [4, 5], [1]),
        ]
    if case == "frontier":
        return [_frontier(s) for s in seqs]
    assert case == "uncaptured"  # every sequence 3 tokens: no q = 3 graph, padded to 4
    return [causal_step(s, [4, 5, 6], [0, 1, 2]) for s in seqs]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", ["verify", "catch_up", "frontier", "uncaptured"])
def test_ragged_step_replays_a_padded_graph(target: Path, page_size: int, case: str) -> None:
    model, kv, seqs = _setup(target, page_size)
    runner = CudaGraphRunner.for_model(model, kv, max_context=256, max_batch_size=4)
    for q in (1, 4, 8):
        runner.capture(q)
    steps = _steps(case, seqs)
    for step in steps:
        step.hidden_rows = list(step.logit_rows)
    batch, _ = build_forward_batch(steps, page_size)
    aux = (1,)
    want = model(batch.to("cuda"), kv, aux_layers=aux)
    plan = runner.plan(batch)
    assert plan is not None and plan[0] == (8 if case == "frontier" else 4)
    got = runner.forward(batch, aux)
    assert got is not None and got.hidden_states is not None and want.hidden_states is not None
    difference = (got.logits - want.logits).abs().max()
    assert torch.allclose(got.logits, want.logits, atol=1e-4), difference
    assert torch.allclose(got.hidden_states, want.hidden_states, atol=1e-4)
    for seq in seqs:
        kv.release(seq)
    kv.check_integrity()


def test_a_prefill_with_a_cached_part_stays_eager(target: Path) -> None:
    """New tokens past any captured q (a long prompt) have no graph: the caller runs it eagerly."""
    model, kv, seqs = _setup(target, 16)
    runner = CudaGraphRunner.for_model(model, kv, max_context=256, max_batch_size=4)
    runner.capture(4)
    batch, _ = build_forward_batch([causal_step(seqs[0], list(range(3, 12)), [8])], 16)
    assert runner.plan(batch) is None
    for seq in seqs:
        kv.release(seq)


def test_a_prefill_replays_a_graph_of_its_own_batch_limit(target: Path) -> None:
    """A prompt (a new sequence's 20 tokens) replays the q = 32 graph captured for at most two
    sequences, its logits and hidden states those of the eager forward; three sequences of 10
    new tokens at once are over that limit (and past q = 4) and stay eager."""
    model, kv, seqs = _setup(target, 16)
    runner = CudaGraphRunner.for_model(
        model, kv, max_context=256, max_batch_size=4, max_query_len=32
    )
    runner.capture(4)
    runner.capture(32, max_batch=2)
    assert runner.sizes(32) == [1, 2] and runner.sizes(4) == [1, 2, 4]
    prompt = kv.new_seq()
    kv.reserve(prompt, 24)
    step = causal_step(prompt, list(range(3, 23)), list(range(20)))
    step.hidden_rows = list(range(20))
    batch, _ = build_forward_batch([step], 16)
    assert runner.plan(batch) == (32, 1)
    got = runner.forward(batch, (1,))  # the same q with hidden states: captured on first use
    want = model(batch.to("cuda"), kv, aux_layers=(1,))
    assert got is not None and got.hidden_states is not None and want.hidden_states is not None
    difference = (got.logits - want.logits).abs().max()
    assert torch.allclose(got.logits, want.logits, atol=1e-4), difference
    assert torch.allclose(got.hidden_states, want.hidden_states, atol=1e-4)
    steps = [causal_step(s, list(range(3, 13)), [9]) for s in seqs]
    assert runner.plan(build_forward_batch(steps, 16)[0]) is None  # 3 > 2: eager
    for seq in [*seqs, prompt]:
        kv.release(seq)
    kv.check_integrity()


def test_a_batch_past_64_replays_the_bucket_of_96(target: Path) -> None:
    """`--graph-max-batch 96` (`up --max-batch-size 96`): a decode step of 70 sequences replays
    the 96 bucket's graph, its logits those of the eager forward."""
    model, config = load_model(str(target), torch.float32, "cuda")
    kv = make_kv_cache(config, 2 * 70 + 8, 16, torch.float32, "cuda")
    seqs = []
    for i in range(70):
        seq = kv.new_seq()
        kv.reserve(seq, 6)
        batch, _ = build_forward_batch([causal_step(seq, [3 + i % 50, 4, 5, 6, 7], [])], 16)
        model(batch.to("cuda"), kv)
        seq.kv_committed_len = 5
        seqs.append(seq)
    runner = CudaGraphRunner.for_model(model, kv, max_context=256, max_batch_size=96)
    runner.capture(1)
    assert runner.sizes(1)[-3:] == [48, 64, 96]
    batch, _ = build_forward_batch(
        [causal_step(s, [8 + i % 40], [0]) for i, s in enumerate(seqs)], 16
    )
    assert runner.plan(batch) == (1, 96)
    want = model(batch.to("cuda"), kv)
    got = runner.forward(batch, ())
    assert got is not None
    difference = (got.logits - want.logits).abs().max()
    assert torch.allclose(got.logits, want.logits, atol=1e-4), difference
    for seq in seqs:
        kv.release(seq)
    kv.check_integrity()
