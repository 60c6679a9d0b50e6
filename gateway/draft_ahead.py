"""Draft-ahead's bookkeeping on the gateway (`--overlap ahead`, DESIGN.md §3), apart from the
round itself (`Scheduler.step_ahead`): the trees a round takes from those drafted ahead, how many
bonus tokens the drafter guesses, and the hint that forwards the trees to the verifier (each cut
to the shape its outcome's next round will have)."""

from __future__ import annotations

from gateway.sequence import Sequence
from specsplit.messages import AheadTree, NextTrees
from specsplit.tree import DraftTree

DEFAULT_AHEAD_GUESSES = 2  # bonus tokens guessed per accept length
DEFAULT_AHEAD_MAX_BATCH = 4  # overlap "both": draft-ahead up to this many running, then groups
MAX_AHEAD_GUESSES = 16  # the drafter's limit (drafter/engine.py TreeLimits.max_topk)
AHEAD_MISSES = ("draft", "plain")  # what a draft-ahead round does for an outcome not guessed
# "plain": an outcome not guessed is verified at once with no tree (a plain decode step) while
# the drafter drafts ahead for that step's likely bonus tokens; "draft": it is drafted first
DEFAULT_AHEAD_MISS = "plain"


def take_ahead(seqs: list[Sequence]) -> tuple[dict[int, DraftTree], int, int]:
    """The trees drafted ahead for the outcomes `seqs` had (by id), the hits and the misses
    (sequences that had trees drafted ahead, none for their outcome); every other tree drafted
    ahead is dropped."""
    trees: dict[int, DraftTree] = {}
    had_ahead = 0
    for seq in seqs:
        had_ahead += bool(seq.ahead)
        tree = seq.take_ahead()
        if tree is not None:
            trees[id(seq)] = tree
    return trees, len(trees), had_ahead - len(trees)


def guesses(seq: Sequence, tree: DraftTree, ahead_guesses: int) -> int:
    """Bonus tokens guessed per accept length of `tree`. A plain round's (an empty tree: one
    accept length) guesses as many trees as a chain round of the sequence's shape would draft,
    (chain length + 1) x ahead_guesses, up to the drafter's limit: the same drafting for more
    of the root's likely tokens (in process, SmolLM2 + head, 2 guesses: 62% of rounds hit
    against 58% with 2 guesses at the root, bench/RESULTS.md)."""
    if tree:
        return ahead_guesses
    width = seq.round_spec().num_steps + 1
    return min(ahead_guesses * width, MAX_AHEAD_GUESSES)


def next_trees(
    seq: Sequence, verifying: DraftTree, ahead: list[AheadTree], misses_plain: bool
) -> NextTrees | None:
    """`seq`'s hint for the verifier while it verifies `verifying`: the round it is for (its
    tokens before the commit: kv_committed_len + pending), each outcome's tree drafted ahead
    as `Sequence.take_ahead` will cut it after that outcome, and, with `misses_plain`, that an
    outcome not guessed runs no tree. Outcomes that would finish the sequence are left out (no
    next round: running one would only cost the verifier's GPU); None when nothing is left."""
    fitted = []
    for outcome in ahead:
        if seq.stop_checker.would_finish(outcome.tokens):
            continue
        fitted.append(AheadTree(outcome.tokens, seq.fit(outcome.tree, len(outcome.tokens))))
    # a miss commits up to the whole tree being verified and a bonus token: plain only if that
    # leaves a next round (by length; a stop token among them is not known)
    room = len(verifying) + 1
    misses_plain = misses_plain and not seq.stop_checker.would_finish([-1] * room)
    if not fitted and not misses_plain:
        return None
    return NextTrees(seq.seq_id, len(seq.tokens), fitted, misses_plain)
