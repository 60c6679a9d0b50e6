"""Attention over a paged KV cache for a ragged batch: decode, verify (tree masks) and prefill.

One Triton kernel (`paged_attention`) for the GPU; its plain-torch reference and the CPU path
are specsplit/kernels/paged_attention_reference.py. DESIGN.md §6.

Visibility, per sequence b with q_len queries, query i (0-based within b), storage index j:
  j <  prefix_len            visible (the committed prefix)
  prefix_len <= j < kv_len   causal: j <= kv_len - q_len + i;  tree: tree_mask[b, i, j - prefix_len]
  j >= kv_len                never
Query head h reads KV head h // (num_heads // num_kv_heads) (transformers' repeat_kv).

Split-KV ("flash-decoding"): when (sequences x query blocks x KV heads) programs would leave
most of the GPU idle (decode at small batch), each program's keys are cut into `num_splits`
tile-aligned chunks of [0, kv_end) run by separate programs, which write unnormalised partials
(acc, running max, running sum) to scratch; `_merge_splits_kernel` combines them (log-sum-exp)
into `out`. The chunks are cut from the kv_len each program loads, so `num_splits` depends on
host ints only and the launch stays capturable in a CUDA graph.

Triton is imported and the kernels jitted on first launch, not at import (triton_jit.py says
why).
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

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


def _paged_attention_kernel(
    q_ptr,  # [T, num_heads, HEAD_DIM]
    k_ptr,  # [num_slots, num_kv_heads, HEAD_DIM]
    v_ptr,  # [num_slots, num_kv_heads, HEAD_DIM]
    out_ptr,  # [T, num_heads, HEAD_DIM] (unused when SPLIT)
    partial_o_ptr,  # [num_splits, T, num_heads, HEAD_DIM] float32 (used when SPLIT)
    partial_m_ptr,  # [num_splits, T, num_heads] float32 running max (log2 units)
    partial_l_ptr,  # [num_splits, T, num_heads] float32 running sum of exp2
    cu_seqlens_q_ptr,  # [B + 1] int32
    kv_lens_ptr,  # [B] int32
    prefix_lens_ptr,  # [B] int32
    block_table_ptr,  # [B, max_pages] int32
    tree_mask_ptr,  # [B, max_q, max_new] uint8 (unused when not HAS_TREE)
    scale_log2,  # softmax scale * log2(e): scores are exponentiated with exp2
    num_q_blocks,  # cdiv(max_q_len, BLOCK_Q)
    num_splits,  # key chunks per (sequence, q block, KV head): grid axis 2
    num_tokens,  # T
    num_heads,
    stride_q_t,
    stride_q_h,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    stride_bt_b,
    stride_tm_b,
    stride_tm_q,
    stride_tm_n,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * GROUP <= BLOCK_M
    BLOCK_M: tl.constexpr,  # rows per program: row m = token m // GROUP, head m % GROUP
    BLOCK_N: tl.constexpr,  # keys per tile
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_TREE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,  # write partials for _merge_splits_kernel instead of out
    PDL: tl.constexpr,  # launched with programmatic dependent launch (triton_jit.pdl)
):
    if PDL:  # every program waits for the kernel before (q, this step's K/V, the lengths)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0) // num_q_blocks
    q_block = tl.program_id(0) % num_q_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)  # loaded before the exit: one round trip, not two
    prefix_len = tl.load(prefix_lens_ptr + seq)
    if q_block * BLOCK_Q >= q_len:  # past this sequence's queries (or a q_len = 0 padding one)
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)  # [BLOCK_M]

    q_rows = (q_start + q_idx).to(tl.int64) * stride_q_t + head * stride_q_h
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    # Keys past the last one any row of this block may see are skipped (causal: the diagonal).
    last_q = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    if HAS_TREE:
        kv_end = kv_len
    else:
        kv_end = tl.minimum(kv_len, tl.maximum(prefix_len, kv_len - q_len + last_q + 1))
    causal_limit = kv_len - q_len + q_idx  # [BLOCK_M] last new key each row sees (causal)
    # This program's keys: chunk `split` of num_splits tile-aligned chunks of [0, kv_end); a
    # chunk past kv_end is empty and leaves the neutral partial (max -inf, sum 0, acc 0).
    chunk = (kv_end + num_splits - 1) // num_splits
    chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    split_start = split * chunk
    split_end = tl.minimum(split_start + chunk, kv_end)

    # tl.full and tl.reduce with triton's own combine functions rather than tl.zeros / tl.max /
    # tl.sum: those are @triton.jit functions, unusable by the interpreter when triton was
    # imported before TRITON_INTERPRET was set (the interpreter maps these combines to numpy).
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)  # running sum of exp2
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] storage index
        key_ok = offs_n < kv_len
        page = tl.load(block_table_ptr + seq * stride_bt_b + offs_n // PAGE_SIZE, mask=key_ok)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # [BLOCK_N]
        k = tl.load(
            k_ptr + slot[:, None] * stride_k_s + kv_head * stride_k_h + offs_d[None, :],
            mask=key_ok[:, None],
            other=0.0,
        )  # [BLOCK_N, HEAD_DIM]
        v = tl.load(
            v_ptr + slot[:, None] * stride_v_s + kv_head * stride_v_h + offs_d[None, :],
            mask=key_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2

        in_prefix = offs_n[None, :] < prefix_len  # [1, BLOCK_N]
        if HAS_TREE:
            new_ok = tl.full([BLOCK_M, BLOCK_N], 0, dtype=tl.int1)
            if start_n + BLOCK_N > prefix_len:  # the tree mask is read only where it applies
                new_idx = offs_n - prefix_len  # [BLOCK_N]
                tm = tl.load(
                    tree_mask_ptr
                    + seq * stride_tm_b
                    + q_idx[:, None] * stride_tm_q
                    + new_idx[None, :] * stride_tm_n,
                    mask=row_ok[:, None] & (new_idx >= 0)[None, :] & key_ok[None, :],
                    other=0,
                )
                new_ok = tm != 0
        else:
            new_ok = offs_n[None, :] <= causal_limit[:, None]
        visible = row_ok[:, None] & key_ok[None, :] & (in_prefix | new_ok)
        s = tl.where(visible, s, float("-inf"))

        # Online softmax; a row with nothing visible yet keeps m = -inf and contributes 0.
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:  # unnormalised; the merge rescales each split by exp2(m - max over splits)
        p_rows = (split * num_tokens + q_start + q_idx).to(tl.int64) * num_heads + head
        tl.store(partial_m_ptr + p_rows, m_i, mask=row_ok)
        tl.store(partial_l_ptr + p_rows, l_i, mask=row_ok)
        tl.store(
            partial_o_ptr + p_rows[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )
    else:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_rows = (q_start + q_idx).to(tl.int64) * stride_o_t + head * stride_o_h
        tl.store(
            out_ptr + o_rows[:, None] + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )


def _merge_splits_kernel(
    out_ptr,  # [T, num_heads, HEAD_DIM]
    partial_o_ptr,  # [num_splits, T, num_heads, HEAD_DIM] float32
    partial_m_ptr,  # [num_splits, T, num_heads] float32
    partial_l_ptr,  # [num_splits, T, num_heads] float32
    cu_seqlens_q_ptr,  # [B + 1] int32
    num_seqs,
    num_splits,
    num_tokens,
    num_heads,
    stride_o_t,
    stride_o_h,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (triton_jit.pdl)
):
    """One (token, head) row of out from its num_splits partials. A split that saw no key (max
    -inf) weighs 0; a row that saw none at all gets 0, as in the single pass."""
    if PDL:  # every program waits for the attention kernel's partials
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(cu_seqlens_q_ptr)
    last = tl.load(cu_seqlens_q_ptr + num_seqs)
    if (token < first) | (token >= last):  # rows no sequence owns: no partials, not written
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    rows = (offs_s * num_tokens + token).to(tl.int64) * num_heads + head  # [BLOCK_S]
    m = tl.load(partial_m_ptr + rows, mask=split_ok, other=float("-inf"))
    l = tl.load(partial_l_ptr + rows, mask=split_ok, other=0.0)  # noqa: E741
    acc = tl.load(
        partial_o_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )  # [BLOCK_S, HEAD_DIM]
    m_max = tl.reduce(m, 0, tl.standard._elementwise_max)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # [BLOCK_S]
    l_sum = tl.reduce(l * weight, 0, tl.standard._sum_combine)
    o = tl.reduce(acc * weight[:, None], 0, tl.standard._sum_combine)  # [HEAD_DIM]
    o = o / tl.where(l_sum > 0.0, l_sum, 1.0)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_o_t + head * stride_o_h + offs_d,
        o.to(out_ptr.dtype.element_ty),
    )


@functools.cache
def _jitted_kernels(interpret: bool) -> tuple[Any, Any]:
    """(attention, merge) kernels, decorated as TRITON_INTERPRET asks (`interpret` is the cache
    key: triton.jit reads the knob itself)."""
    # Triton compiles a variant per value class of each integer argument (== 1, divisible by
    # 16); the counts and strides that follow the batch's shape would build kernels for
    # seconds in the first rounds at a new batch (bench/cold_shapes.py), so they are not
    # specialised: one kernel per constexpr choice serves every batch
    return (
        jit(_paged_attention_kernel, do_not_specialize=_ATTENTION_SHAPE_ARGS),
        jit(_merge_splits_kernel, do_not_specialize=_MERGE_SHAPE_ARGS),
    )


_ATTENTION_SHAPE_ARGS = (
    "num_q_blocks",
    "num_splits",
    "num_tokens",
    "stride_bt_b",
    "stride_tm_b",
    "stride_tm_q",
    "stride_tm_n",
)
_MERGE_SHAPE_ARGS = ("num_seqs", "num_splits", "num_tokens")


# ---------------------------------------------------------------------------------------------
# wrapper
# ---------------------------------------------------------------------------------------------


def _launch_config(
    head_dim: int, group: int, max_q_len: int, split: bool, interpret: bool
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M covers max_q_len * group rows up to a
    cap (at least 16 rows: tl.dot needs M >= 16 on GPUs, and at least one whole group); BLOCK_N
    is the key tile: 128 where the rows are few (decode) or the head small, else 64; 64 when the
    keys are split (short chunks, so more of them hold keys; at batch 1, 32 / 64 / 128 came within
    ~1 us of each other, 32 ahead at kv 512 and 128 at kv 4096). Measured on an H100 inside CUDA
    graphs, kv_len 512, page 16, batch 32, bf16, single pass: decode 27 us at head_dim 128 x 8 KV
    heads (~2.3 TB/s of K/V), 9 us at 64 x 3; verify (8 queries) 37 us / 17 us."""
    cap = 64 if head_dim <= 128 else 32
    block_m = min(next_power_of_2(max(max_q_len * group, 16)), cap)
    block_m = max(block_m, next_power_of_2(group))
    if interpret:  # small key tiles: tests cross tile edges with short sequences
        return block_m, 16, 1, 1
    if head_dim > 128:
        return block_m, 32, 4, 2
    if split:
        return block_m, 64, 4, 2
    return block_m, 128 if block_m <= 16 or head_dim <= 64 else 64, 4, 2


MAX_SPLITS = 32
_SPLIT_BELOW_PROGRAMS_PER_SM = 1  # split only grids smaller than this many programs per SM
_SPLIT_TARGET_PROGRAMS_PER_SM = 4


def auto_num_splits(num_programs: int, num_sms: int) -> int:
    """Key chunks per program for a grid of `num_programs` (sequences x query blocks x KV heads)
    on `num_sms` SMs: 1 (single pass) once the grid fills the SMs, else enough chunks for
    _SPLIT_TARGET_PROGRAMS_PER_SM programs per SM, at most MAX_SPLITS. Host ints only (the kv
    lengths live on the device): chunks past a short sequence's keys are empty, costing a store.
    H100, decode in CUDA graphs (bench/attention_kernel.py), us per call single -> split:
    head_dim 64 x 3 KV heads, batch 1: kv 512 7.5 -> 4.9, kv 4096 63.5 -> 7.8; head_dim 128 x 8,
    batch 1: 12.7 -> 8.2, 82.1 -> 14.3; batch 8: 15.6 -> 13.2, 98.8 -> 53.0. At 256 programs
    (128 x 8, batch 32) splitting in 2 was slower (28.0 -> 31.6 us), hence the 1-per-SM bar."""
    if num_programs >= _SPLIT_BELOW_PROGRAMS_PER_SM * num_sms:
        return 1
    target = _SPLIT_TARGET_PROGRAMS_PER_SM * num_sms
    return min(MAX_SPLITS, -(-target // max(num_programs, 1)))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], last dim contiguous
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], last dim contiguous
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32, query token offsets of each sequence in q
    kv_lens: torch.Tensor,  # [B] int32, sequence b attends storage [0, kv_lens[b])
    prefix_lens: torch.Tensor,  # [B] int32, storage [0, prefix_lens[b]) visible to all queries
    block_table: torch.Tensor,  # [B, max_pages] int32 page ids
    page_size: int,
    tree_mask: torch.Tensor | None,  # [B, max_q >= max_q_len, max_new] bool/uint8; None = causal
    max_q_len: int,  # host int >= every q_len (sets the grid)
    scale: float,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], written in place if given
    *,
    num_splits: int | None = None,  # key chunks per program; None: auto_num_splits on CUDA, 1
    # (single pass) under the interpreter; > 1 adds a merge kernel and float32 scratch
) -> torch.Tensor:
    """Checks the inputs (shapes, dtypes, devices, strides; no host syncs, so it can be captured
    in a CUDA graph) and launches the kernel (and, split, the merge). Rows of q outside every
    sequence are not written."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("paged_attention needs triton; use paged_attention_reference")
    interpret = interpreting()
    _check_inputs(
        q, k_cache, v_cache, cu_seqlens_q, kv_lens, prefix_lens, block_table, page_size,
        tree_mask, max_q_len, out, interpret,
    )  # fmt: skip
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"paged_attention: num_splits must be in [1, {MAX_SPLITS}], "
                         f"got {num_splits}")  # fmt: skip
    if out is None:
        out = torch.empty_like(q)
    num_seqs = kv_lens.shape[0]
    num_tokens = q.shape[0]
    if num_seqs == 0 or max_q_len == 0 or num_tokens == 0:
        return out

    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_m = _launch_config(head_dim, group, max_q_len, False, interpret)[0]
    block_q = block_m // group
    num_q_blocks = -(-max_q_len // block_q)
    if num_splits is None:
        num_programs = num_seqs * num_q_blocks * num_kv_heads
        num_splits = 1 if interpret else auto_num_splits(num_programs, _num_sms(q.device))
    split = num_splits > 1
    _, block_n, num_warps, num_stages = _launch_config(head_dim, group, max_q_len, split, interpret)
    if tree_mask is None:
        tm, tm_strides = kv_lens, (0, 0, 0)  # never read
    else:
        tm = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        tm_strides = (tm.stride(0), tm.stride(1), tm.stride(2))
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if split:  # from the graph pool when captured
        partial_o = q.new_empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32)
        partial_m = q.new_empty(num_splits, num_tokens, num_heads, dtype=torch.float32)
        partial_l = torch.empty_like(partial_m)
    else:
        partial_o = partial_m = partial_l = out  # never written

    attention_kernel, merge_kernel = _jitted_kernels(interpret)
    dependent = pdl(q.device)
    launch = pdl_launch(dependent)
    grid = (num_seqs * num_q_blocks, num_kv_heads, num_splits)
    attention_kernel[grid](
        q, k_cache, v_cache, out, partial_o, partial_m, partial_l,
        cu_seqlens_q, kv_lens, prefix_lens, block_table, tm,
        scale * _LOG2E, num_q_blocks, num_splits, num_tokens, num_heads,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        block_table.stride(0),
        *tm_strides,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, HAS_TREE=tree_mask is not None,
        DOT_PRECISION=dot_precision, SPLIT=split, PDL=dependent,
        num_warps=num_warps, num_stages=num_stages, **launch,
    )  # fmt: skip
    if split:
        merge_kernel[(num_tokens, num_heads)](
            out, partial_o, partial_m, partial_l, cu_seqlens_q,
            num_seqs, num_splits, num_tokens, num_heads, out.stride(0), out.stride(1),
            BLOCK_S=next_power_of_2(num_splits), HEAD_DIM=head_dim, PDL=dependent,
            num_warps=1 if interpret or head_dim <= 64 else 2, **launch,
        )  # fmt: skip
    return out


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    tree_mask: torch.Tensor | None,
    max_q_len: int,
    out: torch.Tensor | None,
    interpret: bool,
) -> None:
    """Everything checkable from shapes, dtypes and strides alone (lengths live on the device).
    Messages are built only on failure: this runs before every eager launch."""

    def fail(what: str) -> NoReturn:
        raise ValueError(f"paged_attention: {what}")

    if q.dim() != 3 or k_cache.dim() != 3:
        fail(f"q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)} must be 3-D")
    if v_cache.shape != k_cache.shape:
        fail(f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim:
        fail(f"cache head_dim {k_cache.shape[2]} != q's {head_dim}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        fail(f"head_dim must be a power of two >= 16, got {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        fail(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.dtype not in _Q_DTYPES:
        fail(f"q must be float16/bfloat16/float32, got {q.dtype}")
    if k_cache.dtype != v_cache.dtype or not k_cache.dtype.is_floating_point:
        fail(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype}: one floating dtype")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        fail(f"q, k_cache, v_cache: last dims must be contiguous, strides {q.stride()}, "
             f"{k_cache.stride()}, {v_cache.stride()}")  # fmt: skip

    if kv_lens.dim() != 1:
        fail(f"kv_lens must be [B], got {tuple(kv_lens.shape)}")
    num_seqs = kv_lens.shape[0]
    for name, t, length in (
        ("cu_seqlens_q", cu_seqlens_q, num_seqs + 1),
        ("kv_lens", kv_lens, num_seqs),
        ("prefix_lens", prefix_lens, num_seqs),
    ):
        if t.dim() != 1 or t.shape[0] != length or t.dtype != torch.int32 or t.stride(0) != 1:
            fail(f"{name} must be a contiguous [{length}] int32, got {tuple(t.shape)} {t.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs or block_table.stride(1) != 1:
        fail(f"block_table must be [B={num_seqs}, max_pages], last dim contiguous, "
             f"got {tuple(block_table.shape)}")  # fmt: skip
    if block_table.dtype != torch.int32:
        fail(f"block_table must be int32, got {block_table.dtype}")
    if page_size < 1 or max_q_len < 0:
        fail(f"page_size {page_size} must be >= 1 and max_q_len {max_q_len} >= 0")
    tensors = [q, k_cache, v_cache, cu_seqlens_q, kv_lens, prefix_lens, block_table]
    if tree_mask is not None:
        if tree_mask.dim() != 3 or tree_mask.shape[0] != num_seqs or tree_mask.shape[1] < max_q_len:
            fail(f"tree_mask must be [B={num_seqs}, max_q >= {max_q_len}, max_new], "
                 f"got {tuple(tree_mask.shape)}")  # fmt: skip
        if tree_mask.dtype not in (torch.bool, torch.uint8):
            fail(f"tree_mask must be bool or uint8, got {tree_mask.dtype}")
        tensors.append(tree_mask)
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
            fail(f"out {tuple(out.shape)} {out.dtype} must be like q {tuple(q.shape)} {q.dtype}, "
                 "last dim contiguous")  # fmt: skip
        tensors.append(out)
    check_device("paged_attention", tensors, interpret)


_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def warm_up(
    k_cache: torch.Tensor,  # one layer's [num_slots, num_kv_heads, head_dim], as served
    v_cache: torch.Tensor,
    num_heads: int,
    page_size: int,
    dtype: torch.dtype,  # the queries'
) -> int:
    """Build every kernel variant `paged_attention` can pick for this cache and head layout
    (the constexpr choices: BLOCK_M from the queries per sequence, a tree or causal, split or
    single pass; the integer shape arguments are not specialised), so that no request waits
    for a build. Reads one page of the cache, writes nothing to it. Returns the launches."""
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = k_cache.device
    # one max_q_len per BLOCK_M class: 16, 32 and 64 rows (_launch_config's cap: 32 beyond 128)
    q_lens = sorted({max(1, rows // group) for rows in (16, 32, 64)})
    num_pages = -(-max(q_lens) // page_size)
    block_table = torch.zeros(1, num_pages, dtype=torch.int32, device=device)
    launches = 0
    for q_len in q_lens:
        q = torch.zeros(q_len, num_heads, head_dim, dtype=dtype, device=device)
        cu_seqlens_q = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        lens = torch.tensor([q_len], dtype=torch.int32, device=device)
        prefix = torch.zeros(1, dtype=torch.int32, device=device)
        tree = torch.ones(1, q_len, q_len, dtype=torch.bool, device=device).tril()
        for tree_mask in (None, tree):
            for num_splits in (1, 2):
                paged_attention(
                    q, k_cache, v_cache, cu_seqlens_q, lens, prefix, block_table, page_size,
                    tree_mask, q_len, head_dim**-0.5, num_splits=num_splits,
                )  # fmt: skip
                launches += 1
    return launches
