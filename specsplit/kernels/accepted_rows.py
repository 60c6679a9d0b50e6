"""A verify round's hidden-state rows that go to the drafter, gathered back to back on the device.

A round that asks for hidden states computes one row per step token: each sequence's pending
tokens, then its tree nodes. The drafter wants, per sequence that asked, its pending rows and
then the rows of its accepted path, which only the device knows until the round's results
cross. `accepted_rows` launches one Triton kernel that reads the accepted counts and nodes from
the acceptance's packed results and writes those rows back to back from row 0 (sequence after
sequence), so the rows cross to the host in one copy, in the order and layout they leave in: no
host-side pick (on an H100 host a 3 MB host copy takes ~0.3 ms) and no wait for the results
first. `accepted_rows_reference` is the same with the results on the host: the CPU path, and
what the kernel is tested against.

Kernel: one program per (sequence, column block, row group); each finds its sequence's first
output row by summing the rows of the sequences before it, then copies its share of the rows'
columns (a prefill's many rows spread over row groups). The launch depends on host ints only,
no host sync.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, NoReturn

import torch

from specsplit.kernels.triton_jit import check_device, interpreting, jit
from specsplit.model.transfer import take_rows

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)

BLOCK_COLUMNS = 1024  # columns a program copies (the last block masked)
ROWS_PER_PROGRAM = 16  # rows a program copies at most, up to MAX_ROW_GROUPS programs
MAX_ROW_GROUPS = 64
BLOCK_SEQS = 64  # sequences a program sums at once for its first output row


def accepted_rows_reference(
    hidden: torch.Tensor,  # [R, width]: each sequence's pending rows, then one per tree node
    packed: torch.Tensor,  # [>= B, 2 + N] int64: accepted drafts, bonus, accepted nodes (-1 pad)
    starts: list[int],  # [B] each sequence's first row of `hidden`
    pending: list[int],  # [B] its pending tokens
    asks: list[bool],  # [B] whether it wants its rows
    dtype: torch.dtype | None = None,  # the output's (None: hidden's)
) -> torch.Tensor:
    """[rows gathered, width] on the CPU: per asking sequence in order, its pending rows and then
    its accepted nodes' rows (start + p + node), back to back (`accepted_rows` writes the same
    rows at the head of an [R, width] output). The host picks them by numpy (`take_rows`:
    torch's CPU index_select waits for every OpenMP worker)."""
    rows: list[int] = []
    for row, start, p, ask in zip(packed.tolist(), starts, pending, asks, strict=False):
        if ask:
            rows += range(start, start + p)
            rows += [start + p + node for node in row[2 : 2 + row[0]]]
    return take_rows(hidden.cpu().to(dtype or hidden.dtype), rows)


def _accepted_rows_kernel(
    hidden_ptr,  # [R, WIDTH]
    packed_ptr,  # [>= B, 2 + N] int64
    meta_ptr,  # [3, B] int64: starts, pending, asks
    out_ptr,  # [R, WIDTH]
    num_seqs,
    width,
    stride_h,
    stride_p,
    stride_o,
    BLOCK_B: tl.constexpr,  # sequences summed at once
    BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0)
    column_block = tl.program_id(1)
    row_group = tl.program_id(2)  # rows row_group, + num_row_groups, ... of the sequence
    num_row_groups = tl.num_programs(2)
    # the first output row: the rows of the sequences before this one, BLOCK_B at a time
    offset = tl.load(meta_ptr) * 0  # an int64 zero (starts[0])
    for first in range(0, b, BLOCK_B):
        seqs = first + tl.arange(0, BLOCK_B)
        before = seqs < b
        asks = tl.load(meta_ptr + 2 * num_seqs + seqs, mask=before, other=0)
        p_all = tl.load(meta_ptr + num_seqs + seqs, mask=before, other=0)
        a_all = tl.load(packed_ptr + seqs * stride_p, mask=before, other=0)
        keep = tl.where(asks != 0, p_all + a_all, 0)
        offset += tl.reduce(keep, 0, tl.standard._sum_combine)
    start = tl.load(meta_ptr + b)
    p = tl.load(meta_ptr + num_seqs + b)
    ask = tl.load(meta_ptr + 2 * num_seqs + b)
    num_rows = tl.where(ask != 0, p + tl.load(packed_ptr + b * stride_p), 0)
    columns = column_block * BLOCK_W + tl.arange(0, BLOCK_W)
    in_width = columns < width
    for r in range(row_group, num_rows, num_row_groups):
        node = tl.load(packed_ptr + b * stride_p + 2 + r - p, mask=r >= p, other=0)
        source = tl.where(r < p, start + r, start + p + node).to(tl.int64)
        row = tl.load(hidden_ptr + source * stride_h + columns, mask=in_width)
        destination = (offset + r).to(tl.int64)
        tl.store(
            out_ptr + destination * stride_o + columns,
            row.to(out_ptr.dtype.element_ty),
            mask=in_width,
        )


@functools.cache
def _jitted_kernel(interpret: bool) -> Any:
    """The kernel, decorated as TRITON_INTERPRET asks (`interpret` is the cache key); the batch
    and the results' row stride (2 + the tree width) are not specialised per value class, and
    no block size follows the batch: one build serves every round of a model."""
    return jit(_accepted_rows_kernel, do_not_specialize=("num_seqs", "stride_p"))


def accepted_rows(
    hidden: torch.Tensor,  # [R, width], last dim contiguous
    packed: torch.Tensor,  # [>= B, 2 + N] int64 on hidden's device, last dim contiguous
    meta: torch.Tensor,  # [3, B] int64 on hidden's device: starts, pending, asks (0 / 1)
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`accepted_rows_reference` as one kernel launch, the per-sequence lists in `meta` (on the
    device), no host sync: [R, width], the gathered rows at its head, the rest left as they are
    (empty)."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("accepted_rows needs triton; use accepted_rows_reference")
    interpret = interpreting()
    _check_inputs(hidden, packed, meta, interpret)
    out = torch.empty(hidden.shape, dtype=dtype or hidden.dtype, device=hidden.device)
    num_seqs, width = meta.shape[1], hidden.shape[1]
    if num_seqs == 0 or hidden.shape[0] == 0:
        return out
    # rows split over programs, about ROWS_PER_PROGRAM each were one sequence to have them all
    # (a long prompt's); a sequence of fewer rows leaves the groups past them idle
    row_groups = min(-(-hidden.shape[0] // ROWS_PER_PROGRAM), MAX_ROW_GROUPS)
    grid = (num_seqs, -(-width // BLOCK_COLUMNS), row_groups)
    _jitted_kernel(interpret)[grid](
        hidden, packed, meta, out, num_seqs, width,
        hidden.stride(0), packed.stride(0), out.stride(0),
        BLOCK_B=BLOCK_SEQS, BLOCK_W=BLOCK_COLUMNS, num_warps=4,
    )  # fmt: skip
    return out


def _check_inputs(
    hidden: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor, interpret: bool
) -> None:
    def fail(what: str) -> NoReturn:
        raise ValueError(f"accepted_rows: {what}")

    if hidden.dim() != 2 or hidden.stride(1) != 1:
        fail(f"hidden must be [rows, width] with contiguous rows, got {tuple(hidden.shape)} "
             f"strides {hidden.stride()}")  # fmt: skip
    if (
        meta.dim() != 2
        or meta.shape[0] != 3
        or meta.dtype != torch.int64
        or not meta.is_contiguous()
    ):
        fail(f"meta must be a contiguous [3, B] int64, got {tuple(meta.shape)} {meta.dtype}")
    if (
        packed.dim() != 2
        or packed.dtype != torch.int64
        or packed.shape[0] < meta.shape[1]
        or packed.shape[1] < 2
        or packed.stride(1) != 1
    ):
        fail(f"packed must be [>= {meta.shape[1]}, 2 + N] int64 with contiguous rows, got "
             f"{tuple(packed.shape)} {packed.dtype}")  # fmt: skip
    check_device("accepted_rows", [hidden, packed, meta], interpret)
