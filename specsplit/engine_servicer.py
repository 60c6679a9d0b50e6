"""The drafter's and verifier's servicers, less what differs between them: the engine on its one
thread (`EngineThread`), sequence ids scoped by connection (specsplit.scopes), the unary Release
and Truncate, the round stream (`round_stream`: a service's `specsplit.rounds.RoundRpc` and its
engine call, `round_call`) and the same three on the round lane (specsplit.lane).

Model code runs on one dedicated thread per engine: loading and warmup, and on the CPU every
engine call. An engine on a GPU takes its calls on the event loop's thread instead
(`calls_on_loop`): its calls mostly wait for the device, and handing each to the engine thread
and back costs two thread wake-ups per round (~0.27 ms measured on an H100 host,
bench/rpc_overhead.py; ~0.02 ms inline). Either way one call runs at a time and none before the
engine is loaded and warm, so engine state is never touched by two threads at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from specsplit import convert_beside, metrics, telemetry, wire_tensors
from specsplit.errors import STILL_LOADING, Code, ServiceError
from specsplit.lane import LaneServer
from specsplit.messages import Truncated, Truncation
from specsplit.rounds import RoundRpc
from specsplit.scopes import ORPHAN_GRACE_S, ConnectionScopes, Scope, grpc_scope_key
from specsplit.server import service_errors
from specsplit.v1 import common_pb2

log = logging.getLogger(__name__)

LOAD_PROGRESS_INTERVAL_S = 10.0

E = TypeVar("E")
T = TypeVar("T")
P = ParamSpec("P")


class EngineThread(Generic[E]):
    """An engine and the one thread that loads it and warms it up, and runs every call on it
    unless `calls_on_loop`: then calls run on the caller's (the event loop's) thread, blocking
    it for the call's length (module docstring)."""

    def __init__(
        self,
        name: str,
        load: Callable[[], E],
        warmup: Callable[[E], None],
        calls_on_loop: bool = False,
    ) -> None:
        self.name = name
        self._load = load
        self._warmup = warmup
        self.calls_on_loop = calls_on_loop
        self._engine: E | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-engine")

    async def load(self) -> None:
        """Load and warm up the engine on its thread, logging progress while it takes."""
        started = time.monotonic()
        log.info("%s: loading the engine", self.name)
        engine = await self._logged("loading", started, self._load)
        log.info("%s: loaded in %.1f s, warming up", self.name, time.monotonic() - started)
        await self._logged("warming up", started, lambda: self._warmup(engine))
        self._engine = engine
        log.info("%s: ready after %.1f s", self.name, time.monotonic() - started)

    @property
    def loaded(self) -> E | None:
        """The engine once loaded and warm, else None."""
        return self._engine

    def warm(self) -> E:
        """The engine; UNAVAILABLE until loaded and warm."""
        if self._engine is None:
            raise ServiceError(Code.UNAVAILABLE, f"{self.name} {STILL_LOADING}")
        return self._engine

    async def run(self, fn: Callable[Concatenate[E, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(engine, ...) on the engine thread (or here: `calls_on_loop`). UNAVAILABLE until
        loaded and warm."""
        engine = self.warm()
        if self.calls_on_loop:
            return fn(engine, *args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(engine, *args, **kwargs))

    async def run_timed(
        self, fn: Callable[Concatenate[E, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> tuple[T, int]:
        """(fn(engine, ...), nanoseconds it took on the engine thread, queueing excluded)."""

        def timed(engine: E) -> tuple[T, int]:
            start = time.perf_counter_ns()
            result = fn(engine, *args, **kwargs)
            return result, time.perf_counter_ns() - start

        return await self.run(timed)

    def close(self) -> None:
        """Stop taking work; a call in progress finishes on its thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _logged(self, what: str, started: float, fn: Callable[[], T]) -> T:
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn)
        while True:
            done, _ = await asyncio.wait({future}, timeout=LOAD_PROGRESS_INTERVAL_S)
            if done:
                return future.result()
            log.info("%s: still %s (%.0f s)", self.name, what, time.monotonic() - started)


class Engine(Protocol):
    """What EngineServicer needs of an engine besides its round call."""

    @property
    def num_pages_used(self) -> int: ...

    @property
    def num_pages_free(self) -> int: ...

    @property
    def seqs(self) -> Mapping[str, object]: ...

    def warmup(self) -> None: ...

    def release(self, seq_ids: list[str]) -> int: ...

    def truncate(self, items: list[Truncation]) -> list[Truncated]: ...


EngineT = TypeVar("EngineT", bound=Engine)


class EngineServicer(Generic[EngineT]):
    """The part the drafter and verifier servicers share: the engine thread, its loading
    (a Servable's load/close), sequence ids scoped by connection (specsplit.scopes) and the
    unary Release. Subclasses name themselves, add register() and their stream method
    (`round_stream`). TLS: mutual (only clients with a certificate from the configured CA)."""

    name: str  # "drafter": the engine thread's name in logs
    service_name: str
    mutual_tls = True
    # the service's round: its RoundRpc and its engine's call (on the engine thread)
    round_call: ClassVar[tuple[RoundRpc[Any, Any], Callable[[Any, list[Any]], list[Any]]]]

    def __init__(
        self,
        load: Callable[[], EngineT],
        orphan_grace_s: float = ORPHAN_GRACE_S,
        calls_on_loop: bool = False,
        idle_poll_s: float = 0.0,
    ) -> None:
        """calls_on_loop: engine calls on the event loop's thread (an engine on a GPU; module
        docstring). idle_poll_s: how long the loop keeps polling the round lane after an
        answer (specsplit.lane.LoopPoll; --idle-poll-ms)."""
        self.engine = EngineThread(self.name, load, _warmup, calls_on_loop)
        self.idle_poll_s = idle_poll_s
        self.scopes = ConnectionScopes(self._release_selected, orphan_grace_s)
        self.lane: LaneServer | None = None
        metrics.watch_kv_pages(self._kv_pages)

    async def load(self) -> None:
        await self.engine.load()

    async def close(self) -> None:
        await self.scopes.close()
        self.engine.close()

    async def _release_selected(self, select: Callable[[Iterable[str]], list[str]]) -> int:
        try:
            await self.settle(None)
            return await self.engine.run(_release_selected, select)
        except RuntimeError:  # the engine thread has shut down: nothing left to free
            return 0

    async def settle(self, seq_ids: list[str] | None) -> None:
        """Wait until no round in flight holds any of `seq_ids` (None: no round at all) before
        they are released or truncated. Rounds here run one at a time: nothing to wait for."""

    async def engine_round(self, inputs: list[Any]) -> tuple[list[Any], int, int]:
        """The service's round call on the engine (its thread, or the loop), timed: its
        outputs, engine nanoseconds and device nanoseconds (0 here: not measured)."""
        outputs, engine_ns = await self.engine.run_timed(self.round_call[1], inputs)
        return outputs, engine_ns, 0

    def _kv_pages(self) -> tuple[int, int]:
        """(used, free) KV pages; (0, 0) while loading. Read from the metrics thread."""
        engine = self.engine.loaded
        return (0, 0) if engine is None else (engine.num_pages_used, engine.num_pages_free)

    async def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        async with service_errors(context):
            return await self.release_in(self.scopes.find(_scope_key(context)), request)

    async def Truncate(
        self, request: common_pb2.TruncateRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TruncateResponse:
        async with service_errors(context):
            return await self.truncate_in(self.scopes.find(_scope_key(context)), request)

    async def release_in(
        self, scope: Scope | None, request: common_pb2.ReleaseRequest
    ) -> common_pb2.ReleaseResponse:
        """Release the caller's own sequences: ids are scoped to the connection that made them
        (none at all when it holds nothing here)."""
        seq_ids = [] if scope is None else [scope.inside(s) for s in request.seq_ids]
        await self.settle(seq_ids)
        num_released, num_pages_used = await self.engine.run(_release, seq_ids)
        return common_pb2.ReleaseResponse(num_released=num_released, num_pages_used=num_pages_used)

    async def truncate_in(
        self, scope: Scope | None, request: common_pb2.TruncateRequest
    ) -> common_pb2.TruncateResponse:
        """Truncate the caller's own sequences (scoped as `release_in`)."""
        items = convert_beside.truncate_request_from_proto(request)
        mine = [] if scope is None else scope.enter(items)
        await self.settle([item.seq_id for item in mine])
        truncated, num_pages_used = await self.engine.run(_truncate, mine)
        if scope is None:
            truncated = [Truncated(t.seq_id, found=False) for t in items]
        else:
            truncated = scope.leave(truncated)
        return convert_beside.truncate_response_to_proto(truncated, num_pages_used)

    def hint_in(self, scope: Scope | None, body: bytes | bytearray | memoryview) -> Message:
        """A hint for rounds in flight (the verifier's `Hint`); refused by a service without
        them."""
        raise ServiceError(Code.INVALID_ARGUMENT, f"{self.name} takes no hints")

    async def round_stream(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """The service's bidi round method (VerifyStream, DraftStream): one response per
        request, in order; a refused round ends the stream (its status from
        `service_errors`). Sequence ids are this connection's own (specsplit.scopes): its
        scope lives as long as the stream, then its orphan grace starts."""
        async with service_errors(context), self.scopes.stream(_scope_key(context)) as scope:
            async for request in request_iterator:
                response, _ = await self.round_in(scope, request)
                yield response

    async def round_in(
        self,
        scope: Scope,
        request: Any,
        beside: bytearray | memoryview | None = None,
        received_ns: int | None = None,
    ) -> tuple[Any, memoryview | bytes]:
        """One round of the service's `round` (its RoundRpc and engine call) for a client in
        `scope`: the request parsed, the engine's call timed and traced, the response and the
        bytes of its rows beside it. beside: the request's rows' bytes that came beside it
        (the round lane); then the response's rows go beside it too. None (gRPC): rows in the
        messages, nothing beside. received_ns: when the request had been read (the lane's
        frame, before its parse; default: now), stamped in the response with the time it
        was built (`time.perf_counter_ns`: CLOCK_MONOTONIC on Linux, one clock per host)."""
        rpc = self.round_call[0]
        start_ns = time.perf_counter_ns()
        inputs = scope.enter(rpc.request_from_proto(request, beside))
        with telemetry.service_span(rpc.span, request) as span:
            outputs, engine_ns, device_ns = await self.engine_round(inputs)
            span.set_attribute(f"{rpc.span}_ns", engine_ns)
            if device_ns:  # the verifier's on a GPU (VerifyResponse.device_ns)
                span.set_attribute("specsplit.device_ns", device_ns)
        rpc.seconds.observe(engine_ns / 1e9)
        if device_ns:
            metrics.VERIFY_DEVICE_SECONDS.observe(device_ns / 1e9)
        rows = None if beside is None else wire_tensors.Beside()
        response = rpc.response_to_proto(scope.leave(outputs), engine_ns, rows)
        if device_ns:
            response.device_ns = device_ns
        response.received_ns = start_ns if received_ns is None else received_ns
        response.answered_ns = time.perf_counter_ns()
        overhead_ns = response.answered_ns - start_ns - engine_ns
        metrics.SERVICE_OVERHEAD_SECONDS.observe(max(overhead_ns, 0) / 1e9)
        return response, b"" if rows is None else rows.data()

    async def serve_lane(self, path: str) -> None:
        """Serve the round lane (specsplit.lane) on the Unix socket `path`."""
        request_type = self.round_call[0].request_type
        self.lane = LaneServer(self, path, request_type, self.rows_buffer, self.idle_poll_s)
        await self.lane.start()

    def rows_buffer(self, num_bytes: int) -> bytearray | memoryview:
        """Where a lane request's rows are read (`LaneServer`): host memory of its own."""
        return bytearray(num_bytes)

    async def close_lane(self) -> None:
        if self.lane is not None:
            await self.lane.close()


def calls_on_loop(engine_calls: str, device: str) -> bool:
    """Whether an engine on `device` takes its calls on the event loop's thread: --engine-calls
    loop, or auto on a GPU."""
    if engine_calls == "auto":
        return device.startswith("cuda")
    return engine_calls == "loop"


def _scope_key(context: grpc.aio.ServicerContext) -> str:
    return grpc_scope_key(context.invocation_metadata(), context.peer())


def _warmup(engine: Engine) -> None:
    engine.warmup()


def _release(engine: Engine, seq_ids: list[str]) -> tuple[int, int]:
    return engine.release(seq_ids), engine.num_pages_used


def _truncate(engine: Engine, items: list[Truncation]) -> tuple[list[Truncated], int]:
    return engine.truncate(items), engine.num_pages_used


def _release_selected(engine: Engine, select: Callable[[Iterable[str]], list[str]]) -> int:
    return engine.release(select(list(engine.seqs)))
