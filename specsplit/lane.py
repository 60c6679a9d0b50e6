"""The round lane: a gateway↔service link's rounds, Release and Truncate as length-prefixed
protobuf frames on a Unix socket beside the service's gRPC socket (`lane_path`: the gRPC
socket's path + ".rounds").

gRPC's aio stream round trip costs ~0.2-0.3 ms between two processes (bench/rpc_overhead.py:
its poller thread hands every read and write completion to the event loop); a frame on a plain
asyncio Unix socket costs about half. The messages are the gRPC services' own (the same
conversions, the same trace context in their fields); gRPC keeps health, reflection and every
link that is not a Unix socket (TCP, TLS). A service listening on a Unix socket serves both;
the gateway takes the lane unless `--round-lane off`.

    request  = kind (1 byte) + body length (4 bytes, little-endian) + rows length (4) + body
               + rows
    response = status (1 byte: 0 OK, else an errors.Code) + body length + rows length + body
               (the response message, or the error's UTF-8 message) + rows

A round's feature rows (a Verify answer's hidden states, a Draft request's target features)
travel as `rows`, their raw bytes beside the message (`wire_tensors.Beside`; its tensor field keeps
dtype and shape): sent from the tensor's own memory and read straight into the buffer that
becomes the receiver's tensor (a drafter on a GPU: page-locked memory, `LaneServer`'s
`rows_buffer`). In the message they cost ~5 copies a hop (the tensor's bytes,
protobuf's field, its serialization, its parse, a writable copy), ~3 ms for the 3 MB of a
batch-32 round at an 8B head's width on a 2-core VM (bench/lane_rows.py).

A connection opens with HELLO, whose body is the client's scope token: the service's
sequence-id scope (specsplit.scopes) is keyed by it, so a client that reconnects (its round
cancelled mid-way, the service restarted) finds its sequences again while the scope lives, and
no other client can name them. A connection carries one request at a time; a client with
several in flight (`LaneConnection`) opens more connections, all with its one token, so they
share its scope, which lives while any of them does. A refused request answers with its status
and the connection stays; a broken connection is the client's to reopen.

Both ends read a long frame's body and rows straight into buffers of their own length
(`FrameStream`, an asyncio buffered protocol, in specsplit/lane_frames.py with the frames'
format) and write its header, body and rows without joining them: the link itself copies
nothing but what asyncio keeps of a send the socket did not take at once. Small frames (most
rounds' requests) go through a scratch buffer: one read and one send each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from google.protobuf.message import DecodeError, Message

from specsplit import metrics
from specsplit.errors import Code, ServiceError, backend_error
from specsplit.lane_frames import (
    CODES,
    STATUS,
    TOKEN_BYTES,
    Buffer,
    Frame,
    FrameStream,
    Kind,
    Writable,
    new_token,
)
from specsplit.pool import Pool
from specsplit.scopes import ConnectionScopes, Scope, client_key
from specsplit.v1 import common_pb2

log = logging.getLogger(__name__)

LANE_SUFFIX = ".rounds"
MAX_CONNECTIONS = 4  # a LaneConnection's requests in flight at once, one connection each


def lane_path(address: str) -> str | None:
    """The lane's socket path for a service's gRPC `address` (None: not a Unix socket)."""
    if not address.startswith("unix:"):
        return None
    path = address.removeprefix("unix:")
    if path.startswith("//"):  # unix:///abs/path
        path = path[2:]
    return path + LANE_SUFFIX


class LaneConnection:
    """The gateway's end: up to `max_connections` connections (a `Pool`), one request at a
    time on each, all opened with the client's one token (one scope on the service). A
    request takes an idle connection, opening a new one while all are busy. Raises
    ServiceError: the service's own status for a refused request, UNAVAILABLE when the service
    cannot be reached or the request's connection broke."""

    def __init__(
        self,
        service: str,
        path: str,
        spin_s: float = 0.0,
        max_connections: int = MAX_CONNECTIONS,
        token: bytes | None = None,
    ) -> None:
        """spin_s: how long the event loop polls after a request is sent before it sleeps
        (`LoopPoll`; 0 = never: where the gateway shares its cores with the engines, polling
        slows them). token: the client's scope token (None: a new one)."""
        self.service = service
        self.path = path
        self.token = token or new_token()
        self.poll = LoopPoll(spin_s)  # one for the connections: they share the event loop
        self.sockets: Pool[LaneSocket] = Pool(
            lambda: LaneSocket(service, path, self.token, self.poll), max_connections
        )

    async def request(self, kind: Kind, body: Buffer, rows: Buffer = b"") -> Frame:
        """The answer to a request (its message and the rows beside it; status OK)."""
        async with self.sockets.lent() as socket:
            answer = await socket.exchange(kind, body, rows)
        if answer.kind == 0:
            return answer
        code = CODES.get(answer.kind, Code.INTERNAL)
        raise backend_error(self.service, code.value, answer.body.decode(errors="replace"))

    def close(self) -> None:
        self.sockets.close()


class LoopPoll:
    """Keeps the running event loop polling its sockets for `seconds` after each `extend`: a
    callback that reschedules itself, so the loop's every pass selects without sleeping and
    every other task still runs. A thread asleep in epoll wakes late, and its core runs the
    next call slower: the drafter's host work for a SmolLM2 round at batch 1 took 1.6 ms
    back to back and 2.6 ms after 3 ms asleep (bench/draft_step.py --gap-ms, one H100 host).
    Polling that waits for answers (`extend(until=...)`, the gateway's) stops as soon as
    they have all come. Where a CPU engine needs the cores, polling slows it: 0 = never."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop polled, while polling
        self.awaited: list[asyncio.Future[Any]] = []  # answers polled for (none: to the deadline)
        self.passes = 0  # the loop's passes polled (tests)

    def extend(self, until: asyncio.Future[Any] | None = None) -> None:
        """Poll until `seconds` from now; given `until`, only until then or once it and every
        other answer polled for is done."""
        if self.seconds <= 0:
            return
        self.deadline = time.perf_counter() + self.seconds
        if until is not None:
            self.awaited = [*(f for f in self.awaited if not f.done()), until]
        loop = asyncio.get_running_loop()
        if self.loop is not loop:  # not polling (or a loop closed mid-poll)
            self.loop = loop
            loop.call_soon(self._poll, loop)

    def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self.loop:
            return
        self.passes += 1
        answered = bool(self.awaited) and all(f.done() for f in self.awaited)
        if not answered and time.perf_counter() < self.deadline:
            loop.call_soon(self._poll, loop)
        else:
            self.loop, self.awaited = None, []


class LaneSocket:
    """One connection of a LaneConnection, lent to one request at a time: opened on first use
    (HELLO with the client's token), closed when a request on it broke or was cancelled (its
    answer would pair with the next request), reopened the same way by its next request."""

    def __init__(self, service: str, path: str, token: bytes, poll: LoopPoll) -> None:
        self.service = service
        self.path = path
        self.token = token
        self.poll = poll
        self._stream: FrameStream | None = None

    @property
    def is_open(self) -> bool:
        return self._stream is not None

    async def exchange(self, kind: Kind, body: Buffer, rows: Buffer = b"") -> Frame:
        """One request's response frame (its status, message and rows)."""
        stream = self._stream or await self._open()
        try:
            stream.write(kind, body, rows)
            return await self._answer(stream)
        except (OSError, EOFError, ConnectionError) as err:
            self.close()
            raise ServiceError(
                Code.UNAVAILABLE, f"{self.service}: the round lane broke ({err!r})"
            ) from None
        except BaseException:  # cancelled mid-request: its answer would pair with the next
            self.close()
            raise

    async def _answer(self, stream: FrameStream) -> Frame:
        """The response frame. While it is awaited the event loop keeps polling (`LoopPoll`:
        until it comes, at most the connection's `spin_s`): a process that sleeps through an
        engine call wakes ~0.1 ms late when the answer comes (bench/rpc_overhead.py: the echo
        that holds its loop 1.5 ms)."""
        answer = asyncio.ensure_future(stream.read())
        self.poll.extend(until=answer)
        try:
            return await answer
        finally:
            answer.cancel()  # cancelled itself: do not leave the read running

    async def _open(self) -> FrameStream:
        loop = asyncio.get_running_loop()
        try:
            _, stream = await loop.create_unix_connection(FrameStream, self.path)
        except OSError as err:
            raise ServiceError(
                Code.UNAVAILABLE, f"{self.service}: not reachable ({err.strerror})"
            ) from None
        stream.write(Kind.HELLO, self.token)
        self._stream = stream
        return stream

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


class LaneService(Protocol):
    """What the lane serves of an engine service (specsplit.engine_servicer.EngineServicer)."""

    name: str
    scopes: ConnectionScopes

    async def round_in(
        self,
        scope: Scope,
        request: Any,
        beside: bytearray | memoryview | None = None,
        received_ns: int | None = None,
    ) -> tuple[Any, Buffer]: ...

    async def release_in(
        self, scope: Scope | None, request: common_pb2.ReleaseRequest
    ) -> common_pb2.ReleaseResponse: ...

    async def truncate_in(
        self, scope: Scope | None, request: common_pb2.TruncateRequest
    ) -> common_pb2.TruncateResponse: ...

    def hint_in(self, scope: Scope | None, body: bytes | bytearray | memoryview) -> Message: ...


class LaneServer:
    """The service's end: a Unix socket server on the service's event loop. Each connection
    says HELLO with its token, then asks one request at a time in the token's scope."""

    def __init__(
        self,
        service: LaneService,
        path: str,
        request_type: Any,
        rows_buffer: Callable[[int], Writable] = bytearray,
        idle_poll_s: float = 0.0,
    ) -> None:
        """idle_poll_s: how long the event loop keeps polling after an answer before it sleeps
        (`LoopPoll`; 0 = never)."""
        self.service = service
        self.path = path
        self.request_type = request_type  # the round's request message class
        self.rows_buffer = rows_buffer  # where long requests' rows land (FrameStream)
        self.poll = LoopPoll(idle_poll_s)
        self._server: asyncio.Server | None = None
        self._streams: set[FrameStream] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # left by a service that was killed
            os.unlink(self.path)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_unix_server(self._accept, self.path)
        except OSError as err:  # a path too long for a socket (~107 bytes), a read-only dir
            message = f"{self.service.name}: cannot open its round lane {self.path}: {err}"
            raise OSError(message) from err
        log.info("%s: round lane on %s", self.service.name, self.path)

    async def close(self) -> None:
        """Stop listening and end every connection (their clients see UNAVAILABLE)."""
        if self._server is None:
            return
        self._server.close()
        for stream in list(self._streams):
            stream.close()
        await self._server.wait_closed()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> FrameStream:
        """A new connection's stream, served by a task of its own (it starts once the
        connection is made: the task's first step runs after the transport's)."""
        stream = FrameStream(self.rows_buffer)
        self._streams.add(stream)
        task = asyncio.get_running_loop().create_task(self._connection(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return stream

    async def _connection(self, stream: FrameStream) -> None:
        try:
            hello = await stream.read()
            kind, token = hello.kind, hello.body
            if kind != Kind.HELLO or len(token) != TOKEN_BYTES:
                return
            async with self.service.scopes.stream(client_key(token.hex())) as scope:
                while True:
                    stream.write(*await self._answer(scope, await stream.read()))
                    self.poll.extend()  # the next request finds the loop awake
        except (EOFError, ConnectionError):
            pass  # the client went away; its scope's orphan grace starts
        finally:
            self._streams.discard(stream)
            stream.close()

    async def _answer(self, scope: Scope, frame: Frame) -> tuple[int, Buffer, Buffer]:
        """One request's (status, body, rows): the answer, or its refusal's status and
        message."""
        kind, body, rows = frame.kind, frame.body, frame.rows
        received_ns = time.perf_counter_ns()  # the frame is read: the round's stages start here
        try:
            if kind == Kind.ROUND:
                request = self.request_type.FromString(body)
                answer, answer_rows = await self.service.round_in(scope, request, rows, received_ns)
                return 0, answer.SerializeToString(), answer_rows
            if rows:
                raise ServiceError(Code.INVALID_ARGUMENT, f"rows beside a request of kind {kind}")
            if kind == Kind.RELEASE:
                request = common_pb2.ReleaseRequest.FromString(body)
                answer = await self.service.release_in(scope, request)
            elif kind == Kind.TRUNCATE:
                request = common_pb2.TruncateRequest.FromString(body)
                answer = await self.service.truncate_in(scope, request)
            elif kind == Kind.HINT:
                answer = self.service.hint_in(scope, body)
            else:
                raise ServiceError(Code.INVALID_ARGUMENT, f"unknown request kind {kind}")
        except ServiceError as err:
            metrics.count_error(err.code.value)
            return STATUS[err.code], err.message.replace(scope.prefix, "").encode(), b""
        except DecodeError as err:
            metrics.count_error(Code.INVALID_ARGUMENT.value)
            return STATUS[Code.INVALID_ARGUMENT], f"bad message: {err}".encode(), b""
        except Exception as err:
            log.exception("internal error")
            metrics.count_error(Code.INTERNAL.value)
            return STATUS[Code.INTERNAL], f"{type(err).__name__}: {err}".encode(), b""
        return 0, answer.SerializeToString(), b""
