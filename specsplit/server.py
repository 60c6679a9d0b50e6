"""Service lifecycle shared by the drafter, verifier and gateway (the gRPC examples' way).

    bind + start (health NOT_SERVING) -> load + warm up off the event loop -> SERVING
    -> SIGTERM / SIGINT -> NOT_SERVING, graceful shutdown, server.stop(grace)

Model code runs on one dedicated thread per engine (`EngineThread`): loading, warmup and every
engine call, so engine state (and a CUDA context) is only ever touched by that thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Concatenate, Generic, NoReturn, ParamSpec, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specsplit import metrics
from specsplit.errors import Code, ServiceError
from specsplit.scopes import ORPHAN_GRACE_S, ConnectionScopes
from specsplit.tls import TLSFiles, add_port
from specsplit.v1 import common_pb2

log = logging.getLogger(__name__)

# draft_probs are [n, vocab] float32: 10 nodes x 150k vocab is 6 MB; leave plenty of room.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_MESSAGE_SIZES = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# gRPC sets SO_REUSEPORT by default: a second server on a busy port would bind and silently
# share the connections with the first. Fail instead.
SERVER_OPTIONS: list[tuple[str, int]] = [*_MESSAGE_SIZES, ("grpc.so_reuseport", 0)]


def server_options(max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """SERVER_OPTIONS, with a lower limit on the size of a received message when given (the
    gateway's client API: a larger request fails with RESOURCE_EXHAUSTED before it is parsed)."""
    if max_receive_bytes is None:
        return SERVER_OPTIONS
    key = "grpc.max_receive_message_length"
    return [(k, max_receive_bytes if k == key else v) for k, v in SERVER_OPTIONS]


# Reconnect quickly after a backend restarts (the default backoff grows to 120 s).
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *_MESSAGE_SIZES,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
LOAD_PROGRESS_INTERVAL_S = 10.0
# At shutdown, after a servable's drain: time for its handlers to send the status they were given.
STOP_SLACK_S = 0.5

STATUS_CODES: dict[Code, grpc.StatusCode] = {
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.INTERNAL: grpc.StatusCode.INTERNAL,
}

E = TypeVar("E")
T = TypeVar("T")
P = ParamSpec("P")


class Servable(Protocol):
    """What `ServiceHost` hosts: a servicer plus its slow start (model load, warmup). One may
    also have `async def drain(grace: float)`, run at shutdown before the server stops: the
    gateway's refuses new requests and ends its running ones, each with a status, within
    `grace` seconds."""

    service_name: str  # full gRPC name, e.g. "specsplit.v1.Drafter"

    def register(self, server: grpc.aio.Server) -> None: ...

    async def load(self) -> None:
        """Get ready to serve (off the event loop for anything slow); raise to give up."""
        ...

    async def close(self) -> None: ...


def service_name(file_descriptor: object, name: str) -> str:
    """Full name of service `name` in a generated *_pb2 module's DESCRIPTOR."""
    return file_descriptor.services_by_name[name].full_name  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def service_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Abort the RPC with the matching status when the body raises ServiceError; anything
    else unexpected is logged and aborts with INTERNAL."""
    try:
        yield
    except ServiceError as err:
        metrics.count_error(STATUS_CODES[err.code].name)
        await abort(context, err)
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as err:
        log.exception("internal error")
        metrics.count_error(grpc.StatusCode.INTERNAL.name)
        await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")


async def abort(context: grpc.aio.ServicerContext, err: ServiceError) -> NoReturn:
    await context.abort(STATUS_CODES[err.code], err.message)
    raise AssertionError("unreachable: context.abort raises")


class EngineThread(Generic[E]):
    """An engine and the one thread that loads it, warms it up and runs every call on it."""

    def __init__(self, name: str, load: Callable[[], E], warmup: Callable[[E], None]) -> None:
        self.name = name
        self._load = load
        self._warmup = warmup
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

    async def run(self, fn: Callable[Concatenate[E, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(engine, ...) on the engine thread. UNAVAILABLE until loaded and warm."""
        engine = self._engine
        if engine is None:
            raise ServiceError(Code.UNAVAILABLE, f"{self.name} is still loading its model")
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


EngineT = TypeVar("EngineT", bound=Engine)


class EngineServicer(Generic[EngineT]):
    """The part the drafter and verifier servicers share: the engine thread, its loading
    (a Servable's load/close), sequence ids scoped by connection (specsplit.scopes) and the
    unary Release. Subclasses add register() and their stream method, which runs inside
    `self.scopes.stream(context.peer())`. TLS: mutual (only clients with a certificate from the
    configured CA)."""

    service_name: str
    mutual_tls = True

    def __init__(
        self, name: str, load: Callable[[], EngineT], orphan_grace_s: float = ORPHAN_GRACE_S
    ) -> None:
        self.engine = EngineThread(name, load, _warmup)
        self.scopes = ConnectionScopes(self._release_selected, orphan_grace_s)
        metrics.watch_kv_pages(self._kv_pages)

    async def load(self) -> None:
        await self.engine.load()

    async def close(self) -> None:
        await self.scopes.close()
        self.engine.close()

    async def _release_selected(self, select: Callable[[Iterable[str]], list[str]]) -> int:
        try:
            return await self.engine.run(_release_selected, select)
        except RuntimeError:  # the engine thread has shut down: nothing left to free
            return 0

    def _kv_pages(self) -> tuple[int, int]:
        """(used, free) KV pages; (0, 0) while loading. Read from the metrics thread."""
        engine = self.engine.loaded
        return (0, 0) if engine is None else (engine.num_pages_used, engine.num_pages_free)

    async def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        # only the caller's own sequences: ids are scoped to the connection that made them
        scope = self.scopes.find(context.peer())
        seq_ids = [] if scope is None else [scope.inside(s) for s in request.seq_ids]
        async with service_errors(context):
            num_released, num_pages_used = await self.engine.run(_release, seq_ids)
        return common_pb2.ReleaseResponse(num_released=num_released, num_pages_used=num_pages_used)


def _warmup(engine: Engine) -> None:
    engine.warmup()


def _release(engine: Engine, seq_ids: list[str]) -> tuple[int, int]:
    return engine.release(seq_ids), engine.num_pages_used


def _release_selected(engine: Engine, select: Callable[[Iterable[str]], list[str]]) -> int:
    return engine.release(select(list(engine.seqs)))


class ServiceHost:
    """A grpc.aio server hosting one Servable with health and reflection. tls: plaintext when
    it names no files; mutual TLS when the servable says `mutual_tls` (drafter, verifier).
    interceptors: the gateway's API-key check."""

    def __init__(
        self,
        servable: Servable,
        address: str,
        *,
        grace: float = 5.0,
        tls: TLSFiles | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_receive_bytes: int | None = None,
    ) -> None:
        self.servable = servable
        self.address = address
        self.grace = grace
        self.tls = tls or TLSFiles()
        self.server = grpc.aio.server(
            options=server_options(max_receive_bytes), interceptors=interceptors
        )
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._stopped = False

    async def start(self) -> int:
        """Bind and start serving with health NOT_SERVING; returns the bound port."""
        name = self.servable.service_name
        await self.set_serving(False)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.servable.register(self.server)
        reflection.enable_server_reflection(
            (
                name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        mutual = getattr(self.servable, "mutual_tls", False)
        self.port = add_port(self.server, self.address, self.tls, mutual=mutual)
        if self.port == 0:
            raise OSError(f"{name}: cannot listen on {self.address}")
        await self.server.start()
        security = "plaintext" if not self.tls.enabled else "mutual TLS" if mutual else "TLS"
        log.info(
            "%s listening on %s (port %d, %s), NOT_SERVING until ready",
            name,
            self.address,
            self.port,
            security,
        )
        return self.port

    async def load(self) -> None:
        """The servable's load, then health SERVING."""
        await self.servable.load()
        await self.set_serving(True)
        log.info("%s SERVING on port %d", self.servable.service_name, self.port)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", self.servable.service_name):
            await self.health.set(service, status)

    async def stop(self) -> None:
        """Health NOT_SERVING for good; the servable's drain, if it has one (the gateway's ends
        its requests within `grace`); then refuse new RPCs and give running ones the rest of
        `grace` (at least STOP_SLACK_S) before cancelling them."""
        if self._stopped:
            return
        self._stopped = True
        name = self.servable.service_name
        started = time.monotonic()
        log.info("%s shutting down (grace %.1f s)", name, self.grace)
        await self.health.enter_graceful_shutdown()
        drain = getattr(self.servable, "drain", None)
        if drain is not None:
            await drain(self.grace)
        await self.server.stop(max(self.grace - (time.monotonic() - started), STOP_SLACK_S))
        await self.servable.close()
        log.info("%s stopped after %.1f s", name, time.monotonic() - started)


async def serve(
    servable: Servable,
    address: str,
    *,
    grace: float = 5.0,
    stop: asyncio.Event | None = None,
    tls: TLSFiles | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_receive_bytes: int | None = None,
) -> None:
    """Run until SIGTERM / SIGINT (or `stop` is set). Raises if loading fails.
    max_receive_bytes: the largest request message (None = SERVER_OPTIONS')."""
    if stop is None:
        stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, _on_signal, sig, stop)
    host = ServiceHost(
        servable,
        address,
        grace=grace,
        tls=tls,
        interceptors=interceptors,
        max_receive_bytes=max_receive_bytes,
    )
    try:
        await host.start()
        loading = asyncio.create_task(host.load())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if loading.done():
                loading.result()  # a failed load ends the service (the exception propagates)
                await stopping
            else:
                log.info("stopped while loading")
        finally:
            loading.cancel()
            stopping.cancel()
    finally:
        await host.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    log.info("received %s", sig.name)
    stop.set()
