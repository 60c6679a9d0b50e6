"""Greedy acceptance, the bonus token and the accepted path's K/V moves as one Triton kernel.

`accept_greedy_batched` + `accepted_kv_moves` (specsplit/kernels/accept.py) are ~50 small torch
ops over the batch (pointer jumping, a cumsum, scatters, gathers): in the verifier's acceptance
graph at batch 1 that is 58 kernel nodes, each a few microseconds of the device's round
(bench/RESULTS.md, forty-second session). Here one program per sequence walks its tree once in
node order: a node is accepted when its parent is the deepest node accepted so far and its token
is the target's argmax at that parent's row (siblings never repeat a token, so at most one child
of an accepted node matches, and parents precede children). The walk ends with the bonus token
(the argmax at the last accepted node's row), the packed results and each depth's K/V move
(source and destination cache slots, scratch -> scratch past the accepted path).
`accept_walk_reference` is the torch version the kernel is tested against (and the CPU's path).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, NoReturn

import torch

from specsplit.kernels.accept import accept_greedy_batched, accepted_kv_moves
from specsplit.kernels.triton_jit import check_device, interpreting, jit, next_power_of_2

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)


def accept_walk_reference(
    argmax: torch.Tensor,  # [>= rows] int64: the target's argmax at each of the round's rows
    row_index: torch.Tensor,  # [B, N + 1] int64: the rows of each sequence's root and nodes
    draft_tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64: -1 = the root; padding nodes -2
    base: torch.Tensor,  # [B] int64: storage of tree node 0 within the table's first page
    table: torch.Tensor,  # [B, P] int64: each sequence's page-table window
    page_size: int,
    scratch_slot: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed [B, 2 + N]: accepted drafts, bonus token, accepted nodes (-1 padded); src and
    dst [B * N] cache slots of the accepted path's K/V moves), as the torch ops give them."""
    accepted = accept_greedy_batched(argmax[row_index], draft_tokens, parents)
    src, dst = accepted_kv_moves(
        base, accepted.accepted_nodes, accepted.num_accepted_drafts, table, page_size, scratch_slot
    )
    return accepted.packed(), src, dst


def _accept_walk_kernel(
    argmax_ptr,  # [>= rows] int64
    row_index_ptr,  # [B, N + 1]
    draft_ptr,  # [B, N]
    parents_ptr,  # [B, N]
    base_ptr,  # [B]
    table_ptr,  # [B, PAGES]
    packed_ptr,  # [B, 2 + N] out
    moves_ptr,  # [2, B * N] out: source slots, then destination slots
    num_seqs,
    N,  # tree nodes a sequence (padded)
    PAGES,  # the page-table window's width
    page_size,
    scratch_slot,
    BLOCK: tl.constexpr,  # N's next power of two (1 for N = 0)
):
    b = tl.program_id(0).to(tl.int64)
    depths = tl.arange(0, BLOCK)
    root_row = tl.load(row_index_ptr + b * (N + 1))
    target = tl.load(argmax_ptr + root_row)  # the argmax at the deepest node accepted so far
    node = root_row * 0 - 1  # that node (-1: the root), int64
    depth = root_row * 0  # accepted drafts so far
    path = tl.full([BLOCK], -1, tl.int64)
    for j in range(N):
        parent = tl.load(parents_ptr + b * N + j)
        token = tl.load(draft_ptr + b * N + j)
        take = (parent == node) & (token == target)
        path = tl.where(take & (depths == depth), j, path)
        row = tl.load(row_index_ptr + b * (N + 1) + 1 + j)
        target = tl.where(take, tl.load(argmax_ptr + row), target)
        node = tl.where(take, j, node)
        depth = tl.where(take, depth + 1, depth)
    out = packed_ptr + b * (2 + N)
    tl.store(out, depth)
    tl.store(out + 1, target)
    in_tree = depths < N
    tl.store(out + 2 + depths, path, mask=in_tree)
    # the node at depth 1 + d moves from base + node to base + d (within the table's window)
    start = tl.load(base_ptr + b)
    real = depths < depth
    source = start + tl.maximum(path, 0)
    destination = start + depths
    source_page = tl.load(
        table_ptr + b * PAGES + tl.minimum(source // page_size, PAGES - 1), mask=in_tree, other=0
    )
    destination_page = tl.load(
        table_ptr + b * PAGES + tl.minimum(destination // page_size, PAGES - 1),
        mask=in_tree,
        other=0,
    )
    source_slot = tl.where(real, source_page * page_size + source % page_size, scratch_slot)
    destination_slot = tl.where(
        real, destination_page * page_size + destination % page_size, scratch_slot
    )
    tl.store(moves_ptr + b * N + depths, source_slot, mask=in_tree)
    tl.store(moves_ptr + num_seqs * N + b * N + depths, destination_slot, mask=in_tree)


@functools.cache
def _jitted_kernel(interpret: bool) -> Any:
    """The kernel, decorated as TRITON_INTERPRET asks (`interpret` is the cache key); built once
    per BLOCK (a power of two), whatever the batch, the tree width, the window and the inputs'
    offsets (views of one flat array): the acceptance graphs' warm-up builds every BLOCK an
    eager round (its exact width, not padded) can take, so no round compiles one in traffic."""
    return jit(_accept_walk_kernel, generic=True)


def accept_walk(
    argmax: torch.Tensor,
    row_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    base: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    scratch_slot: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept_walk_reference` as one kernel launch (no host sync): packed [B, 2 + N], src and
    dst [B * N]."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("accept_walk needs triton; use accept_walk_reference")
    interpret = interpreting()
    tensors = [argmax, row_index, draft_tokens, parents, base, table]
    _check_inputs(tensors, page_size, interpret)
    num_seqs, n = draft_tokens.shape
    packed = torch.empty(num_seqs, 2 + n, dtype=torch.int64, device=argmax.device)
    moves = torch.empty(2, num_seqs * n, dtype=torch.int64, device=argmax.device)
    if num_seqs:
        _jitted_kernel(interpret)[(num_seqs,)](
            argmax, row_index, draft_tokens, parents, base, table, packed, moves,
            num_seqs, n, table.shape[1], page_size, scratch_slot,
            BLOCK=next_power_of_2(max(n, 1)), num_warps=1,
        )  # fmt: skip
    return packed, moves[0], moves[1]


def _check_inputs(tensors: list[torch.Tensor], page_size: int, interpret: bool) -> None:
    """ValueError unless `tensors` (accept_walk's, in order) and `page_size` are what the
    kernel reads."""

    def fail(what: str) -> NoReturn:
        raise ValueError(f"accept_walk: {what}")

    argmax, row_index, draft_tokens, parents, base, table = tensors
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
        fail(
            f"every input must be contiguous int64, got {[(t.dtype, t.stride()) for t in tensors]}"
        )
    if draft_tokens.dim() != 2 or parents.shape != draft_tokens.shape:
        fail(f"draft_tokens and parents must be [B, N], got {draft_tokens.shape}, {parents.shape}")
    num_seqs, n = draft_tokens.shape
    if argmax.dim() != 1:
        fail(f"argmax must be [rows], got {tuple(argmax.shape)}")
    if tuple(row_index.shape) != (num_seqs, n + 1):
        fail(f"row_index must be [B, N + 1] = [{num_seqs}, {n + 1}], got {tuple(row_index.shape)}")
    if tuple(base.shape) != (num_seqs,):
        fail(f"base must be [B] = [{num_seqs}], got {tuple(base.shape)}")
    if table.dim() != 2 or table.shape[0] != num_seqs or table.shape[1] == 0:
        fail(f"table must be [B, pages >= 1], got {tuple(table.shape)}")
    if page_size <= 0:
        fail(f"page_size must be positive, got {page_size}")
    check_device("accept_walk", tensors, interpret)
