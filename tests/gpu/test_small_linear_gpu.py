"""On a CUDA device: the small-linear Triton kernels match their references in bfloat16 on
SmolLM2-135M's projections at 1 to 16 rows, build one kernel per row class, replay from a CUDA
graph when their inputs change, and a SmolLM2-shaped model's steps replayed from the engine's
CUDA graphs through `forward_small` give the logits and greedy tokens of eager steps through
`forward`. Skipped where there is no GPU (CI)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specsplit.kernels import small_linear as sl
from specsplit.kernels import small_linear_kernels, small_linear_tiles
from specsplit.model import llama
from specsplit.model.config import ModelConfig
from specsplit.model.cuda_graphs import CudaGraphRunner
from specsplit.model.llama import DecoderLayer, LlamaModel, make_kv_cache, state_dict_from_hf
from tests.forward_steps import causal_step, make_batch, new_seqs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HIDDEN, INTER, EPS = 576, 1536, 1e-5
QKV = (9 + 2 * 3) * 64  # SmolLM2: 9 query heads, 3 KV heads of 64
# bfloat16: the GEMMs' summation order differs from cuBLAS's, so a result may round one ulp
# the other way (2^-8 relative), and a residual add near cancellation keeps that ulp
ATOL, RTOL = 2e-2, 1.6e-2
Inputs = dict[str, torch.Tensor | None]


def make_inputs(num_rows: int, bias: bool, seed: int = 0) -> Inputs:
    """SmolLM2's projections' inputs in bfloat16, O(1) values (its hidden states are larger)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to("cuda", torch.bfloat16)

    return {
        "hidden": randn(num_rows, HIDDEN, scale=3.0),
        "norm_weight": 1 + randn(HIDDEN, scale=0.2),
        "qkv": randn(QKV, HIDDEN, scale=HIDDEN**-0.5),
        "qkv_bias": randn(QKV, scale=0.5) if bias else None,
        "attn": randn(num_rows, HIDDEN),
        "o": randn(HIDDEN, HIDDEN, scale=HIDDEN**-0.5),
        "gate_up": randn(2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
        "gate_up_bias": randn(2 * INTER, scale=0.5) if bias else None,
        "act": randn(num_rows, INTER),
        "down": randn(HIDDEN, INTER, scale=INTER**-0.5),
        "down_bias": randn(HIDDEN, scale=0.5) if bias else None,
    }


# name -> (kernel, its reference, its arguments from a set of inputs)
OPS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Any]] = {
    "qkv_norm_linear": (
        sl.norm_linear,
        sl.norm_linear_reference,
        lambda t: (t["hidden"], t["norm_weight"], EPS, t["qkv"], t["qkv_bias"]),
    ),
    "o_linear_residual": (
        sl.linear_residual,
        sl.linear_residual_reference,
        lambda t: (t["attn"], t["o"], None, t["hidden"]),
    ),
    "gate_up_norm_linear_silu_mul": (
        sl.norm_linear_silu_mul,
        sl.norm_linear_silu_mul_reference,
        lambda t: (t["hidden"], t["norm_weight"], EPS, t["gate_up"], t["gate_up_bias"]),
    ),
    "down_linear_residual": (
        sl.linear_residual,
        sl.linear_residual_reference,
        lambda t: (t["act"], t["down"], t["down_bias"], t["hidden"]),
    ),
}


def run(op: str, inputs: Inputs, reference: bool = False) -> torch.Tensor:
    kernel, ref, args = OPS[op]
    return (ref if reference else kernel)(*args(inputs))


@pytest.mark.parametrize("bias", [False, True])
# (17 and 32 rows where $SPECSPLIT_SMALL_LINEAR_BROADCAST_ROWS=32 or _DOT_ROWS=32 lets a
# launch take them; with $SPECSPLIT_SMALL_LINEAR_DOT_TILES the tensor-core launches take its tiles)
@pytest.mark.parametrize(
    "num_rows", [1, 4, 9, 16, *(r for r in (17, 32) if r <= small_linear_tiles.MAX_ROWS)]
)
@pytest.mark.parametrize("op", list(OPS))
def test_kernel_matches_reference(op: str, num_rows: int, bias: bool) -> None:
    inputs = make_inputs(num_rows, bias)
    got, want = run(op, inputs), run(op, inputs, reference=True)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def rope_inputs(num_rows: int, cache: torch.Tensor) -> sl.RopeStore:
    """SmolLM2's RoPE at positions 5.. and `cache` ([2, 64 slots, 3 KV heads, 64]), the rows'
    slots scattered over it."""
    gen = torch.Generator().manual_seed(num_rows)
    angles = torch.arange(5, 5 + num_rows)[:, None] * torch.rand(32, generator=gen)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = (t.to("cuda", torch.bfloat16) for t in (emb.cos(), emb.sin()))
    slots = torch.randperm(64, generator=gen)[:num_rows].cuda()
    return sl.RopeStore(cos, sin, cache[0], cache[1], slots, 9)


@pytest.mark.parametrize("num_rows", [1, 4, 9, 16])
def test_qkv_rope_store_matches_reference(num_rows: int) -> None:
    """norm_linear_rope_store in bfloat16: q and the cache rows the reference writes, every
    other slot untouched."""
    inputs = make_inputs(num_rows, bias=True)
    x, weight, bias, norm = (
        inputs["hidden"],
        inputs["qkv"],
        inputs["qkv_bias"],
        inputs["norm_weight"],
    )
    assert x is not None and weight is not None and norm is not None
    caches = [torch.randn(2, 64, 3, 64).to("cuda", torch.bfloat16) for _ in "ab"]
    caches[1].copy_(caches[0])
    got_rope, want_rope = (rope_inputs(num_rows, cache) for cache in caches)
    got = sl.norm_linear_rope_store(x, norm, EPS, weight, bias, got_rope)
    want = sl.norm_linear_rope_store_reference(x, norm, EPS, weight, bias, want_rope)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(caches[0], caches[1], atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(
    small_linear_tiles.BROADCAST_ROWS != 4,
    reason="the default row classes (SMALL_LINEAR_BROADCAST_ROWS)",
)
def test_one_kernel_serves_each_row_class() -> None:
    """The row count is not specialised: 5 to 16 rows (tensor cores) reuse one kernel, and so do
    3 and 4 rows (BLOCK_M 4)."""
    kernel = small_linear_kernels.jitted_kernel(False)

    def built() -> int:
        return sum(len(caches[0]) for caches in kernel.device_caches.values())

    run("o_linear_residual", make_inputs(9, False))
    run("o_linear_residual", make_inputs(3, False))
    before = built()
    for num_rows in (4, 5, 8, 12, 16):
        run("o_linear_residual", make_inputs(num_rows, False, seed=num_rows))
    assert built() == before


def test_cuda_graph_replay_follows_new_inputs() -> None:
    """A layer's four projections captured once over fixed buffers (the attention output stands
    in for attention), replayed after new inputs are copied in: each output matches its
    reference every time (no host sync in the wrappers)."""
    static = make_inputs(9, True, seed=1)
    hidden, attn = static["hidden"], static["attn"]
    assert hidden is not None and attn is not None

    def layer() -> tuple[torch.Tensor, ...]:
        qkv = sl.norm_linear(hidden, static["norm_weight"], EPS, static["qkv"], static["qkv_bias"])
        mid = sl.linear_residual(attn, static["o"], None, hidden)
        act = sl.norm_linear_silu_mul(
            mid, static["norm_weight"], EPS, static["gate_up"], static["gate_up_bias"]
        )
        return qkv, mid, act, sl.linear_residual(act, static["down"], static["down_bias"], mid)

    layer()  # build before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = layer()
    for seed in (2, 3):
        new = make_inputs(9, True, seed=seed)
        for name in ("hidden", "attn"):
            static[name].copy_(new[name])  # type: ignore[union-attr]
        graph.replay()
        qkv, mid, act, out = outputs
        want_mid = sl.linear_residual_reference(attn, static["o"], None, hidden)
        want_qkv = run("qkv_norm_linear", static, reference=True)
        torch.testing.assert_close(qkv, want_qkv, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(mid, want_mid, atol=ATOL, rtol=RTOL)
        want_act = sl.norm_linear_silu_mul_reference(
            mid, static["norm_weight"], EPS, static["gate_up"], static["gate_up_bias"]
        )
        torch.testing.assert_close(act, want_act, atol=ATOL, rtol=RTOL)
        want_out = sl.linear_residual_reference(act, static["down"], static["down_bias"], mid)
        torch.testing.assert_close(out, want_out, atol=ATOL, rtol=RTOL)


def smollm2_layers(num_layers: int = 4) -> tuple[ModelConfig, LlamaForCausalLM]:
    """A random SmolLM2-shaped model of `num_layers` layers (seed 0, a 2048-token vocabulary),
    float32 on the CPU, and our config of it."""
    torch.manual_seed(0)
    hf_config = LlamaConfig(
        vocab_size=2048, hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=num_layers, num_attention_heads=9, num_key_value_heads=3,
        tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=EPS,
        max_position_embeddings=512,
    )  # fmt: skip
    return ModelConfig.from_hf(hf_config), LlamaForCausalLM(hf_config).eval()


@pytest.mark.raw_kv
def test_graph_steps_equal_eager_layer_path_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A random SmolLM2-shaped model (4 layers): decode and verify steps of two sequences
    replayed from CudaGraphRunner's graphs (captured through forward_small) against the same
    steps run eagerly through `forward` (SPECSPLIT_SMALL_LINEAR=0), both in bfloat16, with the
    same model in float32 as the yardstick: the graphs' logits are no farther from float32's
    than the eager bf16 path's are (both sum in another order, so neither is exact), and give
    the same greedy token wherever the float32 logits' top two are clearly apart."""
    config, hf = smollm2_layers()
    state = state_dict_from_hf(config, hf.state_dict(), torch.bfloat16, "cuda")
    state["embed_tokens.weight"] *= 8  # the tied LM head too: logits ~4, not ~0.5, apart
    model = LlamaModel.from_state_dict(config, state, "cuda")
    state32 = {name: t.float() for name, t in state.items()}  # the same (bf16) weights
    model32 = LlamaModel.from_state_dict(config, state32, "cuda")
    kv = make_kv_cache(config, num_pages=32, page_size=16, dtype=torch.bfloat16, device="cuda")
    kv32 = make_kv_cache(config, num_pages=32, page_size=16, dtype=torch.float32, device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (40, 57)]
    seqs = new_seqs(kv, [120, 120], random.Random(0))  # kv32's slots are laid out alike
    prefill = make_batch([causal_step(s, p) for s, p in zip(seqs, prompts, strict=True)])
    model(prefill.to("cuda"), kv)
    model32(prefill.to("cuda"), kv32)
    for seq, prompt in zip(seqs, prompts, strict=True):
        seq.kv_committed_len = len(prompt)

    runner = CudaGraphRunner.for_model(model, kv, 256, max_batch_size=2, max_query_len=5)
    captured: list[int] = []
    forward_small = DecoderLayer.forward_small

    def spy(layer: DecoderLayer, *args: Any) -> torch.Tensor:
        captured.append(layer.layer_index)
        return forward_small(layer, *args)

    with monkeypatch.context() as patch:
        patch.setattr(DecoderLayer, "forward_small", spy)
        patch.setattr(llama, "SMALL_LINEAR", True)  # SPECSPLIT_SMALL_LINEAR=1
        for q in (1, 5):
            runner.capture(q)
    assert captured and set(captured) == {0, 1, 2, 3}  # every graph (T <= 10) runs it

    num_checked = 0
    for q_len, num_seqs in ((1, 2), (5, 2), (1, 1), (5, 1), (1, 2)):
        tokens = [torch.randint(0, 2048, (q_len,), generator=gen).tolist() for _ in seqs]
        steps = zip(seqs[:num_seqs], tokens[:num_seqs], strict=True)
        batch = make_batch([causal_step(s, t) for s, t in steps])
        before = kv.data.clone()
        got = runner.forward(batch)
        assert got is not None, "no captured graph took the step"
        kv.data.copy_(before)
        with monkeypatch.context() as patch:
            patch.setattr(llama, "SMALL_LINEAR", False)
            want = model(batch.to("cuda"), kv)
        exact = model32(batch.to("cuda"), kv32).logits
        # both bf16 paths round each op to bfloat16 (an ulp at logits ~10 is 1/16): each is
        # ~0.02 from float32 on average; the graphs' path may not be farther than 1.25x eager's
        err_graphs = (got.logits - exact).abs().mean().item()
        err_eager = (want.logits - exact).abs().mean().item()
        assert err_graphs <= 1.25 * err_eager + 1e-3, (err_graphs, err_eager)
        torch.testing.assert_close(got.logits, want.logits, atol=0.25, rtol=2e-2)
        top2 = exact.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 0.5  # apart by more than the bf16 paths' noise
        assert torch.equal(got.logits.argmax(-1)[clear], exact.argmax(-1)[clear])
        assert torch.equal(want.logits.argmax(-1)[clear], exact.argmax(-1)[clear])
        num_checked += int(clear.sum())
        for seq in seqs[:num_seqs]:
            seq.kv_committed_len += q_len
    assert num_checked >= 5  # of 20 rows: the greedy check is not vacuous
