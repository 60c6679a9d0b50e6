"""The Scheduler's Draft calls (a mixin of it that declares what it uses) and the drafter's
faults (DESIGN.md §4): a drafter that is down or restarted turns into empty trees (plain target
decoding, the same output) for DRAFTER_RETRY_S, its sequences starting over on it when it
answers again; one that refuses a round is asked sequence by sequence, and a sequence it refuses
decodes without drafts for the rest of its life. Which rounds need the drafter at all
(`_needs_drafter`) and the target layers it reads (EAGLE heads) are kept here too."""

from __future__ import annotations

import contextlib
import logging
import time

from gateway.clients import DrafterClient
from gateway.sequence import Sequence
from gateway.sessions import SessionStore
from specsplit.errors import Code, ServiceError, still_loading
from specsplit.messages import DraftOutput
from specsplit.tree import DraftTree

log = logging.getLogger(__name__)
DRAFTER_RETRY_S = 1.0  # after a drafter failure, decode without drafts this long
DRAFTER_DOWN = (Code.UNAVAILABLE, Code.NOT_FOUND)  # unreachable or restarted: not a refusal


class Drafting:
    # the Scheduler's, which the calls use
    drafter: DrafterClient
    running: list[Sequence]
    sessions: SessionStore

    def _init_drafting(self, hidden_state_layers: tuple[int, ...]) -> None:
        self.hidden_state_layers = hidden_state_layers  # asked of the verifier (EAGLE drafters)
        self._drafter_down_until = 0.0
        self._drafter_answered = False  # hidden_state_layers is the drafter's answer
        self._drafter_refused: set[str] = set()  # seq ids the drafter refused: no drafts
        self._drafter_loading_told = False  # logged once that it is still loading

    async def _draft(self, batch: list[Sequence]) -> list[DraftTree]:
        if self._drafter_resting():
            return [DraftTree() for _ in batch]
        ids = {seq.seq_id for seq in [*self.running, *batch]}
        self._drafter_refused &= ids  # forget the ones that left
        drafting = [seq for seq in batch if self._needs_drafter(seq)]
        if not drafting:
            return [DraftTree() for _ in batch]
        try:
            try:
                outputs = await self.drafter.draft([seq.draft_input() for seq in drafting])
            except ServiceError as e:
                if e.code in DRAFTER_DOWN:
                    raise
                if e.code == Code.RESOURCE_EXHAUSTED and await self.sessions.evict_idle():
                    await self._forget_on_drafter(drafting)  # what it holds of them is unknown
                    return [DraftTree() for _ in batch]  # and drafts them next round
                # a refusal: of one sequence (its shape, its memory), not of drafting
                drafting, outputs = await self._draft_one_by_one(drafting, e)
        except ServiceError as e:
            # drafter down or restarted (NOT_FOUND): decode without drafts for now, and start
            # its sequences over when it answers again. Still loading (its warm-up outlasting
            # the verifier's, as on a GPU): said once, not a warning a retry
            if not still_loading(e):
                log.warning(
                    "drafter failed (%s: %s); decoding without drafts", e.code.value, e.message
                )
            elif not self._drafter_loading_told:
                log.info("the drafter is still loading: decoding without drafts until it answers")
                self._drafter_loading_told = True
            self._drafter_down_until = time.monotonic() + DRAFTER_RETRY_S
            await self._forget_on_drafter(batch)
            return [DraftTree() for _ in batch]
        for seq, out in zip(drafting, outputs, strict=True):
            if not seq.verifier_begun:  # before its prefill: ask the verifier for these layers
                seq.adopt_hidden_state_layers(out.hidden_state_layers)
        if outputs:
            self.hidden_state_layers = outputs[0].hidden_state_layers
            self._drafter_answered = True
            self._drafter_loading_told = False  # (a restart's loading is told again)
        trees = {seq.seq_id: out.tree for seq, out in zip(drafting, outputs, strict=True)}
        return [trees.get(seq.seq_id, DraftTree()) for seq in batch]

    async def _draft_one_by_one(
        self, batch: list[Sequence], refusal: ServiceError
    ) -> tuple[list[Sequence], list[DraftOutput]]:
        """The drafter refused a round (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...): draft each
        sequence alone, so that one it refuses decodes without drafts for the rest of its life
        while the others keep theirs. Returns the sequences drafted and their outputs; raises
        when the drafter goes down meanwhile."""
        log.warning(
            "drafter refused a round of %d (%s: %s); drafting them one by one",
            len(batch),
            refusal.code.value,
            refusal.message,
        )
        await self._forget_on_drafter(batch)  # what it holds of them is unknown now
        drafted, outputs = [], []
        for seq in batch:
            try:
                outputs += await self.drafter.draft([seq.draft_input()])
                drafted.append(seq)
            except ServiceError as e:
                if e.code in DRAFTER_DOWN:
                    raise
                log.warning(
                    "drafter refused %s (%s: %s); it decodes without drafts",
                    seq.seq_id,
                    e.code.value,
                    e.message,
                )
                self._drafter_refused.add(seq.seq_id)
                await self._forget_on_drafter([seq])
        return drafted, outputs

    def _drafter_resting(self) -> bool:
        """The drafter is down (unreachable or restarted): rounds decode without drafts."""
        return time.monotonic() < self._drafter_down_until

    def _drafter_down(self, error: ServiceError) -> None:
        """A drafter that is unreachable or restarted (DRAFTER_DOWN) gets no Draft for
        DRAFTER_RETRY_S; a refusal changes nothing here."""
        if error.code in DRAFTER_DOWN:
            self._drafter_down_until = time.monotonic() + DRAFTER_RETRY_S

    async def _forget_on_drafter(self, seqs: list[Sequence]) -> None:
        """Start these sequences over on the drafter (its next Draft of each begins anew)."""
        for seq in seqs:
            seq.forget_drafter()
        with contextlib.suppress(ServiceError):
            await self.drafter.release([seq.seq_id for seq in seqs])

    def _needs_drafter(self, seq: Sequence) -> bool:
        """A round without drafts (num_steps 0: speculation off, or one token left) skips the
        drafter, once the sequence reads the hidden-state layers the drafter asked for
        (`_layers_known`): its new tokens (and their features) reach the drafter with its next
        Draft, if any. So does a round before the prefill of a sequence whose drafter reads
        target features it does not have yet (an EAGLE head): that Draft could only answer an
        empty tree. So does a chunk round of a long prompt (`Sequence.prefilling`). A sequence
        the drafter refused, or one that never drafts, never asks it."""
        if seq.seq_id in self._drafter_refused or seq.never_drafts:
            return False
        if not self._layers_known(seq):
            return True
        return (
            seq.round_spec().num_steps > 0
            and not (seq.hidden_state_layers and not seq.verifier_begun)
            and not seq.prefilling  # (its chunk rounds take no tree)
        )

    def _layers_known(self, seq: Sequence) -> bool:
        """Whether the drafter has told the target layers it reads (an answer, this gateway's
        life) and `seq` reads those: its prefill asks the verifier for them (none for a draft
        model or n-grams), so its first round need not wait for a Draft to learn them."""
        return self._drafter_answered and seq.hidden_state_layers == self.hidden_state_layers
