"""Requests arriving at the Scheduler and its start and shutdown: the Scheduler's
`RequestsLifecycle`, a mixin of it that declares what it uses. A request joins the waiting line
(`generate`: refused at once while `max_waiting` requests wait, or for a session's turn that
cannot run) as a new Sequence (`_new_sequence`: its stop rules, draft shape and unguessable id),
or, for a session's turn, the whole conversation with its KV carried over (gateway/sessions.py);
closing its stream early cancels it. `start` runs the round loop and the sessions' expiry;
shutting down, `drain` takes no new requests and waits for the admitted ones, and `stop` ends
those left with UNAVAILABLE and frees their KV."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine

from transformers import PreTrainedTokenizerBase

from gateway.adaptive import AdaptiveSpec
from gateway.decode_steps import DecodeSteps
from gateway.request import Chunk, GenerationRequest, ending_ids
from gateway.sequence import Sequence
from gateway.sessions import SessionStore
from gateway.stopping import StopChecker
from gateway.text import IncrementalDetokenizer
from specsplit import telemetry
from specsplit.errors import Code, ServiceError
from specsplit.messages import SpecParams

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING = 256  # requests waiting for a place in the batch; more: RESOURCE_EXHAUSTED
DRAIN_POLL_S = 0.05
STOP_RELEASE_S = 0.5  # at stop, the services get this long to free the sequences left
SHUTTING_DOWN = "the gateway is shutting down"


class RequestsLifecycle:
    # the Scheduler's, which requests arriving and leaving at shutdown use
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]
    default_spec: SpecParams
    adaptive_ladder: tuple[SpecParams, ...] | None
    hidden_state_layers: tuple[int, ...]  # asked of the verifier (EAGLE drafters)
    prefill_chunk: int  # a long prompt's tokens a round (Sequence.prefilling)
    model_name: str  # gen_ai.request.model on request spans
    max_waiting: int | None
    waiting: deque[Sequence]
    running: list[Sequence]
    sessions: SessionStore
    steps_policy: DecodeSteps | None
    draining: bool  # shutting down: the APIs refuse new requests
    _wakeup: asyncio.Event
    _task: asyncio.Task[None] | None
    _expiry: asyncio.Task[None] | None
    _loop: Callable[[], Coroutine[object, object, None]]  # the round loop
    _fail: Callable[[Sequence, ServiceError], None]
    _retire: Callable[[list[Sequence]], Awaitable[None]]
    _stream: Callable[..., None]
    drop_early: Callable[[], None]

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._wakeup = asyncio.Event()  # on this loop: a stack may be started again on another
        self._task = asyncio.create_task(self._loop(), name="scheduler")
        self._expiry = asyncio.create_task(self.sessions.expire_forever(), name="session-expiry")

    async def drain(self, timeout: float) -> bool:
        """Shutting down: take no new requests (the APIs refuse them while `draining`) and wait
        up to `timeout` seconds for the admitted ones to finish. True when none is left."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.running or self.waiting:
            left = deadline - loop.time()
            if left <= 0:
                return False
            await asyncio.sleep(min(DRAIN_POLL_S, left))
        return True

    async def stop(self, message: str = SHUTTING_DOWN) -> None:
        """End every request still here with UNAVAILABLE (`message`) after the tokens it
        streamed, and free their KV (within STOP_RELEASE_S: a service that hangs must not hold
        the shutdown)."""
        self.draining = True
        for task in (self._task, self._expiry):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._expiry = None
        self.drop_early()
        self._stream()  # the rounds committed, before the error
        error = ServiceError(Code.UNAVAILABLE, message)
        for seq in [*self.running, *self.waiting]:
            if not seq.finished:
                self._fail(seq, error)
        try:
            async with asyncio.timeout(STOP_RELEASE_S):
                await self._retire([*self.running, *(s for s in self.waiting if s.turn)])
                await self.sessions.close_all()
        except TimeoutError:
            log.warning("stop: a service did not answer Release in time")
        self.running.clear()
        self.waiting.clear()

    # -- client side -----------------------------------------------------------------------

    def generate(
        self, request: GenerationRequest, waiting_too: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        """Stream a generation; closing the iterator early cancels it and frees its KV.
        Raises RESOURCE_EXHAUSTED right away (before any iteration) when `max_waiting` requests
        already wait for a place in the batch, counting `waiting_too` more (a body's further
        choices, asked for with this one: they wait once iterated); for a session's turn,
        NOT_FOUND (unknown or closed) or FAILED_PRECONDITION (a turn runs on it)."""
        num_waiting = sum(not seq.cancelled for seq in self.waiting) + waiting_too
        if self.max_waiting is not None and num_waiting >= self.max_waiting:
            raise ServiceError(
                Code.RESOURCE_EXHAUSTED,
                f"the gateway is busy: {num_waiting} requests are waiting already "
                f"(--max-waiting); retry later",
            )
        if request.session_id is not None:
            self.sessions.check_free(request.session_id)
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        if request.session_id is not None:  # the whole conversation, its KV carried over
            seq = await self.sessions.begin_turn(request, self._new_sequence)
        else:
            seq = self._new_sequence(request)
        seq.span = telemetry.start_request(self.model_name, request)  # child of the caller's
        self.waiting.append(seq)
        if self.steps_policy is not None:
            self.steps_policy.arrived()
        self._wakeup.set()
        error: BaseException | None = None
        try:
            while True:
                item = await seq.outbox.get()
                if isinstance(item, BaseException):
                    error = item
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not seq.finished:
                seq.cancelled = True
                self._wakeup.set()
            telemetry.end_request(seq, error)

    def _new_sequence(self, request: GenerationRequest) -> Sequence:
        ends = ending_ids(self.eos_token_ids, request.ignore_eos, request.stop_token_ids)
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_ids, skip_special_tokens=request.skip_special_tokens
        )
        stop_checker = StopChecker(
            detokenizer,
            eos_token_ids=ends,
            max_new_tokens=request.max_new_tokens,
            stop_strings=request.stop_strings,
            min_tokens=request.min_tokens,
            include_stop_str=request.include_stop_str,
        )
        spec = request.spec if request.spec is not None else self.default_spec
        adaptive = None
        if request.spec is None and self.adaptive_ladder is not None:
            start = self.adaptive_ladder.index(self.default_spec)
            adaptive = AdaptiveSpec(self.adaptive_ladder, start)
        seq = Sequence(
            f"seq-{secrets.token_hex(16)}",  # unguessable (DESIGN.md §8)
            request,
            spec,
            stop_checker,
            hidden_state_layers=self.hidden_state_layers,
            adaptive=adaptive,
            prefill_chunk=self.prefill_chunk,
        )
        if seq.never_drafts:  # the drafter's features would be computed and carried for nothing
            seq.hidden_state_layers = ()
        return seq
