"""Acceptance: walk a draft tree against the target's outputs (DESIGN.md §2).

Plain-torch reference, one sequence at a time. The verifier runs the batched versions on the
device (specsplit/kernels/accept.py: greedy; specsplit/kernels/accept_sampling.py: lossless
sampling), which tests check against these.

Row convention for the target's outputs ([n + 1, V]): row 0 is the target at the root (the last
pending token), row 1 + j the target at tree node j. A node's "row" below is node + 1, so the
root (-1) maps to row 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.sampling import sample
from specsplit.tree import DraftTree


@dataclass
class AcceptResult:
    accepted_nodes: list[int]  # tree node indices of the accepted path, depth order, root excluded
    bonus_token: int  # drawn by the target at the last accepted node (the root if none)

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.accepted_nodes)

    @property
    def num_accepted_tokens(self) -> int:
        return len(self.accepted_nodes) + 1

    def accepted_tokens(self, tree: DraftTree) -> list[int]:
        """The tokens this round appends to `tokens`: accepted drafts, then the bonus token."""
        return [tree.tokens[node] for node in self.accepted_nodes] + [self.bonus_token]


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> AcceptResult:
    """Follow the child whose token is the target's argmax; bonus = argmax at the last node.

    target_logits: [n + 1, V]. Ties in the argmax go to the lowest token id (torch.argmax).
    """
    _check_rows(tree, target_logits, "target_logits")
    argmax = target_logits.argmax(dim=-1).tolist()  # [n + 1], the one host sync
    children = _children_by_row(tree)
    accepted: list[int] = []
    node = -1
    while True:
        want = argmax[node + 1]
        match = [child for child in children[node + 1] if tree.tokens[child] == want]
        if not match:  # siblings never repeat a token (DraftTree.validate), so <= 1 match
            return AcceptResult(accepted, bonus_token=argmax[node + 1])
        node = match[0]
        accepted.append(node)


def accept_sampling(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator
) -> AcceptResult:
    """Lossless rejection sampling: the accepted drafts + bonus are distributed as the target.

    target_probs: [n + 1, V], each row the target distribution after temperature/top-k/top-p.
    Deterministic proposals (tree.draft_probs is None; any tree shape): children are tried in
    index order, child x accepted with probability r(x), else r(x) = 0 and r renormalised; with
    no child accepted the bonus is drawn from what is left of r. Sampled drafts (a chain with
    draft_probs q): x accepted with min(1, r(x) / q(x)), else bonus ~ norm(max(r - q, 0)).
    All randomness comes from `generator` (uniforms then bonus draws, in walk order).
    """
    _check_rows(tree, target_probs, "target_probs")
    children = _children_by_row(tree)
    if tree.draft_probs is None:
        return _accept_deterministic(tree, children, target_probs, generator)
    if tuple(tree.draft_probs.shape) != (len(tree), target_probs.shape[-1]):
        raise ValueError(
            f"tree.draft_probs shape {tuple(tree.draft_probs.shape)} != "
            f"({len(tree)}, {target_probs.shape[-1]})"
        )
    if any(len(kids) > 1 for kids in children):
        raise ValueError("tree.draft_probs is only supported for chains (one child per node)")
    q = tree.draft_probs.dense(target_probs.device)
    return _accept_chain_with_q(tree, children, target_probs, q, generator)


def residual_distribution(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """[..., V] norm(max(r - q, 0)); where that is all zero (r <= q everywhere), r itself."""
    residual = (target - draft).clamp_min(0)  # [..., V]
    mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    fallback = target / target.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), fallback)


def accept_index(results: list[AcceptResult], num_steps: int) -> torch.Tensor:
    """[B, num_steps + 1] int64: per sequence, the accepted path's node at each depth.

    Column d holds the node at depth d; column 0 is the root (-1); columns after
    num_accepted_drafts are padding (-1). The bonus token was drawn at column num_accepted_drafts
    (target row = that node + 1). The width is num_steps + 1 — one column per depth level plus
    the root — never num_draft_tokens: a tree of n nodes is at most num_steps deep.
    """
    index = torch.full((len(results), num_steps + 1), -1, dtype=torch.int64)
    for b, result in enumerate(results):
        if result.num_accepted_drafts > num_steps:
            raise ValueError(
                f"results[{b}] accepted {result.num_accepted_drafts} drafts > num_steps {num_steps}"
            )
        index[b, 1 : 1 + result.num_accepted_drafts] = torch.tensor(
            result.accepted_nodes, dtype=torch.int64
        )
    return index


def _accept_deterministic(
    tree: DraftTree,
    children: list[list[int]],
    target_probs: torch.Tensor,  # [n + 1, V]
    generator: torch.Generator,
) -> AcceptResult:
    accepted: list[int] = []
    node = -1
    while True:
        r = target_probs[node + 1].to(torch.float64, copy=True)  # [V] unnormalised residual
        mass = float(r.sum())
        for child in children[node + 1]:
            token = tree.tokens[child]
            # Accept with r(x) / mass: the probability of x under the renormalised residual.
            if _uniform(generator, r.device) * mass < float(r[token]):
                break
            r[token] = 0.0
            mass = float(r.sum())
        else:  # no child accepted (or a leaf): the bonus comes from what is left of r
            return AcceptResult(accepted, bonus_token=int(sample(r[None], generator)[0]))
        node = child
        accepted.append(node)


def _accept_chain_with_q(
    tree: DraftTree,
    children: list[list[int]],
    target_probs: torch.Tensor,  # [n + 1, V]
    draft_probs: torch.Tensor,  # [n, V]
    generator: torch.Generator,
) -> AcceptResult:
    accepted: list[int] = []
    node = -1
    while True:
        r = target_probs[node + 1].to(torch.float64)  # [V]
        if not children[node + 1]:  # end of the chain: every draft accepted
            return AcceptResult(accepted, bonus_token=int(sample(r[None], generator)[0]))
        child = children[node + 1][0]
        token = tree.tokens[child]
        q = draft_probs[child].to(torch.float64)  # [V] the distribution `token` was drawn from
        # Accept with min(1, r(x) / q(x)), written without the division.
        if _uniform(generator, r.device) * float(q[token]) < float(r[token]):
            node = child
            accepted.append(node)
            continue
        residual = residual_distribution(r, q)  # [V]
        return AcceptResult(accepted, bonus_token=int(sample(residual[None], generator)[0]))


def _check_rows(tree: DraftTree, target: torch.Tensor, name: str) -> None:
    if target.dim() != 2 or target.shape[0] != len(tree) + 1:
        raise ValueError(
            f"{name} must be [n + 1, V] = [{len(tree) + 1}, V] (root row, then one per node), "
            f"got shape {tuple(target.shape)}"
        )
    if len(tree.parents) != len(tree):
        raise ValueError(
            f"tree.parents has {len(tree.parents)} entries, tree.tokens has {len(tree)}"
        )


def _children_by_row(tree: DraftTree) -> list[list[int]]:
    """[n + 1] lists: children of the node at each row (row 0 = root), in index order."""
    children: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for node, parent in enumerate(tree.parents):
        children[parent + 1].append(node)
    return children


def _uniform(generator: torch.Generator, device: torch.device) -> float:
    """One U[0, 1) draw from `generator` (which must live on `device`)."""
    return float(torch.rand((), generator=generator, device=device))
