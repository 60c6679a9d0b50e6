"""A verifier that fails a round (DESIGN.md §4): the Scheduler's handling, a mixin of it that
declares what it uses. A verifier restarted or unreachable gets every running sequence again
from the gateway's tokens once its health says SERVING, within --verifier-wait; a full KV cache
first frees an idle session's pages, else the newest sequence gives way (preempted: it waits
first in line and re-prefills); any other refusal ends the round's requests with it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from gateway.health import Health
from gateway.retiring import Retiring
from gateway.sequence import Sequence
from specsplit import metrics
from specsplit.errors import Code, ServiceError

log = logging.getLogger(__name__)
VERIFIER_RETRY_S = 0.5  # while the verifier is away, ask its health this often
DEFAULT_VERIFIER_WAIT_S = 300.0  # streams wait this long for a verifier to be back


class VerifierFaults(Retiring):  # (which frees the sequences it gives up on)
    # the Scheduler's, which this handling uses (besides Retiring's)
    verifier_wait_s: float
    clock: Callable[[], float]  # of the verifier wait (a test's fake clock advances it)
    num_preemptions: int
    _verifier_down_since: float | None  # on `clock`
    _verifier_health: Health | None  # last logged while waiting for it

    async def _fail_round(self, error: ServiceError) -> None:
        """The verifier refused or failed the round: nothing was committed."""
        self._stream()  # the last round's chunks, before any wait for the verifier
        if error.code in (Code.UNAVAILABLE, Code.NOT_FOUND):
            # restarted or unreachable: re-prefill every sequence from the gateway's tokens
            log.warning("verifier failed (%s: %s); re-prefilling", error.code.value, error.message)
            for seq in self.running:
                seq.forget_verifier()
            with contextlib.suppress(ServiceError):
                await self.verifier.release([seq.seq_id for seq in self.running])
            await self._await_verifier(error)
        elif error.code == Code.FAILED_PRECONDITION and any(s.rules_kept for s in self.running):
            # the verifier lacks a logit rules' context a round said it kept (verifier/
            # kept_rules.py; nothing of the round ran): the round runs again with every context
            log.warning("verifier: %s; sending the rules' contexts again", error.message)
            for seq in self.running:
                seq.rules_kept = False
        elif error.code == Code.RESOURCE_EXHAUSTED and await self.sessions.evict_idle():
            pass  # an idle session's KV is free now: the round runs again
        elif error.code == Code.RESOURCE_EXHAUSTED and len(self.running) > 1:
            # KV full: the newest sequence gives way and waits again, the others go on
            await self._preempt(self.running[-1], error)
        else:
            log.error("verify round refused (%s: %s)", error.code.value, error.message)
            for seq in self.running:
                self._fail(seq, error)

    async def _await_verifier(self, error: ServiceError) -> None:
        """Wait until the verifier's health says SERVING, polling it every VERIFIER_RETRY_S; a
        verifier that answers NOT_SERVING (loading) is coming back. Once it has been away for
        more than verifier_wait_s (from its first failed round), the running requests end with
        UNAVAILABLE after the tokens they streamed. Returns early when none of them is left to
        wait (all cancelled), so that they are retired."""
        again = self._verifier_down_since is not None  # it failed a round after coming back
        if self._verifier_down_since is None:
            self._verifier_down_since = self.clock()
            self._verifier_health = None
        while any(not (seq.cancelled or seq.finished) for seq in self.running):
            away = self.clock() - self._verifier_down_since
            if away > self.verifier_wait_s:
                message = (
                    f"the verifier has been unavailable for {away:.0f} s, over the gateway's"
                    f" limit of {self.verifier_wait_s:g} s (--verifier-wait): {error.message}"
                )
                log.error("%s; ending %d requests", message, len(self.running))
                for seq in self.running:
                    self._fail(seq, ServiceError(Code.UNAVAILABLE, message))
                return
            health = await self.verifier.health()
            if health is Health.SERVING:
                if again:  # SERVING yet failing rounds: retry at a calm pace, not in a spin
                    await asyncio.sleep(VERIFIER_RETRY_S)
                return
            if health is not self._verifier_health:
                self._verifier_health = health
                state = "loading" if health is Health.LOADING else "not answering"
                log.warning(
                    "verifier %s; %d requests wait for it (%.0f of %g s)",
                    state,
                    len(self.running),
                    away,
                    self.verifier_wait_s,
                )
            await asyncio.sleep(VERIFIER_RETRY_S)

    async def _preempt(self, seq: Sequence, error: ServiceError) -> None:
        """Retract `seq` (DESIGN.md §8 memory pressure): free its KV in both services and put it
        first in line again; once admitted it re-prefills from the gateway's tokens and goes on
        where it stopped (greedy: the same tokens). Until a running sequence finishes, nothing
        more is admitted, so that it does not take the pages back at once."""
        log.warning(
            "verifier KV full (%s); preempting %s (%d tokens), %d others go on",
            error.message,
            seq.seq_id,
            len(seq.tokens),
            len(self.running) - 1,
        )
        self.running.remove(seq)
        await self._release([seq])
        seq.forget_verifier()
        seq.forget_drafter()
        self._drafted.pop(seq.seq_id, None)
        self.waiting.appendleft(seq)
        self._admission_held = True
        self.num_preemptions += 1
        metrics.observe_preemption()
