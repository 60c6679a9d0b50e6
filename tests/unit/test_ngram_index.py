"""Prompt lookup's n-gram index (drafter/ngram.py) finds what a scan of the whole context finds,
as sequences grow and are cut back the way the drafter engine is told to."""

from __future__ import annotations

import random

import pytest

from drafter.ngram import NgramProposer
from drafter.types import DraftSeq
from specsplit.lookup import NgramIndex


def scan_continuations(
    tokens: list[int], depth: int, limit: int, min_ngram: int, max_ngram: int
) -> list[list[int]]:
    """The reference: every earlier start of the longest matching suffix, latest first."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        starts = [s for s in range(n_tokens - n) if tokens[s : s + n] == tokens[n_tokens - n :]]
        follows = dict.fromkeys(tuple(tokens[s + n : s + n + depth]) for s in reversed(starts))
        if follows:
            return [list(follow) for follow in list(follows)[:limit]]
    return []


@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(1, 3), (2, 4), (1, 1)])
def test_index_finds_what_a_scan_finds_through_appends_and_cuts(
    min_ngram: int, max_ngram: int
) -> None:
    rng = random.Random(min_ngram * 10 + max_ngram)
    proposer = NgramProposer(max_ngram=max_ngram, min_ngram=min_ngram)
    seq = DraftSeq("s")
    seq.state = proposer.new_state(seq)
    for _ in range(300):
        if seq.tokens and rng.random() < 0.3:  # the gateway rejected a tail: cut it
            length = rng.randrange(len(seq.tokens) + 1)
            proposer.truncate(seq, length)
            del seq.tokens[length:]
        seq.tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 6))]  # few: many repeats
        depth, limit = rng.randrange(1, 6), rng.randrange(1, 4)
        got = proposer.continuations(seq, depth, limit)
        assert got == scan_continuations(seq.tokens, depth, limit, min_ngram, max_ngram)


def test_cut_to_nothing_and_past_the_indexed_length() -> None:
    index = NgramIndex(range(1, 3))
    tokens = [5, 6, 5, 6, 7]
    index.extend(tokens)
    assert index.starts[(5, 6)] == [0, 2] and index.length == 5
    index.cut(tokens, 3)  # the n-grams ending in 6, 7 go
    assert index.starts[(5, 6)] == [0] and (6, 7) not in index.starts and index.length == 3
    index.cut(tokens, 4)  # past what is indexed: nothing to forget
    assert index.length == 3
    index.cut(tokens, 0)
    assert index.starts == {} and index.length == 0
