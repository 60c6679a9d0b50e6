"""Statistical check that accept_sampling is lossless (DESIGN.md §2).

A tiny synthetic target model maps a prefix to a distribution over V = 8 tokens, so the law of
the first two emitted tokens is exactly p(t1 | ()) * p(t2 | (t1,)). Each test runs N rounds of
a rule from the same root and compares the empirical law of the first token, of the second
token and of the pair with the exact one. When a round emits only the bonus token, the second
token comes from the next round; we draw it from the target directly (as an empty tree would).

Tolerance: for K cells, E|p_hat_i - p_i| <= sqrt(p_i / N), so by Cauchy-Schwarz
E[TV] <= 0.5 * sqrt(K / N). We allow tol = 2 * sqrt(K / N), four times that bound (0.040 for
the K = 8 marginals, 0.113 for the K = 64 pair at N = 20000). Deliberately wrong rules run
through the same check and must fail it, so the check has power. Seeds are fixed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from functools import cache

import pytest
import torch

from specsplit.acceptance import AcceptResult, accept_sampling
from specsplit.sampling import SamplingParams, make_generator, sample, target_probs
from specsplit.tree import DraftProbs, DraftTree

V = 8
N = 20_000
LOGIT_SCALE = 2.0  # spread of the synthetic logits: the top tokens carry 0.2-0.6 of the mass
Prefix = tuple[int, ...]
Rule = Callable[[DraftTree, torch.Tensor, torch.Generator], AcceptResult]
Rounds = Iterable[tuple[DraftTree, torch.Tensor]]  # per round: tree, target rows [n + 1, V]

PLAIN = SamplingParams(temperature=1.0)
TRUNCATED = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)  # some drafts get r(x) = 0


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


def table(model: Callable[[Prefix], torch.Tensor], depth: int) -> torch.Tensor:
    """[V] * depth + [V]: model(prefix) for every prefix of length `depth`."""
    rows = [model(prefix) for prefix in itertools.product(range(V), repeat=depth)]
    return torch.stack(rows).view(*([V] * depth), V)


def exact_pair_law(params: SamplingParams) -> torch.Tensor:
    """[V, V] P(t1, t2) = p(t1 | ()) * p(t2 | (t1,))."""
    return target((), params)[:, None] * table(lambda p: target(p, params), 1)


def target_rows(tree: DraftTree, params: SamplingParams) -> torch.Tensor:
    """[n + 1, V] the target at the root, then at every node (prefix = the node's path)."""
    prefixes = [tuple(tree.tokens[j] for j in tree.path_to(node)) for node in range(len(tree))]
    return torch.stack([target((), params)] + [target(p, params) for p in prefixes])


def run_rounds(rule: Rule, rounds: Rounds, params: SamplingParams, seed: int) -> torch.Tensor:
    """[N, 2] the first two tokens emitted, one row per round."""
    generator = make_generator(seed)
    firsts: list[int] = []
    seconds: list[int] = []
    for tree, probs in rounds:
        emitted = rule(tree, probs, generator).accepted_tokens(tree)
        firsts.append(emitted[0])
        seconds.append(emitted[1] if len(emitted) > 1 else -1)
    pairs = torch.tensor([firsts, seconds]).T  # [N, 2]
    bonus_only = pairs[:, 1] < 0  # the next round, an empty tree, emits the second token
    next_law = table(lambda p: target(p, params), 1)  # [V, V]
    if bonus_only.any():
        pairs[bonus_only, 1] = sample(next_law[pairs[bonus_only, 0]], generator)
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


def passes_check(pairs: torch.Tensor, params: SamplingParams) -> tuple[bool, str]:
    found = distances(pairs, exact_pair_law(params))
    report = ", ".join(f"{name} TV {tv:.4f} (tol {tol:.4f})" for name, (tv, tol) in found.items())
    return all(tv < tol for tv, tol in found.values()), report


# --- deliberately wrong rules: each must fail the check ---------------------------------------


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
    """Chain rule that redraws a rejected position from r instead of norm(max(r - q, 0))."""
    result = accept_sampling(tree, probs, gen)
    if result.num_accepted_drafts < len(tree):  # rejected at row num_accepted_drafts
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
    tree = DraftTree(tokens, parents)
    tree.validate(V)
    return tree


TOPK_CASES = [
    pytest.param(2, 3, PLAIN, id="topk2-depth3"),
    pytest.param(3, 2, TRUNCATED, id="topk3-depth2-truncated"),
]


@pytest.mark.parametrize(("topk", "depth", "params"), TOPK_CASES)
def test_topk_tree_is_lossless(topk: int, depth: int, params: SamplingParams) -> None:
    tree = topk_tree(topk, depth, params)
    rounds = itertools.repeat((tree, target_rows(tree, params)), N)  # deterministic proposals
    ok, report = passes_check(run_rounds(accept_sampling, rounds, params, seed=1), params)
    assert ok, report


@pytest.mark.parametrize("wrong", [accept_every_draft, accept_without_renormalising])
@pytest.mark.parametrize(("topk", "depth", "params"), TOPK_CASES)
def test_topk_tree_check_catches_wrong_rule(
    topk: int, depth: int, params: SamplingParams, wrong: Rule
) -> None:
    tree = topk_tree(topk, depth, params)
    rounds = itertools.repeat((tree, target_rows(tree, params)), N)
    ok, report = passes_check(run_rounds(wrong, rounds, params, seed=1), params)
    assert not ok, f"{wrong.__name__} passed: {report}"


# --- (b) chains of sampled drafts carrying their q --------------------------------------------


def sampled_chains(
    depth: int, params: SamplingParams, seed: int, support: int | None = None
) -> list[tuple[DraftTree, torch.Tensor]]:
    """N chains, each drawn afresh from the draft model, with q per draft and target rows.
    support: each q cut to its `support` most likely tokens and renormalized before drawing
    (as the drafter's DRAFT_SUPPORT cuts it)."""
    generator = make_generator(seed)
    drafts = torch.empty(N, depth, dtype=torch.int64)  # [N, depth] drafted tokens
    q_rows = torch.empty(N, depth, V, dtype=torch.float64)  # [N, depth, V]
    r_rows = torch.empty(N, depth + 1, V, dtype=torch.float64)  # [N, depth + 1, V]
    for d in range(depth + 1):
        prefixes = tuple(drafts[:, :d].T)  # d index tensors of [N]
        r_rows[:, d] = table(lambda p: target(p, params), d)[prefixes]
        if d < depth:
            q_rows[:, d] = table(lambda p: draft(p, params, agreement=0.5), d)[prefixes]
            if support is not None:
                kept = q_rows[:, d].topk(support, dim=-1)
                cut = torch.zeros_like(q_rows[:, d]).scatter_(-1, kept.indices, kept.values)
                q_rows[:, d] = cut / cut.sum(dim=-1, keepdim=True)
            drafts[:, d] = sample(q_rows[:, d], generator)
    parents = list(range(-1, depth - 1))
    return [
        (DraftTree(tokens, parents, draft_probs=DraftProbs.of(q)), r)
        for tokens, q, r in zip(drafts.tolist(), q_rows, r_rows, strict=True)
    ]


def test_sampled_chain_with_q_is_lossless() -> None:
    rounds = sampled_chains(depth=3, params=PLAIN, seed=2)
    ok, report = passes_check(run_rounds(accept_sampling, rounds, PLAIN, seed=3), PLAIN)
    assert ok, report


def test_sampled_chain_drawn_from_a_cut_q_is_lossless() -> None:
    """Drafts drawn from q cut to its 3 most likely of 8 tokens (the drafter's DRAFT_SUPPORT;
    the target puts real mass outside it, which only the residual can emit) and told to the
    verifier as that cut q: the output is still the target's."""
    rounds = sampled_chains(depth=3, params=PLAIN, seed=5, support=3)
    assert all(int((tree.draft_probs.dense() > 0).sum(-1).max()) <= 3 for tree, _ in rounds[:50])  # type: ignore[union-attr]
    ok, report = passes_check(run_rounds(accept_sampling, rounds, PLAIN, seed=6), PLAIN)
    assert ok, report


@pytest.mark.parametrize("support", [None, 3], ids=["whole-q", "cut-q"])
@pytest.mark.parametrize("wrong", [accept_every_draft, bonus_from_target_not_residual])
def test_sampled_chain_check_catches_wrong_rule(wrong: Rule, support: int | None) -> None:
    rounds = sampled_chains(depth=3, params=PLAIN, seed=2, support=support)
    ok, report = passes_check(run_rounds(wrong, rounds, PLAIN, seed=3), PLAIN)
    assert not ok, f"{wrong.__name__} passed: {report}"


# --- (c) n-gram style chain: fixed tokens, no q or a one-hot q --------------------------------


def ngram_chain(one_hot_q: bool) -> DraftTree:
    """A fixed chain following the target's second most likely token: often rejected."""
    tokens: list[int] = []
    for _ in range(3):
        tokens.append(int(target(tuple(tokens), PLAIN).topk(2).indices[1]))
    q = torch.nn.functional.one_hot(torch.tensor(tokens), V).double() if one_hot_q else None
    tree = DraftTree(tokens, [-1, 0, 1], draft_probs=None if q is None else DraftProbs.of(q))
    tree.validate(V)
    return tree


@pytest.mark.parametrize("one_hot_q", [False, True], ids=["no-q", "one-hot-q"])
def test_ngram_chain_is_lossless(one_hot_q: bool) -> None:
    tree = ngram_chain(one_hot_q)
    rounds = itertools.repeat((tree, target_rows(tree, PLAIN)), N)
    ok, report = passes_check(run_rounds(accept_sampling, rounds, PLAIN, seed=4), PLAIN)
    assert ok, report


def test_ngram_chain_check_catches_accepting_every_draft() -> None:
    tree = ngram_chain(one_hot_q=False)
    rounds = itertools.repeat((tree, target_rows(tree, PLAIN)), N)
    ok, report = passes_check(run_rounds(accept_every_draft, rounds, PLAIN, seed=4), PLAIN)
    assert not ok, f"accept_every_draft passed: {report}"
