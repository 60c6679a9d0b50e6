"""The batched sampling acceptance (specsplit/kernels/accept_sampling.py) is lossless: the same
statistical check as the per-sequence reference (tests/unit/test_lossless_sampling_math.py),
with all N rounds run as one batch; and with one-hot targets it is greedy acceptance."""

from __future__ import annotations

import itertools

import pytest
import torch

from specsplit.kernels.accept import accept_greedy_batched
from specsplit.kernels.accept_sampling import accept_sampling_batched
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


def batched_pairs(
    rounds: list[tuple[DraftTree, torch.Tensor]], params: SamplingParams, seed: int
) -> torch.Tensor:
    """[N, 2] the first two tokens each round emits, all rounds as one batch."""
    n = max(len(tree) for tree, _ in rounds)
    batch = len(rounds)
    probs = torch.zeros(batch, n + 1, V, dtype=torch.float64)
    tokens = torch.zeros(batch, n, dtype=torch.int64)
    parents = torch.full((batch, n), -2, dtype=torch.int64)
    q = torch.zeros(batch, n, V, dtype=torch.float64)
    has_q = torch.zeros(batch, dtype=torch.bool)
    for b, (tree, rows) in enumerate(rounds):
        probs[b, : len(tree) + 1] = rows
        tokens[b, : len(tree)] = torch.tensor(tree.tokens)
        parents[b, : len(tree)] = torch.tensor(tree.parents)
        if tree.draft_probs is not None:
            q[b, : len(tree)] = tree.draft_probs.dense()
            has_q[b] = True
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
