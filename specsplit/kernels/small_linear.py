"""Projections of a few token rows (decode and verify steps) with their pointwise neighbours
fused in: a decoder layer as four of these kernels around RoPE and attention.

At batch 1 a small model's step is bound by its kernel count, not by its weight reads (SmolLM2 on
an H100: 333 kernels, 0.83 ms of GPU time for a ~0.1 ms floor). Each projection here is one
launch that also does what sits next to it in the layer:

    norm_linear           RMSNorm(x) @ W.T (+ b)             qkv: input_layernorm as a prologue
    linear_residual       residual + (x @ W.T (+ b))         o_proj, down_proj: the residual add
    norm_linear_silu_mul  silu(g) * u, [g | u] = RMSNorm(x) @ W.T (+ b)     gate_up
    norm_linear_rope_store  qkv = RMSNorm(x) @ W.T (+ b), then RoPE on q and k, k and v to the
                          paged cache (rope_store's arithmetic): the q heads are returned

so a layer is norm_linear_rope_store, attention, linear_residual, norm_linear_silu_mul,
linear_residual: 5 kernels (6 with split-KV attention) where it was 9 (10); 6 (7) where the
qkv projection cannot take RoPE (q/k norms, Qwen3) and runs as norm_linear, then rope_store.
For RoPE a program's columns are pairs: column d of a head and its rotate_half partner
d + head_dim / 2 (two weight row sets, as gate and up are for silu-and-mul). Each has a plain-torch
reference beside it (`*_reference`), the arithmetic of the unfused layer (specsplit/model/fused.py
and linear.py): RMSNorm statistics in float32, `weight * x32.to(dtype)`, the GEMM rounded to the
activation dtype, then silu-and-mul or the residual add in that dtype, each op rounded as torch
rounds it (fp contraction off). Only the GEMM's summation order differs from cuBLAS's.

The wrappers here check the inputs and launch one Triton kernel, its ops chosen by constexpr
flags, in specsplit/kernels/small_linear_kernels.py (its docstring says how a program divides
the work). The path (a broadcast multiply on CUDA cores or tensor cores) and the tiles a launch
of N rows takes come from small_linear_tiles.py (tiles_for), with the benches' switches
($SPECSPLIT_SMALL_LINEAR_*). No host syncs: capturable in a CUDA graph.

Measured on an H100 (random SmolLM2-135M-shaped bf16, 512-token context, bench/profile_step.py,
A/B with SPECSPLIT_SMALL_LINEAR=0 / 1 in one call): decode at batch 1, 333 -> 242 kernels and
0.847 -> 0.656 ms of GPU time a step; verify 1 + 8 at batch 1 (9 rows), 384 -> 293 kernels,
1.000 -> 0.960 ms; decode at batch 8, 0.901 -> 0.874 ms. Per call inside the graphs 3.2 us on the
broadcast path (1 row) and 4.6 us on the tensor-core path (8-9 rows), where cuBLAS's GEMM alone
took 3.6-4.0 us: the tensor-core path's tiles (16 columns: 36-96 programs) are untuned. With
RoPE + K/V store fused into the qkv kernel: 212 kernels, 0.630 ms of GPU time, 0.97 ms a step.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple, NoReturn

import torch
import torch.nn.functional as F

from specsplit.kernels import small_linear_tiles as tiling
from specsplit.kernels.pointwise import rms_norm_reference
from specsplit.kernels.rope_store import rope_store_reference
from specsplit.kernels.small_linear_kernels import jitted_kernel
from specsplit.kernels.triton_jit import (
    check_device,
    interpreting,
    next_power_of_2,
    pdl,
    pdl_launch,
)
from specsplit.model.linear import linear

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# plain-torch references: the unfused layer's arithmetic
# ---------------------------------------------------------------------------------------------


def norm_linear_reference(
    x: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:
    """[M, N] RMSNorm(x) @ weight.T + bias."""
    return linear(rms_norm_reference(x, norm_weight, eps), weight, bias)


def norm_linear_rope_store_reference(
    x: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [(num_heads + 2 * num_kv_heads) * head_dim, K]
    bias: torch.Tensor | None,
    rope: RopeStore,
) -> torch.Tensor:
    """[M, num_heads * head_dim] q of RMSNorm(x) @ weight.T + bias after RoPE; k after RoPE and
    v written to the cache (rope_store_reference: the unfused layer's arithmetic)."""
    num_kv_heads, head_dim = rope.k_cache.shape[1], rope.k_cache.shape[2]
    qkv = norm_linear_reference(x, norm_weight, eps, weight, bias)
    sizes = [rope.num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = (t.view(x.shape[0], -1, head_dim) for t in qkv.split(sizes, dim=-1))
    q = rope_store_reference(
        q, k, v, rope.cos, rope.sin, rope.k_cache, rope.v_cache, rope.slot_mapping
    )
    return q.reshape(x.shape[0], -1)


def linear_residual_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    residual: torch.Tensor,  # [M, N]
) -> torch.Tensor:
    """[M, N] residual + (x @ weight.T + bias), the add in x's dtype."""
    return residual + linear(x, weight, bias)


def norm_linear_silu_mul_reference(
    x: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [2 * N, K]: gate rows, then up rows
    bias: torch.Tensor | None,  # [2 * N]
) -> torch.Tensor:
    """[M, N] silu(gate) * up of [gate | up] = RMSNorm(x) @ weight.T + bias."""
    gate, up = norm_linear_reference(x, norm_weight, eps, weight, bias).chunk(2, -1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------------------
# wrappers
# ---------------------------------------------------------------------------------------------


class RopeStore(NamedTuple):
    """What `norm_linear_rope_store` does with the projected q, k and v: rope_store's inputs."""

    cos: torch.Tensor  # [M, head_dim], x's dtype, last dim contiguous
    sin: torch.Tensor  # [M, head_dim]
    k_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim], x's dtype, last dim contiguous
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [M] int64
    num_heads: int


def _launch(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: tuple[torch.Tensor, float] | None,  # (norm_weight, eps)
    residual: torch.Tensor | None,
    silu_mul: bool,
    rope: RopeStore | None = None,
) -> torch.Tensor:
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(f"{op} needs triton; use {op}_reference")
    interpret = interpreting()
    _check_inputs(op, x, weight, bias, norm, residual, silu_mul, interpret)
    num_rows, k = x.shape
    n = weight.shape[0] // 2 if silu_mul or rope is not None else weight.shape[0]
    num_heads = num_kv_heads = head_dim = 1  # ROPE's, unused without it
    if rope is not None:
        num_kv_heads, head_dim = rope.k_cache.shape[1], rope.k_cache.shape[2]
        num_heads = rope.num_heads
        _check_rope(op, x, weight, rope, interpret)
        out = torch.empty(num_rows, num_heads * head_dim, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tiles = tiling.tiles_for(num_rows, n, k, x.element_size(), interpret)
    norm_weight, eps = norm if norm is not None else (weight, 0.0)  # never read without NORM
    if rope is None:  # never read without ROPE
        cos = sin = k_cache = v_cache = slots = out
    else:
        cos, sin, k_cache, v_cache = rope.cos, rope.sin, rope.k_cache, rope.v_cache
        slots = rope.slot_mapping
    dependent = pdl(x.device) and (tiling.PDL_ON_TENSOR_CORES or not tiles.use_dot)
    line_elems = 128 // x.element_size()
    prefetch = next_power_of_2(-(-k // line_elems)) if dependent and tiling.PREFETCH else 0
    if tiling.PREFETCH_MAX_LINES is not None:  # a bench's cap: the rows' first lines only
        prefetch = min(prefetch, tiling.PREFETCH_MAX_LINES)
    jitted_kernel(interpret)[(-(-n // tiles.block_n),)](
        x, weight, weight if bias is None else bias, norm_weight,
        out if residual is None else residual, out, cos, sin, k_cache, v_cache, slots,
        num_rows, eps, x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1),
        N=n, K=k, NORM=norm is not None, HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None, SILU_MUL=silu_mul, ROPE=rope is not None,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        TWO_SETS=silu_mul or rope is not None, SECOND=head_dim // 2 if rope is not None else n,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        USE_DOT=tiles.use_dot, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        NUM_STAGES=tiles.num_stages, PDL=dependent, PREFETCH_LINES=prefetch,
        LINE_ELEMS=line_elems, TRIGGER_LATE=dependent and tiles.use_dot and tiling.PDL_TRIGGER_LATE,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=False,
        **pdl_launch(dependent),
    )  # fmt: skip
    return out


def _check_rope(
    op: str, x: torch.Tensor, weight: torch.Tensor, rope: RopeStore, interpret: bool
) -> None:
    def fail(what: str) -> NoReturn:
        raise ValueError(f"{op}: {what}")

    num_rows = x.shape[0]
    k_cache, v_cache = rope.k_cache, rope.v_cache
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        fail(f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}: alike, 3-D")
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    if head_dim < 2 or head_dim & (head_dim - 1):
        fail(f"head_dim must be a power of two >= 2, got {head_dim}")
    if weight.shape[0] != (rope.num_heads + 2 * num_kv_heads) * head_dim:
        fail(f"weight {tuple(weight.shape)} must have (num_heads {rope.num_heads} + 2 x "
             f"{num_kv_heads}) x {head_dim} rows: q, k, v")  # fmt: skip
    if rope.cos.shape != (num_rows, head_dim) or rope.sin.shape != rope.cos.shape:
        fail(f"cos {tuple(rope.cos.shape)}, sin {tuple(rope.sin.shape)} must be "
             f"[{num_rows}, {head_dim}]")  # fmt: skip
    if rope.slot_mapping.shape != (num_rows,) or rope.slot_mapping.dtype != torch.int64:
        fail(f"slot_mapping must be [{num_rows}] int64, got {tuple(rope.slot_mapping.shape)} "
             f"{rope.slot_mapping.dtype}")  # fmt: skip
    tensors = [rope.cos, rope.sin, k_cache, v_cache]
    if any(t.dtype != x.dtype for t in tensors):
        fail(f"cos, sin, k_cache, v_cache must be x's dtype {x.dtype}, got "
             f"{[t.dtype for t in tensors]}")  # fmt: skip
    if any(t.stride(-1) != 1 for t in tensors):
        fail(f"last dims must be contiguous, strides {[t.stride() for t in tensors]}")
    check_device(op, [x, *tensors, rope.slot_mapping], interpret)


def norm_linear(
    x: torch.Tensor,  # [M <= 16, K], last dim contiguous
    norm_weight: torch.Tensor,  # [K] contiguous, x's dtype
    eps: float,
    weight: torch.Tensor,  # [N, K] contiguous, x's dtype
    bias: torch.Tensor | None = None,  # [N] contiguous, x's dtype
) -> torch.Tensor:
    """`norm_linear_reference` as one launch: [M, N], contiguous."""
    return _launch("norm_linear", x, weight, bias, (norm_weight, eps), None, False)


def norm_linear_rope_store(
    x: torch.Tensor,  # [M <= 16, K], last dim contiguous
    norm_weight: torch.Tensor,  # [K] contiguous, x's dtype
    eps: float,
    weight: torch.Tensor,  # [(num_heads + 2 * num_kv_heads) * head_dim, K]: q, k, v rows
    bias: torch.Tensor | None,  # [that] contiguous, x's dtype
    rope: RopeStore,
) -> torch.Tensor:
    """`norm_linear_rope_store_reference` as one launch: writes k (rotated) and v to the cache
    rows at rope.slot_mapping and returns the rotated q, [M, num_heads * head_dim]."""
    return _launch("norm_linear_rope_store", x, weight, bias, (norm_weight, eps), None, False, rope)


def linear_residual(
    x: torch.Tensor,  # [M <= 16, K], last dim contiguous
    weight: torch.Tensor,  # [N, K] contiguous, x's dtype
    bias: torch.Tensor | None,  # [N] contiguous, x's dtype
    residual: torch.Tensor,  # [M, N], last dim contiguous, x's dtype
) -> torch.Tensor:
    """`linear_residual_reference` as one launch: [M, N], contiguous (residual is not
    written)."""
    return _launch("linear_residual", x, weight, bias, None, residual, False)


def norm_linear_silu_mul(
    x: torch.Tensor,  # [M <= 16, K], last dim contiguous
    norm_weight: torch.Tensor,  # [K] contiguous, x's dtype
    eps: float,
    weight: torch.Tensor,  # [2 * N, K] contiguous, x's dtype: gate rows, then up rows
    bias: torch.Tensor | None = None,  # [2 * N] contiguous, x's dtype
) -> torch.Tensor:
    """`norm_linear_silu_mul_reference` as one launch: [M, N], contiguous."""
    return _launch("norm_linear_silu_mul", x, weight, bias, (norm_weight, eps), None, True)


def _check_inputs(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: tuple[torch.Tensor, float] | None,
    residual: torch.Tensor | None,
    silu_mul: bool,
    interpret: bool,
) -> None:
    """Everything checkable from shapes, dtypes and strides. Messages are built only on
    failure: this runs before every launch."""

    def fail(what: str) -> NoReturn:
        raise ValueError(f"{op}: {what}")

    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        fail(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    num_rows, k = x.shape
    most = tiling.max_rows()  # as the paths are now (a test may move them)
    if num_rows > most:
        fail(f"x has {num_rows} rows; at most {most} (use F.linear beyond)")
    if k == 0 or weight.shape[0] == 0 or (silu_mul and weight.shape[0] % 2):
        fail(f"weight {tuple(weight.shape)}: K and N must be > 0"
             + (", N even ([gate | up] rows)" if silu_mul else ""))  # fmt: skip
    n_weight = weight.shape[0]
    tensors = [x, weight]
    if bias is not None:
        if bias.shape != (n_weight,):
            fail(f"bias {tuple(bias.shape)} must be [{n_weight}]")
        tensors.append(bias)
    if norm is not None:
        if norm[0].shape != (k,):
            fail(f"norm_weight {tuple(norm[0].shape)} must be [{k}]")
        tensors.append(norm[0])
    if x.dtype not in _ACT_DTYPES or any(t.dtype != x.dtype for t in tensors):
        fail(f"x, weight, bias, norm_weight: one of float16/bfloat16/float32, got "
             f"{[t.dtype for t in tensors]}")  # fmt: skip
    if not all(t.is_contiguous() for t in tensors[1:]) or x.stride(1) != 1:
        fail(f"weight, bias and norm_weight must be contiguous and x's last dim, strides "
             f"{[t.stride() for t in tensors]}")  # fmt: skip
    if residual is not None:
        n = n_weight // 2 if silu_mul else n_weight
        if residual.shape != (num_rows, n) or residual.dtype != x.dtype:
            fail(f"residual {tuple(residual.shape)} {residual.dtype} must be [{num_rows}, {n}] "
                 f"{x.dtype}")  # fmt: skip
        if residual.stride(1) != 1:
            fail(f"residual's last dim must be contiguous, strides {residual.stride()}")
        tensors.append(residual)
    check_device(op, tensors, interpret)
