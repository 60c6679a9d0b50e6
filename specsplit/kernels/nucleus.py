"""Top-k and top-p as one probability threshold per row, found without sorting the vocabulary.

A row's cut keeps the tokens whose probability is at least its threshold tau = max(tau_k, tau_p):
- tau_k: the k-th largest probability (k = top_k; off, k >= V: the smallest), so a token
  survives top-k when fewer than k tokens are likelier;
- tau_p: the smallest probability p_i whose likelier tokens' mass, sum(p_j > p_i), is below
  (top_p - slack) of the mass top-k left (off, top_p >= 1: 0), and never above the largest
  probability (the likeliest token always survives).
For distinct probabilities this keeps exactly what a sort keeps (`specsplit.sampling
.target_probs`); tokens tied at a boundary are kept or cut together.

`cut_thresholds` finds both by bisection on the float32 bit patterns (non-negative floats
order as their bits): one Triton program per row, 30 passes over the row for each threshold, a
fixed launch a CUDA graph captures. From KERNEL_MIN_ROWS rows up it replaces a sort of [rows, V]
(the quicker below: one program a row leaves most SMs idle; see KERNEL_MIN_ROWS).
`cut_thresholds_reference` computes the same from a sort (the CPU path, few rows, and what the
kernel is tested against; on a GPU their float32 sums of a row's mass may round a top-p
boundary token differently).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

from specsplit.kernels.triton_jit import check_device, interpreting, jit

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)

# Nucleus boundary slack: a prefix whose mass is within this of top_p counts as reaching it, so
# float32 rounding cannot pull in one extra token (specsplit.sampling's cuts use it too).
TOP_P_SLACK = 1e-6
_ONE_BITS = 0x3F800000  # 1.0f: no probability is above it
_SEARCH_STEPS = 30  # halvings of [0, 2**30), which holds every bit pattern up to 1.0f
_BLOCK = 2048


def cut_thresholds_reference(
    probs: torch.Tensor,  # [R, V] float32, each row a distribution
    top_k: torch.Tensor,  # [R] int64: 0 or >= V = off
    top_p: torch.Tensor,  # [R] float: >= 1 = off
) -> torch.Tensor:
    """[R] float32: each row's threshold (the module's definition), from a descending sort."""
    vocab = probs.shape[1]
    values = probs.float().sort(dim=-1, descending=True).values  # [R, V]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).clamp_min(1)
    tau_k = values.gather(1, (k - 1)[:, None]).squeeze(1)
    kept_mass = (probs.float() * (probs.float() >= tau_k[:, None])).sum(dim=-1)
    # each value's likelier mass: the exclusive cumulative sum at the first of its ties
    before = values.cumsum(dim=-1) - values
    first = torch.searchsorted(-values, -values, right=False)  # [R, V] each tie group's start
    likelier = before.gather(1, first)
    limit = torch.where(top_p >= 1.0, torch.inf, (top_p.float() - TOP_P_SLACK) * kept_mass)  # [R]
    passes = likelier < limit[:, None]  # a prefix of the sorted row
    count = passes.sum(dim=-1).clamp_min(1)  # the likeliest value always passes
    tau_p = values.gather(1, (count - 1)[:, None]).squeeze(1)
    tau_p = torch.where(top_p >= 1.0, 0.0, tau_p)
    return torch.maximum(tau_k, tau_p)


def _cut_thresholds_kernel(
    probs_ptr,  # [R, V] float32
    top_k_ptr,  # [R] int64
    top_p_ptr,  # [R] float32
    out_ptr,  # [R] float32
    stride_row,
    vocab,
    SLACK: tl.constexpr,
    ONE_BITS: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = probs_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    k = tl.load(top_k_ptr + row)
    k = tl.where((k > 0) & (k < vocab), k, vocab)
    top_p = tl.load(top_p_ptr + row)
    # tau_k: the smallest v with fewer than k tokens above it
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), ONE_BITS, tl.int32)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        v = mid.to(tl.float32, bitcast=True)
        above = tl.full((), 0, tl.int64)
        for start in range(0, vocab, BLOCK):
            p = tl.load(base + start + offs, mask=start + offs < vocab, other=0.0)
            above += tl.reduce((p > v).to(tl.int64), 0, tl.standard._sum_combine)
        fits = above < k
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid + 1)
    tau_k = lo.to(tl.float32, bitcast=True)
    kept = tl.full((), 0.0, tl.float32)
    largest = tl.full((), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        p = tl.load(base + start + offs, mask=start + offs < vocab, other=0.0)
        kept += tl.reduce(tl.where(p >= tau_k, p, 0.0), 0, tl.standard._sum_combine)
        largest = tl.maximum(largest, tl.reduce(p, 0, tl.standard._elementwise_max))
    limit = tl.where(top_p >= 1.0, 3.0e38, (top_p - SLACK) * kept)  # off: every v fits
    # tau_p: the smallest v whose likelier mass is below the limit
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), ONE_BITS, tl.int32)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        v = mid.to(tl.float32, bitcast=True)
        mass = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            p = tl.load(base + start + offs, mask=start + offs < vocab, other=0.0)
            mass += tl.reduce(tl.where(p > v, p, 0.0), 0, tl.standard._sum_combine)
        fits = mass < limit
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid + 1)
    tau_p = tl.minimum(lo.to(tl.float32, bitcast=True), largest)
    tau_p = tl.where(top_p >= 1.0, 0.0, tau_p)
    tl.store(out_ptr + row, tl.maximum(tau_k, tau_p))


@functools.cache
def _jitted_kernel(interpret: bool) -> Any:
    """The kernel, decorated as TRITON_INTERPRET asks (`interpret` is the cache key); the
    vocabulary's size is not specialised on."""
    return jit(_cut_thresholds_kernel, do_not_specialize=("vocab",))


def cut_thresholds(
    probs: torch.Tensor,  # [R, V] float32, rows contiguous
    top_k: torch.Tensor,  # [R] int64
    top_p: torch.Tensor,  # [R] float32
) -> torch.Tensor:
    """`cut_thresholds_reference` as one kernel launch (no host syncs: a CUDA graph captures
    it): [R] float32."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("cut_thresholds needs triton; use cut_thresholds_reference")
    interpret = interpreting()
    check_device("cut_thresholds", [probs, top_k, top_p], interpret)
    rows = probs.shape[0]
    if (
        probs.dim() != 2
        or probs.dtype != torch.float32
        or probs.stride(1) != 1
        or top_k.shape != (rows,)
        or top_p.shape != (rows,)
        or top_k.dtype != torch.int64
        or top_p.dtype != torch.float32
    ):
        raise ValueError(
            "cut_thresholds: probs [R, V] float32 with contiguous rows, top_k [R] int64 and "
            f"top_p [R] float32, got {tuple(probs.shape)} {probs.dtype} stride "
            f"{probs.stride()}, {tuple(top_k.shape)} {top_k.dtype}, {tuple(top_p.shape)} "
            f"{top_p.dtype}"
        )
    out = torch.empty(rows, dtype=torch.float32, device=probs.device)
    if rows == 0:
        return out
    _jitted_kernel(interpret)[(rows,)](
        probs, top_k, top_p, out, probs.stride(0), probs.shape[1],
        SLACK=TOP_P_SLACK, ONE_BITS=_ONE_BITS, STEPS=_SEARCH_STEPS, BLOCK=_BLOCK,
        num_warps=1 if interpret else 8,
    )  # fmt: skip
    return out


# `cut_thresholds_rows` takes the kernel from this many rows up (a batch of 32 chains of 3):
# one program a row, the kernel's passes over fewer rows use as few SMs, and a sort of them is
# quicker. On an H100 (bench/RESULTS.md) the top-p cut of 128 rows cost 0.6 ms with the kernel
# and 1.9 ms sorted at SmolLM2's vocabulary, 3.7 and 3.9 ms at Llama 3's; of 32 rows 0.4 and
# 0.4 ms, 2.4 and 1.2 ms. SPECSPLIT_NUCLEUS_KERNEL=1 / 0: the kernel / the sort at any count.
KERNEL_MIN_ROWS = 128
_KERNEL = os.environ.get("SPECSPLIT_NUCLEUS_KERNEL", "auto")


def cut_thresholds_rows(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The kernel on a GPU (where triton is installed) for KERNEL_MIN_ROWS rows or more, the
    reference elsewhere."""
    enough = probs.shape[0] >= KERNEL_MIN_ROWS if _KERNEL == "auto" else _KERNEL == "1"
    if enough and probs.is_cuda and importlib.util.find_spec("triton") is not None:
        return cut_thresholds(probs.contiguous(), top_k, top_p)
    return cut_thresholds_reference(probs, top_k, top_p)
