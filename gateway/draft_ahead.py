"""Draft-ahead on the gateway (`--overlap ahead`, DESIGN.md §3): the Scheduler's draft-ahead
rounds (`AheadRounds.step_ahead`, a mixin of the Scheduler that declares what it uses of it),
and their bookkeeping: the trees a round takes from those drafted ahead, how many bonus tokens
the drafter guesses, and the hint that forwards the trees to the verifier (each cut to the shape
its outcome's next round will have)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.clients import DrafterClient, VerifierClient
from gateway.sequence import Sequence
from specsplit import metrics, telemetry
from specsplit.errors import ServiceError
from specsplit.messages import AheadTree, NextTrees, SpecParams, VerifyInput, VerifyOutput
from specsplit.tree import DraftTree

log = logging.getLogger(__name__)
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


class AheadRounds:
    # the Scheduler's, which these rounds use
    drafter: DrafterClient
    verifier: VerifierClient
    verify_ahead: bool
    ahead_guesses: int
    num_ahead_hits: int  # rounds whose tree was drafted ahead
    num_ahead_misses: int  # and rounds that had trees drafted ahead, none for the outcome
    _hints: set[asyncio.Future[None]]  # hints on their way (`_hint`)
    _drafter_resting: Callable[[], bool]  # the drafter is down: no Draft for now
    _drafter_down: Callable[[ServiceError], None]  # a failure: no Draft for a while if down
    _sent_then_stream: Callable[[Awaitable[Any]], Awaitable[Any]]
    _draft: Callable[[list[Sequence]], Awaitable[list[DraftTree]]]
    _verify_inputs: Callable[[list[Sequence], list[DraftTree]], list[VerifyInput]]
    _needs_drafter: Callable[[Sequence], bool]
    _layers_known: Callable[[Sequence], bool]
    _forget_on_drafter: Callable[[list[Sequence]], Awaitable[None]]
    _commit: Callable[[list[Sequence], list[DraftTree], list[VerifyOutput]], None]
    _stream: Callable[..., None]

    async def step_ahead(
        self, batch: list[Sequence], plain: bool = False, hint: bool = True
    ) -> None:
        """Draft-ahead (DESIGN.md §3): a sequence whose last outcome was among those guessed
        has its tree already; the others are drafted first. Then the Verify goes out and,
        while the verifier works, the last round's chunks stream and the drafter drafts the
        next round's trees for this round's likely outcomes (`_draft_ahead`). A round where
        every outcome was guessed holds only the Verify on its path; with `plain` (misses run
        plain) every round does: a sequence that drafts ahead but whose outcome was not guessed
        is verified with no tree (a plain decode step) while the drafter drafts ahead for it
        from that step's likely outcomes (the draft's likeliest bonus tokens). `hint`: the
        trees drafted ahead go to the verifier as a hint where verify_ahead says so. A Verify
        that answers before the drafter is committed and streamed at once, while the drafter
        drafts: the next round waits only for the trees. With `plain`, a sampled tree's newcomer
        (trees never draft ahead) is not drafted first either once the drafter has told its layers
        (`_catches_up_beside`): its prefill goes with no tree and the same drafter call catches
        its prompt up."""
        trees = self._take_ahead(batch)
        catching: list[Sequence] = []  # newcomers caught up beside the Verify, no tree
        if plain:
            for seq in batch:
                if id(seq) in trees:
                    continue
                if self._misses_plain(seq):
                    trees[id(seq)] = DraftTree()
                elif self._catches_up_beside(seq):
                    trees[id(seq)] = DraftTree()
                    catching.append(seq)
        with telemetry.round_span([seq.span for seq in batch]):
            missing = [seq for seq in batch if id(seq) not in trees]
            if missing:
                drafted: list[DraftTree] = await self._sent_then_stream(self._draft(missing))
                trees.update(zip(map(id, missing), drafted, strict=True))
            round_trees = [trees[id(seq)] for seq in batch]
            inputs = self._verify_inputs(batch, round_trees)
            for item in inputs:  # (the verifier counts its next round's absence as "off")
                item.unhinted = self.verify_ahead and not hint
            guessing = []
            caught = {id(seq) for seq in catching}  # (a sampled tree's: no draft-ahead)
            for seq, tree, item in zip(batch, round_trees, inputs, strict=True):
                if self._drafts_ahead(seq, tree) and id(seq) not in caught:
                    guessing.append((seq, tree))
                    # one step (a tree's round has one; a plain round's would have several):
                    # the outcomes guessed end with its bonus token, more would match none
                    item.decode_steps = 1
            # the trees drafted ahead are for the outcomes of this round: kept by the tokens
            # and rounds before its commit, which may come first
            marks = [(len(seq.tokens), seq.stats.rounds) for seq, _ in guessing]
            # the Verify on its way before anything else, then the Draft in the same turn of
            # the loop (tasks start in order): its trees must come before this Verify's answer
            # to be of use (and their hint too)
            verifying = asyncio.ensure_future(self.verifier.verify(inputs))
            drafting = asyncio.ensure_future(self._draft_ahead(guessing, catching))
            committed = False
            try:
                await asyncio.sleep(0)  # both requests are sent: the last round's chunks stream
                self._stream()
                await asyncio.wait((verifying, drafting), return_when=asyncio.FIRST_COMPLETED)
                if not drafting.done() and verifying.exception() is None:
                    # the Verify answered first: its commit and chunks off the next round's
                    # path, which waits for the trees
                    self._commit(batch, round_trees, verifying.result())
                    committed = True
                    self._stream()
                guessed = await drafting
                self._send_hint(guessing, guessed, plain, hint, late=verifying.done())
            except BaseException:
                verifying.cancel()
                drafting.cancel()
                raise
            outputs = await verifying
        for (seq, _), ahead, (base, rounds) in zip(guessing, guessed, marks, strict=True):
            seq.keep_ahead(ahead, base, rounds)
        if not committed:
            self._commit(batch, round_trees, outputs)

    def _send_hint(
        self,
        guessing: list[tuple[Sequence, DraftTree]],
        guessed: list[list[AheadTree]],
        plain: bool,
        hint: bool,
        late: bool,
    ) -> None:
        """With verify ahead, start the hint (`_hint`) for the trees drafted ahead unless the
        round sends none (`hint` false: the overlap gate's "ahead-unhinted") or the Verify has
        answered (`late`: its next round goes out at once). Not waited for: its answer must
        not hold up the Verify's; it needs nothing from it (a failure is logged in `_hint`).
        It is written once the round waits for its Verify, from the sequences as they are
        before its commit (which follows that answer). Greedy sequences' only: the verifier
        runs no sampled round ahead."""
        greedy = [i for i, (seq, _) in enumerate(guessing) if seq.request.sampling.greedy]
        guessing, guessed = [guessing[i] for i in greedy], [guessed[i] for i in greedy]
        if not self.verify_ahead or not guessing:
            return
        metrics.count_hint("off" if not hint else "late" if late else "sent")
        if late or not hint:
            return
        hinting = asyncio.ensure_future(self._hint(guessing, guessed, plain))
        self._hints.add(hinting)
        hinting.add_done_callback(self._hints.discard)

    async def _hint(
        self,
        guessing: list[tuple[Sequence, DraftTree]],
        guessed: list[list[AheadTree]],
        plain: bool,
    ) -> None:
        """The trees drafted ahead, to the verifier while it verifies this round (verify_ahead;
        `next_trees`: with misses plain, an outcome not guessed runs no tree, as `step_ahead`
        will send it). Nobody waits for it: a hint that fails costs nothing but itself."""
        hints = [
            next_trees(seq, verifying, ahead, plain and self._misses_plain(seq))
            for (seq, verifying), ahead in zip(guessing, guessed, strict=True)
        ]
        try:
            await self.verifier.hint([hint for hint in hints if hint is not None])
        except ServiceError as e:
            log.debug("a hint to the verifier failed: %s", e)
        except Exception:  # nobody waits for it: a hint's failure ends here
            log.exception("a hint to the verifier failed")

    def _take_ahead(self, seqs: list[Sequence]) -> dict[int, DraftTree]:
        """The trees drafted ahead for the outcomes `seqs` had (by id), counted as hits and
        misses (`take_ahead`)."""
        trees, hits, misses = take_ahead(seqs)
        self.num_ahead_hits += hits
        self.num_ahead_misses += misses
        metrics.observe_draft_ahead(hits, misses)
        return trees

    def _misses_plain(self, seq: Sequence) -> bool:
        """With misses plain: whether `seq`, its outcome not guessed, is verified with no
        tree at once. In its first round too once the drafter has told the layers it reads
        (`_layers_known`: the prefill needs nothing from a Draft; the draft-ahead call beside
        it catches the prompt up, off the other sequences' path: a long prompt's catch-up is
        the drafter's slowest forward), and only where it drafts ahead next: chains, greedy or
        sampled (trees are never drafted ahead)."""
        return (
            (seq.verifier_begun or self._layers_known(seq))
            and seq.round_spec().topk == 1
            and self._drafts_ahead(seq, DraftTree())
        )

    def _drafts_ahead(self, seq: Sequence, tree: DraftTree) -> bool:
        """Whether the drafter drafts ahead for `seq` this round: verifying a chain, with
        drafts next round, and a drafter that answers. Greedy or sampled: a sampled chain's
        trees drafted ahead draw at the uniforms its next Draft would have drawn, with their
        draft distributions (drafter/draft_ahead.py)."""
        return (
            self.ahead_guesses > 0
            and tree.is_chain
            and not seq.prefilling  # (a chunk round: its outcome is the next chunk)
            and self._needs_drafter(seq)
            and seq.round_spec().num_steps > 0
            and not self._drafter_resting()
        )

    async def _draft_ahead(
        self, batch: list[tuple[Sequence, DraftTree]], catching: list[Sequence]
    ) -> list[list[AheadTree]]:
        """The drafter's trees for the likely outcomes of the trees being verified. It also
        takes each sequence's new tokens (and features), as a Draft does, and in the same call
        `catching`'s prompts (no drafts: `_catches_up_beside`). A failure costs only the
        guesses: the sequences start over on the drafter with their next Draft."""
        if not batch and not catching:
            return []
        inputs = []
        for seq, tree in batch:
            item = seq.draft_input()
            item.verifying, item.ahead_guesses = tree, guesses(seq, tree, self.ahead_guesses)
            inputs.append(item)
        for seq in catching:
            item = seq.draft_input()
            item.spec = SpecParams()  # its tokens only: its next Draft drafts
            inputs.append(item)
        try:
            outputs = await self.drafter.draft(inputs)
        except ServiceError as e:
            log.warning("draft-ahead failed (%s: %s)", e.code.value, e.message)
            self._drafter_down(e)
            await self._forget_on_drafter([seq for seq, _ in batch] + catching)
            return [[] for _ in batch]
        return [out.ahead for out in outputs[: len(batch)]]

    def _catches_up_beside(self, seq: Sequence) -> bool:
        """Whether a sampled newcomer that never drafts ahead (a tree) goes without a tree in its
        first round while the drafter takes its prompt in the call beside the Verify, rather
        than drafted first on every sequence's path (a long prompt's catch-up is the drafter's
        slowest forward): where the drafter has told the layers it reads and they are none (an
        EAGLE head has no features before the prefill: it is not asked, as `_needs_drafter`
        says) and the sequence drafts at all. A chain's newcomer drafts ahead instead
        (`_misses_plain`); a greedy tree's is drafted first, as before."""
        return (
            not seq.verifier_begun
            and not seq.request.sampling.greedy
            and self._layers_known(seq)
            and not seq.hidden_state_layers
            and self._needs_drafter(seq)
            and not self._drafter_resting()
        )
