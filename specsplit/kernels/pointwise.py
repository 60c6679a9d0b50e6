"""A decoder layer's pointwise parts as our own Triton kernels: RMSNorm (with the residual add
before it), SiLU-and-mul, and an EAGLE-3 head's layer input (the embedding gather, both norms
and the concatenation), each one launch, with the plain-torch references beside them (the CPU
path, and what the kernels are tested against).

On a GPU specsplit/model/fused.py runs these where `SPECSPLIT_TRITON_POINTWISE=1`, instead of
torch.compile's kernels of the references: then no process compiles anything with
torch.compile (dynamo's tracing cost each warm GPU restart 5-10 s, 9-23 s cold with inductor's
builds, bench/RESULTS.md), and the kernels build beside the others under `building_ahead`.

Arithmetic as the references': statistics in float32, and each op's result rounded to the
dtype torch's op would give it (the normed row to the input's dtype before the weight's
product, the product to the two's promoted dtype; SiLU's output before the product); fp
contraction off, so float32 gets no fused multiply-add. A row's result depends on that row
alone (one program a row, its reduction in one order whatever the batch). Launches depend on
host ints only (the rows set the grid; strides follow the model's layout), so they can be
captured in CUDA graphs.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.nn.functional as F

from specsplit.kernels.triton_jit import (
    check_device,
    interpreting,
    jit,
    next_power_of_2,
    pdl,
    pdl_launch,
)

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)

SILU_BLOCK = 1024  # columns of SiLU-and-mul a program


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in float32, as transformers computes it."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, RMSNorm(residual + x)): a residual add and the next norm, [T, hidden]."""
    hidden = residual + x
    return hidden, rms_norm_reference(hidden, weight, eps)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] -> silu(gate) * up, [T, inter]."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def norm_embed_and_cat_reference(
    features: torch.Tensor,  # [T, H]
    input_ids: torch.Tensor,  # [T]
    embed: torch.Tensor,  # [V, H]
    embed_weight: torch.Tensor,  # [H] the embedding's norm
    features_weight: torch.Tensor,  # [H] the features' norm
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE-3 layer's input: (RMSNorm(embed[input_ids]) | RMSNorm(features)) [T, 2H], and
    RMSNorm(features) [T, H]: the embedding gather, both norms and the concatenation."""
    normed = rms_norm_reference(features, features_weight, eps)
    emb = rms_norm_reference(embed[input_ids], embed_weight, eps)
    return torch.cat([emb, normed], dim=-1), normed


def _rms_norm_kernel(
    x_ptr,  # [R0, R1, H] rows to norm (RESIDUAL: added to the residual first)
    res_ptr,  # [R0, H] the residual (RESIDUAL), else x_ptr again
    w_ptr,  # [H] the norm's weight
    sum_ptr,  # [R0, H] residual + x (RESIDUAL), else x_ptr again
    out_ptr,  # [R0, R1, H] the normed rows
    inner,  # R1: x is [R0, R1, H] (a q / k norm's heads); 1 for [T, H]
    stride_x0,
    stride_x1,
    stride_r0,
    stride_s0,
    stride_o0,
    stride_o1,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= H
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (triton_jit.pdl)
):
    if PDL:  # every program waits for the kernel before it (x, the residual)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner
    head = row - outer * inner
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + outer * stride_x0 + head * stride_x1 + cols, mask=ok, other=0.0)
    act = x_ptr.dtype.element_ty  # the dtype the normed row is rounded to
    if RESIDUAL:  # residual + x rounded to the sum's dtype, stored, then normed
        act = sum_ptr.dtype.element_ty
        res = tl.load(res_ptr + outer * stride_r0 + cols, mask=ok, other=0.0)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(act)
        tl.store(sum_ptr + outer * stride_s0 + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.reduce(x32 * x32, 0, tl.standard._sum_combine) / H + eps)
    normed = (x32 * rstd).to(act).to(tl.float32)
    weight = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = out_ptr + outer * stride_o0 + head * stride_o1 + cols
    tl.store(out, (weight * normed).to(out_ptr.dtype.element_ty), mask=ok)


def _norm_embed_cat_kernel(
    features_ptr,  # [T, H], last dim contiguous
    ids_ptr,  # [T] token ids (any integer dtype, any stride)
    embed_ptr,  # [V, H], last dim contiguous, features' dtype
    embed_w_ptr,  # [H] the embedding's norm
    features_w_ptr,  # [H] the features' norm, embed_w_ptr's dtype
    cat_ptr,  # [T, 2H] contiguous
    normed_ptr,  # [T, H] contiguous
    vocab,
    stride_f,
    stride_ids,
    stride_e,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (T, 2): a row's embedding half (program 0) and its features' half (program 1, also
    # written to normed)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    is_features = tl.program_id(1) == 1
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    token = tl.load(ids_ptr + row * stride_ids).to(tl.int64)
    # a token id out of the vocabulary reads zeros, never out of bounds
    src_ok = is_features | ((token >= 0) & (token < vocab))
    src = tl.where(is_features, features_ptr + row * stride_f, embed_ptr + token * stride_e)
    x32 = tl.load(src + cols, mask=ok & src_ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.reduce(x32 * x32, 0, tl.standard._sum_combine) / H + eps)
    normed = (x32 * rstd).to(features_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(tl.where(is_features, features_w_ptr, embed_w_ptr) + cols, mask=ok, other=0.0)
    y = (w.to(tl.float32) * normed).to(cat_ptr.dtype.element_ty)
    tl.store(cat_ptr + row * 2 * H + tl.program_id(1) * H + cols, y, mask=ok)
    tl.store(normed_ptr + row * H + cols, y, mask=ok & is_features)


def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 * INTER], last dim contiguous
    out_ptr,  # [T, INTER] contiguous
    stride_g,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (T, cdiv(INTER, BLOCK))
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    act = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + INTER + cols, mask=ok, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)
    tl.store(out_ptr + row * INTER + cols, (silu * up.to(tl.float32)).to(act), mask=ok)


_KERNELS: dict[str, Callable[..., Any]] = {
    "rms_norm": _rms_norm_kernel,
    "norm_embed_cat": _norm_embed_cat_kernel,
    "silu_mul": _silu_mul_kernel,
}


@functools.cache
def _jitted(name: str, interpret: bool) -> Any:
    """The kernel `name`, decorated as TRITON_INTERPRET asks (`interpret` is the cache key). The
    rows are the grid's alone; every integer argument is a stride or a count fixed by the
    model's layout (the vocabulary, a q / k norm's heads), so none is left unspecialised."""
    return jit(_KERNELS[name])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference` as one launch: x [T, H] or [T, heads, H] (a q / k norm's view of
    qkv), last dim contiguous; weight [H] -> a new contiguous tensor of x's shape, in the two's
    promoted dtype."""
    x3 = x[:, None] if x.dim() == 2 else x
    if x3.dim() != 3:
        _fail("rms_norm", f"x {tuple(x.shape)}: [T, H] or [T, heads, H]")
    interpret = _check("rms_norm", [x3], (weight,))
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _launch_norm(x3, x3, weight, x3, out.view(x3.shape), eps, False, interpret)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference` as one launch: x and residual [T, H] (last dims contiguous),
    weight [H] -> (residual + x, its RMSNorm), new contiguous tensors in torch's dtypes."""
    if x.dim() != 2 or residual.shape != x.shape:
        _fail("add_rms_norm", f"x {tuple(x.shape)}, residual {tuple(residual.shape)}: [T, H]")
    interpret = _check("add_rms_norm", [x, residual], (weight,))
    dtype = torch.promote_types(residual.dtype, x.dtype)
    summed = torch.empty(x.shape, dtype=dtype, device=x.device)
    normed = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, dtype), device=x.device)
    _launch_norm(x[:, None], residual, weight, summed, normed[:, None], eps, True, interpret)
    return summed, normed


def _launch_norm(
    x: torch.Tensor,  # [R0, R1, H]
    residual: torch.Tensor,  # [R0, H]; x where not `add`
    weight: torch.Tensor,  # [H]
    summed: torch.Tensor,  # [R0, H] written where `add`; x otherwise
    out: torch.Tensor,  # [R0, R1, H]
    eps: float,
    add: bool,
    interpret: bool,
) -> None:
    num_outer, inner, hidden = x.shape
    if num_outer * inner == 0:
        return
    block = next_power_of_2(hidden)
    dependent = pdl(x.device)
    _jitted("rms_norm", interpret)[(num_outer * inner,)](
        x, residual, weight, summed, out, inner,
        x.stride(0), x.stride(1), residual.stride(0), summed.stride(0),
        out.stride(0), out.stride(1), eps,
        H=hidden, BLOCK=block, RESIDUAL=add, PDL=dependent,
        num_warps=1 if interpret else _num_warps(block),
        enable_fp_fusion=False, **pdl_launch(dependent),
    )  # fmt: skip


def norm_embed_and_cat(
    features: torch.Tensor,  # [T, H], last dim contiguous
    input_ids: torch.Tensor,  # [T] integer, any stride (a column of the chains verified)
    embed: torch.Tensor,  # [V, H], last dim contiguous, features' dtype
    embed_weight: torch.Tensor,  # [H]
    features_weight: torch.Tensor,  # [H], embed_weight's dtype
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_embed_and_cat_reference` as one launch: ([T, 2H], [T, H]), new contiguous tensors
    in the promoted dtype of the features and the norms' weights. A token id outside the
    vocabulary gives a row of zeros (where torch's gather would fault)."""
    name = "norm_embed_and_cat"
    if features.dim() != 2 or embed.dim() != 2 or embed.shape[1] != features.shape[1]:
        _fail(name, f"features {tuple(features.shape)}, embed {tuple(embed.shape)}: [T, H], [V, H]")
    num_tokens, hidden = features.shape
    if input_ids.shape != (num_tokens,) or input_ids.dtype.is_floating_point:
        _fail(name, f"input_ids {tuple(input_ids.shape)} {input_ids.dtype}: [{num_tokens}] ints")
    if embed.dtype != features.dtype or features_weight.dtype != embed_weight.dtype:
        _fail(name, f"embed {embed.dtype} / features {features.dtype}, weights "
              f"{embed_weight.dtype} / {features_weight.dtype}: each pair one dtype")  # fmt: skip
    interpret = _check(name, [features, embed], (embed_weight, features_weight), (input_ids,))
    dtype = torch.promote_types(embed_weight.dtype, features.dtype)
    cat = torch.empty(num_tokens, 2 * hidden, dtype=dtype, device=features.device)
    normed = torch.empty(num_tokens, hidden, dtype=dtype, device=features.device)
    if num_tokens == 0:
        return cat, normed
    block = next_power_of_2(hidden)
    dependent = pdl(features.device)
    _jitted("norm_embed_cat", interpret)[(num_tokens, 2)](
        features, input_ids, embed, embed_weight, features_weight, cat, normed, embed.shape[0],
        features.stride(0), input_ids.stride(0), embed.stride(0), eps,
        H=hidden, BLOCK=block, PDL=dependent,
        num_warps=1 if interpret else _num_warps(block),
        enable_fp_fusion=False, **pdl_launch(dependent),
    )  # fmt: skip
    return cat, normed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_reference` as one launch: gate_up [T, 2 * inter] (last dim contiguous) ->
    a new contiguous [T, inter] of its dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        _fail("silu_and_mul", f"gate_up {tuple(gate_up.shape)}: [T, 2 * inter]")
    interpret = _check("silu_and_mul", [gate_up])
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(next_power_of_2(inter), SILU_BLOCK)
    dependent = pdl(gate_up.device)
    _jitted("silu_mul", interpret)[(num_tokens, -(-inter // block))](
        gate_up, out, gate_up.stride(0), INTER=inter, BLOCK=block, PDL=dependent,
        num_warps=1 if interpret else 4, enable_fp_fusion=False, **pdl_launch(dependent),
    )  # fmt: skip
    return out


def _num_warps(block: int) -> int:
    """Warps for a row of `block` columns: about 16 a thread (a 16-byte load of bf16 or two)."""
    return min(max(block // 512, 1), 8)


def _fail(kernel: str, what: str) -> NoReturn:
    raise ValueError(f"{kernel}: {what}")


def _check(
    kernel: str,
    rows: list[torch.Tensor],
    weights: tuple[torch.Tensor, ...] = (),
    others: tuple[torch.Tensor, ...] = (),
) -> bool:
    """What every wrapper checks (no host syncs, so launches can be captured): triton is
    there; the rows are floating, their last dims of one width and contiguous; each weight is
    [width], floating and contiguous; every tensor (`others` too) on one device. Returns
    `interpreting()`."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(f"{kernel} needs triton; use {kernel}_reference")
    interpret = interpreting()
    width = rows[0].shape[-1]
    for t in rows:
        if t.dtype not in _ACT_DTYPES or t.shape[-1] != width or t.stride(-1) != 1:
            _fail(kernel, f"rows {[(tuple(r.shape), r.dtype, r.stride()) for r in rows]}: "
                  "float16/bfloat16/float32, last dims of one width and contiguous")  # fmt: skip
    for w in weights:
        if w.shape != (width,) or w.dtype not in _ACT_DTYPES or w.stride(0) != 1:
            _fail(kernel, f"weight {tuple(w.shape)} {w.dtype} {w.stride()}: [{width}] "
                  "contiguous, float16/bfloat16/float32")  # fmt: skip
    check_device(kernel, [*rows, *weights, *others], interpret)
    return interpret


_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
