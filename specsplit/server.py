"""Service lifecycle shared by the drafter, verifier and gateway (the gRPC examples' way).

    bind + start (health NOT_SERVING) -> load + warm up off the event loop -> SERVING
    -> SIGTERM / SIGINT -> NOT_SERVING, graceful shutdown, server.stop(grace)

The drafter's and verifier's servicers, their engine on its own thread included, are in
specsplit/engine_servicer.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from typing import NoReturn, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specsplit import metrics
from specsplit.affinity import pin_to_cores
from specsplit.errors import Code, ServiceError
from specsplit.lane import lane_path
from specsplit.tls import TLSFiles, add_port

log = logging.getLogger(__name__)

# a round's feature rows: 3 MB at batch 32 for an 8B target's EAGLE-3 head, a prefill's
# [prompt tokens, features] far more (4K tokens x 12288 bf16 = 100 MB); leave room.
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
# At shutdown, after a servable's drain: time for its handlers to send the status they were given.
STOP_SLACK_S = 0.5

STATUS_CODES: dict[Code, grpc.StatusCode] = {
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Code.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.INTERNAL: grpc.StatusCode.INTERNAL,
}


class Servable(Protocol):
    """What `ServiceHost` hosts: a servicer plus its slow start (model load, warmup). One may
    also have `async def drain(grace: float)`, run at shutdown before the server stops: the
    gateway's refuses new requests and ends its running ones, each with a status, within
    `grace` seconds; and `serve_lane(path)` / `close_lane()`: the drafter's and verifier's
    round lane (specsplit.lane), served beside a Unix-socket address."""

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
        cpu_cores: frozenset[int] | None = None,
    ) -> None:
        """cpu_cores: where every thread of the process runs once loaded (`pin_to_cores`,
        --cpu-cores), after the warm-up, whose compiles use every core; None = not pinned."""
        self.servable = servable
        self.cpu_cores = cpu_cores
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
        lane = lane_path(self.address)
        if lane is not None and not self.tls.enabled and hasattr(self.servable, "serve_lane"):
            # the round lane beside the gRPC socket; never beside TLS (it has no credentials)
            await self.servable.serve_lane(lane)
        security = "plaintext" if not self.tls.enabled else "mutual TLS" if mutual else "TLS"
        log.info("%s listening on %s (%s), NOT_SERVING until ready", name, self.where, security)
        return self.port

    @property
    def where(self) -> str:
        """The bound address for logs: host:port, or the Unix socket (grpc gives it port 1)."""
        if self.address.startswith("unix"):
            return self.address
        return f"{self.address.rsplit(':', 1)[0]}:{self.port}"

    async def load(self) -> None:
        """The servable's load, then the start-up's objects set aside from the garbage
        collector (`freeze_startup`), then health SERVING."""
        await self.servable.load()
        freeze_startup()
        if self.cpu_cores:
            pin_to_cores(self.cpu_cores)
        await self.set_serving(True)
        log.info("%s SERVING on %s", self.servable.service_name, self.where)

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
        close_lane = getattr(self.servable, "close_lane", None)
        if close_lane is not None:
            await close_lane()
        await self.server.stop(max(self.grace - (time.monotonic() - started), STOP_SLACK_S))
        await self.servable.close()
        log.info("%s stopped after %.1f s", name, time.monotonic() - started)


def freeze_startup() -> None:
    """Collect the garbage the start-up left, then set every live object aside from the garbage
    collector for good (`gc.freeze`, as vLLM does after its start-up): a loaded model, its
    tokenizer and the warm-up's graphs are hundreds of thousands of objects that a full
    collection would otherwise walk each time, stopping the process (~150 ms for the
    embedded default's verifier on the 2-core VM). Collections then walk only what came since.
    Each collection's pause is in /metrics (`specsplit_gc_pause_seconds`).
    $SPECSPLIT_GC_FREEZE=0 (a developer's switch, for benches) leaves them in."""
    metrics.watch_gc()
    if os.environ.get("SPECSPLIT_GC_FREEZE", "1") == "0":
        return
    started = time.monotonic()
    gc.collect()
    gc.freeze()
    log.info(
        "set %d start-up objects aside from the garbage collector (%.2f s)",
        gc.get_freeze_count(),
        time.monotonic() - started,
    )


async def serve(
    servable: Servable,
    address: str,
    *,
    grace: float = 5.0,
    stop: asyncio.Event | None = None,
    tls: TLSFiles | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_receive_bytes: int | None = None,
    cpu_cores: frozenset[int] | None = None,
) -> None:
    """Run until SIGTERM / SIGINT (or `stop` is set). Raises if loading fails.
    max_receive_bytes: the largest request message (None = SERVER_OPTIONS'); cpu_cores:
    ServiceHost's."""
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
        cpu_cores=cpu_cores,
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
