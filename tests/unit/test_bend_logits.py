"""Synthetic acceptance's bent logits (benchmarks only, `verifier.round_accept.bend_logits`):
exactly the accepted first children raised, every child where acceptance stops lowered, nothing
else touched; a chained round's tokens read from its placed input ids."""

from __future__ import annotations

import random

import torch

from specsplit.messages import VerifyInput
from specsplit.tree import DraftTree
from verifier.round_accept import SYNTHETIC_BIG, bend_logits

VOCAB = 32
# a chain 7 -> 8 -> 9 and a second root child 10; rates: the first level accepted, the second not
TREE = DraftTree([7, 8, 9, 10], [-1, 0, 1, -1])
RATES = (1.0, 0.0)


def _bent(tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(2 * (1 + len(TREE)), VOCAB)
    before = logits.clone()
    inputs = [VerifyInput(f"s{b}", False, 4, [1], TREE) for b in range(2)]
    rows = [range(0, 5), range(5, 10)]
    bend_logits(inputs, logits, rows, RATES, random.Random(0), torch.device("cpu"), tokens)
    return before, logits


def test_bend_raises_the_accepted_first_child_and_lowers_where_it_stops() -> None:
    before, logits = _bent()
    want = before.clone()
    for r in (0, 5):  # each sequence: root row -> node 0 (token 7); node 0's row -> node 1 (8)
        want[r, 7] = SYNTHETIC_BIG
        want[r + 1, 8] = -SYNTHETIC_BIG
    assert torch.equal(logits, want)


def test_bend_of_a_chained_round_reads_the_placed_tokens() -> None:
    """tokens [B, 1 + n]: each sequence's pending token, then its placed tree's tokens."""
    tokens = torch.tensor([[0, 17, 18, 19, 20], [0, 27, 28, 29, 30]])
    before, logits = _bent(tokens)
    want = before.clone()
    for r, placed in ((0, tokens[0]), (5, tokens[1])):
        want[r, placed[1]] = SYNTHETIC_BIG
        want[r + 1, placed[2]] = -SYNTHETIC_BIG
    assert torch.equal(logits, want)
