"""Pipelined groups (`--overlap groups`, DESIGN.md §3): the running sequences form two groups
that take turns, one verified while the drafter drafts the other. The Scheduler's rounds in that
mode (`GroupRounds.step_groups`), their state between rounds (each sequence's group, the trees
drafted for the next turn, the group verified last and not yet committed, the other group's
Verify sent early) and leaving the mode (`_leave_groups`). A mixin of the Scheduler: it uses the
Scheduler's clients, its draft, commit and streaming, declared below."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.clients import VerifierClient
from gateway.sequence import Sequence
from specsplit import telemetry
from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.tree import DraftTree

log = logging.getLogger(__name__)
# a verified round: its sequences, their trees, the verifier's outputs
Round = tuple[list[Sequence], list[DraftTree], list[VerifyOutput]]
# a Verify sent a round early: (its group, its sequences, their trees, the call)
EarlyVerify = tuple[int, list[Sequence], list[DraftTree], "asyncio.Future[list[VerifyOutput]]"]


class GroupRounds:
    # the Scheduler's, which these rounds use
    verifier: VerifierClient
    overlap: str
    _draft: Callable[[list[Sequence]], Awaitable[list[DraftTree]]]
    _verify_inputs: Callable[[list[Sequence], list[DraftTree]], list[VerifyInput]]
    _take_ahead: Callable[[list[Sequence]], dict[int, DraftTree]]
    _commit: Callable[[list[Sequence], list[DraftTree], list[VerifyOutput]], None]
    _commit_and_stream: Callable[[Round], None]
    _stream: Callable[..., None]
    _sent_then_stream: Callable[[Awaitable[list[DraftTree]]], Awaitable[list[DraftTree]]]

    def _init_groups(self) -> None:
        self._group: dict[str, int] = {}  # seq id -> 0 or 1
        self._turn = 0  # the group verified next
        self._drafted: dict[str, DraftTree] = {}  # trees drafted ahead, for their next verify
        # the last verified group's outputs, committed during the next Verify
        self._uncommitted: Round | None = None
        # and the other group's Verify, sent as soon as its trees were drafted
        self._early: EarlyVerify | None = None

    async def step_groups(self, running: list[Sequence], early_verify: bool = False) -> None:
        """Pipelined groups (DESIGN.md §3): the running sequences form two groups that take
        turns. This round's Verify is one group's, with the trees drafted for it during the
        last round, most often already sent then (`_early`); while the verifier works, the
        gateway commits the other group's last round, sends its next Draft and streams its
        chunks while the drafter drafts (detokenizing, stop strings, streaming: off the path to
        the next Verify), and (`early_verify`) that group's Verify goes out as soon as its trees
        come, so the verifier has it before this one is done (it runs the two back to back;
        "groups-early" rounds). The verified
        group's outputs are committed next round. A new sequence joins the smaller group, on a
        tie the one drafted this round (`_assign_groups`); where sequences left one group more
        than the other, a Verify about to go out leaves its surplus to the other group
        (`_rebalance`); one with no tree drafted ahead (new in the verified group, or after a
        fault) is drafted first; with one group empty a round commits, drafts and verifies in
        turn. A round that fails commits what it can
        first: the last round's outputs and the early Verify's."""
        early, self._early = self._early, None
        if early is not None:
            turn, verify, trees, verifying = early
        else:
            turn = (
                self._turn
                if any(self._group.get(s.seq_id) == self._turn for s in running)
                else 1 - self._turn
            )
        self._assign_groups(running, turn)
        if early is None:
            if not any(self._group[s.seq_id] == turn for s in running):
                turn = 1 - turn  # all of them new: the group they joined
            verify = self._rebalance(running, turn)
        self._turn = 1 - turn
        sent = {id(seq) for seq in verify}
        ahead = [seq for seq in running if self._group[seq.seq_id] != turn and id(seq) not in sent]
        pending, self._uncommitted = self._uncommitted, None
        if pending is not None and not set(map(id, pending[0])).isdisjoint(sent):
            # the group verified last round is the one verified now
            self._commit_and_stream(pending)
            pending = None
        try:
            if early is None:
                verify = [seq for seq in verify if not (seq.finished or seq.cancelled)]
                if not verify:
                    if pending is not None:
                        self._commit_and_stream(pending)
                    return
                trees = await self._trees(running, verify)
            with telemetry.round_span([seq.span for seq in verify]):
                if early is None:
                    verifying = asyncio.ensure_future(
                        self.verifier.verify(self._verify_inputs(verify, trees))
                    )
                    await asyncio.sleep(0)  # the Verify is on its way before the commit below
                try:
                    if pending is not None:
                        self._commit(*pending)
                        pending = None
                    ahead = [
                        seq
                        for seq in ahead
                        if not (seq.finished or seq.cancelled or seq.seq_id in self._drafted)
                    ]
                    # the committed group's chunks (and what earlier serial or draft-ahead
                    # rounds committed) stream once its next Draft is on its way: the Draft,
                    # then its Verify, are the path to the verifier's next round
                    drafted = await self._sent_then_stream(self._draft(ahead))
                    self._stream()  # where the Draft needed no RPC
                    for seq, tree in zip(ahead, drafted, strict=True):
                        self._drafted[seq.seq_id] = tree
                    if early_verify:
                        self._send_early(running, 1 - turn)
                    verified = await verifying
                except BaseException:
                    verifying.cancel()
                    raise
        except BaseException as e:
            self._drafted.clear()  # whatever happens next, draft again from the tokens
            if pending is not None:
                self._commit_and_stream(pending)
            if isinstance(e, asyncio.CancelledError):
                self.drop_early()
            else:
                await self.land_early()
            raise
        self._uncommitted = (verify, trees, verified)

    async def _trees(self, running: list[Sequence], verify: list[Sequence]) -> list[DraftTree]:
        """The trees for `verify`'s round: those drafted ahead, the missing ones drafted now."""
        if self.overlap in ("both", "gated"):  # after a draft-ahead round its trees serve
            guessed = self._take_ahead(running)
            self._drafted.update((s.seq_id, guessed[id(s)]) for s in running if id(s) in guessed)
        missing = [seq for seq in verify if seq.seq_id not in self._drafted]
        if missing:
            for seq, tree in zip(missing, await self._draft(missing), strict=True):
                self._drafted[seq.seq_id] = tree
        return [self._drafted.pop(seq.seq_id) for seq in verify]

    def _send_early(self, running: list[Sequence], group: int) -> None:
        """The Verify of `group`'s next round, sent now (`_early`) when each of its running
        sequences has its tree: the next round verifies exactly these."""
        batch = self._rebalance(running, group)
        if not batch or any(seq.seq_id not in self._drafted for seq in batch):
            return
        trees = [self._drafted.pop(seq.seq_id) for seq in batch]
        verifying = asyncio.ensure_future(self.verifier.verify(self._verify_inputs(batch, trees)))
        self._early = (group, batch, trees, verifying)

    def _rebalance(self, running: list[Sequence], group: int) -> list[Sequence]:
        """`group`'s running sequences for the Verify about to go out, less those past an even
        split: where requests left the other group more (their lengths differ), those move to
        it, keeping the trees drafted for them (their tokens do not change until they are
        verified), and go out with its next Verify. Uneven groups lose the overlap: a round
        lasts the larger of one group's Verify and the other's Draft, so with a draft as long
        as a verify, groups of 7 and 1 take 2 x the time of 7 a cycle against 2 x 4's."""
        live = [s for s in running if not (s.finished or s.cancelled)]
        batch = [s for s in live if self._group.get(s.seq_id) == group]
        others = sum(self._group.get(s.seq_id) == 1 - group for s in live)
        surplus = (len(batch) - others) // 2
        if surplus < 1:
            return batch
        for seq in batch[-surplus:]:
            self._group[seq.seq_id] = 1 - group
        return batch[:-surplus]

    def drop_early(self) -> None:
        """Cancel the early Verify (stopping, or the round cancelled): its outputs are lost, so
        its sequences' state on the verifier is not known any more."""
        early, self._early = self._early, None
        if early is not None:
            early[3].cancel()

    async def land_early(self) -> None:
        """The early Verify (`_early`), if one is out, waited for and its round committed
        after the round before it: before anything but a groups round runs (or after one
        failed). A failed early round is dropped: its sequences' tokens are as they were, and
        the next round (or the fault's handling) finds what the verifier holds."""
        early, self._early = self._early, None
        if early is None:
            return
        _, batch, trees, verifying = early
        try:
            outputs = await verifying
        except Exception as e:
            log.warning("an early Verify failed: %s", e)
            return
        if self._uncommitted is not None:
            self._commit_and_stream(self._uncommitted)
            self._uncommitted = None
        self._commit_and_stream((batch, trees, outputs))

    async def _leave_groups(self) -> bool:
        """Before a serial round in "groups" mode (the gate holds drafts back): commit the group
        verified last round and the early Verify's, and drop the trees drafted ahead (their
        sequences draft again from their tokens when speculation resumes). True when a group
        was committed."""
        landed = self._early is not None
        await self.land_early()
        pending, self._uncommitted = self._uncommitted, None
        self._drafted.clear()
        if pending is not None:
            self._commit_and_stream(pending)
        return landed or pending is not None

    def _assign_groups(self, running: list[Sequence], verified: int) -> None:
        """Forget sequences that left; a new one joins the smaller group, on a tie the one
        drafted this round (not `verified`, the group this round verifies). There it is
        drafted while this round's Verify runs; in the verified group its first Draft would
        hold that Verify back (or, with the group's Verify sent early without it, wait a
        round)."""
        ids = {seq.seq_id for seq in running}
        for gone in [seq_id for seq_id in self._group if seq_id not in ids]:
            del self._group[gone]
            self._drafted.pop(gone, None)
        sizes = [list(self._group.values()).count(g) for g in (0, 1)]
        drafted = 1 - verified
        for seq in running:
            if seq.seq_id not in self._group:
                group = drafted if sizes[drafted] <= sizes[verified] else verified
                self._group[seq.seq_id] = group
                sizes[group] += 1
