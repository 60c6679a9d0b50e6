"""The Triton kernel of the small-linear projections (specsplit/kernels/small_linear.py: the
wrappers that check its inputs and launch it, and the plain-torch references; its docstring gives
what each op computes).

One kernel, its ops chosen by constexpr flags: program p computes output columns
[p * BLOCK_N, (p + 1) * BLOCK_N) of every row (the gate columns and the same columns of the up
half, intermediate_size rows further down the weight, for silu-and-mul), so each weight row is
read once. Rows are padded to BLOCK_M, a power of two, on one of two paths: a broadcast
multiply summed once at the end (CUDA cores; the K loop is unrolled, so every weight load is in
flight at once) or tensor cores (tl.dot, loads pipelined). K is a constexpr (fixed per model),
the row count is not specialised: one kernel per (op, BLOCK_M class) serves every step of a
model. No host syncs: capturable in a CUDA graph.

Triton is imported and the kernel jitted on first launch, not at import (triton_jit.py says
why).
"""

from __future__ import annotations

import functools
from typing import Any

from specsplit.kernels.triton_jit import jit

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)


def _small_linear_kernel(
    x_ptr,  # [num_rows, K], last dim contiguous
    weight_ptr,  # [N, K] contiguous; [2 * N, K] with SILU_MUL (gate rows, then up rows)
    bias_ptr,  # [N] or [2 * N] (read when HAS_BIAS)
    norm_weight_ptr,  # [K] (read when NORM)
    residual_ptr,  # [num_rows, N], last dim contiguous (read when RESIDUAL)
    out_ptr,  # [num_rows, N], last dim contiguous; ROPE: [num_rows, NUM_HEADS * HEAD_DIM], q
    cos_ptr,  # ROPE: [num_rows, HEAD_DIM] (and sin_ptr), last dim contiguous
    sin_ptr,
    k_cache_ptr,  # ROPE: [num_slots, NUM_KV_HEADS, HEAD_DIM], last dim contiguous, x's dtype
    v_cache_ptr,
    slot_ptr,  # ROPE: [num_rows] int64, each row's cache slot
    num_rows,  # <= BLOCK_M
    eps,  # RMSNorm's
    stride_x,
    stride_res,
    stride_out,
    stride_cos,
    stride_sin,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    N: tl.constexpr,  # output columns; ROPE: column pairs (d, d + HEAD_DIM / 2 of a head)
    K: tl.constexpr,
    NORM: tl.constexpr,  # the input is RMSNorm(x) (statistics in float32, then norm_weight)
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,  # out = residual + the projection
    SILU_MUL: tl.constexpr,  # out = silu(gate) * up
    ROPE: tl.constexpr,  # qkv: RoPE on the q and k heads, q to out, k and v to the cache
    NUM_HEADS: tl.constexpr,  # ROPE: query heads, then NUM_KV_HEADS k heads, then v heads
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TWO_SETS: tl.constexpr,  # SILU_MUL or ROPE: a second column set, SECOND weight rows down
    SECOND: tl.constexpr,  # N (SILU_MUL: the up half) or HEAD_DIM / 2 (ROPE: the partners)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,  # tensor cores (BLOCK_M 16 or 32), else a broadcast multiply
    DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # the tensor-core K loop's software pipelining
    PDL: tl.constexpr,  # launched with programmatic dependent launch (triton_jit.pdl)
    PREFETCH_LINES: tl.constexpr,  # PDL: > 0 prefetches the weight rows to L2 before the wait,
    # in lines of LINE_ELEMS elements (128 bytes), PREFETCH_LINES (a power of two) a row
    LINE_ELEMS: tl.constexpr,
    TRIGGER_LATE: tl.constexpr,  # PDL: let the next kernel launch after the K loop, not first
):
    act = x_ptr.dtype.element_ty  # the activation dtype: each op's result is rounded to it
    rows = tl.arange(0, BLOCK_M)
    pairs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's output columns
    col_ok = pairs < N
    if ROPE:  # noqa: SIM108  pair p: column d of head h and its partner, d + HEAD_DIM / 2
        cols = pairs // (HEAD_DIM // 2) * HEAD_DIM + pairs % (HEAD_DIM // 2)
    else:
        cols = pairs
    if PDL:
        if not TRIGGER_LATE:
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start (and prefetch)
        if PREFETCH_LINES > 0:  # the weights are constant: read to L2 while the kernel
            # before still runs, one address a 128-byte line of this program's rows (clamped)
            lines = tl.minimum(tl.arange(0, PREFETCH_LINES) * LINE_ELEMS, K - 1)[None, :]
            w_rows = weight_ptr + tl.where(col_ok, cols, 0)[:, None].to(tl.int64) * K + lines
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; // $0", "=r,l", [w_rows], dtype=tl.int32,
                is_pure=False, pack=1,
            )  # fmt: skip
            if TWO_SETS:
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1]; // $0", "=r,l", [w_rows + SECOND * K],
                    dtype=tl.int32, is_pure=False, pack=1,
                )  # fmt: skip
        tl.extra.cuda.gdc_wait()  # the kernel before finished: x, the residual, the cache
    out_ok = (rows < num_rows)[:, None] & col_ok[None, :]  # [BLOCK_M, BLOCK_N]
    # the epilogue's inputs, loaded first: their latency hides behind the weights'
    bias = tl.full([1, BLOCK_N], 0.0, dtype=tl.float32)
    bias_up = tl.full([1, BLOCK_N], 0.0, dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols[None, :], mask=col_ok[None, :], other=0.0).to(tl.float32)
        if TWO_SETS:
            bias_up = tl.load(bias_ptr + SECOND + cols[None, :], mask=col_ok[None, :], other=0.0)
            bias_up = bias_up.to(tl.float32)
    residual = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=act)
    if RESIDUAL:
        residual = tl.load(
            residual_ptr + rows[:, None] * stride_res + cols[None, :], mask=out_ok, other=0.0
        )

    # tl.full and tl.reduce with triton's combine functions, not tl.zeros / tl.sum (triton_jit)
    if USE_DOT:
        # [BLOCK_M, BLOCK_K] rows of x against [BLOCK_N, BLOCK_K] rows of the weight
        k_lanes = tl.arange(0, BLOCK_K)[None, :]
        x_ptrs = x_ptr + rows[:, None] * stride_x + k_lanes  # + k0
        x_ok = (rows < num_rows)[:, None]
        w_ptrs = weight_ptr + cols[:, None].to(tl.int64) * K + k_lanes
        w_ok = col_ok[:, None]
        rstd = tl.full([BLOCK_M, 1], 1.0, dtype=tl.float32)
        if NORM:  # each row's 1 / sqrt(mean(x^2) + eps)
            squares = tl.full([BLOCK_M, BLOCK_K], 0.0, dtype=tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K):
                x32 = tl.load(x_ptrs + k0, mask=x_ok & (k0 + k_lanes < K), other=0.0)
                squares += x32.to(tl.float32) * x32.to(tl.float32)
            rstd = tl.math.rsqrt(tl.reduce(squares, 1, tl.standard._sum_combine) / K + eps)
            rstd = rstd[:, None]
        gate = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        up = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = k0 + k_lanes < K
            x = tl.load(x_ptrs + k0, mask=x_ok & k_ok, other=0.0)
            if NORM:  # fused.rms_norm: (x32 * rstd) rounded, times the norm weight, rounded;
                # the norm weight read as a tile like x's, so that it is pipelined like x
                x = (x.to(tl.float32) * rstd).to(act)
                nw = tl.load(
                    norm_weight_ptr + rows[:, None] * 0 + k0 + k_lanes, mask=k_ok, other=0.0
                )
                x = (nw.to(tl.float32) * x.to(tl.float32)).to(act)
            w = tl.load(w_ptrs + k0, mask=w_ok & k_ok, other=0.0)
            gate = tl.dot(x, tl.trans(w), gate, input_precision=DOT_PRECISION)
            if TWO_SETS:
                w = tl.load(w_ptrs + SECOND * K + k0, mask=w_ok & k_ok, other=0.0)
                up = tl.dot(x, tl.trans(w), up, input_precision=DOT_PRECISION)
    else:
        # [BLOCK_M, BLOCK_N, BLOCK_K] tiles throughout, x repeated over the columns and the
        # weight over the rows: every load and product shares one layout (nothing crosses
        # threads in the loop, so the unrolled loop's weight loads are all in flight at once),
        # and the sums over K stay within a warp
        k_lanes = tl.arange(0, BLOCK_K)[None, None, :]
        rows3 = rows[:, None, None]
        cols3 = cols[None, :, None]
        zeros3 = tl.full([BLOCK_M, BLOCK_N, BLOCK_K], 0, dtype=tl.int32)
        x_ptrs = x_ptr + rows3 * stride_x + zeros3 + k_lanes  # + k0
        x_ok = rows3 < num_rows
        w_ptrs = weight_ptr + cols3.to(tl.int64) * K + zeros3 + k_lanes
        w_ok = col_ok[None, :, None]
        rstd = tl.full([BLOCK_M, BLOCK_N, 1], 1.0, dtype=tl.float32)
        if NORM:
            squares = tl.full([BLOCK_M, BLOCK_N, BLOCK_K], 0.0, dtype=tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K):
                x32 = tl.load(x_ptrs + k0, mask=x_ok & (k0 + k_lanes < K), other=0.0)
                squares += x32.to(tl.float32) * x32.to(tl.float32)
            rstd = tl.math.rsqrt(tl.reduce(squares, 2, tl.standard._sum_combine) / K + eps)
            rstd = rstd[:, :, None]
        gate = tl.full([BLOCK_M, BLOCK_N, BLOCK_K], 0.0, dtype=tl.float32)  # summed over K last
        up = tl.full([BLOCK_M, BLOCK_N, BLOCK_K], 0.0, dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            k_ok = k0 + k_lanes < K
            x = tl.load(x_ptrs + k0, mask=x_ok & k_ok, other=0.0)
            if NORM:
                x = (x.to(tl.float32) * rstd).to(act)
                nw = tl.load(norm_weight_ptr + zeros3 + k0 + k_lanes, mask=k_ok, other=0.0)
                x = (nw.to(tl.float32) * x.to(tl.float32)).to(act)
            w = tl.load(w_ptrs + k0, mask=w_ok & k_ok, other=0.0)
            gate += x.to(tl.float32) * w.to(tl.float32)
            if TWO_SETS:
                w = tl.load(w_ptrs + SECOND * K + k0, mask=w_ok & k_ok, other=0.0)
                up += x.to(tl.float32) * w.to(tl.float32)
        gate = tl.reduce(gate, 2, tl.standard._sum_combine)  # [BLOCK_M, BLOCK_N]
        if TWO_SETS:
            up = tl.reduce(up, 2, tl.standard._sum_combine)

    if PDL and TRIGGER_LATE:  # one kernel ahead at most, launched as this one ends
        tl.extra.cuda.gdc_launch_dependents()
    # the epilogue: the projection (its bias added in float32) rounded, then each op rounded
    y = (gate + bias).to(act)  # [BLOCK_M, BLOCK_N]
    if SILU_MUL:
        g = y.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(act)  # F.silu, computed in float32
        y = (silu.to(tl.float32) * (up + bias_up).to(act).to(tl.float32)).to(act)
    if RESIDUAL:
        y = (residual.to(tl.float32) + y.to(tl.float32)).to(act)
    if ROPE:
        # rope_store's arithmetic on the (a, b) = (y, its partner) pairs: x * cos +
        # rotate_half(x) * sin, each product and the sum rounded to the activation dtype
        # (rotate_half(x)[d] = -x[d + HALF] for d < HALF, x[d - HALF] above), on the q and k
        # heads; then q to out, k and v (as it is) to the cache
        half = HEAD_DIM // 2
        head = (pairs // half)[None, :]  # [1, BLOCK_N]: q heads, then k heads, then v heads
        d = (pairs % half)[None, :]
        row_ok = rows[:, None] < num_rows
        cos_a = tl.load(cos_ptr + rows[:, None] * stride_cos + d, mask=row_ok, other=0.0)
        cos_b = tl.load(cos_ptr + rows[:, None] * stride_cos + d + half, mask=row_ok, other=0.0)
        sin_a = tl.load(sin_ptr + rows[:, None] * stride_sin + d, mask=row_ok, other=0.0)
        sin_b = tl.load(sin_ptr + rows[:, None] * stride_sin + d + half, mask=row_ok, other=0.0)
        b = (up + bias_up).to(act)
        a32, b32 = y.to(tl.float32), b.to(tl.float32)
        a_cos = (a32 * cos_a.to(tl.float32)).to(act).to(tl.float32)
        b_sin = (b32 * -sin_a.to(tl.float32)).to(act).to(tl.float32)
        b_cos = (b32 * cos_b.to(tl.float32)).to(act).to(tl.float32)
        a_sin = (a32 * sin_b.to(tl.float32)).to(act).to(tl.float32)
        rotate = head < NUM_HEADS + NUM_KV_HEADS  # q and k heads; v heads go as they are
        y = tl.where(rotate, (a_cos + b_sin).to(act), y)
        b = tl.where(rotate, (b_cos + a_sin).to(act), b)
        slot = tl.load(slot_ptr + rows, mask=rows < num_rows, other=0)[:, None]  # [BLOCK_M, 1]
        is_q = head < NUM_HEADS
        is_k = (head >= NUM_HEADS) & rotate
        kv_head = tl.where(is_k, head - NUM_HEADS, head - NUM_HEADS - NUM_KV_HEADS)
        q_dst = out_ptr + rows[:, None] * stride_out + head * HEAD_DIM + d
        k_dst = k_cache_ptr + slot * stride_kc_s + kv_head * stride_kc_h + d
        v_dst = v_cache_ptr + slot * stride_vc_s + kv_head * stride_vc_h + d
        dst = tl.where(is_q, q_dst, tl.where(is_k, k_dst, v_dst))
        tl.store(dst, y, mask=out_ok)
        tl.store(dst + half, b, mask=out_ok)
    else:
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y, mask=out_ok)


@functools.cache
def jitted_kernel(interpret: bool) -> Any:
    """The kernel, decorated as TRITON_INTERPRET asks (`interpret` is the cache key). The row
    count follows the batch, so it is not specialised (== 1 would build its own variant); the
    strides are the model's layout, the same at every step."""
    return jit(_small_linear_kernel, do_not_specialize=("num_rows",))
