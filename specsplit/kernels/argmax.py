"""Greedy decoding's argmax over a step's logits rows, split across programs.

`torch.argmax` over a [rows, vocab] tensor runs one block a row, so a decode step at batch 1
waits on one SM reading the whole vocabulary (11.8 us for SmolLM2's 49152 bf16 columns on an
H200, ~2% of its 0.52 ms step). `argmax_rows` cuts each row into chunks of `chunk` columns: one
program a (row, chunk) finds its chunk's largest value and the lowest column holding it, and a
second launch, one program a row, takes the largest of those and its lowest column: 1.9 us at 1
row, 3.8 at 32 (bench/argmax_kernel.py, in CUDA graphs). Ties go to the lowest column and NaN
counts as the largest value, as torch.argmax does; the result equals `argmax_reference`
(torch.argmax) exactly. No host syncs: capturable in a CUDA graph.

Its two launches cost the host more than torch's one, so it is meant for graphs: the verifier's
forward graphs take each step's argmax beside its logits (specsplit/model/graph_buffers.py) and
the drafter's expansion graphs each greedy chain step's (`greedy_tokens`).

Triton is imported and the kernels jitted on first launch, not at import (triton_jit.py says
why).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

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

CHUNK = 1024  # columns a first-stage program reads


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """[rows] int64: each row's column of its largest value (lowest on ties)."""
    return logits.argmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[rows] int64, each row's argmax: `argmax_rows` on a GPU (2-D, last dim contiguous),
    torch.argmax elsewhere (the CPU, where the interpreter would be far slower)."""
    usable = logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1
    if usable and importlib.util.find_spec("triton") is not None and not torch.version.hip:
        return argmax_rows(logits)
    return argmax_reference(logits)


def _chunk_max_kernel(
    x_ptr,  # [rows, n_cols], last dim contiguous
    vals_ptr,  # [rows, num_chunks] float32
    cols_ptr,  # [rows, num_chunks] int32
    n_cols,
    stride_x,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < n_cols,
                other=float("-inf")).to(tl.float32)  # fmt: skip
    x = tl.where(x != x, float("inf"), x)  # NaN is the largest, as in torch.argmax
    best = tl.reduce(x, 0, tl.standard._elementwise_max)
    col = tl.reduce(tl.where(x == best, cols, n_cols), 0, tl.standard._elementwise_min)
    at = row * tl.num_programs(1) + chunk
    tl.store(vals_ptr + at, best)
    tl.store(cols_ptr + at, col)


def _rows_max_kernel(
    vals_ptr,  # [rows, num_chunks] float32
    cols_ptr,  # [rows, num_chunks] int32
    out_ptr,  # [rows] int64
    num_chunks,
    BLOCK: tl.constexpr,  # >= num_chunks
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK)
    ok = chunks < num_chunks
    vals = tl.load(vals_ptr + row * num_chunks + chunks, mask=ok, other=float("-inf"))
    cols = tl.load(cols_ptr + row * num_chunks + chunks, mask=ok, other=2**31 - 1)
    best = tl.reduce(vals, 0, tl.standard._elementwise_max)
    # the lowest column among the chunks holding the largest value (chunks past the row's
    # end never hold it: their value is -inf, and a row of -inf ties at column 0)
    col = tl.reduce(tl.where(vals == best, cols, 2**31 - 1), 0, tl.standard._elementwise_min)
    tl.store(out_ptr + row, col.to(tl.int64))


@functools.cache
def jitted_kernels(interpret: bool) -> tuple[Any, Any]:
    """(chunk, rows) kernels, decorated as TRITON_INTERPRET asks (`interpret` is the cache key).
    The row and column counts follow the batch and the vocabulary: not specialised."""
    return (
        jit(_chunk_max_kernel, do_not_specialize=("n_cols", "stride_x")),
        jit(_rows_max_kernel, do_not_specialize=("num_chunks",)),
    )


def argmax_rows(
    logits: torch.Tensor,  # [rows, n_cols] float, last dim contiguous
    out: torch.Tensor | None = None,  # [rows] int64, written in place if given
    *,
    chunk: int | None = None,  # columns a first-stage program reads (None: CHUNK)
) -> torch.Tensor:
    """[rows] int64: argmax_reference(logits), from two launches (module docstring)."""
    interpret = interpreting()
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"argmax_rows: logits must be a 2-D float tensor, last dim contiguous, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    rows, n_cols = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if out.shape != (rows,) or out.dtype != torch.int64:
        raise ValueError(f"argmax_rows: out must be [{rows}] int64, got {tuple(out.shape)}")
    check_device("argmax_rows", [logits, out], interpret)
    if rows == 0:
        return out
    if n_cols == 0:
        raise ValueError("argmax_rows: no columns")
    chunk = chunk or (64 if interpret else CHUNK)
    num_chunks = -(-n_cols // chunk)
    vals = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    cols = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    chunk_kernel, rows_kernel = jitted_kernels(interpret)
    dependent = pdl(logits.device)
    launch = pdl_launch(dependent)
    chunk_kernel[(rows, num_chunks)](
        logits, vals, cols, n_cols, logits.stride(0),
        CHUNK=chunk, PDL=dependent, num_warps=1 if interpret else 4, **launch,
    )  # fmt: skip
    rows_kernel[(rows,)](
        vals, cols, out, num_chunks,
        BLOCK=max(16, next_power_of_2(num_chunks)), PDL=dependent, num_warps=1, **launch,
    )  # fmt: skip
    return out
