"""The verifier's hints between rounds (`verifier/hints.py:HintBook`), host state only: a hint is
kept for the round it names, a round waiting for its hint is launched only on the hint that
names it, a hint that comes after the next round started is dropped, and the rounds with none
run ahead are counted by reason for sequences that send hints only."""

from __future__ import annotations

from specsplit.messages import AheadTree, NextTrees, VerifyInput, VerifyOutput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from verifier.hints import HintBook

CHAIN = DraftTree([7, 8], [-1, 0])


def _round(seq_id: str, committed: int, accepted: list[int], bonus: int):
    """A chain round of `seq_id` with one pending token at `committed` (its base: committed
    + 1), and its output."""
    item = VerifyInput(seq_id, False, committed, [5], CHAIN)
    out = VerifyOutput(seq_id, accepted, bonus, committed + 1 + len(accepted))
    return item, out


def test_a_hint_gives_the_tree_drafted_for_the_outcome_that_came() -> None:
    book = HintBook()
    item, out = _round("a", 10, [7], 9)  # base 11, outcome [7, 9]
    tree = DraftTree([1, 2], [-1, 0])
    hint = NextTrees("a", 11, [AheadTree([7, 9], tree), AheadTree([3], CHAIN)], plain=False)
    assert book.store([hint], {"a"}) == ["a"]
    assert book.next_tree(item, out, park=False) == tree
    assert not book.next and not book.num_not_ahead


def test_an_outcome_not_guessed_runs_plain_only_where_the_hint_says_so() -> None:
    for plain, want in ((True, DraftTree()), (False, None)):
        book = HintBook()
        item, out = _round("a", 10, [], 4)
        book.store([NextTrees("a", 11, [AheadTree([3], CHAIN)], plain=plain)], {"a"})
        assert book.next_tree(item, out, park=False) == want
        assert book.num_not_ahead == ({} if plain else {"unguessed": 1})


def test_a_hint_for_another_round_is_stale() -> None:
    book = HintBook()
    item, out = _round("a", 10, [], 4)
    book.store([NextTrees("a", 12, [], plain=True)], {"a"})
    assert book.next_tree(item, out, park=False) is None
    assert book.num_not_ahead == {"stale": 1}


def test_a_parked_round_launches_only_on_the_hint_that_names_it() -> None:
    """A round waiting for its hint (`park`) is ready only once a hint for it is kept: not on
    one for the round after (a hint that overtook its Verify)."""
    book = HintBook()
    item, out = _round("a", 10, [7], 9)
    book.park([item], [out], {"a"})
    book.store([NextTrees("a", 13, [], plain=True)], {"a"})  # the next round's hint
    assert book.ready(["a"]) == [] and "a" in book.finished
    book.store([NextTrees("a", 11, [], plain=True)], {"a"})
    assert book.ready(book.waiting()) == [(item, out)] and not book.finished


def test_a_hint_after_its_next_round_started_is_dropped_and_counted_late() -> None:
    book = HintBook()
    book.store([NextTrees("a", 1, [], plain=True)], {"a"})  # "a" sends hints
    book.next.clear()
    item, out = _round("a", 10, [], 4)
    book.park([item], [out], {"a"})
    book.round_started()
    assert book.num_not_ahead == {"late": 1} and not book.finished
    assert book.store([NextTrees("a", 11, [], plain=True)], {"a"}) == []
    assert not book.next


def test_a_round_the_gateway_sent_no_hint_for_is_counted_off_not_late() -> None:
    """A sequence that sends hints, in a round the gateway marked unhinted (the overlap gate's
    draft-ahead rounds without hints): its next round's not running ahead is "off", parked or
    not."""
    book = HintBook()
    book.store([NextTrees("a", 1, [], plain=True)], {"a"})  # "a" sends hints
    book.next.clear()
    item, out = _round("a", 10, [], 4)
    item.unhinted = True
    book.park([item], [out], {"a"})
    book.round_started()
    assert book.num_not_ahead == {"off": 1}
    assert book.next_tree(item, out, park=False) is None
    assert book.num_not_ahead == {"off": 2}
    item.unhinted = False
    assert book.next_tree(item, out, park=False) is None
    assert book.num_not_ahead == {"off": 2, "late": 1}


def test_only_sequences_that_send_hints_are_counted() -> None:
    reasons: list[str] = []
    book = HintBook()
    book.on_not_ahead = reasons.append
    book.store([NextTrees("a", 11, [], plain=True)], {"a"})
    book.drop(["a", "b"], "busy")
    assert reasons == ["busy"] and not book.next


def test_sampled_and_unknown_sequences_do_not_wait_for_hints() -> None:
    book = HintBook()
    greedy, out_a = _round("a", 10, [], 4)
    sampled, out_b = _round("b", 10, [], 4)
    sampled.sampling = SamplingParams(temperature=1.0)
    gone, out_c = _round("c", 10, [], 4)
    book.park([greedy, sampled, gone], [out_a, out_b, out_c], {"a", "b"})
    assert list(book.finished) == ["a"]


def test_a_released_sequence_is_forgotten() -> None:
    book = HintBook()
    book.store([NextTrees("a", 11, [], plain=True)], {"a"})
    item, out = _round("a", 10, [], 4)
    book.park([item], [out], {"a"})
    book.forget("a", released=True)
    assert not (book.next or book.finished or book.hinting or book.hinted or book.missed)
