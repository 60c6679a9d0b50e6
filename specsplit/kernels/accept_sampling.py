"""Batched lossless sampling acceptance on the device (DESIGN.md §2, "Acceptance that stays
lossless"): the per-sequence reference is `specsplit.acceptance.accept_sampling`.

One pass over the tree's nodes in index order, for every sequence at once, on [B]-sized values:
what a node's test reads (the target's probability of its token at its parent, q's, each row's
mass) is gathered up front, and the residual distribution is built once, at the end, for the
node the walk stopped at. Parents precede
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
    # q of sampled chains on their supports, or None: tokens [B, N, S] int64 and probabilities
    # [B, N, S] (padding entries: probability 0; a token listed twice counts both)
    draft_probs: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        has_draft_probs is None
        or draft_probs[0].shape != draft_probs[1].shape
        or tuple(draft_probs[0].shape[:2]) != (batch, n)
    ):
        raise ValueError(
            "draft_probs must be tokens and probabilities [B, N, S] each, with has_draft_probs [B]"
        )
    vocab, device = target_probs.shape[2], target_probs.device
    with_q = has_draft_probs if draft_probs is not None else None
    # what the walk reads of each node j, gathered up front ([B, N] each): the target's
    # probability of its token at its parent, q's of its token, and each row's mass
    parent_rows = (parents + 1).clamp_min(0)  # padding (-2) reads row 0, never used
    flat_target = target_probs.reshape(batch, -1)
    p_x = flat_target.gather(1, parent_rows * vocab + draft_tokens).double()
    # summed in the targets' dtype: in float64 it is 50x slower on a CPU, and differs by
    # ~1e-7 (float32's own rounding of the probabilities)
    row_mass = target_probs.sum(dim=2).double()  # [B, N + 1]
    q_x = None
    if draft_probs is not None:
        q_tokens, q_probs = draft_probs
        q_x = (q_probs.double() * (q_tokens == draft_tokens[:, :, None])).sum(dim=2)  # [B, N]
    current = torch.zeros(batch, dtype=torch.int64, device=device)  # row of the current node
    mass = row_mass[:, 0]  # [B] what is left of r at the current node
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)  # a q chain rejected
    rejected_q = torch.zeros(batch, dtype=torch.int64, device=device)  # its rejected node
    accepted = torch.zeros(batch, n, dtype=torch.bool, device=device)
    rejected = torch.zeros(batch, n, dtype=torch.bool, device=device)  # deterministic ones
    for j in range(n):
        tried = (parents[:, j] + 1 == current) & (parents[:, j] >= -1) & ~stopped  # [B]
        r_x = p_x[:, j]  # [B] r(x): a tried node's siblings so far carried other tokens
        threshold = mass  # deterministic: accept with r(x) / mass
        if q_x is not None and with_q is not None:
            threshold = torch.where(with_q, q_x[:, j], mass)  # min(1, r(x) / q(x))
        accept = tried & (uniforms[:, j].double() * threshold < r_x)
        reject = tried & ~accept
        accepted[:, j] = accept
        current = torch.where(accept, j + 1, current)
        # an accepted node: r is the target at it; a rejected deterministic proposal: r(x) = 0
        mass = torch.where(accept, row_mass[:, j + 1], torch.where(reject, mass - r_x, mass))
        if with_q is not None:
            stop = reject & with_q  # a rejected sampled draft: the walk stops
            rejected_q = torch.where(stop, j, rejected_q)
            stopped = stopped | stop
            reject = reject & ~with_q
        rejected[:, j] = reject
    # r at the end: the target at the current node, less the tokens of its rejected children
    # (deterministic), or norm(max(r - q, 0)) where a sampled draft was rejected
    seq = torch.arange(batch, device=device)
    here = target_probs[seq, current].double()  # [B, V]
    gone = (parents + 1 == current[:, None]) & rejected  # [B, N]
    zeroed = torch.zeros_like(here).scatter_add_(1, draft_tokens, gone.double())
    r = here * (zeroed == 0)
    if draft_probs is not None:
        # [B, V] the rejected draft's distribution, from its support
        q = torch.zeros_like(here).scatter_add_(
            1, q_tokens[seq, rejected_q], q_probs[seq, rejected_q].double()
        )
        residual = (here - q).clamp_min(0)
        residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, here)
        r = torch.where(stopped[:, None], residual, r)
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
