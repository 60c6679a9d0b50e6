"""The round lane: a gateway↔service link's rounds, Release and Truncate as length-prefixed
protobuf frames on a Unix socket beside the service's gRPC socket (`lane_path`: the gRPC
socket's path + ".rounds").

gRPC's aio stream round trip costs ~0.2-0.3 ms between two processes (bench/rpc_overhead.py:
its poller thread hands every read and write completion to the event loop); a frame on a plain
asyncio Unix socket costs about half. The messages are the gRPC services' own (the same
conversions, the same trace context in their fields); gRPC keeps health, reflection and every
link that is not a Unix socket (TCP, TLS). A service listening on a Unix socket serves both;
the gateway takes the lane unless `--round-lane off`.

    request  = kind (1 byte) + length (4 bytes, little-endian) + body
    response = status (1 byte: 0 OK, else an errors.Code) + length + body
               (the response message, or the error's UTF-8 message)

A connection opens with HELLO, whose body is the client's scope token: the service's
sequence-id scope (specsplit.scopes) is keyed by it, so a client that reconnects (its round
cancelled mid-way, the service restarted) finds its sequences again while the scope lives, and
no other client can name them. A connection carries one request at a time; a client with
several in flight (`LaneConnection`) opens more connections, all with its one token, so they
share its scope, which lives while any of them does. A refused request answers with its status
and the connection stays; a broken connection is the client's to reopen.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import secrets
import struct
import time
from typing import Any, Protocol

from google.protobuf.message import DecodeError

from specsplit import metrics
from specsplit.errors import Code, ServiceError, backend_error
from specsplit.pool import Pool
from specsplit.scopes import ConnectionScopes, Scope, client_key
from specsplit.v1 import common_pb2

log = logging.getLogger(__name__)

LANE_SUFFIX = ".rounds"
HEADER = struct.Struct("<BI")  # kind or status, body length
TOKEN_BYTES = 16
MAX_FRAME_BYTES = 256 * 1024 * 1024  # as gRPC's MAX_MESSAGE_BYTES (specsplit.server)
MAX_CONNECTIONS = 4  # a LaneConnection's requests in flight at once, one connection each


class Kind(enum.IntEnum):
    HELLO = 0
    ROUND = 1
    RELEASE = 2
    TRUNCATE = 3


STATUS = {code: i for i, code in enumerate(Code, start=1)}  # 0 = OK
CODES = {i: code for code, i in STATUS.items()}


def lane_path(address: str) -> str | None:
    """The lane's socket path for a service's gRPC `address` (None: not a Unix socket)."""
    if not address.startswith("unix:"):
        return None
    path = address.removeprefix("unix:")
    if path.startswith("//"):  # unix:///abs/path
        path = path[2:]
    return path + LANE_SUFFIX


def frame(kind_or_status: int, body: bytes) -> bytes:
    return HEADER.pack(kind_or_status, len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(kind or status, body); IncompleteReadError when the peer closed."""
    kind, length = HEADER.unpack(await reader.readexactly(HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ConnectionError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return kind, await reader.readexactly(length)


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


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
        """spin_s: how long the event loop polls for an answer before it sleeps
        (`LaneSocket`; 0 = never: where the gateway shares its cores with the engines,
        polling slows them). token: the client's scope token (None: a new one)."""
        self.service = service
        self.path = path
        self.token = token or new_token()
        self.sockets: Pool[LaneSocket] = Pool(
            lambda: LaneSocket(service, path, self.token, spin_s), max_connections
        )

    async def request(self, kind: Kind, body: bytes) -> bytes:
        async with self.sockets.lent() as socket:
            status, answer = await socket.exchange(kind, body)
        if status == 0:
            return answer
        code = CODES.get(status, Code.INTERNAL)
        raise backend_error(self.service, code.value, answer.decode(errors="replace"))

    def close(self) -> None:
        self.sockets.close()


class LaneSocket:
    """One connection of a LaneConnection, lent to one request at a time: opened on first use
    (HELLO with the client's token), closed when a request on it broke or was cancelled (its
    answer would pair with the next request), reopened the same way by its next request."""

    def __init__(self, service: str, path: str, token: bytes, spin_s: float) -> None:
        self.service = service
        self.path = path
        self.token = token
        self.spin_s = spin_s
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    @property
    def is_open(self) -> bool:
        return self._streams is not None

    async def exchange(self, kind: Kind, body: bytes) -> tuple[int, bytes]:
        """One request's (status, answer): the response frame."""
        reader, writer = self._streams or await self._open()
        try:
            writer.write(frame(kind, body))
            return await self._answer(reader)
        except (OSError, EOFError, ConnectionError) as err:
            self.close()
            raise ServiceError(
                Code.UNAVAILABLE, f"{self.service}: the round lane broke ({err!r})"
            ) from None
        except BaseException:  # cancelled mid-request: its answer would pair with the next
            self.close()
            raise

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        """The response frame. While it is awaited the event loop keeps polling (a callback
        that reschedules itself: every other task still runs) for up to `spin_s`, then sleeps:
        a process that sleeps through an engine call wakes ~0.1 ms late when the answer comes
        (bench/rpc_overhead.py: the echo that holds its loop 1.5 ms)."""
        answer = asyncio.ensure_future(read_frame(reader))
        if self.spin_s > 0:
            loop = asyncio.get_running_loop()
            deadline = time.perf_counter() + self.spin_s

            def spin() -> None:
                if not answer.done() and time.perf_counter() < deadline:
                    loop.call_soon(spin)

            loop.call_soon(spin)
        try:
            return await answer
        finally:
            answer.cancel()  # cancelled itself: do not leave the read running

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            reader, writer = await asyncio.open_unix_connection(self.path)
        except OSError as err:
            raise ServiceError(
                Code.UNAVAILABLE, f"{self.service}: not reachable ({err.strerror})"
            ) from None
        writer.write(frame(Kind.HELLO, self.token))
        self._streams = reader, writer
        return reader, writer

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


class LaneService(Protocol):
    """What the lane serves of an engine service (specsplit.engine_servicer.EngineServicer)."""

    name: str
    scopes: ConnectionScopes

    async def round_in(self, scope: Scope, request: Any) -> Any: ...

    async def release_in(
        self, scope: Scope | None, request: common_pb2.ReleaseRequest
    ) -> common_pb2.ReleaseResponse: ...

    async def truncate_in(
        self, scope: Scope | None, request: common_pb2.TruncateRequest
    ) -> common_pb2.TruncateResponse: ...


class LaneServer:
    """The service's end: a Unix socket server on the service's event loop. Each connection
    says HELLO with its token, then asks one request at a time in the token's scope."""

    def __init__(self, service: LaneService, path: str, request_type: Any) -> None:
        self.service = service
        self.path = path
        self.request_type = request_type  # the round's request message class
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # left by a service that was killed
            os.unlink(self.path)
        try:
            self._server = await asyncio.start_unix_server(self._connection, self.path)
        except OSError as err:  # a path too long for a socket (~107 bytes), a read-only dir
            message = f"{self.service.name}: cannot open its round lane {self.path}: {err}"
            raise OSError(message) from err
        log.info("%s: round lane on %s", self.service.name, self.path)

    async def close(self) -> None:
        """Stop listening and end every connection (their clients see UNAVAILABLE)."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            kind, token = await read_frame(reader)
            if kind != Kind.HELLO or len(token) != TOKEN_BYTES:
                return
            async with self.service.scopes.stream(client_key(token.hex())) as scope:
                while True:
                    kind, body = await read_frame(reader)
                    writer.write(await self._answer(scope, kind, body))
        except (EOFError, ConnectionError):
            pass  # the client went away; its scope's orphan grace starts
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, scope: Scope, kind: int, body: bytes) -> bytes:
        """One request's response frame: the answer, or its refusal's status and message."""
        try:
            if kind == Kind.ROUND:
                answer = await self.service.round_in(scope, self.request_type.FromString(body))
            elif kind == Kind.RELEASE:
                request = common_pb2.ReleaseRequest.FromString(body)
                answer = await self.service.release_in(scope, request)
            elif kind == Kind.TRUNCATE:
                request = common_pb2.TruncateRequest.FromString(body)
                answer = await self.service.truncate_in(scope, request)
            else:
                raise ServiceError(Code.INVALID_ARGUMENT, f"unknown request kind {kind}")
        except ServiceError as err:
            metrics.count_error(err.code.value)
            return frame(STATUS[err.code], err.message.replace(scope.prefix, "").encode())
        except DecodeError as err:
            metrics.count_error(Code.INVALID_ARGUMENT.value)
            return frame(STATUS[Code.INVALID_ARGUMENT], f"bad message: {err}".encode())
        except Exception as err:
            log.exception("internal error")
            metrics.count_error(Code.INTERNAL.value)
            return frame(STATUS[Code.INTERNAL], f"{type(err).__name__}: {err}".encode())
        return frame(0, answer.SerializeToString())
