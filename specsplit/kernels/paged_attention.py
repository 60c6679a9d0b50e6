"""Attention over a paged KV cache for a ragged batch: decode, verify (tree masks) and prefill.

The wrapper `paged_attention` checks the inputs, picks the tiles and the number of key chunks
(split-KV), and launches the Triton kernels of specsplit/kernels/paged_attention_kernels.py (its
docstring says how a split pass works) on the GPU; its plain-torch reference and the CPU path
are specsplit/kernels/paged_attention_reference.py. DESIGN.md §6.

Visibility, per sequence b with q_len queries, query i (0-based within b), storage index j:
  j <  prefix_len            visible (the committed prefix)
  prefix_len <= j < kv_len   causal: j <= kv_len - q_len + i;  tree: tree_mask[b, i, j - prefix_len]
  j >= kv_len                never
Query head h reads KV head h // (num_heads // num_kv_heads) (transformers' repeat_kv).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NoReturn

import torch

from specsplit.kernels.paged_attention_kernels import jitted_kernels
from specsplit.kernels.triton_jit import (
    building_ahead,
    check_device,
    interpreting,
    next_power_of_2,
    pdl,
    pdl_launch,
)

_LOG2E = 1.4426950408889634


def _launch_config(
    head_dim: int, group: int, max_q_len: int, split: bool, interpret: bool, tree: bool = False
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M covers max_q_len * group rows up to a
    cap (at least 16 rows: tl.dot needs M >= 16 on GPUs, and at least one whole group); BLOCK_N
    is the key tile: 128 where the rows are few (decode) or the head small, else 64; 64 when the
    keys are split (short chunks, so more of them hold keys; at batch 1, 32 / 64 / 128 came within
    ~1 us of each other, 32 ahead at kv 512 and 128 at kv 4096). Measured on an H100 inside CUDA
    graphs, kv_len 512, page 16, batch 32, bf16, single pass: decode 27 us at head_dim 128 x 8 KV
    heads (~2.3 TB/s of K/V), 9 us at 64 x 3; verify (8 queries) 37 us / 17 us. The causal
    16-row tile of a 128-wide head (decode) pipelines DECODE_STAGES key tiles."""
    cap = 64 if head_dim <= 128 else 32
    block_m = min(next_power_of_2(max(max_q_len * group, 16)), cap)
    block_m = max(block_m, next_power_of_2(group))
    if interpret:  # small key tiles: tests cross tile edges with short sequences
        return block_m, 16, 1, 1
    if head_dim > 128:
        return block_m, 32, 4, 2
    if wide_block(head_dim, block_m):  # a tree's rows of a 128-wide head, either path
        return block_m, WIDE_BLOCK_N, WIDE_WARPS, 2
    if split:
        return block_m, 64, 4, 2
    block_n = 128 if block_m <= 16 or head_dim <= 64 else 64
    decode_tile = block_m <= 16 and head_dim > 64 and not tree
    return block_m, block_n, 4, DECODE_STAGES if decode_tile else 2


# pipeline stages of the single pass's causal decode tile (16 rows x 128 keys, head_dim 128):
# 3 against 2, 8B shape on an H200 in CUDA graphs (bench/attention_kernel.py --sweep, ninetieth
# session), us a layer: batch 32 kv 512 26.0 -> 21.9, kv 4096 164.7 -> 126.1 (the K/V floor
# 127.9), batch 64 41.2 -> 40.2, 277.1 -> 246.9, pages shuffled or in order alike. The engine's
# step (bench/step_ab.py) did not move: batch 32 at 512 / 4096 tokens 5.49 / 8.87 ms either way,
# its attention already at the K/V floor with 2 stages (130.3 / 131.3 us a layer at 4096 tokens
# with 3 / 2, profiled with PDL off, ninety-first session: the micro-benchmark's 164.7 is its
# own graph of back-to-back calls). Not for
# a 64-wide head (SmolLM2, batch 64: 15.2 -> 15.8, 80.7 -> 87.8) nor a tree's tile (batch 32,
# 1 + 8 over 64 rows: 150.9 -> 156.2)
DECODE_STAGES = 3
# the key tile and warps of a 128-wide head's blocks of more than 32 rows (wide_block: a verify's
# tree, 1 + 8 queries x a group of 4 = 64 rows), split or not. At 64 keys and 4 warps the 8B's
# take 255 registers and spill (bench/kernel_regs.py --tree [--split] --rows 64: 12 / 28 bytes a
# thread; at 32 keys 223 / 228 and none), yet beat 32 keys but at batch 1 and 2: H200, 1 + 8
# tree, us a layer at 512 / 4,096 tokens (ninety-second session), split 64 against 32 keys:
# batch 1 12.9 / 17.4 vs 10.5 / 16.4, batch 8 23.0 / 57.8 vs 20.2 / 70.8; single pass batch 32
# 29.7 / 153.7 vs 30.4 / 183.5 (8 warps 46.4 / 273.0); the engine's batch-1 verify step on the
# device 5.075 vs 5.048 ms (bench/gpu_engine.py, a process each)
WIDE_BLOCK_N = 64
WIDE_WARPS = 4
MAX_SPLITS = 32
# the key loop loads each tile's page ids one tile ahead, so that its K/V loads need not wait
# for them (off: loaded in the tile; an A/B switch for bench/attention_kernel.py and
# bench/step_ab.py, read at each launch, not yet measured on a GPU)
PAGES_AHEAD = False
# split-KV: a chunk past kv_end stores its max alone and leaves before it loads q, and the merge
# zeroes what lies behind a max of -inf (off: every chunk stores the neutral partial; an A/B
# switch read at each launch). At batch 1 and 512 tokens 24 of the 8B's 32 chunks are empty. H200,
# ninety-second session: bench/attention_kernel.py, us a layer, decode batch 1 at 512 tokens
# 8.3 -> 7.8, batch 8 at 4,096 49.3 -> 46.0, the 1 + 8 tree at batch 1 and 512 13.5 -> 13.1, the
# rest within 0.7 either way; the 8B's decode step at batch 1 (bench/step_ab.py) 0.983x at 512
# tokens, 0.986x at 4,096, the same tokens. (Masking the empty chunks' stores alone, a380c30,
# reverted: the merge's loads then waited for the max)
SKIP_EMPTY_CHUNKS = True
_SPLIT_BELOW_PROGRAMS_PER_SM = 1  # split only grids smaller than this many programs per SM
# split grids' target programs a SM (split_programs_per_sm picks one): decode blocks of a head
# of at most 64 (SmolLM2's: 6 and 8 lost to 4 in the step, 1.03-1.09x at batch 8 / 32, H200,
# seventy-second session; at 4,096 tokens 3 a SM 1.015x / 1.033x, 2 a SM 1.069x / 1.213x,
# ninety-fourth session)
SPLIT_PROGRAMS_PER_SM = 4
# decode blocks of a wider head (the 8B's 128). H200, the 8B's decode step at 4,096 tokens
# (bench/step_ab.py, alternating in one process, ninety-third session) against 4 a SM at batch
# 4 / 8 / 16 (split counts 17 / 9 / 5; 4 again: 1.002x / 0.999x / 0.997x): 3 a SM (13 / 7 / 4)
# 0.992x / 0.997x / 0.933x (batch 16 0.93-0.94 every turn), 2 a SM 1.003x / 1.017x / 0.967x;
# on another machine (ninety-fourth session) 4 a SM 1.005x / 1.000x / 1.072x against 3; at 512
# tokens 4 a SM 0.992x / 0.984x / 1.003x, 2 a SM 0.992x / 0.999x / 1.019x (within 2%)
LARGE_HEAD_SPLIT_PROGRAMS_PER_SM = 3
# a wide block's (wide_block: a tree's 64 rows of a 128-wide head). H200, the 8B's verify 1 + 8
# in the engine (bench/step_ab.py --verify-n 8, ninety-third session), ms a round against 4 a SM
# (split counts at batch 2 / 4 / 8 / 16: 32 / 17 / 9 / 5): 3 a SM (25 / 13 / 7 / 4) at 4,096
# tokens 0.997x / 0.999x / 0.991x / 0.936x (batch 16 0.91-0.96 every turn; with 3 first in
# turn, 4 a SM 1.044x there, on two other machines 1.052x and 1.056x), at 512 0.995x /
# 0.996x / 0.977x / 0.972x; 2 a SM (17 / 9 / 5 / 3) lost at batch 8 (1.029-1.046x at 4,096
# tokens). (A single pass of 3 stages where the wide grid is one wave, 78.9 against 103.6 us a
# layer in bench/attention_kernel.py at batch 16, cost 1.098x in the engine: dropped.) Batch 1
# keeps 32
WIDE_SPLIT_PROGRAMS_PER_SM = 3


def wide_block(head_dim: int, block_m: int) -> bool:
    """A 128-wide head's row block of more than 32 rows (a verify's tree): WIDE_BLOCK_N keys and
    WIDE_WARPS warps a tile, WIDE_SPLIT_PROGRAMS_PER_SM when split."""
    return 64 < head_dim <= 128 and block_m > 32


def split_programs_per_sm(head_dim: int, block_m: int) -> int:
    """A split grid's target programs a SM for blocks of `block_m` rows of a `head_dim` head."""
    if wide_block(head_dim, block_m):
        return WIDE_SPLIT_PROGRAMS_PER_SM
    return LARGE_HEAD_SPLIT_PROGRAMS_PER_SM if head_dim > 64 else SPLIT_PROGRAMS_PER_SM


def auto_num_splits(num_programs: int, num_sms: int, per_sm: int | None = None) -> int:
    """Key chunks per program for a grid of `num_programs` (sequences x query blocks x KV heads)
    on `num_sms` SMs: 1 (single pass) once the grid fills the SMs, else enough chunks for
    `per_sm` programs per SM (split_programs_per_sm; None: SPLIT_PROGRAMS_PER_SM), at most
    MAX_SPLITS. Host ints only (the kv lengths live on the device): chunks past a short
    sequence's keys are empty, costing a store.
    H100, decode in CUDA graphs (bench/attention_kernel.py), us per call single -> split:
    head_dim 64 x 3 KV heads, batch 1: kv 512 7.5 -> 4.9, kv 4096 63.5 -> 7.8; head_dim 128 x 8,
    batch 1: 12.7 -> 8.2, 82.1 -> 14.3; batch 8: 15.6 -> 13.2, 98.8 -> 53.0. At 256 programs
    (128 x 8, batch 32) splitting in 2 was slower (28.0 -> 31.6 us), hence the 1-per-SM bar."""
    if num_programs >= _SPLIT_BELOW_PROGRAMS_PER_SM * num_sms:
        return 1
    target = (SPLIT_PROGRAMS_PER_SM if per_sm is None else per_sm) * num_sms
    return min(MAX_SPLITS, -(-target // max(num_programs, 1)))


@functools.cache
def launch_grid(
    head_dim: int, group: int, max_q_len: int, num_seqs: int, num_kv_heads: int, interpret: bool
) -> tuple[int, int, int]:
    """(BLOCK_M, query blocks a sequence, programs a key chunk: sequences x query blocks x KV
    heads) of a launch."""
    block_m = _launch_config(head_dim, group, max_q_len, False, interpret)[0]
    num_q_blocks = -(-max_q_len // (block_m // group))
    return block_m, num_q_blocks, num_seqs * num_q_blocks * num_kv_heads


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_splits(head_dim: int, block_m: int, num_programs: int, device: torch.device) -> int:
    """The key chunks the wrapper picks for a grid of `num_programs` blocks of `block_m` rows
    (launch_grid) on `device`: auto_num_splits at the blocks' split_programs_per_sm."""
    per_sm = split_programs_per_sm(head_dim, block_m)
    return auto_num_splits(num_programs, _num_sms(device), per_sm)


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
    block_m, num_q_blocks, num_programs = launch_grid(
        head_dim, group, max_q_len, num_seqs, num_kv_heads, interpret
    )
    if num_splits is None:
        num_splits = 1 if interpret else launch_splits(head_dim, block_m, num_programs, q.device)
    split = num_splits > 1
    _, block_n, num_warps, num_stages = _launch_config(
        head_dim, group, max_q_len, split, interpret, tree_mask is not None
    )
    if tree_mask is None:
        tm, tm_strides = kv_lens, (0, 0, 0)  # never read
    else:
        tm = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        tm_strides = (tm.stride(0), tm.stride(1), tm.stride(2))
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if split:  # from the graph pool when captured
        partial_o = _scratch(q, (num_splits, num_tokens, num_heads, head_dim))
        partial_m = _scratch(q, (num_splits, num_tokens, num_heads))
        partial_l = _scratch(q, (num_splits, num_tokens, num_heads))
    else:
        partial_o = partial_m = partial_l = out  # never written

    attention_kernel, merge_kernel = jitted_kernels(interpret)
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
        GROUP=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, HAS_TREE=tree_mask is not None,
        DOT_PRECISION=dot_precision, SPLIT=split, PDL=dependent, PAGES_AHEAD=PAGES_AHEAD,
        SKIP_EMPTY=SKIP_EMPTY_CHUNKS,
        num_warps=num_warps, num_stages=num_stages, **launch,
    )  # fmt: skip
    if split:
        merge_kernel[(num_tokens, num_heads)](
            out, partial_o, partial_m, partial_l, cu_seqlens_q,
            num_seqs, num_splits, num_tokens, num_heads, out.stride(0), out.stride(1),
            BLOCK_S=next_power_of_2(num_splits), HEAD_DIM=head_dim, PDL=dependent,
            SKIP_EMPTY=SKIP_EMPTY_CHUNKS,
            num_warps=1 if interpret or head_dim <= 64 else 2, **launch,
        )  # fmt: skip
    return out


def _scratch(q: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A split pass's float32 partials, uninitialised (tests fill them with NaN here)."""
    return q.new_empty(shape, dtype=torch.float32)


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
    for a build: side by side, inside `building_ahead` (the launches run nothing). Writes
    nothing to the cache. Returns the launches."""
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = k_cache.device
    # one max_q_len per BLOCK_M class: 16, 32 and 64 rows (_launch_config's cap: 32 beyond 128)
    q_lens = sorted({max(1, rows // group) for rows in (16, 32, 64)})
    num_pages = -(-max(q_lens) // page_size)
    block_table = torch.zeros(1, num_pages, dtype=torch.int32, device=device)
    launches = 0
    with building_ahead():
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
