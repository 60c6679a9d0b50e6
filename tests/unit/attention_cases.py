"""Paged-attention test cases: a batch of sequences (query, key and prefix lengths) over a paged,
shuffled KV cache whose slots no sequence owns hold NaN, for the Triton kernel's tests
(test_paged_attention.py) and the CPU path's (test_attention_reference.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specsplit.tree import DraftTree


@dataclass
class Case:
    q: torch.Tensor  # [T + 2, H, D]: two trailing rows owned by no sequence
    k_cache: torch.Tensor  # [num_slots, num_kv_heads, D], a strided view
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    prefix_lens: torch.Tensor
    block_table: torch.Tensor
    page_size: int
    tree_mask: torch.Tensor | None
    max_q_len: int
    scale: float

    def args(self) -> dict[str, Any]:
        return dict(self.__dict__)


def make_case(
    seqs: list[tuple[int, int, int]],  # (q_len, kv_len, prefix_len) per sequence
    *,
    page_size: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    new_masks: Sequence[torch.Tensor | None] | None = None,  # [q_len, kv_len - prefix_len] each
    shuffle: bool = True,
    max_q_len: int | None = None,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    q_lens = [s[0] for s in seqs]
    num_pages = [-(-kv_len // page_size) for _, kv_len, _ in seqs]
    total_pages = sum(num_pages) + 3  # spare pages nobody owns
    order = torch.randperm(total_pages, generator=gen) if shuffle else torch.arange(total_pages)
    block_table = torch.zeros(len(seqs), max(num_pages, default=0) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(num_pages):
        block_table[b, :n] = order[used : used + n].to(torch.int32)
        used += n

    # K and V interleaved in one buffer: each cache is a view with row stride 2 * kv_heads * D
    kv = torch.randn(total_pages * page_size, 2, num_kv_heads, head_dim, generator=gen)
    owned = torch.zeros(total_pages * page_size, dtype=torch.bool)
    for b, (_, kv_len, _) in enumerate(seqs):
        for s in range(kv_len):
            owned[int(block_table[b, s // page_size]) * page_size + s % page_size] = True
    kv[~owned] = float("nan")  # a slot outside [0, kv_len) must never be read

    tree_mask = None
    if new_masks is not None:
        max_q = max(max(q_lens), max_q_len or 0)
        max_new = max(kv_len - prefix_len for _, kv_len, prefix_len in seqs) + 2
        tree_mask = torch.ones(len(seqs), max_q, max_new, dtype=torch.bool)  # beyond: ignored
        for b, m in enumerate(new_masks):
            if m is not None:
                tree_mask[b, : m.shape[0], : m.shape[1]] = m

    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Case(
        q=torch.randn(sum(q_lens) + 2, num_heads, head_dim, generator=gen),
        k_cache=kv[:, 0],
        v_cache=kv[:, 1],
        cu_seqlens_q=cu,
        kv_lens=torch.tensor([s[1] for s in seqs], dtype=torch.int32),
        prefix_lens=torch.tensor([s[2] for s in seqs], dtype=torch.int32),
        block_table=block_table,
        page_size=page_size,
        tree_mask=tree_mask,
        max_q_len=max_q_len if max_q_len is not None else max(q_lens),
        scale=head_dim**-0.5,
    )


def verify_new_mask(num_pending: int, parents: list[int]) -> torch.Tensor:
    """[p + n, p + n] bool among a verify step's new tokens (DESIGN.md §2): pending tokens are
    causal; a tree node sees every pending token, its ancestors and itself, never siblings."""
    p, n = num_pending, len(parents)
    mask = torch.zeros(p + n, p + n, dtype=torch.bool)
    mask[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    mask[p:, :p] = True
    mask[p:, p:] = DraftTree(tokens=[0] * n, parents=parents).ancestor_mask()
    return mask
