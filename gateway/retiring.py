"""Requests leaving the Scheduler's batch, and their KV on both services: the Scheduler's
`Retiring`, a mixin of it that declares what it uses. A finished or cancelled request is retired
(its last chunks streamed, its KV released on both services at once, or a session's turn put
away with its KV kept); a failed one gets its error after the tokens it streamed; and a sequence
whose plain rounds carried no target features has the verifier take those tokens back and
verify them again with their features when speculation resumes (`_restart_features`)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from gateway.clients import DrafterClient, VerifierClient
from gateway.sequence import Sequence
from gateway.sessions import SessionStore
from specsplit.errors import ServiceError
from specsplit.messages import Truncation
from specsplit.tree import DraftTree

log = logging.getLogger(__name__)


class Retiring:
    # the Scheduler's, which these use
    drafter: DrafterClient
    verifier: VerifierClient
    running: list[Sequence]
    waiting: deque[Sequence]
    sessions: SessionStore
    num_feature_restarts: int
    _drafted: dict[str, DraftTree]
    _group: dict[str, int]
    _admission_held: bool  # a preemption freed pages for the running ones only
    _drafter_resting: Callable[[], bool]  # the drafter is down: no Draft for now
    _stream: Callable[..., None]

    def _resumes_features(self, seq: Sequence) -> bool:
        """Whether `seq`'s features restart this round: some committed tokens have none (the
        gate's plain rounds, or a drafter that lost rows the gateway let go), it drafts this
        round, and the drafter answers (while it is down the re-verify would be for nothing)."""
        return seq.features_gap and not seq.drafts_held and not self._drafter_resting()

    async def _restart_features(self, seqs: list[Sequence]) -> None:
        """Speculation resumes for sequences whose plain rounds carried no target features (the
        gate held their drafts back, and an EAGLE drafter's features with them): the verifier
        takes back the tokens past the last features it gave (Truncate) and verifies them again
        with their features; meanwhile the drafter, short of features, drafts an empty tree,
        then catches up from where it stopped. A verifier that no longer holds a sequence, or a
        failed Truncate, starts it over on both services (a re-prefill with the features)."""
        if not seqs:
            return
        self.num_feature_restarts += len(seqs)
        held = [seq for seq in seqs if seq.verifier_begun]
        lost = [seq for seq in seqs if not seq.verifier_begun]
        if held:
            items = [Truncation(seq.seq_id, seq.num_feature_rows) for seq in held]
            try:
                outs = await self.verifier.truncate(items)
            except ServiceError as err:
                log.warning("truncate to resume speculation failed (%s)", err.message)
                lost += held
            else:
                for seq, item, out in zip(held, items, outs, strict=True):
                    if out.found and out.kv_committed_len == item.max_len:
                        seq.keep_verifier_kv(item.max_len)
                        seq.features_gap = False
                        seq.rounds_since_prefill = 0  # its tokens since are verified again
                    else:
                        lost.append(seq)
        if lost:
            await self._release(lost)
            for seq in lost:
                seq.forget_verifier()
                seq.forget_drafter()
        for seq in seqs:
            self._drafted.pop(seq.seq_id, None)

    def _fail(self, seq: Sequence, error: ServiceError) -> None:
        self._stream([seq])  # its committed rounds first
        seq.outbox.put_nowait(error)
        seq.finished = True

    async def _retire(self, seqs: list[Sequence] | None = None) -> None:
        """Free the finished or cancelled sequences (`seqs`: these, unfinished ones too) on both
        services; a session's turn is put away instead (its KV kept), also one cancelled while
        it waited."""
        if seqs is None:
            done = [seq for seq in self.running if seq.finished or seq.cancelled]
            done += [seq for seq in self.waiting if seq.cancelled and seq.turn is not None]
        else:
            done = list(seqs)
        if not done:
            return
        self._stream(done)  # their last chunks (and a session's reply) before they go
        # before forgetting them: stop() retires what is still here
        await self._release([seq for seq in done if seq.turn is None])
        for seq in done:
            self._drafted.pop(seq.seq_id, None)  # a session's next turn has the same id
            self._group.pop(seq.seq_id, None)
            if seq.turn is not None:
                await self.sessions.end_turn(seq)
        # forget exactly what was released: a sequence cancelled during that await is retired
        # (and released) next time, not dropped with its KV still held
        released = {id(seq) for seq in done}
        self.running = [seq for seq in self.running if id(seq) not in released]
        self.waiting = deque(seq for seq in self.waiting if id(seq) not in released)
        self._admission_held = False  # pages came free

    async def _release(self, seqs: list[Sequence]) -> None:
        """Free the sequences on both services at once (one round trip on the path, not two);
        the drafter only for those that may have reached it (a sequence that never drafts
        never did)."""
        # a drafter known down (or still loading) failing the release is expected: not warned
        releases = [
            (client, ids, quiet)
            for client, ids, quiet in (
                (
                    self.drafter,
                    [seq.seq_id for seq in seqs if not seq.never_drafts],
                    self._drafter_resting(),
                ),
                (self.verifier, [seq.seq_id for seq in seqs], False),
            )
            if ids
        ]
        await asyncio.gather(*(self._release_on(*release) for release in releases))

    @staticmethod
    async def _release_on(
        client: DrafterClient | VerifierClient, ids: list[str], quiet: bool
    ) -> None:
        try:
            await client.release(ids)
        except Exception as e:  # the service frees them when it restarts or drops the seqs
            level = logging.DEBUG if quiet else logging.WARNING
            log.log(level, "release failed on %s: %s", type(client).__name__, e)
