"""The plain-torch reference of `paged_attention` (specsplit/kernels/paged_attention.py), and the
CPU path: `reference_plan` (each sequence's key slots and dense visibility mask, built on the
host once per forward) and `paged_attention_with_plan` (SDPA per sequence, every layer), so the
CPU path builds its gathers and masks once per forward, not once per layer. The visibility
rules are the kernel's (its module docstring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# (q_start, q_end, slots [kv_len] int64, mask [q_len, kv_len] bool) per sequence
PlanEntry = tuple[int, int, torch.Tensor, torch.Tensor]


def reference_plan(
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    kv_lens: torch.Tensor,  # [B] int32
    prefix_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_pages] int32
    page_size: int,
    tree_mask: torch.Tensor | None,  # [B, max_q, max_new] bool/uint8, None = causal
) -> list[PlanEntry]:
    """Per sequence: its query rows, the slots of its keys and its dense visibility mask. Built on
    the host once per forward (it reads the lengths), shared by every layer."""
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
        plan.append((q_start, q_end, slots, mask))
    return plan


def paged_attention_with_plan(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    plan: list[PlanEntry],
    scale: float,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]
) -> torch.Tensor:
    """SDPA per sequence over the gathered keys; what `paged_attention` computes, in torch."""
    if out is None:
        out = torch.empty_like(q)
    groups = q.shape[1] // k_cache.shape[1]
    for q_start, q_end, slots, mask in plan:
        if q_end == q_start:
            continue
        q_b = q[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
        k_b = _expand_kv(k_cache[slots], groups).to(q.dtype)  # [H, kv_len, D]
        v_b = _expand_kv(v_cache[slots], groups).to(q.dtype)
        o_b = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=mask, scale=scale)
        out[q_start:q_end] = o_b.transpose(0, 1)  # [q_len, H, D]
    return out


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


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[kv_len, num_kv_heads, D] -> [num_kv_heads * groups, kv_len, D] (repeat_kv)."""
    kv_len, num_kv_heads, head_dim = x.shape
    x = x.transpose(0, 1)  # [num_kv_heads, kv_len, D]
    if groups == 1:
        return x
    x = x[:, None].expand(num_kv_heads, groups, kv_len, head_dim)
    return x.reshape(num_kv_heads * groups, kv_len, head_dim)
