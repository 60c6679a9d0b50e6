"""Sessions (DESIGN.md §7): a conversation whose KV the drafter and the verifier keep between turns.

A session is one sequence id on both services. A turn is an ordinary gateway `Sequence` whose
`tokens` are the whole conversation, exactly the prompt a fresh request carrying it would have,
and whose service state (what each service holds of it) is carried over from the last turn, so
that only the new tokens are computed:

    begin_turn: tokens = continuation(session, prompt); keep = common prefix with the session's
                verifier kv_committed_len = min(last turn's, keep): normally len(previous) - 1
                (the pending bonus token), so this turn's pending tokens are that token + the
                new prompt
    ... rounds, as for any request ...
    end_turn:   completed: Truncate both services to the turn's tokens (the verifier to
                len(tokens) - 1: tokens past a stop point go, the last token stays pending);
                aborted, failed or cancelled: Truncate back to where the turn began, the session
                keeps its previous tokens

The gateway's tokens stay authoritative: a session whose KV was evicted (memory pressure) or
lost (a service restarted) re-prefills from them on its next turn, with the same output.

The conversation each prompt kind makes is in gateway/continuation.py; the session and its
running turn are in gateway/session_state.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from gateway.clients import DrafterClient, VerifierClient
from gateway.continuation import carry, common_prefix_len, continuation
from gateway.request import GenerationRequest, InvalidField
from gateway.sequence import Sequence
from gateway.session_state import Session, Turn
from specsplit import metrics
from specsplit.errors import Code, ServiceError
from specsplit.messages import Truncation

log = logging.getLogger(__name__)

DEFAULT_SESSION_TTL_S = 600.0  # an idle session lives this long unless it asks otherwise
EXPIRY_SWEEP_S = 1.0  # idle sessions past their TTL are freed within this long


class Backends(Protocol):
    """Where the sessions' KV lives (the scheduler's clients, replaced by some tests)."""

    drafter: DrafterClient
    verifier: VerifierClient


class SessionStore:
    """The gateway's sessions: open / close, turns (begin_turn, end_turn), expiry and eviction.
    `clock` is injectable (tests); `executor` runs the tokenizer (None = inline)."""

    def __init__(
        self,
        backends: Backends,
        tokenizer: PreTrainedTokenizerBase,
        *,
        ttl_s: float = DEFAULT_SESSION_TTL_S,
        max_context: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backends = backends
        self.tokenizer = tokenizer
        self.ttl_s = ttl_s
        self.max_context = max_context  # None: the verifier alone checks the context
        self.clock = clock
        self.executor: Executor | None = None  # the API's tokenizer thread
        self.sessions: dict[str, Session] = {}
        metrics.watch_sessions(
            lambda: (len(self.sessions), sum(s.num_kv_pages for s in self.sessions.values()))
        )

    # -- open, close, look up ----------------------------------------------------------------

    def open(self, ttl_s: float | None = None) -> Session:
        """A new, empty session; ttl_s None or 0 = the store's default."""
        if ttl_s is not None and not ttl_s >= 0:  # also refuses nan
            raise InvalidField("ttl_seconds", f"ttl_seconds = {ttl_s}: must be >= 0")
        session = Session(
            f"sess-{secrets.token_hex(16)}",  # unguessable (DESIGN.md §8)
            f"seq-{secrets.token_hex(16)}",
            ttl_s or self.ttl_s,
            self.clock(),
        )
        self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise ServiceError(Code.NOT_FOUND, f"session {session_id!r}: unknown or closed")
        return session

    def check_free(self, session_id: str) -> None:
        """NOT_FOUND / FAILED_PRECONDITION right away, before a turn is queued."""
        if self.get(session_id).busy:
            raise _busy(session_id)

    async def close(self, session_id: str) -> int:
        """Close a session; its KV is freed now, or when the turn running on it ends. Returns
        the tokens it held (after a turn being put away, that turn's too)."""
        session = self.get(session_id)
        if not session.busy:
            await session.ready.wait()
            session = self.get(session_id)  # closed meanwhile: NOT_FOUND
        del self.sessions[session_id]
        session.closed = True
        num_tokens = len(session.tokens)
        if not session.claimed:
            await self._hold(session, self._free(session))
        return num_tokens

    async def close_all(self) -> None:
        """Shutting down: free every idle session (a running turn's end frees its own)."""
        for session_id in list(self.sessions):
            await self.close(session_id)

    # -- turns -------------------------------------------------------------------------------

    async def begin_turn(
        self, request: GenerationRequest, new_sequence: Callable[[GenerationRequest], Sequence]
    ) -> Sequence:
        """The turn's Sequence: the whole conversation as its tokens, the services' KV of the
        session carried over. Waits while the last turn is being put away; NOT_FOUND for an
        unknown or closed session, FAILED_PRECONDITION while another turn runs on it."""
        assert request.session_id is not None
        while True:
            session = self.get(request.session_id)
            if session.busy:
                raise _busy(request.session_id)
            if session.ready.is_set():
                break
            await session.ready.wait()
        session.ready.clear()
        session.claimed = True
        try:
            seq = await self._new_turn(session, request, new_sequence)
        except BaseException:
            session.claimed = False
            session.ready.set()
            if session.closed:  # closed meanwhile: nobody else frees it
                await self._hold(session, self._free(session))
            raise
        session.turn = seq
        return seq

    async def _new_turn(
        self,
        session: Session,
        request: GenerationRequest,
        new_sequence: Callable[[GenerationRequest], Sequence],
    ) -> Sequence:
        loop = asyncio.get_running_loop()
        tokens, messages = await loop.run_in_executor(
            self.executor, continuation, self.tokenizer, session, request
        )
        max_new_tokens = self._max_new_tokens(request, len(tokens))
        request = dataclasses.replace(request, prompt_ids=tokens, max_new_tokens=max_new_tokens)
        seq = new_sequence(request)
        seq.seq_id = session.seq_id
        last = session.state
        if last is not None and last.hidden_state_layers != seq.hidden_state_layers:
            await self._free(session)  # the drafter reads other layers now: start over
            last = None
        if last is not None:
            keep = common_prefix_len(last.tokens, tokens)
            seq.verifier_begun, seq.drafter_begun = last.verifier_begun, last.drafter_begun
            seq.verifier_kv_committed_len = last.verifier_kv_committed_len
            seq.features = last.features.copy()
            seq.features_gap = last.features_gap  # plain rounds (the speculation gate's)
            seq.keep_verifier_kv(min(last.verifier_kv_committed_len, keep, len(tokens) - 1))
            seq.drafter_num_tokens = min(last.drafter_num_tokens, keep)
            if keep < len(last.tokens):  # the rendering differs from what the session holds
                await self._truncate(
                    session, seq, seq.verifier_kv_committed_len, seq.drafter_num_tokens
                )
        seq.turn = Turn(session, seq.verifier_kv_committed_len, seq.drafter_num_tokens, messages)
        seq.stats.num_reused_tokens = seq.verifier_kv_committed_len
        metrics.observe_session_turn(seq.stats.num_reused_tokens)
        return seq

    def _max_new_tokens(self, request: GenerationRequest, num_tokens: int) -> int:
        """The turn's max_new_tokens against the whole conversation, as a fresh request's."""
        if self.max_context is None:
            return request.max_new_tokens
        room = self.max_context - num_tokens
        if request.max_new_tokens_default:
            if room <= 0:
                raise InvalidField(
                    "prompt",
                    f"the conversation ({num_tokens} tokens) fills the model's context of "
                    f"{self.max_context} tokens",
                )
            return min(request.max_new_tokens, room)
        if request.max_new_tokens > room:
            raise InvalidField(
                "max_new_tokens",
                f"the conversation ({num_tokens} tokens) + max_new_tokens "
                f"({request.max_new_tokens}) exceeds the model's context of {self.max_context}",
            )
        return request.max_new_tokens

    async def end_turn(self, seq: Sequence) -> None:
        """Put a finished, failed or cancelled turn away: both services truncated to what the
        session holds now, then the session is ready for its next turn."""
        turn = seq.turn
        assert isinstance(turn, Turn)
        session = turn.session
        try:
            if session.closed:
                await self._free(session)
            elif seq.finish_reason is not None:  # completed: the session holds the turn
                await self._truncate(session, seq, len(seq.tokens) - 1, len(seq.tokens))
                session.state = seq
                if turn.messages is not None:
                    reply = "".join(turn.reply_parts)
                    session.messages = [*turn.messages, {"role": "assistant", "content": reply}]
                else:
                    session.messages = None
            elif session.state is None:  # the first turn taken back: nothing to keep
                await self._free(session)
            else:  # taken back: the services return to where the turn began
                await self._truncate(session, seq, turn.verifier_start, turn.drafter_start)
                carry(seq, session.state)
        finally:
            session.turn = None
            session.claimed = False
            session.last_used = self.clock()
            session.ready.set()

    # -- expiry and eviction -----------------------------------------------------------------

    async def expire(self) -> int:
        """Close the idle sessions past their TTL; returns how many."""
        now = self.clock()
        expired = [
            s for s in self.sessions.values() if not s.claimed and now - s.last_used > s.ttl_s
        ]
        num_expired = 0
        for session in expired:
            if self.sessions.get(session.session_id) is not session:
                continue  # closed meanwhile
            log.info("session %s expired after %.0f s idle", session.session_id, session.ttl_s)
            metrics.observe_session_eviction("expired")
            await self.close(session.session_id)
            num_expired += 1
        return num_expired

    async def expire_forever(self) -> None:
        """Every EXPIRY_SWEEP_S: expire(). A failure is logged, never the end of expiry."""
        while True:
            await asyncio.sleep(EXPIRY_SWEEP_S)
            try:
                await self.expire()
            except Exception:
                log.exception("session expiry failed")

    async def evict_idle(self) -> bool:
        """KV ran short: free the KV of the idle session used longest ago (it stays open and
        re-prefills on its next turn). False when no idle session holds any."""
        idle = [
            s for s in self.sessions.values() if not s.claimed and s.ready.is_set() and s.holds_kv
        ]
        if not idle:
            return False
        session = min(idle, key=lambda s: s.last_used)
        log.warning(
            "KV short: evicting idle session %s (%d tokens)",
            session.session_id,
            len(session.tokens),
        )
        metrics.observe_session_eviction("memory")
        await self._hold(session, self._free(session))
        return True

    # -- the services ------------------------------------------------------------------------

    async def _hold(self, session: Session, work: Any) -> None:
        """Run `work` (an RPC on the session's sequence) with no turn starting meanwhile."""
        session.ready.clear()
        try:
            await work
        finally:
            session.ready.set()

    async def _free(self, session: Session) -> None:
        """Release the session's sequence on both services; it keeps its tokens."""
        session.num_kv_pages = 0
        if session.state is not None:
            session.state.forget_verifier()
            session.state.forget_drafter()
        await self._release(session.seq_id)

    async def _release(self, seq_id: str) -> None:
        for client in (self.backends.drafter, self.backends.verifier):
            try:
                await client.release([seq_id])
            except ServiceError as err:  # it frees them when it restarts or drops the scope
                log.warning("%s: release failed on the %s: %s", seq_id, client, err.message)

    async def _truncate(
        self, session: Session, seq: Sequence, verifier_len: int, drafter_len: int
    ) -> None:
        """Both services keep the first verifier_len / drafter_len tokens of the session's
        sequence (and restart its sampling generators); `seq`, a turn of it, records what they
        answer. A service that does not hold it (restarted) or fails begins it again."""
        verifier_len = min(verifier_len, seq.verifier_kv_committed_len)
        drafter_len = min(drafter_len, seq.drafter_num_tokens)
        try:
            if seq.verifier_begun:
                verifier = self.backends.verifier
                [out] = await verifier.truncate([Truncation(seq.seq_id, verifier_len)])
                if out.found:
                    # the verifier held at least what the gateway last saw it commit
                    assert out.kv_committed_len == verifier_len, (out, verifier_len)
                    seq.keep_verifier_kv(verifier_len)
                    session.num_kv_pages = out.num_pages
                else:
                    seq.forget_verifier()
            if seq.drafter_begun:
                drafter = self.backends.drafter
                [out] = await drafter.truncate([Truncation(seq.seq_id, drafter_len)])
                if out.found:
                    seq.drafter_num_tokens = drafter_len
                else:
                    seq.forget_drafter()
        except ServiceError as err:
            log.warning("session %s: truncate failed (%s)", session.session_id, err.message)
            seq.forget_verifier()  # the next turn re-prefills from the gateway's tokens
            seq.forget_drafter()
            session.num_kv_pages = 0
            await self._release(seq.seq_id)


def _busy(session_id: str) -> ServiceError:
    return ServiceError(
        Code.FAILED_PRECONDITION,
        f"session {session_id!r}: a turn is running on it; send the next turn after it ends",
    )
