"""A sampled draft's cut and draw over its support, in one launch (`specsplit.sampling
.draw_from_cut` after its top-k of the vocabulary).

Given each row's likeliest `S` tempered logits, largest first, and the log-normalizer of its
whole row, a row's support distribution is: the probabilities of those tokens (a top-k within
the support cuts the rest and normalises over what it keeps, else over the whole vocabulary),
then only its likeliest tokens whose mass before them is below top-p (less a slack) and below
1 - tail (the first always), renormalized; the draft is drawn from it by inverse CDF at the
row's uniform. `cut_draw_reference` is that as torch ops (about twenty kernels a row's step on a
GPU, each a launch of a few microseconds, inside the drafter's graphs: ~60 launches a sampled
chain of 3 at any batch); `cut_draw` one Triton program a row over its S values, a launch a
step. Their float32 sums may round differently (a draw at a uniform on a boundary of two
tokens' CDF may then pick either); each is exactly the distribution it returns, so the
verifier's acceptance stays lossless whichever runs.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from typing import Any

import torch

from specsplit.kernels.nucleus import TOP_P_SLACK
from specsplit.kernels.triton_jit import check_device, interpreting, jit, next_power_of_2

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)


def cut_draw_reference(
    values: torch.Tensor,  # [R, S] float32 each row's likeliest tempered logits, largest first
    log_norm: torch.Tensor,  # [R] float32 logsumexp of each whole tempered row
    params: torch.Tensor,  # [R, 3] float: temperature (unused here), top_p, top_k (0 = off)
    uniforms: torch.Tensor,  # [R] in [0, 1)
    vocab_size: int,
    tail: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the support's probabilities [R, S] float32, 0 past the cut; the drawn column [R]
    int64): the module's definition as torch ops."""
    support = values.shape[1]
    _, top_p, top_k = params.float().unbind(dim=1)
    rank = torch.arange(support, device=values.device)
    k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    cut = rank >= k[:, None]
    row_norm = torch.where(
        k <= support, torch.logsumexp(values.masked_fill(cut, -math.inf), dim=-1), log_norm
    )
    probs = torch.exp(values - row_norm[:, None]).masked_fill(cut, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    bound = torch.where(top_p >= 1.0, math.inf, top_p - TOP_P_SLACK)  # top-p off: no bound
    if tail > 0:
        bound = bound.clamp(max=1.0 - tail)
    keep = mass_before < bound[:, None]
    probs = probs * (keep | (rank == 0))
    probs = probs / probs.sum(dim=-1, keepdim=True)
    cdf = probs.cumsum(dim=-1)
    at = torch.searchsorted(cdf, (uniforms.float() * cdf[:, -1])[:, None], right=True)
    last = (probs > 0).sum(dim=-1, keepdim=True) - 1  # kept tokens are a prefix
    return probs, torch.minimum(at, last).squeeze(1)


def _cut_draw_kernel(
    values_ptr,  # [R, S] float32, rows contiguous
    log_norm_ptr,  # [R] float32
    params_ptr,  # [R, 3] float32, columns contiguous
    uniforms_ptr,  # [R] float32
    probs_ptr,  # [R, S] float32 out
    pick_ptr,  # [R] int64 out
    params_stride,
    uniforms_stride,
    support,
    vocab,
    bound_cap,  # 1 - tail (> 1: no tail)
    SLACK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    rank = tl.arange(0, BLOCK)
    inside = rank < support
    v = tl.load(values_ptr + row * support + rank, mask=inside, other=-float("inf"))
    top_p = tl.load(params_ptr + row * params_stride + 1)
    top_k = tl.load(params_ptr + row * params_stride + 2)
    k = tl.where((top_k > 0) & (top_k < vocab), top_k, vocab * 1.0)
    cut = (rank.to(tl.float32) >= k) | ~inside
    kept_v = tl.where(cut, -float("inf"), v)
    largest = tl.reduce(kept_v, 0, tl.standard._elementwise_max)
    own = largest + tl.log(tl.reduce(tl.exp(kept_v - largest), 0, tl.standard._sum_combine))
    row_norm = tl.where(k <= support, own, tl.load(log_norm_ptr + row))
    probs = tl.where(cut, 0.0, tl.exp(v - row_norm))
    mass_before = tl.associative_scan(probs, 0, tl.standard._sum_combine) - probs
    bound = tl.where(top_p >= 1.0, 3.0e38, top_p - SLACK)
    bound = tl.minimum(bound, bound_cap)
    probs = tl.where((mass_before < bound) | (rank == 0), probs, 0.0)
    probs = probs / tl.reduce(probs, 0, tl.standard._sum_combine)
    cdf = tl.associative_scan(probs, 0, tl.standard._sum_combine)
    total = tl.reduce(tl.where(rank == support - 1, cdf, 0.0), 0, tl.standard._sum_combine)
    target = tl.load(uniforms_ptr + row * uniforms_stride) * total
    at = tl.reduce(
        tl.where(inside & (cdf <= target), 1, 0).to(tl.int64), 0, tl.standard._sum_combine
    )
    last = tl.reduce((probs > 0).to(tl.int64), 0, tl.standard._sum_combine) - 1
    tl.store(probs_ptr + row * support + rank, probs, mask=inside)
    tl.store(pick_ptr + row, tl.minimum(at, last))


@functools.cache
def _jitted_kernel(interpret: bool) -> Any:
    """The kernel, decorated as TRITON_INTERPRET asks (`interpret` is the cache key)."""
    return jit(_cut_draw_kernel, do_not_specialize=("vocab", "params_stride", "uniforms_stride"))


def cut_draw(
    values: torch.Tensor,
    log_norm: torch.Tensor,
    params: torch.Tensor,
    uniforms: torch.Tensor,
    vocab_size: int,
    tail: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cut_draw_reference` as one launch (no host syncs: a CUDA graph captures it)."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("cut_draw needs triton; use cut_draw_reference")
    interpret = interpreting()
    check_device("cut_draw", [values, log_norm, params, uniforms], interpret)
    rows, support = values.shape if values.dim() == 2 else (-1, -1)
    if (
        rows < 0
        or values.dtype != torch.float32
        or not values.is_contiguous()
        or log_norm.shape != (rows,)
        or log_norm.dtype != torch.float32
        or params.shape != (rows, 3)
        or uniforms.shape != (rows,)
        or not 0 < support <= vocab_size
    ):
        raise ValueError(
            "cut_draw: values [R, S] float32 contiguous (0 < S <= vocab_size), log_norm [R] "
            f"float32, params [R, 3], uniforms [R]; got {tuple(values.shape)} {values.dtype} "
            f"{values.stride()}, {tuple(log_norm.shape)} {log_norm.dtype}, "
            f"{tuple(params.shape)}, {tuple(uniforms.shape)}, vocab_size {vocab_size}"
        )
    if params.dtype != torch.float32 or params.stride(1) != 1:
        params = params.float().contiguous()
    uniforms = uniforms.float()  # a column of a sampled chain's rows (strided): as it is
    probs = torch.empty_like(values)
    pick = torch.empty(rows, dtype=torch.int64, device=values.device)
    if rows == 0:
        return probs, pick
    _jitted_kernel(interpret)[(rows,)](
        values, log_norm, params, uniforms, probs, pick, params.stride(0), uniforms.stride(0),
        support, vocab_size, 1.0 - tail if tail > 0 else 2.0,
        SLACK=TOP_P_SLACK, BLOCK=next_power_of_2(support), num_warps=1 if interpret else 4,
    )  # fmt: skip
    return probs, pick


# SPECSPLIT_CUT_DRAW_KERNEL=0: the reference on a GPU too (an A/B of the two in one benchmark)
_KERNEL = os.environ.get("SPECSPLIT_CUT_DRAW_KERNEL", "1") == "1"


def takes_kernel(values: torch.Tensor) -> bool:
    """Whether the cut and draw of `values` runs as the kernel: on a GPU, where triton is
    installed (the reference elsewhere)."""
    return _KERNEL and values.is_cuda and importlib.util.find_spec("triton") is not None
