"""The round lane's frames (specsplit/lane.py): a frame's header, its kinds and statuses, and
`FrameStream`, one end of a lane connection (an asyncio buffered protocol that reads a long
frame's body and rows straight into buffers of their own length and writes header, body and
rows without joining them; small frames go through a scratch buffer: one read and one send
each); `grow_buffers` asks for socket buffers that hold a round's feature rows.

    request  = kind (1 byte) + body length (4 bytes, little-endian) + rows length (4) + body
               + rows
    response = status (1 byte: 0 OK, else an errors.Code) + body length + rows length + body
               (the response message, or the error's UTF-8 message) + rows
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import secrets
import socket
import struct
import time
from collections.abc import Callable
from typing import NamedTuple

from specsplit.errors import Code

log = logging.getLogger("specsplit.lane")

HEADER = struct.Struct("<BII")  # kind or status, body length, rows length
TOKEN_BYTES = 16
MAX_FRAME_BYTES = 256 * 1024 * 1024  # as gRPC's MAX_MESSAGE_BYTES (specsplit.server)
SCRATCH_BYTES = 64 * 1024  # a FrameStream's read buffer; longer frames get their own
SOCKET_BUFFER_BYTES = 8 * 1024 * 1024  # asked of each end's socket (`grow_buffers`)
Buffer = bytes | bytearray | memoryview


class Kind(enum.IntEnum):
    HELLO = 0
    ROUND = 1
    RELEASE = 2
    TRUNCATE = 3
    HINT = 4


STATUS = {code: i for i, code in enumerate(Code, start=1)}  # 0 = OK
CODES = {i: code for code, i in STATUS.items()}


Writable = bytearray | memoryview  # a frame's buffers, written in place as they are read


class Frame(NamedTuple):
    kind: int  # a request's kind, a response's status
    body: bytearray  # the message (or an error's text)
    rows: Writable  # the feature rows' bytes beside it (empty: none)
    read_ns: int = 0  # when its last byte had been read (time.perf_counter_ns)


class FrameStream(asyncio.BufferedProtocol):
    """One end of a lane connection: the socket read into a scratch buffer whose whole frames
    are queued for `read`, except a frame too long for it, whose body and rows are read
    straight into buffers of their own lengths (no copy of their bytes but the few that came
    with the header); `write` sends a small frame in one piece, a long one as its header and
    body and its rows as they are. `rows_buffer(n)`: the writable buffer a long frame's n
    bytes of rows are read into (a drafter on a GPU: page-locked memory, so that the rows
    cross to the device from where they landed)."""

    def __init__(self, rows_buffer: Callable[[int], Writable] = bytearray) -> None:
        self.transport: asyncio.Transport | None = None
        self._rows_buffer = rows_buffer
        self._scratch = bytearray(SCRATCH_BYTES)
        self._held = 0  # bytes of the scratch buffer not yet taken as frames
        self._long: Frame | None = None  # a long frame being read into its own buffers
        self._filled = 0  # of the long frame's body, then rows
        self._frames: collections.deque[Frame] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._lost: Exception | None = None  # set once the connection is gone

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            grow_buffers(sock)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._long is not None:
            body = len(self._long.body)
            if self._filled < body:
                return memoryview(self._long.body)[self._filled :]
            return memoryview(self._long.rows)[self._filled - body :]
        return memoryview(self._scratch)[self._held :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._long is not None:
            self._filled += nbytes
            if self._filled == len(self._long.body) + len(self._long.rows):
                self._frames.append(self._long._replace(read_ns=time.perf_counter_ns()))
                self._long = None
                self._wake()
            return
        self._held += nbytes
        self._take_frames()
        self._wake()

    def _take_frames(self) -> None:
        """Queue the scratch buffer's whole frames; start a long frame's own buffers; move
        what is left (a frame's beginning) to the front."""
        scratch, at = self._scratch, 0
        while self._held - at >= HEADER.size:
            kind, body_len, rows_len = HEADER.unpack_from(scratch, at)
            length = body_len + rows_len
            if length > MAX_FRAME_BYTES:
                self._lose(
                    ConnectionError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
                )
                return
            body_at = at + HEADER.size
            rows_at = body_at + body_len
            came = self._held - body_at
            if came >= length:
                body = scratch[body_at:rows_at]
                rows = scratch[rows_at : rows_at + rows_len]
                self._frames.append(Frame(kind, body, rows, time.perf_counter_ns()))
                at = rows_at + rows_len
            elif HEADER.size + length > len(scratch):  # read the rest into its own buffers
                long = Frame(kind, bytearray(body_len), self._rows_buffer(rows_len))
                part = min(came, body_len)
                long.body[:part] = scratch[body_at : body_at + part]
                long.rows[: came - part] = scratch[body_at + part : self._held]
                self._long, self._filled = long, came
                at = self._held
                break
            else:
                break
        left = self._held - at
        if at and left:
            scratch[:left] = scratch[at : self._held]
        self._held = left

    def eof_received(self) -> bool:
        return False  # the transport closes itself: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(exc or EOFError("the peer closed the connection"))

    async def read(self) -> Frame:
        """The next frame; EOFError / ConnectionError once the connection is gone."""
        while not self._frames:
            if self._lost is not None:
                raise self._lost
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._frames.popleft()

    def write(self, kind_or_status: int, body: Buffer, rows: Buffer = b"") -> None:
        """Send a frame. `rows` may be a view of a tensor's memory: asyncio sends what the
        socket takes at once and keeps the rest (a copy, or the view itself on newer Pythons):
        the tensor must not change after it is written."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the lane connection is closed")
        header = HEADER.pack(kind_or_status, len(body), len(rows))
        if len(body) + len(rows) <= SCRATCH_BYTES:  # one send: joining costs less than two
            self.transport.write(b"".join((header, body, rows)))
            return
        if len(body) <= SCRATCH_BYTES:
            self.transport.write(header + body)
        else:
            self.transport.write(header)
            self.transport.write(body)
        if len(rows):
            self.transport.write(rows)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _lose(self, error: Exception) -> None:
        if self._lost is None:
            self._lost = error
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


_capped_logged = False


def grow_buffers(sock: socket.socket) -> None:
    """Ask for socket buffers that hold a round's feature rows (3 MB at an 8B head's width), so
    that a frame goes in one send instead of one send a kernel-default buffer (~200 KB), each
    waiting for the peer to read: 1.6 -> 0.8 ms a 3 MB hop between two processes on the
    2-core VM (bench/lane_rows.py --echo-process). The kernel caps the size at
    net.core.wmem_max / rmem_max (said once in the log when that is less)."""
    global _capped_logged
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
    with contextlib.suppress(OSError):
        granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)  # Linux: twice the size
        if granted < SOCKET_BUFFER_BYTES and not _capped_logged:
            _capped_logged = True
            log.info(
                "round lane: %d-byte socket buffers (asked %d): raise net.core.wmem_max and "
                "net.core.rmem_max for a round's feature rows in one send",
                granted,
                SOCKET_BUFFER_BYTES,
            )


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)
