"""A chained verify round placed on the outcome that came (verifier/chain.py), on the device.

A round chained behind round r is built on the host for one outcome of r (the reference) and its
inputs copied into the forward's buffers; once r's results are on the device, these kernels
rewrite them for the outcome that came, with no host sync:

- `place_forward`: per sequence, the outcome of its hint with r's number of accepted drafts and
  bonus token (keys `accepted * KEY_SHIFT + bonus`, the first that matches; where none does, the
  first outcome, and where the hint runs misses plain (`plain`) that one with r's bonus token as
  its first input: the plain round the gateway sends for a miss, whose drafts the acceptance
  takes none of), its committed length after r (`bases + accepted`), and in the forward's
  inputs its input ids (that outcome's bonus token and tree), positions (each token's offset past
  the committed prefix kept), K/V slots (through its page table), kv_lens and prefix_lens; the
  committed lengths, input ids and the outcome placed (-1: a miss placed plain) also go to
  `committed` / `tokens` / `placed` for the acceptance.
- `place_accept`: the acceptance's draft tokens (none, -1, for a miss placed plain) and page
  window (verifier/accept_layout.py's Layout) for the same outcomes.

Each is one Triton launch (one program per sequence) in place of ~20 small torch ops (~15 us of
host time each on an H100 host); `place_forward_reference` / `place_accept_reference` are those
torch ops: the CPU path, and what the kernels are tested against.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, NoReturn

import torch

from specsplit.kernels.accept import cache_slots
from specsplit.kernels.triton_jit import check_device, interpreting, jit, next_power_of_2

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)

KEY_SHIFT = 1 << 32  # an outcome's key: its accepted drafts * this + its bonus token
# the least blocks of query tokens and page-window columns: one compiled variant of each kernel
# for rounds of up to 31 drafts and windows of up to 8 pages (`warm_up` compiles it)
BLOCK_Q, BLOCK_W = 32, 8


def outcome_keys(num_accepted: Any, bonus: Any) -> Any:
    """The key of outcomes with these accepted drafts and bonus tokens (ints or tensors)."""
    return num_accepted * KEY_SHIFT + bonus


def place_forward_reference(
    packed: torch.Tensor,  # [>= B, 2 + N] int64: r's results (accepted drafts, bonus, nodes)
    bases: torch.Tensor,  # [B] int64: r's committed length + its pending tokens
    keys: torch.Tensor,  # [B, O] int64: each outcome's key (-1: none)
    next_tokens: torch.Tensor,  # [B, O, Q] int64: each outcome's bonus token, then its tree
    plain: torch.Tensor,  # [B] int64: 1 where a miss runs plain (NextTrees.plain)
    table: torch.Tensor,  # [B, P] int64: page tables
    page_size: int,
    input_ids: torch.Tensor,  # [>= B * Q] int64, rewritten
    positions: torch.Tensor,  # [>= B * Q] int64, rewritten
    slot_mapping: torch.Tensor,  # [>= B * Q] int64, rewritten
    kv_lens: torch.Tensor,  # [>= B] int32, rewritten
    prefix_lens: torch.Tensor,  # [>= B] int32, rewritten
    committed: torch.Tensor,  # [B] int64, written
    tokens: torch.Tensor,  # [B, Q] int64, written
    placed: torch.Tensor,  # [B] int64, written: the outcome placed, -1 a miss placed plain
) -> None:
    b, q = tokens.shape
    t = b * q
    accepted = packed[:b, 0]
    came = outcome_keys(accepted, packed[:b, 1])
    matches = keys == came[:, None]
    index = matches.to(torch.int32).argmax(dim=1)  # the first match (0: none)
    tokens.copy_(next_tokens.gather(1, index[:, None, None].expand(b, 1, q)).squeeze(1))
    as_plain = ~matches.any(dim=1) & (plain != 0)
    tokens[:, 0] = torch.where(as_plain, packed[:b, 1], tokens[:, 0])
    placed.copy_(torch.where(as_plain, -1, index.to(torch.int64)))
    committed.copy_(bases + accepted)
    shift = committed - prefix_lens[:b].to(torch.int64)  # [B]
    positions[:t] += shift[:, None].expand(b, q).reshape(-1)
    storage = committed[:, None] + torch.arange(q, device=shift.device)[None, :]
    slot_mapping[:t] = cache_slots(storage, table, page_size).reshape(-1)
    kv_lens[:b] += shift.to(kv_lens.dtype)
    prefix_lens[:b] = committed.to(prefix_lens.dtype)
    input_ids[:t] = tokens.reshape(-1)


def place_accept_reference(
    committed: torch.Tensor,  # [B] int64 (`place_forward`'s)
    tokens: torch.Tensor,  # [B, Q] int64 (`place_forward`'s)
    placed: torch.Tensor,  # [B] int64 (`place_forward`'s): -1 a miss placed plain
    table: torch.Tensor,  # [B, P] int64
    page_size: int,
    draft: torch.Tensor,  # [>= B, >= Q - 1] int64, rewritten
    base: torch.Tensor,  # [>= B] int64, rewritten: node 0's storage within the window's page
    window: torch.Tensor,  # [>= B, W] int64, rewritten: the page table from node 0's page on
) -> None:
    b, q = tokens.shape
    draft[:b, : q - 1] = torch.where(placed[:, None] < 0, -1, tokens[:, 1:])
    start = committed + 1  # tree node 0's storage (after the one pending token)
    first = start // page_size
    columns = first[:, None] + torch.arange(window.shape[1], device=start.device)[None, :]
    window[:b] = table.gather(1, columns.clamp_max(table.shape[1] - 1))
    base[:b] = start - first * page_size


def _place_forward_kernel(
    packed_ptr, bases_ptr, keys_ptr, next_ptr, plain_ptr, table_ptr,
    ids_ptr, positions_ptr, slots_ptr, kv_lens_ptr, prefix_ptr, committed_ptr, tokens_ptr,
    placed_ptr, num_outcomes, num_pages, page_size, stride_p, Q,
    BLOCK_Q: tl.constexpr, SHIFT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    accepted = tl.load(packed_ptr + b * stride_p)
    bonus = tl.load(packed_ptr + b * stride_p + 1)
    came = accepted * SHIFT + bonus
    index = accepted * 0 - 1  # the first outcome with this key (an int64 -1 until found)
    for o in range(0, num_outcomes):
        key = tl.load(keys_ptr + b * num_outcomes + o)
        index = tl.where((index < 0) & (key == came), o, index)
    as_plain = (index < 0) & (tl.load(plain_ptr + b) != 0)
    index = tl.maximum(index, 0)
    committed = tl.load(bases_ptr + b) + accepted
    old_prefix = tl.load(prefix_ptr + b).to(tl.int64)
    shift = committed - old_prefix
    i = tl.arange(0, BLOCK_Q)
    in_q = i < Q
    row = b * Q + i
    tokens = tl.load(next_ptr + (b * num_outcomes + index) * Q + i, mask=in_q, other=0)
    tokens = tl.where((i == 0) & as_plain, bonus, tokens)  # a miss placed as the plain round
    position = tl.load(positions_ptr + row, mask=in_q, other=0)
    storage = committed + i
    page = tl.minimum(storage // page_size, num_pages - 1)
    page_id = tl.load(table_ptr + b * num_pages + page, mask=in_q, other=0)
    tl.store(ids_ptr + row, tokens, mask=in_q)
    tl.store(positions_ptr + row, position + shift, mask=in_q)
    tl.store(slots_ptr + row, page_id * page_size + storage % page_size, mask=in_q)
    tl.store(tokens_ptr + row, tokens, mask=in_q)
    kv_len = tl.load(kv_lens_ptr + b)
    tl.store(kv_lens_ptr + b, (kv_len + shift).to(kv_len.dtype))
    tl.store(prefix_ptr + b, committed.to(kv_len.dtype))
    tl.store(committed_ptr + b, committed)
    tl.store(placed_ptr + b, tl.where(as_plain, -1, index))


def _place_accept_kernel(
    committed_ptr, tokens_ptr, placed_ptr, table_ptr, draft_ptr, base_ptr, window_ptr,
    num_pages, page_size, stride_d, stride_w, Q, W,
    BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK_Q)
    nodes = i < Q - 1
    tokens = tl.load(tokens_ptr + b * Q + 1 + i, mask=nodes, other=0)
    tokens = tl.where(tl.load(placed_ptr + b) < 0, -1, tokens)  # a miss placed plain: no drafts
    tl.store(draft_ptr + b * stride_d + i, tokens, mask=nodes)
    start = tl.load(committed_ptr + b) + 1
    first = start // page_size
    j = tl.arange(0, BLOCK_W)
    in_window = j < W
    column = tl.minimum(first + j, num_pages - 1)
    page_id = tl.load(table_ptr + b * num_pages + column, mask=in_window, other=0)
    tl.store(window_ptr + b * stride_w + j, page_id, mask=in_window)
    tl.store(base_ptr + b, start - first * page_size)


@functools.cache
def _jitted(kernel: str, interpret: bool) -> Any:
    """The kernel, decorated as TRITON_INTERPRET asks (`interpret` is the cache key); generic:
    the acceptance's inputs are views at offsets that vary with the graph bucket, and a chained
    round must not wait for a compile."""
    return jit(_place_forward_kernel if kernel == "forward" else _place_accept_kernel, generic=True)


def _block(n: int, least: int) -> int:
    """A block of at least `least` (one compiled variant for every n up to it)."""
    return max(least, next_power_of_2(n))


def place_forward(
    packed: torch.Tensor,
    bases: torch.Tensor,
    keys: torch.Tensor,
    next_tokens: torch.Tensor,
    plain: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    committed: torch.Tensor,
    tokens: torch.Tensor,
    placed: torch.Tensor,
) -> None:
    """`place_forward_reference` as one kernel launch (one program per sequence)."""
    interpret = _available()
    b, q = tokens.shape
    int64 = [bases, keys, next_tokens, plain, table, input_ids, positions, slot_mapping]
    int64 += [committed, tokens, placed]
    _check("place_forward", int64, torch.int64)
    _check("place_forward", [kv_lens, prefix_lens], torch.int32)
    if packed.dtype != torch.int64 or packed.stride(1) != 1 or packed.shape[0] < b:
        _fail("place_forward", f"packed must be [>= {b}, 2 + N] int64 with contiguous rows")
    per_seq = (keys.shape[0], table.shape[0], plain.numel(), placed.numel())
    if per_seq != (b,) * 4 or next_tokens.shape != (b, keys.shape[1], q):
        shapes = [tuple(t.shape) for t in (keys, next_tokens, plain, table, placed)]
        _fail("place_forward", f"keys, next_tokens, plain, table, placed {shapes} for {b} x {q}")
    if min(input_ids.shape[0], positions.shape[0], slot_mapping.shape[0]) < b * q:
        _fail("place_forward", f"the forward's inputs hold fewer than {b * q} tokens")
    check_device("place_forward", [packed, *int64, kv_lens, prefix_lens], interpret)
    if b == 0:
        return
    _jitted("forward", interpret)[(b,)](
        packed, bases, keys, next_tokens, plain, table,
        input_ids, positions, slot_mapping, kv_lens, prefix_lens, committed, tokens,
        placed, keys.shape[1], table.shape[1], page_size, packed.stride(0), q,
        BLOCK_Q=_block(q, BLOCK_Q), SHIFT=KEY_SHIFT, num_warps=1,
    )  # fmt: skip


def place_accept(
    committed: torch.Tensor,
    tokens: torch.Tensor,
    placed: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    draft: torch.Tensor,
    base: torch.Tensor,
    window: torch.Tensor,
) -> None:
    """`place_accept_reference` as one kernel launch (one program per sequence)."""
    interpret = _available()
    b, q = tokens.shape
    _check("place_accept", [committed, tokens, placed, table, draft, base, window], torch.int64)
    if draft.dim() != 2 or window.dim() != 2 or draft.shape[1] < q - 1:
        _fail("place_accept", f"draft {tuple(draft.shape)} and window {tuple(window.shape)} "
              f"must be 2-d, draft at least {q - 1} wide")  # fmt: skip
    rows = (draft.shape[0], base.shape[0], window.shape[0])
    if min(rows) < b or (table.shape[0], placed.numel()) != (b, b):
        _fail("place_accept", f"draft, base, window, table and placed must hold {b} sequences")
    check_device("place_accept", [committed, tokens, placed, table, draft, base, window], interpret)
    if b == 0:
        return
    w = window.shape[1]
    _jitted("accept", interpret)[(b,)](
        committed, tokens, placed, table, draft, base, window,
        table.shape[1], page_size, draft.stride(0), window.stride(0), q, w,
        BLOCK_Q=_block(q, BLOCK_Q), BLOCK_W=_block(w, BLOCK_W), num_warps=1,
    )  # fmt: skip


def warm_up(device: torch.device, shapes: list[tuple[int, int]]) -> None:
    """Compile both kernels for rounds of these shapes (query tokens a sequence, page-window
    columns; one variant per pair of blocks), so that no chained round waits for a compile; a
    no-op without triton. Writes only its own scratch tensors."""
    if importlib.util.find_spec("triton") is None:
        return
    blocks = {(_block(q, BLOCK_Q), _block(w, BLOCK_W)) for q, w in shapes}
    ints = functools.partial(torch.zeros, dtype=torch.int64, device=device)
    for q, w in sorted(blocks):  # the blocks' own sizes: one outcome, one sequence, one page
        tokens, committed, table, placed = ints(1, q), ints(1), ints(1, 1), ints(1)
        place_forward(
            ints(1, 2 + q), ints(1), ints(1, 1), ints(1, 1, q), ints(1), table, 1, ints(q),
            ints(q), ints(q), ints(1, dtype=torch.int32), ints(1, dtype=torch.int32), committed,
            tokens, placed,
        )  # fmt: skip
        place_accept(committed, tokens, placed, table, 1, ints(1, q), ints(1), ints(1, w))


def _available() -> bool:
    """Whether the kernels run interpreted; RuntimeError without triton."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("place_chain needs triton; use place_*_reference")
    return interpreting()


def _check(kernel: str, tensors: list[torch.Tensor], dtype: torch.dtype) -> None:
    """ValueError unless every tensor has `dtype` and is contiguous (the kernels index them
    flat, row after row)."""
    for tensor in tensors:
        if tensor.dtype != dtype or not tensor.is_contiguous():
            _fail(kernel, f"expected contiguous {dtype}, got {tensor.dtype} "
                  f"{tuple(tensor.shape)} strides {tensor.stride()}")  # fmt: skip


def _fail(kernel: str, what: str) -> NoReturn:
    raise ValueError(f"{kernel}: {what}")
