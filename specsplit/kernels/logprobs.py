"""Log-probabilities of tokens at logits rows, and each row's most likely tokens', one launch
each (verifier/round_logprobs.py: a round's new tokens, where its sequences ask).

`token_logprobs`: one program a query (row, token, results row b): the token's logit at the row
less the row's logsumexp. A query with b >= 0 is a bonus token's: its token and row are read from
the acceptance's results on the device (row b of `packed`: [accepted drafts a, bonus, the
accepted nodes...]; the row is the query's root row + 1 + the last accepted node, or the root
row itself where a = 0). `top_logprobs`: one program a row: its logsumexp, then its k largest
logits, each found by one more pass over the row (the largest below the one before, ties to the
lowest column; the row stays in L2 across its passes), less the logsumexp; each row's k values
then their k columns (as float32: exact below 2**24).

Torch's ops for the same work cost the host ~35 launches a round (logsumexp, topk's several
kernels, gathers, casts): ~1.2 ms a decode step on an H200 host, where a SmolLM2-sized step is
0.5 ms of GPU time. The references (`*_reference`, plain torch) are the CPU path and the tests'
oracle; the kernels also run under TRITON_INTERPRET=1 (float32). No host syncs.

Triton is imported and the kernels jitted on first launch, not at import (triton_jit.py says
why).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from specsplit.kernels.triton_jit import check_device, interpreting, jit

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)

# columns a program reads at a time: one program reads a whole row once a pass (at batch 1 one
# program a row is all the GPU runs), so wide blocks keep the passes few (an 8B's 128256
# columns: 16 a pass)
BLOCK = 8192
INTERPRET_BLOCK = 64


def _logprobs_kernel(
    logits_ptr,  # [rows, n_cols], last dim contiguous
    stride_l,
    n_cols,
    meta_ptr,  # int64 [programs, 3]: row, token, results row b (-1: none)
    packed_ptr,  # the acceptance's results [>= B, packed_width] (read where b >= 0)
    stride_p,
    packed_width,
    out_ptr,  # float32: [programs] (not TOP), [programs, 2 * k] (TOP)
    k,
    TOP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0)
    row = tl.load(meta_ptr + p * 3)
    token = tl.load(meta_ptr + p * 3 + 1)
    b = tl.load(meta_ptr + p * 3 + 2)
    if not TOP:  # a bonus token's query: its token and row from the results
        has = b >= 0
        results = packed_ptr + tl.maximum(b, 0) * stride_p
        accepted = tl.load(results, mask=has, other=0).to(tl.int64)
        bonus = tl.load(results + 1, mask=has, other=0).to(tl.int64)
        last_at = tl.minimum(accepted + 1, packed_width - 1)
        last = tl.load(results + last_at, mask=has & (accepted > 0), other=-1).to(tl.int64)
        row = tl.where(has, row + last + 1, row)
        token = tl.where(has, bonus, token)
    base = logits_ptr + row * stride_l
    cols = tl.arange(0, BLOCK)
    # the row's logsumexp, online over its blocks
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < n_cols, other=-float("inf"))
        x = x.to(tl.float32)
        new_m = tl.maximum(m, tl.reduce(x, 0, tl.standard._elementwise_max))
        s = s * tl.exp(m - new_m) + tl.reduce(tl.exp(x - new_m), 0, tl.standard._sum_combine)
        m = new_m
    lse = m + tl.log(s)
    if TOP:
        prev_v = float("inf")
        prev_i = -1
        for j in range(0, k):
            best_v = -float("inf")
            best_i = n_cols
            for start in range(0, n_cols, BLOCK):
                idx = start + cols
                x = tl.load(base + idx, mask=idx < n_cols, other=-float("inf")).to(tl.float32)
                after = (x < prev_v) | ((x == prev_v) & (idx > prev_i))
                ok = (idx < n_cols) & after
                xv = tl.where(ok, x, -float("inf"))
                top = tl.reduce(xv, 0, tl.standard._elementwise_max)
                col = tl.reduce(
                    tl.where(ok & (xv == top), idx, n_cols), 0, tl.standard._elementwise_min
                )
                better = (top > best_v) | ((top == best_v) & (col < best_i))
                best_v = tl.where(better, top, best_v)
                best_i = tl.where(better, col, best_i)
            tl.store(out_ptr + p * 2 * k + j, best_v - lse)
            tl.store(out_ptr + p * 2 * k + k + j, best_i.to(tl.float32))
            prev_v = best_v
            prev_i = best_i
    else:
        x = tl.load(base + token).to(tl.float32)
        tl.store(out_ptr + p, x - lse)


@functools.cache
def jitted_kernel(interpret: bool) -> Any:
    """The kernel, decorated as TRITON_INTERPRET asks (`interpret` is the cache key); the row
    and column counts and k follow the round and the model: not specialised."""
    return jit(
        _logprobs_kernel,
        do_not_specialize=("stride_l", "n_cols", "stride_p", "packed_width", "k"),
    )


def _usable(logits: torch.Tensor, kernel: bool | None) -> bool:
    """Whether the kernel runs: `kernel`, or where None on a GPU's logits (2-D, last dim
    contiguous, triton installed); the CPU runs the reference (the interpreter would be slower)."""
    if kernel is not None:
        return kernel
    shaped = logits.dim() == 2 and logits.stride(1) == 1
    return logits.is_cuda and shaped and importlib.util.find_spec("triton") is not None


def token_logprobs(
    logits: torch.Tensor,  # [rows, vocab]
    queries: torch.Tensor,  # int64 [Q, 3]: row, token, results row b (-1: none) each
    packed: torch.Tensor,  # the acceptance's results [>= B, W] (int), read where b >= 0
    out: torch.Tensor | None = None,  # float32 [Q], written in place if given
    kernel: bool | None = None,  # the kernel (True) or the reference; None: on a GPU
) -> torch.Tensor:
    """[Q] float32: each query's token's log-probability at its row (module docstring)."""
    if not _usable(logits, kernel):
        return _into(out, token_logprobs_reference(logits, queries, packed))
    return _run("token_logprobs", logits, queries, packed, (queries.shape[0],), 0, out)


def top_logprobs(
    logits: torch.Tensor,  # [rows, vocab]
    rows: torch.Tensor,  # int64 [R, 3]: each program's row in column 0 (the others unread)
    k: int,
    out: torch.Tensor | None = None,  # float32 [R, 2 * k], written in place if given
    kernel: bool | None = None,  # the kernel (True) or the reference; None: on a GPU
) -> torch.Tensor:
    """[R, 2 * k] float32: each row's k largest log-probabilities, then their columns."""
    if not _usable(logits, kernel):
        return _into(out, top_logprobs_reference(logits, rows, k))
    return _run("top_logprobs", logits, rows, rows, (rows.shape[0], 2 * k), k, out, top=True)


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    return result if out is None else out.copy_(result)


def _run(
    name: str,
    logits: torch.Tensor,
    meta: torch.Tensor,
    packed: torch.Tensor,
    shape: tuple[int, ...],
    k: int,  # each row's top k (`top`)
    out: torch.Tensor | None,
    top: bool = False,  # each row's top k, not each query's token
) -> torch.Tensor:
    """The kernel's launch over `meta`'s programs into `out` (made if None) of `shape`."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"{name}: logits must be a 2-D float tensor, last dim contiguous, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    if meta.dim() != 2 or meta.shape[1] != 3 or meta.dtype != torch.int64:
        raise ValueError(f"{name}: meta must be [programs, 3] int64, got {tuple(meta.shape)}")
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=logits.device)
    if out.shape != shape or out.dtype != torch.float32:
        raise ValueError(f"{name}: out must be {list(shape)} float32, got {tuple(out.shape)}")
    interpret = interpreting()
    check_device(name, [logits, meta, packed, out], interpret)
    if meta.shape[0] == 0 or out.numel() == 0:  # (nothing to write: no programs, or k = 0)
        return out
    jitted_kernel(interpret)[(meta.shape[0],)](
        logits, logits.stride(0), logits.shape[1], meta, packed, packed.stride(0),
        packed.shape[1], out, k, TOP=top, BLOCK=INTERPRET_BLOCK if interpret else BLOCK,
        num_warps=1 if interpret else 8,
    )  # fmt: skip
    return out


def _log_softmax_rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)


def token_logprobs_reference(
    logits: torch.Tensor, queries: torch.Tensor, packed: torch.Tensor
) -> torch.Tensor:
    """`token_logprobs` in torch ops (the CPU's path)."""
    row, token, b = queries.long().unbind(1)
    has = b >= 0
    results = packed.index_select(0, b.clamp(min=0)).long()
    accepted = results[:, 0]
    last = results.gather(1, (accepted + 1).clamp(max=results.shape[1] - 1)[:, None])[:, 0]
    row = torch.where(has, row + torch.where(accepted > 0, last + 1, 0), row)
    token = torch.where(has, results[:, 1], token)
    logp = _log_softmax_rows(logits, row)
    return logp.gather(1, token[:, None])[:, 0]


def top_logprobs_reference(logits: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """`top_logprobs` in torch ops (the CPU's path; torch.topk's order among equal values)."""
    logp = _log_softmax_rows(logits, rows[:, 0].long())
    values, columns = logp.topk(k, dim=-1)
    return torch.cat([values, columns.float()], dim=1)
