"""The batched sampling acceptance (specsplit/kernels/accept_sampling.py) is lossless: the same
statistical check as the per-sequence reference (tests/unit/test_lossless_sampling_math.py),
with all N rounds run as one batch; and with one-hot targets it is greedy acceptance."""

from __future__ import annotations

import itertools

import pytest
import torch

from specsplit.kernels.accept import BatchedAccept, accept_greedy_batched, accepted_path
from specsplit.kernels.accept_sampling import _inverse_cdf, accept_sampling_batched
from specsplit.sampling import SamplingParams, make_generator, sample
from specsplit.tree import DraftTree
from tests.unit.test_lossless_sampling_math import (
    PLAIN,
    TOPK_CASES,
    N,
    V,
    ngram_chain,
    passes_check,
    sampled_chains,
    table,
    target,
    target_rows,
    topk_tree,
)


def on_supports(
    trees: list[DraftTree], n: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The trees' draft distributions on their supports as accept_sampling_batched takes them
    (tokens and probabilities [B, N, S], padding entries token 0 with probability 0), and
    [B] which trees carry one."""
    cut = [t.draft_probs.tokens.shape[1] for t in trees if t.draft_probs is not None]
    width = max(cut, default=1)
    q_tokens = torch.zeros(len(trees), n, width, dtype=torch.int64)
    q_probs = torch.zeros(len(trees), n, width, dtype=torch.float64)
    has_q = torch.zeros(len(trees), dtype=torch.bool)
    for b, tree in enumerate(trees):
        if tree.draft_probs is not None:
            rows, k = tree.draft_probs.tokens.shape
            q_tokens[b, :rows, :k] = tree.draft_probs.tokens
            q_probs[b, :rows, :k] = tree.draft_probs.probs.double()
            has_q[b] = True
    return (q_tokens, q_probs), has_q


def batched_pairs(
    rounds: list[tuple[DraftTree, torch.Tensor]], params: SamplingParams, seed: int
) -> torch.Tensor:
    """[N, 2] the first two tokens each round emits, all rounds as one batch."""
    n = max(len(tree) for tree, _ in rounds)
    batch = len(rounds)
    probs = torch.zeros(batch, n + 1, V, dtype=torch.float64)
    tokens = torch.zeros(batch, n, dtype=torch.int64)
    parents = torch.full((batch, n), -2, dtype=torch.int64)
    for b, (tree, rows) in enumerate(rounds):
        probs[b, : len(tree) + 1] = rows
        tokens[b, : len(tree)] = torch.tensor(tree.tokens)
        parents[b, : len(tree)] = torch.tensor(tree.parents)
    q, has_q = on_supports([tree for tree, _ in rounds], n)
    generator = make_generator(seed)
    uniforms = torch.rand(batch, n + 1, generator=generator, dtype=torch.float64)
    out = accept_sampling_batched(
        probs, tokens, parents, uniforms, q if has_q.any() else None, has_q
    )
    emitted = torch.cat([out.accepted_nodes, out.bonus_tokens[:, None]], dim=1)  # nodes, bonus
    firsts, seconds = [], []
    for b, (tree, _) in enumerate(rounds):
        k = int(out.num_accepted_drafts[b])
        row = [tree.tokens[int(node)] for node in emitted[b, :k]] + [int(out.bonus_tokens[b])]
        firsts.append(row[0])
        seconds.append(row[1] if len(row) > 1 else -1)
    pairs = torch.tensor([firsts, seconds]).T
    bonus_only = pairs[:, 1] < 0
    next_law = table(lambda p: target(p, params), 1)
    if bonus_only.any():
        pairs[bonus_only, 1] = sample(next_law[pairs[bonus_only, 0]], generator)
    return pairs


@pytest.mark.parametrize(("topk", "depth", "params"), TOPK_CASES)
def test_batched_topk_tree_is_lossless(topk: int, depth: int, params: SamplingParams) -> None:
    tree = topk_tree(topk, depth, params)
    rounds = list(itertools.repeat((tree, target_rows(tree, params)), N))
    ok, report = passes_check(batched_pairs(rounds, params, seed=11), params)
    assert ok, report


def test_batched_sampled_chain_with_q_is_lossless() -> None:
    rounds = sampled_chains(depth=3, params=PLAIN, seed=2)
    ok, report = passes_check(batched_pairs(rounds, PLAIN, seed=13), PLAIN)
    assert ok, report


@pytest.mark.parametrize("one_hot_q", [False, True], ids=["no-q", "one-hot-q"])
def test_batched_ngram_chain_is_lossless(one_hot_q: bool) -> None:
    tree = ngram_chain(one_hot_q)
    rounds = list(itertools.repeat((tree, target_rows(tree, PLAIN)), N))
    ok, report = passes_check(batched_pairs(rounds, PLAIN, seed=14), PLAIN)
    assert ok, report


def test_batched_mixed_trees_chains_and_padding_are_lossless() -> None:
    """Top-k trees, sampled chains with q and n-gram chains in one batch (padded to the widest
    tree): each kind keeps its law."""
    tree = topk_tree(2, 3, PLAIN)
    chains = sampled_chains(depth=3, params=PLAIN, seed=5)
    ngram = ngram_chain(one_hot_q=False)
    kinds = [(tree, target_rows(tree, PLAIN)), None, (ngram, target_rows(ngram, PLAIN))]
    rounds = [kinds[i % 3] or chains[i] for i in range(N)]
    pairs = batched_pairs(rounds, PLAIN, seed=15)
    for kind in range(3):
        ok, report = passes_check(pairs[kind::3], PLAIN)
        assert ok, f"kind {kind}: {report}"


def test_one_hot_target_is_greedy_acceptance() -> None:
    gen = torch.Generator().manual_seed(0)
    batch, n = 64, 6
    argmax = torch.randint(0, V, (batch, n + 1), generator=gen)
    tokens = torch.randint(0, V, (batch, n), generator=gen)
    parents = torch.tensor([-1, 0, 0, 1, -1, 4]).expand(batch, n).clone()
    tokens[:, 0] = argmax[:, 0]  # some paths get accepted
    tokens[::2, 1] = argmax[::2, 1]
    # siblings never repeat a token (DraftTree.validate): nodes 1 and 2, nodes 0 and 4
    tokens[:, 2] = torch.where(tokens[:, 1] == tokens[:, 2], (tokens[:, 2] + 1) % V, tokens[:, 2])
    tokens[:, 4] = torch.where(tokens[:, 0] == tokens[:, 4], (tokens[:, 4] + 1) % V, tokens[:, 4])
    probs = torch.nn.functional.one_hot(argmax, V).double()
    uniforms = torch.rand(batch, n + 1, generator=gen, dtype=torch.float64)
    got = accept_sampling_batched(probs, tokens, parents, uniforms)
    want = accept_greedy_batched(argmax, tokens, parents)
    assert torch.equal(got.num_accepted_drafts, want.num_accepted_drafts)
    assert torch.equal(got.accepted_nodes, want.accepted_nodes)
    assert torch.equal(got.bonus_tokens, want.bonus_tokens)
    assert int(want.num_accepted_drafts.max()) >= 2


def test_check_catches_a_batched_rule_that_accepts_every_tried_draft() -> None:
    """The check has power here too: uniforms of 0 accept every draft that is tried."""
    tree = topk_tree(2, 3, PLAIN)
    rounds = list(itertools.repeat((tree, target_rows(tree, PLAIN)), N))
    original = torch.rand

    def zeros_then_rand(*args, **kwargs):  # the acceptance uniforms are 0, the rest random
        out = original(*args, **kwargs)
        return out.zero_() if out.dim() == 2 else out

    torch.rand = zeros_then_rand  # type: ignore[assignment]
    try:
        pairs = batched_pairs(rounds, PLAIN, seed=11)
    finally:
        torch.rand = original  # type: ignore[assignment]
    ok, report = passes_check(pairs, PLAIN)
    assert not ok, f"accepting every draft passed: {report}"


# The walk as it ran before it went to [B]-sized values (a [B, V] residual carried node to
# node): the new one must give the same outcome for the same uniforms.
def dense_walk(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor,
    has_draft_probs: torch.Tensor,
) -> BatchedAccept:
    """The same arguments as accept_sampling_batched (unchecked), q given."""
    batch, n = draft_tokens.shape
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


@pytest.mark.parametrize("seed", range(4))
def test_the_walk_gives_the_dense_walks_outcome_for_the_same_uniforms(seed: int) -> None:
    """Random targets and uniforms over a batch of top-k trees, sampled chains with q (q cut
    to a support, as the drafter sends it), n-gram chains and padding: the same accepted
    nodes and bonus tokens as the dense walk, sequence by sequence."""
    gen = make_generator(seed)
    tree = topk_tree(2, 3, PLAIN)
    chains = sampled_chains(depth=3, params=PLAIN, seed=seed, support=4)[:40]
    ngram = ngram_chain(one_hot_q=False)
    rounds = [(tree, None), *((c, None) for c, _ in chains), (ngram, None), (DraftTree(), None)]
    batch, n = len(rounds), max(len(t) for t, _ in rounds)
    probs = torch.softmax(3 * torch.randn(batch, n + 1, V, generator=gen), dim=-1)
    probs[::3, :, 5:] = 0  # some targets with a small support (top-k)
    probs /= probs.sum(dim=-1, keepdim=True)
    tokens = torch.zeros(batch, n, dtype=torch.int64)
    parents = torch.full((batch, n), -2, dtype=torch.int64)
    q = torch.zeros(batch, n, V, dtype=torch.float64)
    for b, (t, _) in enumerate(rounds):
        tokens[b, : len(t)] = torch.tensor(t.tokens, dtype=torch.int64)
        parents[b, : len(t)] = torch.tensor(t.parents, dtype=torch.int64)
        if t.draft_probs is not None:
            q[b, : len(t)] = t.draft_probs.dense()
    support, has_q = on_supports([t for t, _ in rounds], n)
    uniforms = torch.rand(batch, n + 1, generator=gen, dtype=torch.float64)
    got = accept_sampling_batched(probs, tokens, parents, uniforms, support, has_q)
    want = dense_walk(probs, tokens, parents, uniforms, q, has_q)
    assert torch.equal(got.num_accepted_drafts, want.num_accepted_drafts)
    assert torch.equal(got.accepted_nodes, want.accepted_nodes)
    assert torch.equal(got.bonus_tokens, want.bonus_tokens)
    accepted = got.num_accepted_drafts
    assert int((accepted > 0).sum()) > 5 and int((accepted == 0).sum()) > 5  # both happen
