"""Batched greedy acceptance and accepted-path KV compaction on the device (DESIGN.md §2, §6).

Fused torch ops over the whole batch: no host sync, and a fixed sequence of ops for a given
tree width N whatever the data, so a verify step can be captured in a CUDA graph and its results
leave the device in the round's one device-to-host copy. The per-sequence references are
`specsplit.acceptance.accept_greedy` and moving each accepted node's K/V by hand, one sequence
at a time; tests/unit/test_batched_accept.py checks both against these.

Row convention as in `specsplit.acceptance`: row 0 is the target at the root (the last pending
token), row 1 + j the target at tree node j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchedAccept:
    num_accepted_drafts: torch.Tensor  # [B] int64
    accepted_nodes: torch.Tensor  # [B, N] int64: node at depth 1 + d; -1 past num_accepted_drafts
    bonus_tokens: torch.Tensor  # [B] int64: the target's argmax at the last accepted node

    @property
    def num_accepted_tokens(self) -> torch.Tensor:
        """[B] int64: accepted drafts plus the bonus token."""
        return self.num_accepted_drafts + 1

    def packed(self) -> torch.Tensor:
        """[B, 2 + N] int64: accepted drafts, bonus token, accepted nodes (-1 padded), for the
        round's one device-to-host copy."""
        return torch.cat(
            [self.num_accepted_drafts[:, None], self.bonus_tokens[:, None], self.accepted_nodes],
            dim=1,
        )


def accept_greedy_batched(
    target_argmax: torch.Tensor,  # [B, N + 1] int64: argmax at the root (col 0), node j (1 + j)
    draft_tokens: torch.Tensor,  # [B, N] int64 (padding nodes: any value)
    parents: torch.Tensor,  # [B, N] int64: -1 = root, else an earlier node; padding nodes: -2
) -> BatchedAccept:
    """`accept_greedy` for a batch of trees padded to N nodes, without leaving the device.

    A node is accepted when its token is the target's argmax at its parent and its parent is
    accepted (the root always is). Siblings never repeat a token (DraftTree.validate), so the
    accepted nodes form one path from the root, and since parents precede children a node's
    depth on that path is its rank among the accepted nodes in index order.
    """
    _check_accept_inputs(target_argmax, draft_tokens, parents)
    batch, n = draft_tokens.shape
    device = draft_tokens.device
    parent_rows = (parents + 1).clamp_min(0)  # [B, N] row of each node's parent; padding -> 0
    matched = (draft_tokens == target_argmax.gather(1, parent_rows)) & (parents >= -1)  # [B, N]

    # Pointer jumping: after k steps `accepted[j]` is the AND of `matched` over j and its next
    # 2^k - 1 ancestors, and `ancestor_rows[j]` the row of its 2^k-th ancestor (0 = the root,
    # which stays put and is always accepted). ceil(log2 N) steps cover the deepest chain.
    accepted, ancestor_rows = matched, parent_rows
    root_accepted = torch.ones(batch, 1, dtype=torch.bool, device=device)
    root_row = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    for _ in range(max(n - 1, 0).bit_length()):
        accepted_by_row = torch.cat([root_accepted, accepted], dim=1)  # [B, N + 1]
        ancestor_by_row = torch.cat([root_row, ancestor_rows], dim=1)  # [B, N + 1]
        accepted = accepted & accepted_by_row.gather(1, ancestor_rows)
        ancestor_rows = ancestor_by_row.gather(1, ancestor_rows)

    num_accepted_drafts, accepted_nodes, last_node = accepted_path(accepted)
    bonus_tokens = target_argmax.gather(1, last_node[:, None] + 1).squeeze(1)  # [B]
    return BatchedAccept(num_accepted_drafts, accepted_nodes, bonus_tokens)


def accepted_path(
    accepted: torch.Tensor,  # [B, N] bool: the accepted nodes, one path from the root
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_accepted_drafts [B], accepted_nodes [B, N] (-1 padded), last accepted node [B], -1 =
    the root). Parents precede children, so a node's depth on the path is its rank among the
    accepted nodes in index order."""
    batch, n = accepted.shape
    device = accepted.device
    # path[:, d] = the accepted node at depth d (column 0: the root, -1), like `accept_index`.
    # Unaccepted nodes scatter -1 into a spare last column, dropped afterwards.
    nodes = torch.arange(n, dtype=torch.int64, device=device).expand(batch, n)  # [B, N]
    depth = torch.cumsum(accepted, dim=1)  # [B, N] int64: depth of each accepted node
    path = torch.full((batch, n + 2), -1, dtype=torch.int64, device=device)
    path.scatter_(1, torch.where(accepted, depth, n + 1), torch.where(accepted, nodes, -1))
    path = path[:, : n + 1]  # [B, N + 1]
    num_accepted_drafts = accepted.sum(dim=1)  # [B] int64
    last_node = path.gather(1, num_accepted_drafts[:, None]).squeeze(1)  # [B]
    return num_accepted_drafts, path[:, 1:], last_node


def accept_greedy_from_logits(
    target_logits: torch.Tensor,  # [B, N + 1, V]
    draft_tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64
) -> BatchedAccept:
    """`accept_greedy_batched` on the target's logits (ties go to the lowest token id)."""
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, N + 1, V], got {tuple(target_logits.shape)}")
    return accept_greedy_batched(target_logits.argmax(dim=-1), draft_tokens, parents)


def accepted_kv_moves(
    base: torch.Tensor,  # [B] int64: storage index of tree node 0 (kv_committed_len + pending)
    accepted_nodes: torch.Tensor,  # [B, N] int64 from accept_greedy_batched
    num_accepted_drafts: torch.Tensor,  # [B] int64
    block_table: torch.Tensor,  # [B, max_pages] int32/int64 page ids
    page_size: int,
    scratch_slot: int,  # a slot no sequence owns: padding moves go scratch -> scratch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots ([B * N] int64 each, src and dst) that move the accepted path's K/V so that
    the node at depth 1 + d lands at storage base + d, right after the pending tokens.

    Entry (b, d) is a real move only for d < num_accepted_drafts[b]; every other entry is
    scratch -> scratch, so it never overwrites a real slot and never reads a page-table entry
    that may be garbage (clamped gathers keep every index in range either way). Real
    destinations are distinct, and dst <= src (node j at depth 1 + d has j >= d).
    """
    _check_move_inputs(base, accepted_nodes, num_accepted_drafts, block_table, page_size)
    n = accepted_nodes.shape[1]
    offsets = torch.arange(n, dtype=torch.int64, device=accepted_nodes.device)  # [N]
    real = offsets[None, :] < num_accepted_drafts[:, None]  # [B, N]
    src = cache_slots(base[:, None] + accepted_nodes.clamp_min(0), block_table, page_size)
    dst = cache_slots(base[:, None] + offsets[None, :], block_table, page_size)
    src = torch.where(real, src, scratch_slot)
    dst = torch.where(real, dst, scratch_slot)
    return src.reshape(-1), dst.reshape(-1)


def compact_accepted_kv(
    kv_data: torch.Tensor,  # [num_layers, 2, num_slots, num_kv_heads, head_dim]; K at [:, 0]
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
) -> None:
    """kv_data[:, :, dst] = kv_data[:, :, src] over all layers: one gather, then one scatter.

    Gathering first makes overlapping src/dst ranges safe. Duplicate destinations must carry
    equal values (accepted_kv_moves repeats only scratch -> scratch).
    """
    if kv_data.dim() != 5 or kv_data.shape[1] != 2:
        raise ValueError(
            "kv_data must be [num_layers, 2, num_slots, num_kv_heads, head_dim], "
            f"got {tuple(kv_data.shape)}"
        )
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if slots.dim() != 1 or slots.dtype != torch.int64 or slots.device != kv_data.device:
            raise ValueError(
                f"{name} must be 1-D int64 on {kv_data.device}, got {tuple(slots.shape)} "
                f"{slots.dtype} on {slots.device}"
            )
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"src_slots {src_slots.shape} != dst_slots {dst_slots.shape}")
    rows = kv_data.index_select(2, src_slots)  # [num_layers, 2, M, num_kv_heads, head_dim]
    kv_data.index_copy_(2, dst_slots, rows)


def compact_and_pack(
    accepted: BatchedAccept,
    base: torch.Tensor,  # [B] int64, as accepted_kv_moves'
    block_table: torch.Tensor,  # [B, max_pages]
    kv_data: torch.Tensor,  # as compact_accepted_kv's
    page_size: int,
    scratch_slot: int,
) -> torch.Tensor:
    """The round's end on the device: the accepted path's K/V moved into place, then the
    results in one [B, 2 + N] int64 tensor (accepted drafts, bonus token, accepted nodes) for
    the round's one device-to-host copy."""
    src, dst = accepted_kv_moves(
        base,
        accepted.accepted_nodes,
        accepted.num_accepted_drafts,
        block_table,
        page_size,
        scratch_slot,
    )
    compact_accepted_kv(kv_data, src, dst)
    return accepted.packed()


def cache_slots(storage: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, N] cache slots of per-sequence storage indices; pages clamped into the table."""
    pages = (storage // page_size).clamp(0, block_table.shape[1] - 1)  # [B, N]
    page_ids = block_table.gather(1, pages).to(torch.int64)  # [B, N]
    return page_ids * page_size + storage % page_size


def _check_accept_inputs(
    target_argmax: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor
) -> None:
    if draft_tokens.dim() != 2 or parents.shape != draft_tokens.shape:
        raise ValueError(
            f"draft_tokens and parents must both be [B, N], got {tuple(draft_tokens.shape)} "
            f"and {tuple(parents.shape)}"
        )
    batch, n = draft_tokens.shape
    if tuple(target_argmax.shape) != (batch, n + 1):
        raise ValueError(
            f"target_argmax must be [B, N + 1] = [{batch}, {n + 1}] (root column, then one per "
            f"node), got {tuple(target_argmax.shape)}"
        )
    _check_int64_on_one_device(target_argmax, draft_tokens, parents)


def _check_move_inputs(
    base: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted_drafts: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
) -> None:
    if accepted_nodes.dim() != 2:
        raise ValueError(f"accepted_nodes must be [B, N], got {tuple(accepted_nodes.shape)}")
    batch = accepted_nodes.shape[0]
    for name, t in (("base", base), ("num_accepted_drafts", num_accepted_drafts)):
        if tuple(t.shape) != (batch,):
            raise ValueError(f"{name} must be [B] = [{batch}], got {tuple(t.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table must be [B, max_pages >= 1], got {block_table.shape}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32 or int64, got {block_table.dtype}")
    if block_table.device != accepted_nodes.device:
        raise ValueError(f"block_table on {block_table.device}, not {accepted_nodes.device}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    _check_int64_on_one_device(base, accepted_nodes, num_accepted_drafts)


def _check_int64_on_one_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors:
        if t.dtype != torch.int64 or t.device != device:
            raise ValueError(f"expected int64 tensors on {device}, got {t.dtype} on {t.device}")
