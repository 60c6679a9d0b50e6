"""Statistical check that accept_sampling is lossless (DESIGN.md §2).

A tiny synthetic target model maps a prefix to a distribution over V = 8 tokens, so the law of
the first two emitted tokens is exactly p(t1 | ()) * p(t2 | (t1,)). Each test runs N rounds of
accept_sampling from the same root and compares the empirical law of the first token, of the
second token and of the pair with the exact one. When a round emits only the bonus token, the
second token comes from the next round; we draw it from the target directly (an empty tree).

Tolerance: for K cells, E|p_hat_i - p_i| <= sqrt(p_i / N), so by Cauchy-Schwarz
E[TV] <= 0.5 * sqrt(K / N). We allow tol = 2 * sqrt(K / N), four times that bound (the same
as 4 * sqrt(V / N) for K = V halved). Every test also runs a deliberately wrong rule through
the same check and requires it to fail, so the check has power. Seeds are fixed: deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import pytest
import torch

from specsplit.acceptance import AcceptResult, accept_sampling
from specsplit.sampling import SamplingParams, make_generator, sample, target_probs
from specsplit.tree import DraftTree

V = 8
N = 20_000
LOGIT_SCALE = 2.0  # spread of the synthetic logits (top tokens carry 0.3-0.6 of the mass)
Prefix = tuple[int, ...]
Rule = Callable[[DraftTree, torch.Tensor, torch.Generator], AcceptResult]
Round = Callable[[torch.Generator], tuple[DraftTree, torch.Tensor]]  # -> tree, [n + 1, V]


def _random_logits(prefix: Prefix, salt: int) -> torch.Tensor:
    """[V] logits, a fixed function of (prefix, salt)."""
    seed = salt
    for token in prefix:
        seed = (seed * 1_000_003 + token + 1) % 2**61
    return torch.randn(V, generator=make_generator(seed), dtype=torch.float64) * LOGIT_SCALE


@cache
def target(prefix: Prefix, params: SamplingParams) -> torch.Tensor:
    """[V] the synthetic target's distribution after `prefix`."""
    return target_probs(_random_logits(prefix, salt=1)[None], params)[0].double()


@cache
def draft(prefix: Prefix, params: SamplingParams, agreement: float) -> torch.Tensor:
    """[V] a draft model: `agreement` parts the target, the rest an unrelated distribution."""
    other = torch.softmax(_random_logits(prefix, salt=2), dim=-1)
    return agreement * target(prefix, params) + (1 - agreement) * other


def exact_pair_law(params: SamplingParams) -> torch.Tensor:
    """[V, V] P(t1, t2) = p(t1 | ()) * p(t2 | (t1,))."""
    second = torch.stack([target((t,), params) for t in range(V)])  # [V, V]
    return target((), params)[:, None] * second


def target_rows(tree: DraftTree, params: SamplingParams) -> torch.Tensor:
    """[n + 1, V] the target at the root, then at every node (prefix = the node's path)."""
    prefixes = [tuple(tree.tokens[j] for j in tree.path_to(node)) for node in range(len(tree))]
    return torch.stack([target((), params)] + [target(p, params) for p in prefixes])


def run_rounds(rule: Rule, make_round: Round, params: SamplingParams, seed: int) -> torch.Tensor:
    """[N, 2] the first two tokens emitted, over N independent rounds."""
    generator = make_generator(seed)
    pairs = torch.empty(N, 2, dtype=torch.int64)
    for i in range(N):
        tree, probs = make_round(generator)
        emitted = rule(tree, probs, generator).accepted_tokens(tree)
        if len(emitted) == 1:  # bonus only: the next round (an empty tree) emits the second
            emitted.append(int(sample(target(tuple(emitted), params)[None], generator)[0]))
        pairs[i] = torch.tensor(emitted[:2])
    return pairs


def distances(pairs: torch.Tensor, exact: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Per statistic: (total variation distance to the exact law, tolerance)."""
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    joint = (counts / len(pairs)).view(V, V)
    laws = {
        "first": (joint.sum(dim=1), exact.sum(dim=1)),
        "second": (joint.sum(dim=0), exact.sum(dim=0)),
        "pair": (joint.flatten(), exact.flatten()),
    }
    return {
        name: (0.5 * float((got - want).abs().sum()), 2 * math.sqrt(want.numel() / len(pairs)))
        for name, (got, want) in laws.items()
    }


def assert_lossless(pairs: torch.Tensor, exact: torch.Tensor) -> None:
    for name, (tv, tol) in distances(pairs, exact).items():
        assert tv < tol, f"{name} token: TV {tv:.4f} >= tol {tol:.4f}"


def assert_detected(pairs: torch.Tensor, exact: torch.Tensor) -> None:
    found = {name: tv >= tol for name, (tv, tol) in distances(pairs, exact).items()}
    assert any(found.values()), f"a wrong rule passed the check: {distances(pairs, exact)}"


# --- deliberately wrong rules (each must fail the check) --------------------------------------


def accept_every_draft(tree: DraftTree, probs: torch.Tensor, gen: torch.Generator) -> AcceptResult:
    """Follow the first child down to a leaf, bonus from the target there."""
    path: list[int] = []
    while kids := tree.children(path[-1] if path else -1):
        path.append(kids[0])
    bonus = int(sample(probs[path[-1] + 1 if path else 0][None], gen)[0])
    return AcceptResult(path, bonus)


def accept_without_renormalising(
    tree: DraftTree, probs: torch.Tensor, gen: torch.Generator
) -> AcceptResult:
    """Top-k tree rule that tries each child with its ORIGINAL r(x), never renormalising."""
    path: list[int] = []
    node = -1
    while True:
        r = probs[node + 1].clone()
        for child in tree.children(node):
            if float(torch.rand((), generator=gen)) < float(probs[node + 1, tree.tokens[child]]):
                break
            r[tree.tokens[child]] = 0.0
        else:
            if float(r.sum()) <= 0:  # every child rejected though they held all the mass
                r = probs[node + 1]
            return AcceptResult(path, int(sample(r[None], gen)[0]))
        node = child
        path.append(node)


def bonus_from_target_not_residual(
    tree: DraftTree, probs: torch.Tensor, gen: torch.Generator
) -> AcceptResult:
    """Chain rule that resamples a rejected position from r instead of norm(max(r - q, 0))."""
    result = accept_sampling(tree, probs, gen)
    if result.num_accepted_drafts < len(tree):  # a rejection happened: redraw the bonus from r
        result.bonus_token = int(sample(probs[result.num_accepted_drafts][None], gen)[0])
    return result


# --- (a) deterministic top-k trees ------------------------------------------------------------


def topk_tree(topk: int, depth: int, params: SamplingParams) -> DraftTree:
    """A full tree: each node's children are the draft model's top-k tokens, breadth first."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier: list[tuple[int, Prefix]] = [(-1, ())]
    for _ in range(depth):
        next_frontier = []
        for parent, prefix in frontier:
            for token in draft(prefix, params, agreement=0.7).topk(topk).indices.tolist():
                tokens.append(token)
                parents.append(parent)
                next_frontier.append((len(tokens) - 1, (*prefix, token)))
        frontier = next_frontier
    return DraftTree(tokens, parents)


TOPK_CASES = [
    pytest.param(2, 3, SamplingParams(temperature=1.0), id="topk2-depth3"),
    # truncated target: some proposed children have r(x) = 0
    pytest.param(
        3, 2, SamplingParams(temperature=0.7, top_k=5, top_p=0.9), id="topk3-depth2-trunc"
    ),
]


@pytest.mark.parametrize(("topk", "depth", "params"), TOPK_CASES)
def test_topk_tree_is_lossless(topk: int, depth: int, params: SamplingParams) -> None:
    tree = topk_tree(topk, depth, params)
    tree.validate(V)
    probs = target_rows(tree, params)  # [n + 1, V], fixed: the proposals are deterministic
    exact = exact_pair_law(params)
    assert_lossless(run_rounds(accept_sampling, lambda g: (tree, probs), params, seed=1), exact)
    for wrong in (accept_every_draft, accept_without_renormalising):
        assert_detected(run_rounds(wrong, lambda g: (tree, probs), params, seed=1), exact)


# --- (b) chain of sampled drafts with their q -------------------------------------------------


def sampled_chain(depth: int, params: SamplingParams) -> Round:
    """Each round draws a fresh chain from the draft model, carrying the q of every draft."""

    def make_round(generator: torch.Generator) -> tuple[DraftTree, torch.Tensor]:
        prefix: Prefix = ()
        qs = []
        for _ in range(depth):
            q = draft(prefix, params, agreement=0.5)
            qs.append(q)
            prefix = (*prefix, int(sample(q[None], generator)[0]))
        tree = DraftTree(list(prefix), list(range(-1, depth - 1)), draft_probs=torch.stack(qs))
        probs = torch.stack([target(prefix[:d], params) for d in range(depth + 1)])
        return tree, probs

    return make_round


def test_sampled_chain_with_q_is_lossless() -> None:
    params = SamplingParams(temperature=1.0)
    make_round = sampled_chain(depth=3, params=params)
    exact = exact_pair_law(params)
    assert_lossless(run_rounds(accept_sampling, make_round, params, seed=2), exact)
    for wrong in (accept_every_draft, bonus_from_target_not_residual):
        assert_detected(run_rounds(wrong, make_round, params, seed=2), exact)


# --- (c) n-gram style chain: fixed tokens, one-hot q or none ----------------------------------


@pytest.mark.parametrize("one_hot_q", [False, True], ids=["no-q", "one-hot-q"])
def test_ngram_chain_is_lossless(one_hot_q: bool) -> None:
    params = SamplingParams(temperature=1.0)
    # the chain follows the target's second most likely token at each step: often rejected
    tokens: list[int] = []
    for _ in range(3):
        tokens.append(int(target(tuple(tokens), params).topk(2).indices[1]))
    q = torch.nn.functional.one_hot(torch.tensor(tokens), V).double() if one_hot_q else None
    tree = DraftTree(tokens, [-1, 0, 1], draft_probs=q)
    tree.validate(V)
    probs = target_rows(tree, params)
    exact = exact_pair_law(params)
    assert_lossless(run_rounds(accept_sampling, lambda g: (tree, probs), params, seed=3), exact)
    assert_detected(run_rounds(accept_every_draft, lambda g: (tree, probs), params, seed=3), exact)
