"""bench/ahead_ranks.py's arithmetic: an outcome's rank among the bonus tokens guessed after
the same accepted drafts, and the split of a number of guesses over the accept lengths that
hits most."""

from __future__ import annotations

from collections import Counter

from bench.ahead_ranks import best_split, rank_of
from specsplit.tree import DraftTree


def test_an_outcomes_rank_counts_only_the_guesses_after_the_same_accepted_drafts() -> None:
    guessed = {key: DraftTree() for key in [(7,), (8,), (5, 9), (5, 7), (5, 6, 7)]}
    assert rank_of(guessed, (8,)) == 1
    assert rank_of(guessed, (5, 7)) == 1  # (7,) is another accept length's guess
    assert rank_of(guessed, (5, 6, 7)) == 0
    assert rank_of(guessed, (9,)) is None
    assert rank_of(guessed, (5, 6, 8)) is None


def test_the_best_split_takes_a_later_guess_that_hits_past_one_that_does_not() -> None:
    """Length 1's second guess never hits but its third hits twice: a greedy split would stop
    at its first; the best split of 4 guesses spends 3 there."""
    hits = {0: Counter({0: 2}), 1: Counter({0: 1, 2: 2})}
    rate, split = best_split(hits, lengths=2, outcomes=4, rounds=10)
    assert split == [1, 3] and rate == 0.5
    assert best_split(hits, lengths=2, outcomes=2, rounds=10) == (0.3, [1, 1])
