"""On a CUDA device: the RoPE + K/V store Triton kernel matches the reference run in the same
dtype (bfloat16, float16) on SmolLM2's and Llama-8B's head layouts at 1 to 512 tokens (bit for
bit, in fact), builds one kernel for every token count, and replays correctly from a CUDA graph
when its inputs change. Skipped where there is no GPU (CI)."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.rope_store import _jitted_kernel, rope_store, rope_store_reference
from specsplit.model.rope import rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NUM_SLOTS = 4096
SCRATCH_SLOT = NUM_SLOTS - 1  # where CUDA-graph padding tokens write
SENTINEL = 7.0
ATOL = RTOL = 1.6e-2  # bfloat16's (torch.testing's rtol for it), though the bits match too
LAYOUTS = {  # (num_heads, num_kv_heads, head_dim)
    "smollm2": (9, 3, 64),
    "llama-8b": (32, 8, 128),
}
Step = dict[str, torch.Tensor]


def make_step(
    layout: str, num_tokens: int, dtype: torch.dtype, seed: int = 0
) -> tuple[Step, torch.Tensor]:
    """rope_store's arguments on CUDA (q/k/v views of one qkv row, the caches layer 1 of a
    3-layer pool, distinct shuffled slots, the last token a padding one) and that pool,
    [3, 2, num_slots, Hk, D], SENTINEL-filled."""
    num_heads, num_kv_heads, head_dim = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    kv_width = num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, num_heads * head_dim + 2 * kv_width, generator=gen)
    qkv = qkv.to("cuda", dtype)
    q, k, v = qkv.split([num_heads * head_dim, kv_width, kv_width], dim=-1)
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen).cuda()
    cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, 500000.0, None).cuda(), dtype)
    slots = torch.randperm(NUM_SLOTS - 1, generator=gen)[:num_tokens]
    slots[-1] = SCRATCH_SLOT
    pool = torch.full((3, 2, NUM_SLOTS, num_kv_heads, head_dim), SENTINEL, dtype=dtype)
    pool = pool.cuda()
    step = {
        "q": q.view(num_tokens, num_heads, head_dim),
        "k": k.view(num_tokens, num_kv_heads, head_dim),
        "v": v.view(num_tokens, num_kv_heads, head_dim),
        "cos": cos,
        "sin": sin,
        "k_cache": pool[1, 0],
        "v_cache": pool[1, 1],
        "slot_mapping": slots.cuda(),
    }
    return step, pool


def reference(step: Step, pool_before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, pool) of the reference run on a copy of the step's pool before the kernel."""
    pool = pool_before.clone()
    q = rope_store_reference(**{**step, "k_cache": pool[1, 0], "v_cache": pool[1, 1]})
    return q, pool


def assert_matches(
    got_q: torch.Tensor, step: Step, pool: torch.Tensor, pool_before: torch.Tensor
) -> None:
    """The kernel's q and pool (`pool`, written from `pool_before`) are the reference's."""
    want_q, want_pool = reference(step, pool_before)
    torch.testing.assert_close(got_q, want_q, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(pool, want_pool, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_tokens", [1, 8, 37, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernel_matches_reference(layout: str, dtype: torch.dtype, num_tokens: int) -> None:
    step, pool = make_step(layout, num_tokens, dtype)
    before = pool.clone()
    got = rope_store(**step)
    assert got.dtype == dtype and got.is_contiguous()
    assert_matches(got, step, pool, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rounding_is_the_references_bit_for_bit(dtype: torch.dtype) -> None:
    """Not only close: each product and the sum rounded to the activation dtype as torch's CUDA
    ops round them (no fused multiply-add in float32), so the kernel's bits are the reference's
    (torch.compile's version rounds once and differs by up to an ulp)."""
    step, pool = make_step("llama-8b", 37, dtype)
    before = pool.clone()
    got = rope_store(**step)
    want_q, want_pool = reference(step, before)
    assert torch.equal(got, want_q)
    assert torch.equal(pool, want_pool)


def test_one_kernel_serves_every_token_count() -> None:
    """T is the grid's alone: steps of 1 to 512 tokens reuse the first step's kernel."""
    kernel = _jitted_kernel(False)
    rope_store(**make_step("smollm2", 3, torch.bfloat16)[0])
    built = sum(len(caches[0]) for caches in kernel.device_caches.values())
    for num_tokens in (1, 8, 37, 512):
        rope_store(**make_step("smollm2", num_tokens, torch.bfloat16, seed=num_tokens)[0])
    assert sum(len(caches[0]) for caches in kernel.device_caches.values()) == built


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_graph_replay_follows_new_inputs(layout: str) -> None:
    """Captured once over fixed buffers, replayed after new q/k/v, cos/sin and slots are copied
    in: the output and the cache match the reference each time (no host sync in the wrapper)."""
    static, pool = make_step(layout, 8, torch.bfloat16, seed=1)
    before = pool.clone()
    out = torch.empty_like(static["q"])
    rope_store(**static, out=out)  # build before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # synchronizes the device first
        rope_store(**static, out=out)
    for seed in (2, 3):
        new, _ = make_step(layout, 8, torch.bfloat16, seed=seed)
        for name in ("q", "k", "v", "cos", "sin", "slot_mapping"):
            static[name].copy_(new[name])
        pool.copy_(before)
        graph.replay()
        assert_matches(out, static, pool, before)
