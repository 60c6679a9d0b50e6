"""`x @ weight.T + bias`, routed to the faster float32 GEMM on the CPU.

On the CPU, torch's `F.linear` with a few rows (decode and verify steps: 1-16 tokens) runs far
below memory bandwidth with MKL: on the 2-core development VM (AMD EPYC, MKL), the embedded
default's 30 layers + LM head take ~34 ms per step at 1 row and ~52 ms at 4 rows, while the same
products computed weight-major (`weight @ x.T`, a GEMM with a narrow right-hand side) take ~17 ms
at 4 rows. With fewer than `NARROW_ROWS` rows the input is padded to `NARROW_ROWS` zero rows, so a
one-token step and a four-token verify run the same kernel: each output row is then the same
whatever else is in the batch.

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
