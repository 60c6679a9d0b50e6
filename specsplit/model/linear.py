"""`x @ weight.T + bias`, on the CPU in float32 as one kernel whatever the number of rows.

On the CPU the products are computed weight-major (`weight @ x.T`, a GEMM with a narrow
right-hand side), and with fewer than `NARROW_ROWS` rows the input is padded to `NARROW_ROWS`
zero rows, so a one-token step and a four-token verify run the same kernel: each output row is
then the same whatever else is in the batch (MKL's `F.linear` picks its kernel by the row count
and the shape: on the ninety-ninth session's VM 1, 2-3 and 4-15 rows gave a row different bits).
Its speed against `F.linear` depends on the CPU:
on the seventy-fourth session's 2-core VM (AMD EPYC, MKL) the embedded default's 30 layers + LM
head took ~17 ms weight-major at 4 rows against ~34 ms through `F.linear` at 1 row; on the
ninety-ninth session's 56 ms against 20 ms at 1 row, 38 at 4 and 47 at 8 (`bench/RESULTS.md`).

`SPECSPLIT_CPU_LINEAR=torch` keeps `F.linear` everywhere (for comparison). GPUs and non-float32
dtypes always take `F.linear`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

NARROW_ROWS = 4
WEIGHT_MAJOR = os.environ.get("SPECSPLIT_CPU_LINEAR", "weight_major") != "torch"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in], weight [out, in], bias [out] or None -> [T, out], contiguous."""
    if not (WEIGHT_MAJOR and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2):
        return F.linear(x, weight, bias)
    assert weight.dtype == x.dtype and weight.shape[1] == x.shape[1], (weight.shape, x.shape)
    num_rows = x.shape[0]
    if num_rows < NARROW_ROWS:
        x = torch.cat([x, x.new_zeros(NARROW_ROWS - num_rows, x.shape[1])])
    out = torch.matmul(weight, x.t()).t()[:num_rows].contiguous()  # [T, out]
    return out if bias is None else out.add_(bias)
