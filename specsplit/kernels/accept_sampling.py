"""Batched lossless sampling acceptance on the device (DESIGN.md §2, "Acceptance that stays
lossless"): the per-sequence reference is `specsplit.acceptance.accept_sampling`.

One pass over the tree's nodes in index order, for every sequence at once. Parents precede
children and the walk never returns to a node it left, so node j is tried exactly when its
parent is the walk's current node when j comes up:
- deterministic proposals (no q; any tree): accept x with probability r(x) / sum(r), else
  r(x) = 0 (later siblings see the renormalised residual);
- a sampled chain carrying q: accept x with min(1, r(x) / q(x)), else r = norm(max(r - q, 0)) and
  the walk stops.
Moving to an accepted child resets r to the target at it. The bonus token is drawn from the final
r by inverse CDF. Randomness comes in as uniforms, one per node and one for the bonus, that the
caller draws from each sequence's own generator: a sequence's draws do not depend on the batch it
is in. No host sync; a fixed sequence of ops for a given N.
"""

from __future__ import annotations

import torch

from specsplit.kernels.accept import BatchedAccept, accepted_path


def accept_sampling_batched(
    target_probs: torch.Tensor,  # [B, N + 1, V] the target at the root (row 0) and at each node
    draft_tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64: -1 = root, earlier node, or -2 = padding (never tried)
    uniforms: torch.Tensor,  # [B, N + 1] in [0, 1): column j for node j, column N for the bonus
    draft_probs: torch.Tensor | None = None,  # [B, N, V] q of sampled chains, or None
    has_draft_probs: torch.Tensor | None = None,  # [B] bool: which sequences carry q
) -> BatchedAccept:
    batch, n = draft_tokens.shape
    if tuple(target_probs.shape[:2]) != (batch, n + 1) or target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, N + 1, V], got {tuple(target_probs.shape)}")
    if parents.shape != draft_tokens.shape or tuple(uniforms.shape) != (batch, n + 1):
        raise ValueError(
            f"parents {tuple(parents.shape)} and uniforms {tuple(uniforms.shape)} must be "
            f"[B, N] and [B, N + 1] for draft_tokens {tuple(draft_tokens.shape)}"
        )
    if draft_probs is not None and (
        has_draft_probs is None or tuple(draft_probs.shape) != tuple(target_probs[:, 1:].shape)
    ):
        raise ValueError("draft_probs must be [B, N, V] and come with has_draft_probs [B]")
    probs = target_probs.double()
    device = probs.device
    r = probs[:, 0].clone()  # [B, V] residual at the current node
    current = torch.zeros(batch, dtype=torch.int64, device=device)  # row of the current node
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)  # a q chain rejected
    accepted = torch.zeros(batch, n, dtype=torch.bool, device=device)
    for j in range(n):
        tried = (parents[:, j] + 1 == current) & (parents[:, j] >= -1) & ~stopped  # [B]
        token = draft_tokens[:, j : j + 1]  # [B, 1]
        r_x = r.gather(1, token).squeeze(1)  # [B]
        u = uniforms[:, j].double()
        threshold = r.sum(dim=1)  # deterministic: accept with r(x) / mass
        if draft_probs is not None and has_draft_probs is not None:
            q = draft_probs[:, j].double()  # [B, V] the distribution x was drawn from
            q_x = q.gather(1, token).squeeze(1)
            threshold = torch.where(has_draft_probs, q_x, threshold)  # min(1, r(x) / q(x))
        accept = tried & (u * threshold < r_x)  # [B]
        reject = tried & ~accept
        accepted[:, j] = accept
        current = torch.where(accept, j + 1, current)
        r = torch.where(accept[:, None], probs[:, j + 1], r)
        # a rejected deterministic proposal: r(x) = 0, the next sibling sees the rest
        r = r.scatter(1, token, torch.where(reject, 0.0, r.gather(1, token).squeeze(1))[:, None])
        if draft_probs is not None and has_draft_probs is not None:
            # a rejected sampled draft: the residual norm(max(r - q, 0)) of the target at the
            # current node (the target itself where r <= q everywhere), and the walk stops
            with_q = reject & has_draft_probs
            rows = current[:, None, None].expand(-1, 1, probs.shape[2])
            target_here = probs.gather(1, rows).squeeze(1)  # [B, V]
            residual = (target_here - q).clamp_min(0)
            residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, target_here)
            r = torch.where(with_q[:, None], residual, r)
            stopped = stopped | with_q
    num_accepted_drafts, accepted_nodes, _ = accepted_path(accepted)
    bonus_tokens = _inverse_cdf(r, uniforms[:, n].double())
    return BatchedAccept(num_accepted_drafts, accepted_nodes, bonus_tokens)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B, V] non-negative weights, [B] uniforms -> [B] int64 tokens: the first token whose
    cumulative weight exceeds u * total (zero-weight tokens are never drawn)."""
    cdf = weights.cumsum(dim=1)  # [B, V]
    target = (u * cdf[:, -1])[:, None]  # [B, 1]
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return token.clamp_max(weights.shape[1] - 1)
