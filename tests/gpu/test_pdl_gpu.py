"""On a CUDA GPU of compute capability 9.0+: programmatic dependent launch (triton_jit.pdl) changes
no result. Each kernel launched with it (small_linear, paged_attention, rope_store) gives bit
for bit what it gives without it, also as a chain of dependent launches captured in a CUDA graph
(a kernel that read its input before the kernel before it finished would read stale values
there), and a SmolLM2-shaped model's decode and verify steps replayed from graphs captured with
it give the logits and K/V of graphs captured without it, on the broadcast and the tensor-core
small-linear paths. Skipped elsewhere (CI)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from specsplit.kernels import small_linear as sl
from specsplit.kernels import small_linear_tiles, triton_jit
from specsplit.kernels.paged_attention import paged_attention
from specsplit.kernels.rope_store import rope_store
from specsplit.model import llama
from specsplit.model.cuda_graphs import CudaGraphRunner
from specsplit.model.llama import LlamaModel, make_kv_cache, state_dict_from_hf
from tests.forward_steps import causal_step, make_batch, new_seqs
from tests.gpu.test_small_linear_gpu import (
    EPS,
    OPS,
    make_inputs,
    rope_inputs,
    run,
    smollm2_layers,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU with programmatic dependent launch (compute capability 9.0+)",
)
T = TypeVar("T")


@pytest.fixture(params=["default", "prefetch", "wait-first", "trigger-late"])
def pdl_on(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch on: as shipped ("default": the tensor-core launches without
    it), or the tensor-core path's launches with it too (a bench's switch), small_linear's
    weights prefetched to L2 or not, the tensor-core launches' dependents let start at once or
    after their K loop."""
    monkeypatch.setattr(triton_jit, "PDL_SWITCH", "1")
    if request.param == "default":
        return
    monkeypatch.setattr(small_linear_tiles, "PDL_ON_TENSOR_CORES", True)
    monkeypatch.setattr(small_linear_tiles, "PREFETCH", request.param != "wait-first")
    monkeypatch.setattr(small_linear_tiles, "PDL_TRIGGER_LATE", request.param == "trigger-late")


def without_pdl(fn: Callable[[], T]) -> T:
    """fn() with the switch off (the reference launches)."""
    before, triton_jit.PDL_SWITCH = triton_jit.PDL_SWITCH, "0"
    try:
        return fn()
    finally:
        triton_jit.PDL_SWITCH = before


@pytest.mark.parametrize("num_rows", [1, 4, 9, 16])
@pytest.mark.parametrize("op", [*OPS, "qkv_rope_store"])
def test_small_linear_with_pdl_is_bitwise_without(pdl_on: None, op: str, num_rows: int) -> None:
    """Each op's PDL build (and its RoPE + K/V store: q and the cache) against the launch
    without PDL, on inputs made before (the races are the chain test's)."""
    assert triton_jit.pdl(torch.device("cuda"))
    inputs = make_inputs(num_rows, bias=True)
    if op == "qkv_rope_store":
        caches = [torch.zeros(2, 64, 3, 64, dtype=torch.bfloat16, device="cuda") for _ in "ab"]

        def qkv(cache: torch.Tensor) -> torch.Tensor:
            rope = rope_inputs(num_rows, cache)
            x, weight, bias = inputs["hidden"], inputs["qkv"], inputs["qkv_bias"]
            norm = inputs["norm_weight"]
            assert x is not None and weight is not None and norm is not None
            return sl.norm_linear_rope_store(x, norm, EPS, weight, bias, rope)

        want = without_pdl(lambda: qkv(caches[1]))
        assert torch.equal(qkv(caches[0]), want) and torch.equal(caches[0], caches[1])
        return
    want = without_pdl(lambda: run(op, inputs))
    assert torch.equal(run(op, inputs), want)


def test_dependent_chain_in_a_graph_is_bitwise_without_pdl(pdl_on: None) -> None:
    """Sixty launches, each reading the one before's output at once (a residual stream through
    o_proj- and gate_up-shaped kernels at 1 and 9 rows), captured with PDL, replayed on new
    inputs: every replay equals the chain launched without PDL."""
    for num_rows in (1, 9):
        static = make_inputs(num_rows, bias=False, seed=num_rows)
        hidden = static["hidden"]
        assert hidden is not None

        def chain(x: torch.Tensor = hidden, t: dict = static) -> torch.Tensor:
            for _ in range(20):
                x = sl.linear_residual(x, t["o"], None, x)
                act = sl.norm_linear_silu_mul(x, t["norm_weight"], EPS, t["gate_up"], None)
                x = sl.linear_residual(act, t["down"], None, x)
            return x

        chain()  # built before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for seed in (1, 2, 3):
            new = make_inputs(num_rows, bias=False, seed=100 + seed)["hidden"]
            assert new is not None
            hidden.copy_(new)
            graph.replay()
            want = without_pdl(chain)
            assert torch.equal(out, want), (num_rows, seed)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_attention_with_pdl_is_bitwise_without(pdl_on: None, num_splits: int) -> None:
    """Decode at batch 4 over 300 keys a sequence, GQA 3, in a graph behind the PDL kernel that
    writes its queries (a 4-row o_proj-shaped small-linear launch, which lets its dependent
    start at once): equal to the launches without PDL (single pass and split with its
    merge)."""
    gen = torch.Generator().manual_seed(0)
    num_seqs, kv_len, page = 4, 300, 16
    pages = -(-kv_len // page)
    k_cache, v_cache = (
        torch.randn(num_seqs * pages * page, 3, 64, generator=gen).to("cuda", torch.bfloat16)
        for _ in range(2)
    )
    block_table = torch.randperm(num_seqs * pages, generator=gen).view(num_seqs, pages)
    meta = {
        "cu_seqlens_q": torch.arange(num_seqs + 1, dtype=torch.int32),
        "kv_lens": torch.full((num_seqs,), kv_len, dtype=torch.int32),
        "prefix_lens": torch.full((num_seqs,), kv_len - 1, dtype=torch.int32),
        "block_table": block_table.to(torch.int32),
    }
    meta = {name: t.cuda() for name, t in meta.items()}
    source = torch.randn(num_seqs, 9 * 64, generator=gen).to("cuda", torch.bfloat16)
    weight = (torch.randn(9 * 64, 9 * 64, generator=gen) / 24).to("cuda", torch.bfloat16)

    def step() -> torch.Tensor:
        q = sl.linear_residual(source, weight, None, source).view(num_seqs, 9, 64)
        return paged_attention(
            q, k_cache, v_cache, meta["cu_seqlens_q"], meta["kv_lens"], meta["prefix_lens"],
            meta["block_table"], page, None, 1, 0.125, num_splits=num_splits,
        )  # fmt: skip

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        source.copy_(torch.randn(num_seqs, 9 * 64, generator=gen).to("cuda", torch.bfloat16))
        graph.replay()
        assert torch.equal(out, without_pdl(step)), seed


def test_rope_store_with_pdl_is_bitwise_without(pdl_on: None) -> None:
    """RoPE + K/V store at 4 rows (SmolLM2's heads), behind the PDL kernel that writes its q, k
    and v (a 4-row small-linear launch, its dependent let start at once): q and the cache as
    the launches without PDL leave them."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to("cuda", torch.bfloat16)

    source, weight = randn(4, 576), randn(15 * 64, 576, scale=576**-0.5)
    norm = 1 + randn(576, scale=0.1)
    cos, sin = randn(4, 64), randn(4, 64)
    slots = torch.randperm(40, generator=gen)[:4].cuda()
    caches = [torch.zeros(2, 40, 3, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2)]

    def step(cache: torch.Tensor) -> torch.Tensor:
        qkv = sl.norm_linear(source, norm, EPS, weight).view(4, 15, 64)
        q, k, v = qkv.split([9, 3, 3], dim=1)
        return rope_store(q, k, v, cos, sin, cache[0], cache[1], slots)

    got = step(caches[0])
    want = without_pdl(lambda: step(caches[1]))
    assert torch.equal(got, want) and torch.equal(caches[0], caches[1])


@pytest.mark.raw_kv
def test_model_graphs_with_pdl_equal_graphs_without(
    pdl_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random SmolLM2-shaped model (4 layers), graphs of decode (1 token) and verify (5 tokens)
    steps of one or two sequences, the small-linear path up to 16 rows (1-2 rows broadcast,
    5-10 on tensor cores): the graphs captured with PDL give the logits and the K/V of the
    graphs captured without it, bit for bit."""
    monkeypatch.setattr(llama, "SMALL_LINEAR_ROWS", 16)
    config, hf = smollm2_layers()
    model = LlamaModel.from_state_dict(
        config, state_dict_from_hf(config, hf.state_dict(), torch.bfloat16, "cuda"), "cuda"
    )
    caches = [
        make_kv_cache(config, num_pages=32, page_size=16, dtype=torch.bfloat16, device="cuda")
        for _ in range(2)
    ]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (40, 57)]
    seqs = new_seqs(caches[0], [120, 120], random.Random(0))  # the other's slots alike
    prefill = make_batch([causal_step(s, p) for s, p in zip(seqs, prompts, strict=True)])
    for kv in caches:
        model(prefill.to("cuda"), kv)
    for seq, prompt in zip(seqs, prompts, strict=True):
        seq.kv_committed_len = len(prompt)
    runners = []
    for kv, switch in zip(caches, ("0", "1"), strict=True):
        monkeypatch.setattr(triton_jit, "PDL_SWITCH", switch)  # read at capture
        runner = CudaGraphRunner.for_model(model, kv, 256, max_batch_size=2, max_query_len=5)
        for q in (1, 5):
            runner.capture(q)
        runners.append(runner)
    for q_len, num_seqs in ((1, 2), (5, 2), (1, 1), (5, 1), (1, 2)):
        tokens = [torch.randint(0, 2048, (q_len,), generator=gen).tolist() for _ in seqs]
        steps = zip(seqs[:num_seqs], tokens[:num_seqs], strict=True)
        batch = make_batch([causal_step(s, t) for s, t in steps])
        without, with_pdl = (runner.forward(batch) for runner in runners)
        assert without is not None and with_pdl is not None
        assert torch.equal(with_pdl.logits, without.logits), (q_len, num_seqs)
        for seq in seqs[:num_seqs]:
            seq.kv_committed_len += q_len
        # every committed token's K and V in every layer (a graph's padding rows write a
        # scratch slot, from buffers each runner fills its own way)
        slots = torch.cat([seq.slots(0, seq.kv_committed_len) for seq in seqs]).cuda()
        assert torch.equal(caches[1].data[:, :, slots], caches[0].data[:, :, slots]), q_len
