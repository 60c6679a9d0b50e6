"""RoPE on a step's q and k and the store of its k and v into the paged cache, as one kernel.

`rope_store` launches one Triton program per token that rotates all of the token's q and k heads
(the HF rotate_half convention of specsplit/model/rope.py), writes the rotated q to its output
and the rotated k and the raw v to the cache rows at slot_mapping[token]: one launch per decoder
layer, where torch.compile makes ~3 of `rope_store_reference`, the plain-torch version beside
it (the CPU path and what the kernel is tested against).

Arithmetic as the reference's: `x * cos + rotate_half(x) * sin` in the activation dtype, i.e.
each product and the sum rounded to that dtype (computed in float32 and rounded after each op,
as torch's CUDA kernels do; fp contraction is off, so float32 gets no fused multiply-add). The
launch depends on host ints only (T sets the grid; no stride follows the batch), so it can be
captured in a CUDA graph and one built kernel serves every batch of a model.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, NoReturn

import torch

from specsplit.kernels.triton_jit import (
    check_device,
    interpreting,
    jit,
    next_power_of_2,
    pdl,
    pdl_launch,
)
from specsplit.model.rope import apply_rotary

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)


def rope_store_reference(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> torch.Tensor:
    """RoPE on q and k, k and v written to the cache at slot_mapping; returns the rotated q."""
    k = apply_rotary(k, cos, sin)
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return apply_rotary(q, cos, sin)


def _rope_store_kernel(
    q_ptr,  # [T, NUM_HEADS, HEAD_DIM]
    k_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM]
    v_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM]
    cos_ptr,  # [T, HEAD_DIM]
    sin_ptr,  # [T, HEAD_DIM]
    out_ptr,  # [T, NUM_HEADS, HEAD_DIM] the rotated q
    k_cache_ptr,  # [num_slots, NUM_KV_HEADS, HEAD_DIM]
    v_cache_ptr,  # [num_slots, NUM_KV_HEADS, HEAD_DIM]
    slot_mapping_ptr,  # [T] int64
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_cos_t,
    stride_sin_t,
    stride_o_t,
    stride_o_h,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    stride_slot,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,  # next power of two >= NUM_HEADS + NUM_KV_HEADS
    BLOCK_KV: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (triton_jit.pdl)
):
    if PDL:  # every program waits for the projection before it (q, k, v)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token * stride_slot)
    act = q_ptr.dtype.element_ty  # the activation dtype: products and sums are rounded to it
    offs_d = tl.arange(0, HEAD_DIM)

    # rotate_half(x)[d] is -x[d + HEAD_DIM/2] in the first half, x[d - HEAD_DIM/2] in the second:
    # each column reads its partner column, and sin carries the sign
    partner = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    cos = tl.load(cos_ptr + token * stride_cos_t + offs_d).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin_t + offs_d).to(tl.float32)
    sin = tl.where(offs_d < HEAD_DIM // 2, -sin, sin)

    # the token's q heads, then its k heads, as the rows of one tile, rotated together
    rows = tl.arange(0, BLOCK_ROWS)
    is_q = rows < NUM_HEADS
    kv_head = rows - NUM_HEADS  # a k row's head (negative on q rows: masked off there)
    is_k = (kv_head >= 0) & (kv_head < NUM_KV_HEADS)
    src = tl.where(
        is_q,
        q_ptr + token * stride_q_t + rows * stride_q_h,
        k_ptr + token * stride_k_t + kv_head * stride_k_h,
    )[:, None]  # [BLOCK_ROWS, 1]
    row_ok = (is_q | is_k)[:, None]
    x = tl.load(src + offs_d[None, :], mask=row_ok, other=0.0).to(tl.float32)
    x_partner = tl.load(src + partner[None, :], mask=row_ok, other=0.0).to(tl.float32)
    x_cos = (x * cos[None, :]).to(act).to(tl.float32)
    partner_sin = (x_partner * sin[None, :]).to(act).to(tl.float32)
    rotated = (x_cos + partner_sin).to(act)  # [BLOCK_ROWS, HEAD_DIM]

    tl.store(
        out_ptr + token * stride_o_t + rows[:, None] * stride_o_h + offs_d[None, :],
        rotated,
        mask=is_q[:, None],
    )
    tl.store(
        k_cache_ptr + slot * stride_kc_s + kv_head[:, None] * stride_kc_h + offs_d[None, :],
        rotated.to(k_cache_ptr.dtype.element_ty),
        mask=is_k[:, None],
    )

    heads = tl.arange(0, BLOCK_KV)
    head_ok = (heads < NUM_KV_HEADS)[:, None]
    v_rows = v_ptr + token * stride_v_t + heads[:, None] * stride_v_h  # [BLOCK_KV, 1]
    v = tl.load(v_rows + offs_d[None, :], mask=head_ok)
    tl.store(
        v_cache_ptr + slot * stride_vc_s + heads[:, None] * stride_vc_h + offs_d[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=head_ok,
    )


@functools.cache
def _jitted_kernel(interpret: bool) -> Any:
    """The kernel, decorated as TRITON_INTERPRET asks (`interpret` is the cache key). Every
    integer argument is a stride fixed by the model's layout (the qkv row width, the cache's),
    the same at every batch, so none is left unspecialised: T is the grid's alone."""
    return jit(_rope_store_kernel)


def rope_store(
    q: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous (a view of qkv is fine)
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], last dim contiguous
    v: torch.Tensor,  # [T, num_kv_heads, head_dim], last dim contiguous
    cos: torch.Tensor,  # [T, head_dim], q's dtype
    sin: torch.Tensor,  # [T, head_dim], q's dtype
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], last dim contiguous
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], k_cache's dtype
    slot_mapping: torch.Tensor,  # [T] int64, the cache row of each token
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim] q's dtype; written if given
) -> torch.Tensor:
    """`rope_store_reference` as one kernel launch: checks the inputs (shapes, dtypes, devices,
    strides; no host syncs, so it can be captured in a CUDA graph), writes k and v to the
    cache and returns the rotated q (`out`, or a new contiguous tensor). Tokens that share a
    slot (CUDA-graph padding) must bring the same k and v: which one lands is not defined."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("rope_store needs triton; use rope_store_reference")
    interpret = interpreting()
    _check_inputs(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, out, interpret)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return out
    num_kv_heads = k.shape[1]
    block_rows = next_power_of_2(num_heads + num_kv_heads)
    dependent = pdl(q.device)
    _jitted_kernel(interpret)[(num_tokens,)](
        q, k, v, cos, sin, out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        slot_mapping.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_ROWS=block_rows,
        BLOCK_KV=next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, PDL=dependent,
        num_warps=1 if interpret else _num_warps(block_rows * head_dim),
        enable_fp_fusion=False, **pdl_launch(dependent),
    )  # fmt: skip
    return out


def _num_warps(tile: int) -> int:
    """Warps for a [BLOCK_ROWS, HEAD_DIM] tile: about 8 elements per thread and load."""
    return min(max(tile // 256, 1), 8)


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor | None,
    interpret: bool,
) -> None:
    """Everything checkable from shapes, dtypes and strides alone (the slots live on the
    device). Messages are built only on failure: this runs before every launch."""

    def fail(what: str) -> NoReturn:
        raise ValueError(f"rope_store: {what}")

    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        fail(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: 3-D, k and v alike")
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        fail(f"k {tuple(k.shape)} must be [T={num_tokens}, num_kv_heads, {head_dim}]")
    if head_dim < 2 or head_dim & (head_dim - 1):
        fail(f"head_dim must be a power of two >= 2, got {head_dim}")
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        fail(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [{num_tokens}, "
             f"{head_dim}]")  # fmt: skip
    if q.dtype not in _ACT_DTYPES or any(t.dtype != q.dtype for t in (k, v, cos, sin)):
        fail(f"q, k, v, cos, sin: one of float16/bfloat16/float32, got {q.dtype}, {k.dtype}, "
             f"{v.dtype}, {cos.dtype}, {sin.dtype}")  # fmt: skip
    if k_cache.dim() != 3 or k_cache.shape[1:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        fail(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
             f"[num_slots, {k.shape[1]}, {head_dim}]")  # fmt: skip
    if k_cache.dtype != v_cache.dtype or not k_cache.dtype.is_floating_point:
        fail(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype}: one floating dtype")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        fail(f"slot_mapping must be [T={num_tokens}] int64, got {tuple(slot_mapping.shape)} "
             f"{slot_mapping.dtype}")  # fmt: skip
    tensors = [q, k, v, cos, sin, k_cache, v_cache]
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            fail(f"out {tuple(out.shape)} {out.dtype} must be like q {tuple(q.shape)} {q.dtype}")
        tensors.append(out)
    if any(t.stride(-1) != 1 for t in tensors):
        fail(f"last dims must be contiguous, strides {[t.stride() for t in tensors]}")
    tensors.append(slot_mapping)
    check_device("rope_store", tensors, interpret)


_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
