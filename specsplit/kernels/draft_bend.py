"""The drafter's logit rules on a step's rows (drafter/draft_rules.py's RuleTables.bend): every row
bent at its sequence's slot of the [slots, columns] tables, in `bend_row`'s order and float32 ops
(specsplit/logit_rules.py): bias, repetition, presence and frequency, then (the roots' rows) a
guide's root mask.

On a GPU `bend_drafts` is one launch, a program a (row, block of columns), where torch's ops
for the same work are ~17 launches a bend (three bends a chain of 3, inside the expansion's CUDA
graph: a batch-1 Draft 0.40 -> 0.86 ms on an H200, bench/RESULTS.md). It runs without fused
multiply-adds and with IEEE division, so its rows equal `bend_drafts_reference`'s (torch's ops: the
CPU's path and the tests' oracle) bit for bit. No host syncs; it also runs under
TRITON_INTERPRET=1 (float32). Triton is imported and the kernel jitted on first launch
(triton_jit.py says why).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, NamedTuple

import torch

from specsplit.kernels.triton_jit import check_device, interpreting, jit

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)

BLOCK = 1024  # columns a program reads
INTERPRET_BLOCK = 64


class DraftTables(NamedTuple):
    """The rows a bend reads, [slots, columns] each on one device: `bias`, `counts` and `root`
    (float32), `prompt` (bool), and `params` [slots, 3] float32 (repetition, presence,
    frequency)."""

    bias: torch.Tensor
    counts: torch.Tensor
    prompt: torch.Tensor
    root: torch.Tensor
    params: torch.Tensor


def bend_drafts(
    logits: torch.Tensor,  # [R, columns] float32
    slots: torch.Tensor,  # [R] int32 or int64: each row's slot
    tables: DraftTables,
    root: bool = False,  # the roots' rows: the root mask bends them too
    kernel: bool | None = None,  # the kernel (True) or the reference; None: on a GPU
) -> torch.Tensor:
    """The rows bent (a new tensor): the kernel, or its reference (module docstring)."""
    if not (_usable(logits) if kernel is None else kernel):
        return bend_drafts_reference(logits, slots, tables, root)
    slots = slots.contiguous()  # (a tree step's are its roots' expanded: a stride of 0)
    _check(logits, slots, tables)
    rows, columns = logits.shape
    out = torch.empty_like(logits)
    if not rows:
        return out
    interpret = interpreting()
    block = INTERPRET_BLOCK if interpret else BLOCK
    _jitted(interpret)[(rows, -(-columns // block))](
        logits, logits.stride(0), out, slots, tables.bias, tables.counts,
        tables.prompt.view(torch.uint8), tables.root, tables.params, columns, ROOT=root,
        BLOCK=block, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def bend_drafts_reference(
    logits: torch.Tensor, slots: torch.Tensor, tables: DraftTables, root: bool = False
) -> torch.Tensor:
    """`bend_drafts` as torch's ops (a graph captures them too)."""
    params = tables.params[slots]
    repetition, presence, frequency = params[:, :1], params[:, 1:2], params[:, 2:]
    counts = tables.counts[slots]
    occurs = counts > 0
    bent = logits + tables.bias[slots]
    seen = tables.prompt[slots] | occurs
    bent = torch.where(seen, torch.where(bent > 0, bent / repetition, bent * repetition), bent)
    bent = bent - (counts * frequency + occurs * presence)  # (bend_row's float32 ops)
    return bent + tables.root[slots] if root else bent


def write_roots(
    root: torch.Tensor,  # [slots, columns] float32: the tables' root rows, written in place
    table: torch.Tensor,  # [J, 2 + words] int32: per row its slot, 1 (masked) or 0, mask words
    word_of: torch.Tensor,  # [columns] int64: each column's token's mask word
    bit_of: torch.Tensor,  # [columns] int32: its bit in that word
    kernel: bool | None = None,  # the kernel (True) or the reference; None: on a GPU
) -> None:
    """Each table row's slot's root row written: a masked row 0 where its mask allows the
    column's token and -inf where not, an unmasked (cleared) one 0 everywhere. One launch on a
    GPU (where torch's ops are ~7 launches and an indexed clear from a host list waits for
    the device), its reference elsewhere; both write the same bits."""
    if not (_usable(root) if kernel is None else kernel):
        write_roots_reference(root, table, word_of, bit_of)
        return
    _check_roots(root, table, word_of, bit_of)
    rows, columns = table.shape[0], root.shape[1]
    if not rows:
        return
    interpret = interpreting()
    block = INTERPRET_BLOCK if interpret else BLOCK
    _roots_jitted(interpret)[(rows, -(-columns // block))](
        root, table, table.stride(0), word_of, bit_of, columns, BLOCK=block
    )


def write_roots_reference(
    root: torch.Tensor, table: torch.Tensor, word_of: torch.Tensor, bit_of: torch.Tensor
) -> None:
    """`write_roots` as torch's ops."""
    allowed = (table[:, 1:2] == 0).expand(-1, root.shape[1])  # (a cleared row: every token)
    if table.shape[1] > 2:
        allowed = allowed | (((table[:, 2:][:, word_of] >> bit_of) & 1) == 1)
    root.index_copy_(0, table[:, 0].long(), torch.where(allowed, 0.0, -torch.inf))


def _check_roots(
    root: torch.Tensor, table: torch.Tensor, word_of: torch.Tensor, bit_of: torch.Tensor
) -> None:
    """ValueError unless `write_roots`' kernel can read these."""
    if root.dtype != torch.float32 or root.dim() != 2 or not root.is_contiguous():
        raise ValueError("root must be contiguous float32 [slots, columns]")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[1] < 2:
        raise ValueError("table must be int32 [rows, 2 + words]")
    if table.stride(1) != 1:
        raise ValueError("table's rows must be contiguous")
    columns = root.shape[1]
    if word_of.dtype != torch.int64 or word_of.shape != (columns,):
        raise ValueError(f"word_of must be int64 [{columns}]")
    if bit_of.dtype != torch.int32 or bit_of.shape != (columns,):
        raise ValueError(f"bit_of must be int32 [{columns}]")
    check_device("write_roots", [root, table, word_of, bit_of], interpreting())


def _usable(logits: torch.Tensor) -> bool:
    """Whether the kernel runs: on a GPU's rows (2-D, last dim contiguous, triton there)."""
    shaped = logits.dim() == 2 and logits.stride(1) == 1
    return logits.is_cuda and shaped and importlib.util.find_spec("triton") is not None


def _check(logits: torch.Tensor, slots: torch.Tensor, tables: DraftTables) -> None:
    """ValueError unless the kernel can read these (shapes, dtypes, strides, one device)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be 2-D float32 with contiguous rows")
    if slots.dtype not in (torch.int32, torch.int64) or slots.shape != logits.shape[:1]:
        raise ValueError("slots must be int32 or int64, one a row")
    if not slots.is_contiguous():
        raise ValueError("slots must be contiguous")
    columns = logits.shape[1]
    shape = tables.bias.shape
    for name, table, dtype in (("bias", tables.bias, torch.float32),
                               ("counts", tables.counts, torch.float32),
                               ("prompt", tables.prompt, torch.bool),
                               ("root", tables.root, torch.float32)):  # fmt: skip
        if table.dtype != dtype or table.shape != shape or not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dtype} [slots, {columns}]")
    if shape[1] != columns:
        raise ValueError(f"the tables have {shape[1]} columns, the logits {columns}")
    params = tables.params
    if params.dtype != torch.float32 or params.shape != (shape[0], 3) or not params.is_contiguous():
        raise ValueError("params must be contiguous float32 [slots, 3]")
    check_device("bend_drafts", [logits, slots, *tables], interpreting())


def _draft_bend_kernel(
    logits_ptr, stride_l, out_ptr, slots_ptr, bias_ptr, counts_ptr, prompt_ptr, root_ptr,
    params_ptr, columns, ROOT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < columns
    slot = tl.load(slots_ptr + row).to(tl.int64)
    at = slot * columns + cols
    x = tl.load(logits_ptr + row * stride_l + cols, mask=inside, other=0.0)
    x = x + tl.load(bias_ptr + at, mask=inside, other=0.0)
    counts = tl.load(counts_ptr + at, mask=inside, other=0.0)
    occurs = counts > 0
    seen = (tl.load(prompt_ptr + at, mask=inside, other=0) != 0) | occurs
    repetition = tl.load(params_ptr + slot * 3)
    presence = tl.load(params_ptr + slot * 3 + 1)
    frequency = tl.load(params_ptr + slot * 3 + 2)
    repeated = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
    x = tl.where(seen, repeated, x)
    x = x - (counts * frequency + tl.where(occurs, 1.0, 0.0) * presence)
    if ROOT:
        x = x + tl.load(root_ptr + at, mask=inside, other=0.0)
    tl.store(out_ptr + row * columns + cols, x, mask=inside)


@functools.cache
def _jitted(interpret: bool) -> Any:
    """The kernel, decorated as TRITON_INTERPRET asks (`interpret` is the cache key)."""
    return jit(_draft_bend_kernel, do_not_specialize=("stride_l", "columns"))


def _write_roots_kernel(
    root_ptr, table_ptr, stride_t, word_of_ptr, bit_of_ptr, columns, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < columns
    slot = tl.load(table_ptr + row * stride_t).to(tl.int64)
    masked = tl.load(table_ptr + row * stride_t + 1) != 0
    word_at = tl.load(word_of_ptr + cols, mask=inside, other=0)
    bit = tl.load(bit_of_ptr + cols, mask=inside, other=0)
    # (a cleared row may have no words: nothing is read where it is not masked)
    word = tl.load(table_ptr + row * stride_t + 2 + word_at, mask=inside & masked, other=-1)
    allowed = ((word >> bit) & 1) == 1
    tl.store(root_ptr + slot * columns + cols, tl.where(allowed, 0.0, -float("inf")), mask=inside)


@functools.cache
def _roots_jitted(interpret: bool) -> Any:
    """`_write_roots_kernel`, decorated as TRITON_INTERPRET asks."""
    return jit(_write_roots_kernel, do_not_specialize=("stride_t", "columns"))
