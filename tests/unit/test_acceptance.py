"""Tree acceptance on hand-made target outputs: exact accepted paths and bonus tokens."""

from __future__ import annotations

import pytest
import torch

from specsplit.acceptance import (
    AcceptResult,
    accept_greedy,
    accept_index,
    accept_sampling,
    residual_distribution,
)
from specsplit.sampling import make_generator
from specsplit.tree import DraftProbs, DraftTree

VOCAB = 64


def _logits(argmax_per_row: list[int]) -> torch.Tensor:
    """[len, VOCAB] logits: row i peaks at argmax_per_row[i], with noise below the peak."""
    noise = torch.rand(len(argmax_per_row), VOCAB, generator=make_generator(0))  # [0, 1)
    rows = torch.arange(len(argmax_per_row))
    noise[rows, torch.tensor(argmax_per_row)] = 2.0
    return noise


def _one_hot(tokens: list[int]) -> torch.Tensor:
    """[len, VOCAB] probabilities: row i puts all its mass on tokens[i]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).float()


# A full topk = 2, depth = 3 tree. Node 2 carries token 23 like node 5 in another branch: the
# walk must pick a child of the current node, not any node with the right token.
#            root
#        0:10      1:11
#      2:23 3:21  4:22 5:23
#   6:30 7:31 (4)  8:32 9:33 (5)    -- nodes 6, 7 under node 4; 8, 9 under node 5
TOPK_TREE = DraftTree(
    tokens=[10, 11, 23, 21, 22, 23, 30, 31, 32, 33],
    parents=[-1, -1, 0, 0, 1, 1, 4, 4, 5, 5],
)
CHAIN = DraftTree(tokens=[3, 5, 7], parents=[-1, 0, 1])


def test_all_accepted() -> None:
    # rows: root, node 0, node 1, node 2
    result = accept_greedy(CHAIN, _logits([3, 5, 7, 42]))
    assert result == AcceptResult(accepted_nodes=[0, 1, 2], bonus_token=42)
    assert result.num_accepted_drafts == 3
    assert result.num_accepted_tokens == 4
    assert result.accepted_tokens(CHAIN) == [3, 5, 7, 42]


def test_early_mismatch() -> None:
    # the target wants 6 after 3; the later rows would match the chain but must not be used
    result = accept_greedy(CHAIN, _logits([3, 6, 7, 42]))
    assert result == AcceptResult(accepted_nodes=[0], bonus_token=6)
    assert result.num_accepted_tokens == 2
    assert result.accepted_tokens(CHAIN) == [3, 6]


def test_reject_first_level() -> None:
    chain = accept_greedy(CHAIN, _logits([4, 5, 7, 42]))
    assert chain == AcceptResult(accepted_nodes=[], bonus_token=4)
    # both first-level children of the top-k tree miss
    rows = [12, 23, 22, 0, 0, 23, 0, 0, 0, 0, 0]
    tree = accept_greedy(TOPK_TREE, _logits(rows))
    assert tree == AcceptResult(accepted_nodes=[], bonus_token=12)
    assert tree.num_accepted_drafts == 0
    assert tree.num_accepted_tokens == 1


def test_empty_tree() -> None:
    result = accept_greedy(DraftTree(), _logits([17]))
    assert result == AcceptResult(accepted_nodes=[], bonus_token=17)
    assert result.num_accepted_tokens == 1


def test_deep_branch_accepted_in_topk_tree() -> None:
    # root -> 11 (node 1, the second child), node 1 -> 23 (node 5, not node 2 which also holds
    # 23), node 5 -> 32 (node 8, depth 3), node 8 -> bonus 40. Decoy rows point elsewhere.
    rows = [11, 23, 23, 0, 0, 31, 32, 0, 0, 40, 0]
    #      root n0  n1 n2 n3  n4  n5 n6 n7  n8 n9
    result = accept_greedy(TOPK_TREE, _logits(rows))
    assert result == AcceptResult(accepted_nodes=[1, 5, 8], bonus_token=40)
    assert TOPK_TREE.path_to(8) == result.accepted_nodes
    assert result.accepted_tokens(TOPK_TREE) == [11, 23, 32, 40]


def test_bonus_token_at_right_node() -> None:
    # accept node 0 (10); at node 0 the target wants 9, which no child of node 0 holds.
    # The root (10), the sibling node 1 (50) and the unaccepted child node 2 (51) want others.
    rows = [10, 9, 50, 51, 0, 0, 0, 0, 0, 0, 0]
    result = accept_greedy(TOPK_TREE, _logits(rows))
    assert result == AcceptResult(accepted_nodes=[0], bonus_token=9)


def test_greedy_rejects_wrong_row_count() -> None:
    with pytest.raises(ValueError, match=r"target_logits must be \[n \+ 1, V\] = \[4, V\]"):
        accept_greedy(CHAIN, _logits([3, 5, 7]))


def test_sampling_with_one_hot_targets_is_the_greedy_walk() -> None:
    # r(x) = 1 accepts x surely, r(x) = 0 rejects it surely: the walk is deterministic.
    rows = [11, 23, 23, 0, 0, 31, 32, 0, 0, 40, 0]
    result = accept_sampling(TOPK_TREE, _one_hot(rows), make_generator(0))
    assert result == AcceptResult(accepted_nodes=[1, 5, 8], bonus_token=40)
    rows = [10, 9, 50, 51, 0, 0, 0, 0, 0, 0, 0]
    result = accept_sampling(TOPK_TREE, _one_hot(rows), make_generator(0))
    assert result == AcceptResult(accepted_nodes=[0], bonus_token=9)


def test_sampling_empty_tree_draws_bonus_from_root() -> None:
    result = accept_sampling(DraftTree(), _one_hot([17]), make_generator(0))
    assert result == AcceptResult(accepted_nodes=[], bonus_token=17)


def test_sampling_rejected_child_is_never_the_bonus() -> None:
    # root: r = 1/2 on 10, 1/4 on 11, 1/4 on 12; children 10 and 11 (nodes 0, 1), leaves.
    tree = DraftTree(tokens=[10, 11], parents=[-1, -1])
    probs = torch.zeros(3, VOCAB)
    probs[0, [10, 11, 12]] = torch.tensor([0.5, 0.25, 0.25])
    probs[1:, 60] = 1.0  # bonus after an accepted leaf
    generator = make_generator(3)
    results = [accept_sampling(tree, probs, generator) for _ in range(400)]
    rejected = [r for r in results if r.num_accepted_drafts == 0]
    assert rejected  # P(both rejected) = 1/4
    assert {r.bonus_token for r in rejected} == {12}
    assert {r.bonus_token for r in results if r.num_accepted_drafts == 1} == {60}


def test_sampling_chain_with_q_equal_to_r_accepts_everything() -> None:
    # min(1, r(x) / q(x)) = 1 whenever q == r: every draft is accepted, bonus drawn at the end.
    target = torch.softmax(torch.randn(4, VOCAB, generator=make_generator(1)), dim=-1)
    target[3] = _one_hot([33])[0]
    chain = DraftTree(tokens=[3, 5, 7], parents=[-1, 0, 1], draft_probs=DraftProbs.of(target[:3]))
    generator = make_generator(5)
    for _ in range(50):
        result = accept_sampling(chain, target, generator)
        assert result == AcceptResult(accepted_nodes=[0, 1, 2], bonus_token=33)


def test_sampling_chain_with_zero_target_mass_rejects_and_samples_residual() -> None:
    # r(3) = 0: the first draft is always rejected, the bonus comes from max(r - q, 0) = {9}.
    target = _one_hot([9, 0, 0, 0])
    target[0, 3] = 0.0
    q = torch.zeros(3, VOCAB)
    q[:, 3] = 0.5
    q[:, 9] = 0.5
    chain = DraftTree(tokens=[3, 5, 7], parents=[-1, 0, 1], draft_probs=DraftProbs.of(q))
    result = accept_sampling(chain, target, make_generator(0))
    assert result == AcceptResult(accepted_nodes=[], bonus_token=9)


def test_sampling_is_reproducible_with_a_seed() -> None:
    probs = torch.softmax(torch.randn(len(TOPK_TREE) + 1, VOCAB, generator=make_generator(2)), -1)
    probs[:, [10, 11, 21, 22, 23, 30, 31, 32, 33]] += 0.2  # make acceptances likely
    probs /= probs.sum(dim=-1, keepdim=True)
    first, second = make_generator(99), make_generator(99)
    runs = [accept_sampling(TOPK_TREE, probs, first) for _ in range(100)]
    again = [accept_sampling(TOPK_TREE, probs, second) for _ in range(100)]
    assert runs == again
    assert len({(tuple(r.accepted_nodes), r.bonus_token) for r in runs}) > 10  # not constant


def test_sampling_rejects_draft_probs_on_a_branching_tree() -> None:
    tree = DraftTree(
        tokens=[1, 2],
        parents=[-1, -1],
        draft_probs=DraftProbs.of(torch.full((2, VOCAB), 1 / VOCAB)),
    )
    with pytest.raises(ValueError, match="chains"):
        accept_sampling(tree, torch.full((3, VOCAB), 1 / VOCAB), make_generator(0))


def test_residual_distribution() -> None:
    r = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.1, 0.2])
    # max(r - q, 0) = [0.3, 0, 0.1, 0] -> [0.75, 0, 0.25, 0]
    torch.testing.assert_close(residual_distribution(r, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))
    # r == q leaves nothing: fall back to r
    torch.testing.assert_close(residual_distribution(r, r), r)
    batched = residual_distribution(torch.stack([r, r]), torch.stack([q, r]))  # [2, V]
    torch.testing.assert_close(batched, torch.tensor([[0.75, 0.0, 0.25, 0.0], r.tolist()]))


def test_accept_index_pads_with_minus_one() -> None:
    results = [
        AcceptResult(accepted_nodes=[1, 5, 8], bonus_token=40),  # all num_steps levels accepted
        AcceptResult(accepted_nodes=[0], bonus_token=9),
        AcceptResult(accepted_nodes=[], bonus_token=12),
    ]
    index = accept_index(results, num_steps=3)
    assert index.dtype == torch.int64
    assert index.tolist() == [[-1, 1, 5, 8], [-1, 0, -1, -1], [-1, -1, -1, -1]]
    # the bonus was drawn at column num_accepted_drafts: its target row is that node + 1
    bonus_rows = [int(index[b, r.num_accepted_drafts]) + 1 for b, r in enumerate(results)]
    assert bonus_rows == [9, 1, 0]


def test_accept_index_width_is_num_steps_plus_one_not_num_draft_tokens() -> None:
    # 10 draft tokens, 3 levels: the index is 4 wide, and a full-depth path fits exactly.
    index = accept_index([AcceptResult(accepted_nodes=[1, 5, 8], bonus_token=40)], num_steps=3)
    assert index.shape == (1, 4)
    assert accept_index([], num_steps=3).shape == (0, 4)


def test_accept_index_rejects_path_longer_than_num_steps() -> None:
    with pytest.raises(ValueError, match="num_steps 2"):
        accept_index([AcceptResult(accepted_nodes=[1, 5, 8], bonus_token=40)], num_steps=2)
