"""Maps the host and device expansions share, as plain functions: a proposer's logits into the
target's vocabulary (`in_vocab`), a sampled chain's draw over the proposer's columns with its
tokens mapped to the target's ids (`draw_columns`, `draw_mapped`), storage indices to cache
slots through a block table (`cache_slots`), and a run's flat metadata buffer to its per-row views
(`split_meta`)."""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from specsplit.sampling import draw_from_cut
from specsplit.tree import DRAFT_SUPPORT, DRAFT_TAIL


def in_vocab(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, C] logits of the ids `ids` [C] -> [R, vocab_size]: each at its id, -inf elsewhere
    (an EAGLE head's draft logits in the target's vocabulary)."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    full[:, ids] = logits
    return full


def draw_columns(scored_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The columns a sampled chain's draw reads, by their target ids: a vocabulary of the
    proposer's own (`scored_ids`) where it holds a whole support (DRAFT_SUPPORT ids, so the
    supports keep their width), else None: the target's. Either way the draw is exactly one
    from the distribution it reports (tokens outside the scored ones have probability 0)."""
    if scored_ids is None or scored_ids.shape[0] < DRAFT_SUPPORT:
        return None
    return scored_ids


def draw_mapped(
    logits: torch.Tensor,  # [R, C] the logits of `columns` (None: of the target's vocabulary)
    params: torch.Tensor,  # [R, 3]
    uniforms: torch.Tensor,  # [R]
    columns: torch.Tensor | None,  # [C] each column's target id
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`draw_from_cut` over `logits`' columns, the draws and the supports' tokens as the
    target's ids (the host and the device expansion draw alike)."""
    token, ids, probs = draw_from_cut(logits, params, uniforms, DRAFT_SUPPORT, DRAFT_TAIL)
    if columns is not None:
        token, ids = columns[token], columns[ids]
    return token, ids, probs


def cache_slots(table: torch.Tensor, storage: torch.Tensor, page: int) -> torch.Tensor:
    """Cache slots [R, q] of storage indices [R, q] through each row's block table [R, pages]."""
    return table.gather(1, storage // page).long() * page + storage % page


A = TypeVar("A", np.ndarray, torch.Tensor)


def split_meta(
    meta: A, bs: int, chain_len: int, catch_up: int = 0, row_slots: int = 0
) -> tuple[A, A, A, A, A]:
    """The flat meta buffer of `bs` rows as (base [bs], block table [bs, pages], chains
    [bs, chain_len], catch-up tokens [bs, catch_up], new pool rows' slots [bs, row_slots])
    views."""
    slots = len(meta) - bs * row_slots
    end = slots - bs * catch_up
    start = end - bs * chain_len
    tables = meta[bs:start]
    return (
        meta[:bs],
        tables.reshape(bs, -1),
        meta[start:end].reshape(bs, chain_len),
        meta[end:slots].reshape(bs, catch_up),
        meta[slots:].reshape(bs, row_slots),
    )
