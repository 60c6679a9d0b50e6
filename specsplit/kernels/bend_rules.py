"""A round's logit rules applied on the device (verifier/round_rules.py builds their table): the
kept rows brought up to date, then every rule row's logits bent in `bend_row`'s order and float32
ops (specsplit/logit_rules.py): bias, repetition, presence and frequency, min_tokens' stops, a
guide's mask, min_p's cut.

The round's table is one int32 [3, width] tensor on the device, parts side by side (`Layout`
says where): its eight sections of (owner, token, value) entries (`SECTIONS`), per rule row its
(logits row, sequence, mask) and its paths' and stops' first entries, per sequence the float32
bits of its repetition, frequency and presence, then of min_p's cut beside its slot in the kept
rows, and the guide's mask words, three to a column. The kept rows (verifier/rule_rows.py) are
[slots, vocab] tables: bias and output counts (float32), prompt tokens seen (bool).

On a GPU, `bend_rows` launches three kernels, where torch's ops for the same work cost the host
~35 launches a round (~1.1 ms a SmolLM2 decode step at batch 1 on an H200, bench/RESULTS.md):
`_count_in_kernel` adds the commits' tokens to the kept counts (atomics of whole numbers: exact
in any order); `_bend_kernel`, a program a (rule row, block of the vocabulary), reads the row's
kept rows by its slot, counts its path and pending tokens in by comparison (a path holds at
most the tree's depth), and bends the block in place; `_min_p_kernel`, a program a rule row
(only where a sequence asks for min_p), takes the bent row's largest logit and cuts below it.
They run without fused multiply-adds and with IEEE division, so their rows equal the references'
(`*_reference`, torch ops: the CPU's path and the tests' oracle) bit for bit. The slots refilled
(a first round, another context) are brought up by torch ops on either path (`refill_rows`).
No host syncs. The kernels also run under TRITON_INTERPRET=1 (float32).

Triton is imported and the kernels jitted on first launch, not at import (triton_jit.py says
why).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specsplit.kernels.triton_jit import check_device, interpreting, jit
from specsplit.logit_rules import mask_words

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)

# the table's sections, each [3, n]: (slot, token, value) for the rows refilled and the deltas
# counted in; (rule row, token, value) for the paths and the stops; a step run ahead's
# (`pending`): (rule row, the row's input, 0); the slots refilled: (slot, 0, 0)
SECTIONS = BIAS, COUNTS, PROMPT, DELTAS, PATHS, STOPS, PENDING, CLEAR = range(8)

BLOCK = 2048  # columns a bending program reads
ROW_BLOCK = 8192  # columns min_p's programs read at a time (a whole row a program)
INTERPRET_BLOCK = 64


@dataclass(frozen=True)
class Layout:
    """Where a round's table holds what (module docstring): each section's first column and,
    last, where the sections end (`starts`, len 9); the rule rows (`rows`), their extents (R + 1
    columns: first path entry, first stop entry, relative to their sections), the sequences'
    penalties (`seqs`, K columns) and cuts and slots (K more), the mask words' first column
    (`words`, `num_words` words); and which rules the round's rows read."""

    starts: tuple[int, ...]
    num_rows: int
    num_seqs: int
    num_words: int
    biased: bool  # a sequence has a bias
    counted: bool  # a sequence has a penalty that reads its counts
    repeats: bool  # a sequence has a repetition penalty
    cut: bool  # a sequence has min_p

    @property
    def rows(self) -> int:
        return self.starts[-1]

    @property
    def extents(self) -> int:
        return self.rows + self.num_rows

    @property
    def seqs(self) -> int:
        return self.extents + self.num_rows + 1

    @property
    def words(self) -> int:
        return self.seqs + 2 * self.num_seqs

    def size(self, section: int) -> int:
        return self.starts[section + 1] - self.starts[section]

    def section(self, table: torch.Tensor, section: int) -> torch.Tensor:
        """[3, n] int64: the section's entries."""
        return table[:, self.starts[section] : self.starts[section + 1]].long()


def as_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as the int32 holding their bits (the table is one int32 array)."""
    return values.astype(np.float32).view(np.int32)


def usable(logits: torch.Tensor) -> bool:
    """Whether the kernels run: on a GPU's logits (2-D, last dim contiguous, triton there); the
    CPU runs the references (the interpreter would be slower)."""
    shaped = logits.dim() == 2 and logits.stride(1) == 1
    return logits.is_cuda and shaped and importlib.util.find_spec("triton") is not None


def refill_rows(
    table: torch.Tensor, layout: Layout, kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """The slots in CLEAR cleared, then filled from BIAS, COUNTS and PROMPT (torch ops: a
    sequence's first round, or rules of another context)."""
    bias_t, counts_t, seen_t = kept
    vocab = bias_t.shape[1]
    if layout.size(CLEAR):
        clear = layout.section(table, CLEAR)[0]
        for kept_table in kept:
            kept_table.index_fill_(0, clear, 0)  # (a value, not a tensor from the host: no sync)
    for section, kept_table in ((BIAS, bias_t), (COUNTS, counts_t), (PROMPT, seen_t)):
        if layout.size(section):
            slot, token, value = layout.section(table, section)
            if section == BIAS:
                value = value.int().view(torch.float32)
            kept_table.view(-1)[slot * vocab + token] = value.to(kept_table.dtype)


def count_in_reference(table: torch.Tensor, layout: Layout, counts: torch.Tensor) -> None:
    """The DELTAS section's tokens added to the kept counts (a token twice: counted twice)."""
    if layout.size(DELTAS):
        slot, token, value = layout.section(table, DELTAS)
        vocab = counts.shape[1]
        counts.view(-1).index_put_((slot * vocab + token,), value.float(), accumulate=True)


def bend_reference(
    logits: torch.Tensor,  # [L, vocab] float32, bent in place
    table: torch.Tensor,
    layout: Layout,
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pending: torch.Tensor | None,  # a step run ahead's input tokens, one an input
) -> None:
    """Every rule row's logits bent by its sequence's rules (module docstring), torch ops."""
    bias_t, counts_t, seen_t = kept
    vocab = logits.shape[1]
    rule_rows = table[:, layout.rows : layout.extents].long()
    rows_at, ks = rule_rows[0], rule_rows[1]
    per_seq = table[:, layout.seqs : layout.seqs + 2 * layout.num_seqs]
    scalar = per_seq[:, : layout.num_seqs].contiguous().view(torch.float32)  # [3, K]
    cuts = per_seq[0, layout.num_seqs :].contiguous().view(torch.float32)  # [K]
    slots = per_seq[1, layout.num_seqs :].long()[ks]  # [R]: each row's slot
    x = logits[rows_at]  # [R, vocab]
    if layout.biased:
        x = x + bias_t[slots]
    if layout.counted:
        count = counts_t[slots]  # [R, vocab]: each row's output counts, plus its path's
        cells = count.view(-1)
        paths = layout.section(table, PATHS)
        cells.scatter_add_(0, paths[0] * vocab + paths[1], paths[2].to(logits.dtype))
        if pending is not None:  # (each rule row: its input's token, once)
            pend = layout.section(table, PENDING)
            drawn = pending.to(torch.int64)[pend[1]]
            ones = torch.ones_like(drawn, dtype=cells.dtype)
            cells.scatter_add_(0, pend[0] * vocab + drawn, ones)
        present = count > 0
        repetition, frequency, presence = (s[ks][:, None] for s in scalar)
        if layout.repeats:  # (x / 1 and x * 1 are x: the rows without it keep theirs)
            seen = present | seen_t[slots]
            x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - (frequency * count + presence * present)
    if layout.size(STOPS):
        stops = layout.section(table, STOPS)
        x[stops[0], stops[1]] = torch.full((), -math.inf, device=x.device)  # (no host copy)
    if layout.num_words:
        words = table[:, layout.words :].t().reshape(-1)[: layout.num_words]  # (the host's order)
        x.masked_fill_(~_allowed(words, rule_rows[2], vocab), -torch.inf)
    if layout.cut:  # (a cut of -inf keeps every token)
        below = x.max(dim=-1, keepdim=True).values + cuts[ks][:, None]
        x = torch.where(x < below, -torch.inf, x)
    logits[rows_at] = x


def _allowed(words: torch.Tensor, mask_of: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] bool: each rule row's allowed tokens from the masks' words (int32, mask after
    mask, 32 tokens a word, the lowest bit first) and its mask (< 0, NO_MASK: every token)."""
    num_words = mask_words(vocab)
    masks = words.new_empty(len(words) // num_words, 4 * num_words, dtype=torch.uint8)
    masks.view(torch.int32).copy_(words.view(-1, num_words))  # [M, 4 words]: 8 tokens a byte
    every = torch.full_like(masks[:1], 255)  # the last: NO_MASK's
    rows = torch.cat([masks, every])[torch.where(mask_of < 0, len(masks), mask_of)]
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    return ((rows[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()


def bend_rows(
    logits: torch.Tensor,
    table: torch.Tensor,
    layout: Layout,
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pending: torch.Tensor | None = None,
    kernel: bool | None = None,  # the kernels (True) or the references; None: on a GPU
) -> None:
    """The kept rows brought up to date (`refill_rows`, then the deltas counted in) and every
    rule row's logits bent in place: the kernels, or their references (module docstring)."""
    refill_rows(table, layout, kept)
    if not (usable(logits) if kernel is None else kernel):
        count_in_reference(table, layout, kept[1])
        bend_reference(logits, table, layout, kept, pending)
        return
    _check(logits, table, kept, pending)
    bias_t, counts_t, seen_t = kept
    interpret = interpreting()
    count_in, bend, cut = jitted_kernels(interpret)
    vocab, width = logits.shape[1], table.shape[1]
    block = INTERPRET_BLOCK if interpret else BLOCK
    starts = layout.starts
    if layout.size(DELTAS):
        count_in[(_cdiv(layout.size(DELTAS), block),)](
            table, width, starts[DELTAS], layout.size(DELTAS), counts_t, vocab, BLOCK=block
        )
    if not layout.num_rows:
        return
    bend[(layout.num_rows, _cdiv(vocab, block))](
        logits, logits.stride(0), vocab, table, width, layout.rows, layout.extents, layout.seqs,
        starts[PATHS], starts[STOPS], starts[PENDING], layout.words, layout.num_seqs,
        mask_words(vocab), bias_t, counts_t, seen_t.view(torch.uint8),
        pending if pending is not None else table, BIASED=layout.biased, COUNTED=layout.counted,
        REPEATS=layout.repeats, STOPS=layout.size(STOPS) > 0, MASKS=layout.num_words > 0,
        PENDING=pending is not None, BLOCK=block, enable_fp_fusion=False,
    )  # fmt: skip
    if layout.cut:
        cut[(layout.num_rows,)](
            logits, logits.stride(0), vocab, table, width, layout.rows, layout.seqs,
            layout.num_seqs, BLOCK=INTERPRET_BLOCK if interpret else ROW_BLOCK,
            num_warps=1 if interpret else 8, enable_fp_fusion=False,
        )  # fmt: skip


def _cdiv(n: int, block: int) -> int:
    return -(-n // block)


def _check(
    logits: torch.Tensor,
    table: torch.Tensor,
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pending: torch.Tensor | None,
) -> None:
    """ValueError unless the kernels can read the tensors as they are."""
    vocab = logits.shape[1]
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype != torch.float32:
        raise ValueError(
            f"bend_rows: logits must be 2-D float32, last dim contiguous, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    if table.dim() != 2 or table.shape[0] != 3 or table.dtype != torch.int32:
        raise ValueError(f"bend_rows: table must be [3, width] int32, got {tuple(table.shape)}")
    if not table.is_contiguous():
        raise ValueError("bend_rows: table must be contiguous")
    for kept_table, dtype in zip(kept, (torch.float32, torch.float32, torch.bool), strict=True):
        if kept_table.dtype != dtype or kept_table.shape[1:] != (vocab,):
            raise ValueError(
                f"bend_rows: kept rows must be [slots, {vocab}] {dtype}, got "
                f"{tuple(kept_table.shape)} {kept_table.dtype}"
            )
        if not kept_table.is_contiguous():
            raise ValueError("bend_rows: kept rows must be contiguous")
    if pending is not None and (pending.dim() != 1 or pending.dtype.is_floating_point):
        raise ValueError(f"bend_rows: pending must be 1-D integers, got {pending.dtype}")
    more = [] if pending is None else [pending]
    check_device("bend_rows", [logits, table, *kept, *more], interpreting())


def _count_in_kernel(
    table_ptr,  # int32 [3, width]
    width,
    deltas_at,  # the DELTAS section's first column
    num_deltas,
    counts_ptr,  # float32 [slots, vocab]
    vocab,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < num_deltas
    slot = tl.load(table_ptr + deltas_at + i, mask=ok, other=0).to(tl.int64)
    token = tl.load(table_ptr + width + deltas_at + i, mask=ok, other=0).to(tl.int64)
    value = tl.load(table_ptr + 2 * width + deltas_at + i, mask=ok, other=0).to(tl.float32)
    tl.atomic_add(counts_ptr + slot * vocab + token, value, mask=ok)


def _bend_kernel(
    logits_ptr,  # float32 [L, vocab], last dim contiguous
    stride_l,
    vocab,
    table_ptr,  # int32 [3, width]: the round's table (module docstring)
    width,
    rows_at,  # the parts' first columns (`Layout`)
    extents_at,
    seqs_at,
    paths_at,
    stops_at,
    pending_at,
    words_at,
    num_seqs,
    num_words,  # a mask's words
    bias_ptr,  # float32 [slots, vocab]
    counts_ptr,  # float32 [slots, vocab]
    seen_ptr,  # uint8 [slots, vocab]
    pending_ptr,  # [inputs] integers (read where PENDING)
    BIASED: tl.constexpr,
    COUNTED: tl.constexpr,
    REPEATS: tl.constexpr,
    STOPS: tl.constexpr,
    MASKS: tl.constexpr,
    PENDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    t1 = table_ptr + width
    t2 = table_ptr + 2 * width
    row = tl.load(table_ptr + rows_at + r).to(tl.int64)
    inside = inside & (row >= 0)  # (a padding rule row of a fixed layout: -1, bends nothing)
    k = tl.load(t1 + rows_at + r)
    slot = tl.load(t1 + seqs_at + num_seqs + k).to(tl.int64)
    at = logits_ptr + row * stride_l + cols
    x = tl.load(at, mask=inside, other=0.0)
    kept = slot * vocab + cols
    if BIASED:
        x = x + tl.load(bias_ptr + kept, mask=inside, other=0.0)
    if COUNTED:
        count = tl.load(counts_ptr + kept, mask=inside, other=0.0)
        first = tl.load(table_ptr + extents_at + r)
        last = tl.load(table_ptr + extents_at + r + 1)
        for j in range(first, last):  # the row's path: a token each
            token = tl.load(t1 + paths_at + j)
            value = tl.load(t2 + paths_at + j).to(tl.float32)
            count = count + tl.where(cols == token, value, 0.0)
        if PENDING:  # (the row's input's token, once)
            drawn = tl.load(pending_ptr + tl.load(t1 + pending_at + r)).to(tl.int32)
            count = count + tl.where(cols == drawn, 1.0, 0.0)
        present = count > 0
        frequency = tl.load(t1 + seqs_at + k).to(tl.float32, bitcast=True)
        presence = tl.load(t2 + seqs_at + k).to(tl.float32, bitcast=True)
        if REPEATS:
            repetition = tl.load(table_ptr + seqs_at + k).to(tl.float32, bitcast=True)
            seen = present | (tl.load(seen_ptr + kept, mask=inside, other=0) != 0)
            repeated = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
            x = tl.where(seen, repeated, x)
        x = x - (frequency * count + presence * present.to(tl.float32))
    if STOPS:
        first = tl.load(t1 + extents_at + r)
        last = tl.load(t1 + extents_at + r + 1)
        for j in range(first, last):  # the stop tokens min_tokens holds back at the row
            x = tl.where(cols == tl.load(t1 + stops_at + j), -float("inf"), x)
    if MASKS:
        mask = tl.load(t2 + rows_at + r)
        word = tl.maximum(mask, 0).to(tl.int64) * num_words + cols // 32
        # the words three to a column, in the host's order
        at_word = table_ptr + (word % 3) * width + words_at + word // 3
        bits = tl.load(at_word, mask=inside & (mask >= 0), other=-1)
        x = tl.where(((bits >> (cols % 32)) & 1) != 0, x, -float("inf"))
    tl.store(at, x, mask=inside)


def _min_p_kernel(
    logits_ptr,  # float32 [L, vocab], last dim contiguous
    stride_l,
    vocab,
    table_ptr,  # int32 [3, width]
    width,
    rows_at,
    seqs_at,
    num_seqs,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    row = tl.load(table_ptr + rows_at + r).to(tl.int64)
    k = tl.load(table_ptr + width + rows_at + r)
    cut = tl.load(table_ptr + seqs_at + num_seqs + k).to(tl.float32, bitcast=True)
    if row < 0:  # (a padding rule row: nothing to cut)
        cut = -float("inf")
    if cut > -float("inf"):  # (a cut of -inf keeps every token)
        base = logits_ptr + row * stride_l
        cols = tl.arange(0, BLOCK)
        top = -float("inf")
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < vocab, other=-float("inf"))
            top = tl.maximum(top, tl.reduce(x, 0, tl.standard._elementwise_max))
        below = top + cut
        for start in range(0, vocab, BLOCK):
            inside = start + cols < vocab
            x = tl.load(base + start + cols, mask=inside, other=0.0)
            tl.store(base + start + cols, tl.where(x < below, -float("inf"), x), mask=inside)


@functools.cache
def jitted_kernels(interpret: bool) -> tuple[Any, Any, Any]:
    """The kernels, decorated as TRITON_INTERPRET asks (`interpret` is the cache key); the
    table's width and parts follow the round: not specialised, nor the table's and the pending
    tokens' addresses (read an integer at a time; the eager path's pending tokens are a view at
    the batch's offset: a plain round's at batch 2 built a variant in traffic on an H200)."""
    parts = ("rows_at", "extents_at", "seqs_at", "paths_at", "stops_at", "pending_at")
    count_in = jit(
        _count_in_kernel,
        do_not_specialize=("width", "deltas_at", "num_deltas"),
        any_alignment=("table_ptr",),
    )
    bend = jit(
        _bend_kernel,
        do_not_specialize=("stride_l", "width", *parts, "words_at", "num_seqs"),
        any_alignment=("table_ptr", "pending_ptr"),
    )
    cut = jit(
        _min_p_kernel,
        do_not_specialize=("stride_l", "width", "rows_at", "seqs_at"),
        any_alignment=("table_ptr",),
    )
    return count_in, bend, cut
