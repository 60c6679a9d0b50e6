"""The Triton kernels of `paged_attention` (specsplit/kernels/paged_attention.py: the wrapper that
checks their inputs, picks their tiles and split count, and launches them; its docstring gives
what they compute): attention over the paged KV cache, and the merge of a split-KV pass.

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
from typing import Any

from specsplit.kernels.triton_jit import jit

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)


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
    PAGES_AHEAD: tl.constexpr,  # each key tile's page ids loaded one tile ahead (A/B, bench)
    SKIP_EMPTY: tl.constexpr,  # SPLIT: a chunk past kv_end stores its max alone and leaves
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
    q_tile = q_ptr + q_rows[:, None] + offs_d[None, :]
    if not (SPLIT and SKIP_EMPTY):  # (else once the chunk is known not to be empty)
        q = tl.load(q_tile, mask=row_ok[:, None], other=0.0)

    # Keys past the last one any row of this block may see are skipped (causal: the diagonal).
    last_q = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    if HAS_TREE:
        kv_end = kv_len
    else:
        kv_end = tl.minimum(kv_len, tl.maximum(prefix_len, kv_len - q_len + last_q + 1))
    causal_limit = kv_len - q_len + q_idx  # [BLOCK_M] last new key each row sees (causal)
    # This program's keys: chunk `split` of num_splits tile-aligned chunks of [0, kv_end); a
    # chunk past kv_end is empty and leaves the neutral partial (max -inf, sum 0, acc 0), or
    # with SKIP_EMPTY its max alone, before it loads anything more (the merge then ignores its
    # sum and acc): at batch 1 most chunks of a short context are empty.
    chunk = (kv_end + num_splits - 1) // num_splits
    chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    split_start = split * chunk
    split_end = tl.minimum(split_start + chunk, kv_end)
    if SPLIT and SKIP_EMPTY:  # (compile-time, then the runtime test)
        if split_start >= kv_end:  # (p_rows here and at the store, not once above: live across
            # the key loop it took the split tile from 183 to 246 registers, bench/kernel_regs.py)
            p_rows = (split * num_tokens + q_start + q_idx).to(tl.int64) * num_heads + head
            empty = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            tl.store(partial_m_ptr + p_rows, empty, mask=row_ok)
            return
        q = tl.load(q_tile, mask=row_ok[:, None], other=0.0)

    # tl.full and tl.reduce with triton's own combine functions rather than tl.zeros / tl.max /
    # tl.sum: those are @triton.jit functions, unusable by the interpreter when triton was
    # imported before TRITON_INTERPRET was set (the interpreter maps these combines to numpy).
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)  # running sum of exp2
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    pages = block_table_ptr + seq * stride_bt_b
    # Two passes over this program's key tiles, the body written once (static_range unrolls
    # it, `masked` a constexpr): pass 0 the tiles wholly inside the committed prefix, which
    # every row sees (no mask to build or load: most tiles of a long context), pass 1 the rest
    # (the prefix's last part-tile and the new keys, under the causal or tree mask). The chunk
    # starts tile-aligned, so pass 0 ends on a tile edge at or below prefix_len.
    full_end = tl.maximum(split_start, tl.minimum(split_end, prefix_len // BLOCK_N * BLOCK_N))
    for masked in tl.static_range(2):
        if masked:
            tiles_start = full_end
            tiles_end = split_end
        else:
            tiles_start = split_start
            tiles_end = full_end
        if PAGES_AHEAD:  # the first tile's page ids (masked as its keys are: key_ok)
            offs_next = tiles_start + tl.arange(0, BLOCK_N)
            page_next = tl.load(pages + offs_next // PAGE_SIZE, mask=offs_next < kv_len)
        for start_n in range(tiles_start, tiles_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] storage index
            key_ok = offs_n < kv_len
            if PAGES_AHEAD:  # this tile's page ids loaded a tile before, the next tile's now
                page = page_next
                offs_next = offs_n + BLOCK_N
                page_next = tl.load(pages + offs_next // PAGE_SIZE, mask=offs_next < kv_len)
            elif masked:
                page = tl.load(pages + offs_n // PAGE_SIZE, mask=key_ok)
            else:
                page = tl.load(pages + offs_n // PAGE_SIZE)
            slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # [BLOCK_N]
            k_tile = k_ptr + slot[:, None] * stride_k_s + kv_head * stride_k_h + offs_d[None, :]
            v_tile = v_ptr + slot[:, None] * stride_v_s + kv_head * stride_v_h + offs_d[None, :]
            if masked:
                k = tl.load(k_tile, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
                v = tl.load(v_tile, mask=key_ok[:, None], other=0.0)
            else:
                k = tl.load(k_tile)
                v = tl.load(v_tile)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2

            if masked:
                in_prefix = offs_n[None, :] < prefix_len  # [1, BLOCK_N]
                if HAS_TREE:
                    new_ok = tl.full([BLOCK_M, BLOCK_N], 0, dtype=tl.int1)
                    if start_n + BLOCK_N > prefix_len:  # the tree mask is read where it applies
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

            # Online softmax; a row with nothing visible yet keeps m = -inf and contributes 0
            # (pass 0's scores are all finite, rows past q_len included: q is 0 there).
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            m_safe = m_new
            if masked:
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
    SKIP_EMPTY: tl.constexpr,  # empty chunks stored their max alone (the attention kernel's)
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
    if SKIP_EMPTY:  # behind a max of -inf the scratch may hold anything (NaN): 0 in its place,
        seen = m != float("-inf")  # loaded regardless so that no load waits for the max's
        l = tl.where(seen, l, 0.0)  # noqa: E741
        acc = tl.where(seen[:, None], acc, 0.0)
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
def jitted_kernels(interpret: bool) -> tuple[Any, Any]:
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
