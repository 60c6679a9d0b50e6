"""`x @ weight.T + bias`, on the CPU in float32 with each row's result the same whatever the
number of rows.

A greedy verify of 1 + n tokens must give each row the bits a one-token step gives it (so
speculative output is token for token the target alone's), and MKL's `F.linear` picks its
kernel by the row count and the shape (on the ninety-ninth session's VM 1, 2-3 and 4-15 rows
gave a row different bits). Routes, by `SPECSPLIT_CPU_LINEAR`:

- `auto` (default): `fixed` where its kernel builds (a C compiler, an x86 CPU with AVX-512 or
  AVX2 + FMA), else `weight_major`;
- `fixed`: specsplit/model/cpu_gemm.c's kernel, each output summed in one fixed order (exact
  at any row count); on the hundred-and-first session's VM (2-core Intel Xeon, AVX-512) the
  embedded default's 30 layers + LM head in 18 ms at 1 row against 51 weight-major and 17
  through `F.linear`, 27 against 52 at 9 rows, at par at 200 (bench/cpu_linear.py);
- `weight_major`: `weight @ x.T` (a GEMM with a narrow right-hand side), fewer than
  `NARROW_ROWS` rows padded to `NARROW_ROWS` zero rows, so a one-token step and a four-token
  verify run the same kernel (exact up to a few dozen rows: not down_proj's 64 and more);
- `torch`: `F.linear` everywhere (for comparison).

GPUs and non-float32 dtypes always take `F.linear`; a product autograd must differentiate takes
the weight-major route in place of `fixed`.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from specsplit.model import cpu_gemm

NARROW_ROWS = 4
ROUTES = ("auto", "fixed", "weight_major", "torch")


@functools.cache
def cpu_route() -> str:
    """The float32 CPU route $SPECSPLIT_CPU_LINEAR asks, `auto` resolved (which builds the
    fixed-order kernel on first use); `fixed` asked where it cannot build is an error."""
    asked = os.environ.get("SPECSPLIT_CPU_LINEAR", "auto")
    if asked not in ROUTES:
        raise SystemExit(f"SPECSPLIT_CPU_LINEAR={asked!r}: one of {', '.join(ROUTES)}")
    if asked in ("auto", "fixed") and cpu_gemm.library() is not None:
        return "fixed"
    if asked == "fixed":
        raise SystemExit("SPECSPLIT_CPU_LINEAR=fixed: its kernel did not build (see the log)")
    return "weight_major" if asked == "auto" else asked


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in], weight [out, in], bias [out] or None -> [T, out], contiguous."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2):
        return F.linear(x, weight, bias)
    route = cpu_route()
    if route == "torch":
        return F.linear(x, weight, bias)
    assert weight.dtype == x.dtype and weight.shape[1] == x.shape[1], (weight.shape, x.shape)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if route == "fixed" and not needs_grad:  # (the kernel keeps no autograd graph)
        out = cpu_gemm.fixed_linear(x, weight)
    else:
        out = weight_major(x, weight)
    return out if bias is None else out.add_(bias)


def weight_major(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weight-major route: `weight @ x.T` with fewer than NARROW_ROWS rows padded to
    NARROW_ROWS zero rows -> [T, out], contiguous."""
    num_rows = x.shape[0]
    if num_rows < NARROW_ROWS:
        x = torch.cat([x, x.new_zeros(NARROW_ROWS - num_rows, x.shape[1])])
    return torch.matmul(weight, x.t()).t()[:num_rows].contiguous()
