"""The plain-torch reference of `paged_attention` (specsplit/kernels/paged_attention.py), and the
CPU path: `reference_plan` (each sequence's key slots and dense visibility mask, built on the
host once per forward) and `paged_attention_with_plan` (SDPA per sequence, every layer), so the
CPU path builds its gathers and masks once per forward, not once per layer. The visibility
rules are the kernel's (its module docstring).

Grouped-query attention runs as one SDPA over each KV head's keys with its query heads stacked as
rows (no copy of the keys per query head), the keys gathered with index_select (~4x faster than
indexing on the CPU), and a sequence whose every query sees every key (a decode step) has no
mask. SmolLM2's decode attention a layer 1.4x / 3.5x / 2.2x faster at 128 / 512 / 2048 keys on
a 2-core CPU than with the keys repeated per query head (bench/cpu_attention.py; RESULTS.md,
seventy-third session), and its flash kernel (4-D inputs) 1.5-2x faster a layer than its math
path at 300-1000 keys (seventy-fifth session). SDPA, not the softmax written out with matmuls:
a query's output does not move with keys hidden from it (draft-ahead's outcomes in one run equal
their forks to 1e-9, tests/unit/test_draft_ahead.py); matmuls over more keys sum in another
order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# (q_start, q_end, slots [kv_len] int64, mask [q_len, kv_len] bool or None: every key visible
# to every query) per sequence
PlanEntry = tuple[int, int, torch.Tensor, torch.Tensor | None]


def reference_plan(
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    kv_lens: torch.Tensor,  # [B] int32
    prefix_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_pages] int32
    page_size: int,
    tree_mask: torch.Tensor | None,  # [B, max_q, max_new] bool/uint8, None = causal
) -> list[PlanEntry]:
    """Per sequence: its query rows, the slots of its keys and its dense visibility mask (None
    where it is all visible). Built on the host once per forward (it reads the lengths), shared
    by every layer."""
    cu = cu_seqlens_q.tolist()
    device = block_table.device
    plan: list[PlanEntry] = []
    lens = zip(kv_lens.tolist(), prefix_lens.tolist(), strict=True)
    for b, (kv_len, prefix_len) in enumerate(lens):
        q_start, q_end = cu[b], cu[b + 1]
        q_len = q_end - q_start
        assert q_len >= 0 and prefix_len >= 0 and kv_len >= 0, (b, q_len, prefix_len, kv_len)
        assert q_len == 0 or kv_len > 0, f"sequence {b} has queries but no keys"
        pos = torch.arange(kv_len, device=device)  # [kv_len] storage index
        pages = block_table[b, pos // page_size].to(torch.int64)
        slots = pages * page_size + pos % page_size  # [kv_len]
        rows = torch.arange(q_len, device=device)[:, None]  # [q_len, 1]
        mask = (pos < prefix_len)[None, :].expand(q_len, kv_len).clone()  # [q_len, kv_len]
        num_new = max(kv_len - prefix_len, 0)
        if tree_mask is None:
            mask |= pos[None, :] <= kv_len - q_len + rows
        elif num_new > 0 and q_len > 0:
            assert tree_mask.shape[2] >= num_new, (tree_mask.shape, num_new)
            mask[:, prefix_len:] = tree_mask[b, :q_len, :num_new].to(device, torch.bool)
        plan.append((q_start, q_end, slots, None if bool(mask.all()) else mask))
    return plan


def paged_attention_with_plan(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    plan: list[PlanEntry],
    scale: float,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]
) -> torch.Tensor:
    """SDPA per sequence over its gathered keys; what `paged_attention` computes, in torch. A
    KV head's `groups` query heads are rows of one SDPA over its keys (query head h reads KV
    head h // groups, as repeat_kv pairs them)."""
    if out is None:
        out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[1], q.shape[2]
    groups = q.shape[1] // num_kv_heads
    for q_start, q_end, slots, mask in plan:
        q_len = q_end - q_start
        if q_len == 0:
            continue
        # [q_len, H, D] -> [KV heads, groups * q_len, D]: row g * q_len + i is query i, head g
        q_b = q[q_start:q_end].view(q_len, num_kv_heads, groups, head_dim).permute(1, 2, 0, 3)
        q_b = q_b.reshape(num_kv_heads, groups * q_len, head_dim)
        k_b, v_b = _gather(k_cache, slots), _gather(v_cache, slots)
        rows_mask = None if mask is None else mask.repeat(groups, 1)  # [groups * q_len, kv_len]
        o_b = _sdpa(q_b, k_b.to(q.dtype), v_b.to(q.dtype), rows_mask, scale)
        o_b = o_b.view(num_kv_heads, groups, q_len, head_dim).permute(2, 0, 1, 3)
        out[q_start:q_end] = o_b.reshape(q_len, num_kv_heads * groups, head_dim)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A sequence's keys (or values) [KV heads, kv_len, D] from `cache` [slots, KV heads, D]
    (index_select: ~4x faster than indexing on the CPU), along the slots of each head where the
    pool is heads outer (the CPU's, kv_cache.py): 3,000 slots of SmolLM2's 3 heads in 98 us
    against 690 by slot, one slot's heads from three places."""
    if cache.stride(1) > cache.stride(0):
        return cache.transpose(0, 1).index_select(1, slots)
    return cache.index_select(0, slots).transpose(0, 1)


def _sdpa(
    q: torch.Tensor,  # [KV heads, rows, D]
    k: torch.Tensor,  # [KV heads, kv_len, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [rows, kv_len] bool
    scale: float,
) -> torch.Tensor:
    """SDPA over each KV head's rows. On the CPU as [1, KV heads, rows, D]: 4-D inputs take
    its flash kernel (3-D ones its math path: bmm, softmax, bmm, 1.5-2x slower a layer at
    300-1000 keys, bench/RESULTS.md); on a GPU (the kernel tests' reference) as given."""
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[0]


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    tree_mask: torch.Tensor | None,
    max_q_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention`'s arguments, plain torch: the reference the kernel is tested against."""
    plan = reference_plan(cu_seqlens_q, kv_lens, prefix_lens, block_table, page_size, tree_mask)
    return paged_attention_with_plan(q, k_cache, v_cache, plan, scale, out)
