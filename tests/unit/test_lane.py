"""The round lane (specsplit.lane): a service on a Unix socket serves the gateway's rounds,
Release and Truncate as frames on a plain socket beside its gRPC socket. Named invariants: a
round on the lane answers what the same round on gRPC does; a refusal carries the service's
status and leaves the connection usable; a client that reconnects keeps its sequences, and no
other client can name them; Release, Truncate and a client gone for its orphan grace free the
KV; a stopped or absent service is UNAVAILABLE."""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from drafter.engine import DrafterEngine
from drafter.servicer import DrafterServicer
from gateway.grpc_clients import GrpcVerifierClient
from specsplit import convert, wire_tensors
from specsplit.errors import Code, ServiceError
from specsplit.lane import LoopPoll, lane_path
from specsplit.lane_frames import (
    HEADER,
    MAX_FRAME_BYTES,
    SCRATCH_BYTES,
    SOCKET_BUFFER_BYTES,
    STATUS,
    Frame,
    FrameStream,
    Kind,
    new_token,
)
from specsplit.messages import Truncation, VerifyInput, VerifyOutput
from specsplit.metrics import RPC_STAGES
from specsplit.scopes import client_key
from specsplit.server import ServiceHost
from specsplit.tree import DraftTree
from tests.support import save_tiny_llama
from verifier.engine import VerifierEngine
from verifier.rounds import Launched
from verifier.servicer import VerifierServicer

PROMPT = list(range(10, 30))


def frame(kind_or_status: int, body: bytes, rows: bytes = b"") -> bytes:
    """A frame's bytes as the wire has them, written by hand (a client apart from FrameStream)."""
    return HEADER.pack(kind_or_status, len(body), len(rows)) + body + rows


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    kind, body_len, rows_len = HEADER.unpack(await reader.readexactly(HEADER.size))
    return kind, await reader.readexactly(body_len), await reader.readexactly(rows_len)


OTHER_PROMPT = list(range(40, 57))  # another sequence's, answered differently


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("lane") / "target", seed=4)


def _with_verifier(
    target: Path,
    tmp_path: Path,
    body: Callable[[ServiceHost, str], Awaitable[None]],
    tcp: bool = False,
    calls_on_loop: bool = False,
    idle_poll_s: float = 0.0,
) -> None:
    """Run `body(host, address)` against a verifier service on a Unix socket (or on TCP).
    calls_on_loop: its engine's calls on the event loop, rounds pipelined (as on a GPU);
    idle_poll_s: its loop polling the lane after each answer (--idle-poll-ms)."""
    address = "127.0.0.1:0" if tcp else f"unix:{tmp_path}/verifier.sock"

    async def run() -> None:
        servicer = VerifierServicer(
            lambda: VerifierEngine.load(str(target), num_pages=64),
            orphan_grace_s=0.2,
            calls_on_loop=calls_on_loop,
            idle_poll_s=idle_poll_s,
        )
        host = ServiceHost(servicer, address, grace=0.1)
        await host.start()
        await host.load()
        try:
            await body(host, host.where)
        finally:
            await host.stop()

    asyncio.run(run())


def _engine(host: ServiceHost) -> VerifierEngine:
    engine = host.servable.engine.loaded  # type: ignore[attr-defined]
    assert engine is not None
    return engine  # type: ignore[no-any-return]


async def _decode(
    client: GrpcVerifierClient, seq_id: str, rounds: int, prompt: list[int] = PROMPT
) -> list[int]:
    """A prefill, then `rounds` one-token rounds with a one-node draft; the tokens it got."""
    (out,) = await client.verify([VerifyInput(seq_id, True, 0, prompt, DraftTree())])
    tokens = [out.bonus_token]
    for _ in range(rounds):
        (out,) = await client.verify([_next(seq_id, out)])
        tokens += [*out.accepted_tokens, out.bonus_token]
    return tokens


def _next(seq_id: str, out: VerifyOutput) -> VerifyInput:
    """The round after `out`: its bonus token, drafted as a one-node tree."""
    tree = DraftTree([out.bonus_token], [-1])
    return VerifyInput(seq_id, False, out.kv_committed_len, [out.bonus_token], tree)


async def _until(condition: Callable[[], bool]) -> None:
    """Wait for what the service does when a connection goes (it sees the end, then acts)."""
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("poll_s", [0.0, 0.005], ids=["sleeping", "polling"])
def test_rounds_on_the_lane_answer_what_rounds_on_grpc_do(
    target: Path, tmp_path: Path, poll_s: float
) -> None:
    """Either end's loop asleep between frames, or polling (the client after its request, the
    service after its answer, `LoopPoll`): the same answers, and the polling stops."""

    async def body(host: ServiceHost, address: str) -> None:
        lane = GrpcVerifierClient(address, lane_poll_s=poll_s)
        grpc_only = GrpcVerifierClient(address, round_lane=False)
        assert lane.lane is not None and grpc_only.lane is None
        assert os.path.exists(lane_path(address) or "")
        client_poll = lane.lane.poll
        service_poll = host.servable.lane.poll  # type: ignore[attr-defined]
        try:
            assert await _decode(lane, "a", 6) == await _decode(grpc_only, "a", 6)
            assert lane.last_engine_seconds > 0
            await lane.release(["a"])
            await grpc_only.release(["a"])
            assert _engine(host).num_pages_used == 0
            assert (client_poll.passes > 0) == (service_poll.passes > 0) == (poll_s > 0)
            await _until(lambda: client_poll.loop is None and service_poll.loop is None)
        finally:
            await lane.close()
            await grpc_only.close()

    _with_verifier(target, tmp_path, body, idle_poll_s=poll_s)


def test_a_loop_poll_keeps_the_loop_awake_until_its_deadline_and_other_tasks_running() -> None:
    """LoopPoll: each extend moves the deadline on; the loop's passes go on without a sleep
    while other tasks still run, and stop at the deadline; 0 never polls."""

    async def run() -> None:
        poll, never = LoopPoll(0.05), LoopPoll(0.0)
        never.extend()
        poll.extend()
        start = time.perf_counter()
        await asyncio.sleep(0.02)  # another task: it still wakes on time
        assert time.perf_counter() - start < 0.5
        poll.extend()  # the deadline moves to 50 ms from here
        passes = poll.passes
        await asyncio.sleep(0.03)
        assert poll.loop is not None and poll.passes > passes > 10
        await _until(lambda: poll.loop is None)
        assert time.perf_counter() - start >= 0.07
        stopped = poll.passes
        await asyncio.sleep(0.01)
        assert poll.passes == stopped and never.passes == 0 and never.loop is None

    asyncio.run(run())


def test_a_loop_poll_for_answers_stops_once_they_have_all_come() -> None:
    """The gateway's polling (`extend(until=answer)`) ends with its last answer, long before
    the deadline; an answer still out keeps it going."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        poll = LoopPoll(10.0)
        first, second = loop.create_future(), loop.create_future()
        poll.extend(until=first)
        poll.extend(until=second)
        await asyncio.sleep(0.01)
        first.set_result(None)
        await asyncio.sleep(0.01)
        assert poll.loop is not None  # the second answer is still out
        second.set_result(None)
        start = time.perf_counter()
        await _until(lambda: poll.loop is None)
        assert time.perf_counter() - start < 1.0 and poll.awaited == []

    asyncio.run(run())


def _stage_totals(service: str) -> dict[str, tuple[float, float]]:
    """(count, sum in seconds) of the gateway's RPC stages for `service`, by stage."""
    sample = REGISTRY.get_sample_value
    return {
        stage: (
            sample("specsplit_rpc_stage_seconds_count", {"service": service, "stage": stage}) or 0,
            sample("specsplit_rpc_stage_seconds_sum", {"service": service, "stage": stage}) or 0,
        )
        for stage in RPC_STAGES
    }


def test_a_lane_rounds_rpc_is_split_into_stages_that_add_up_to_it(
    target: Path, tmp_path: Path
) -> None:
    """On the lane (one host, one clock) each round's RPC is observed in its six stages from
    the service's stamps (received, answered) and the answer frame's read time between the
    gateway's own: together they are the round trip (within each call as the caller timed it,
    most of it in the median round: a pause of the host outside the stamps, a 2-core CI VM's,
    falls in one round), its service stage holds the engine call, and none is negative. Over
    gRPC (maybe another host) no stage is observed."""

    async def body(host: ServiceHost, address: str) -> None:
        lane = GrpcVerifierClient(address)
        grpc_only = GrpcVerifierClient(address, round_lane=False)
        try:
            await _decode(grpc_only, "g", 2)
            before = _stage_totals("verifier")
            covered, engine = [], 0.0  # each round's stages over its round trip
            items = [VerifyInput("a", True, 0, PROMPT, DraftTree())]
            for _ in range(6):  # a prefill, then five one-token rounds
                start = _stage_totals("verifier")
                begin = time.perf_counter()
                (out,) = await lane.verify(items)
                span = time.perf_counter() - begin
                end = _stage_totals("verifier")
                stages = sum(end[s][1] - start[s][1] for s in end)
                assert 0 <= stages <= span, (stages, span)
                covered.append(stages / span)
                engine += lane.last_engine_seconds
                items = [_next("a", out)]
            await _decode(grpc_only, "g2", 2)
            after = _stage_totals("verifier")
            grown = {s: (after[s][0] - before[s][0], after[s][1] - before[s][1]) for s in after}
            assert all(count == 6 for count, _ in grown.values()), grown  # lane rounds only
            assert set(grown) == set(RPC_STAGES) and len(RPC_STAGES) == 6
            assert all(seconds >= 0 for _, seconds in grown.values()), grown
            assert statistics.median(covered) > 0.5, covered
            assert grown["service"][1] >= engine
            for client, seq_id in ((lane, "a"), (grpc_only, "g"), (grpc_only, "g2")):
                await client.release([seq_id])
        finally:
            await lane.close()
            await grpc_only.close()

    _with_verifier(target, tmp_path, body)


def test_feature_rows_beside_a_lane_answer_equal_those_in_a_grpc_answer(
    target: Path, tmp_path: Path
) -> None:
    """The hidden-state rows travel beside the lane's message (wire_tensors.Beside), in the
    message on gRPC: the same rows either way, each sequence's own."""

    async def body(host: ServiceHost, address: str) -> None:
        lane = GrpcVerifierClient(address)
        grpc_only = GrpcVerifierClient(address, round_lane=False)
        try:
            answers = []
            for client, tag in ((lane, "l"), (grpc_only, "g")):
                inputs = [
                    VerifyInput(f"{tag}{i}", True, 0, prompt, DraftTree(), hidden_state_layers=h)
                    for i, (prompt, h) in enumerate(
                        [(PROMPT, (0, 1)), (OTHER_PROMPT, ()), (PROMPT[:7], (0, 1))]
                    )
                ]
                answers.append(await client.verify(inputs))
                await client.release([item.seq_id for item in inputs])
            for by_lane, by_grpc in zip(*answers, strict=True):
                assert by_lane.bonus_token == by_grpc.bonus_token
                if by_grpc.hidden_states is None:
                    assert by_lane.hidden_states is None
                else:
                    assert by_lane.hidden_states is not None
                    assert torch.equal(by_lane.hidden_states, by_grpc.hidden_states)
            assert answers[1][0].hidden_states.shape[0] == len(PROMPT)  # type: ignore[union-attr]
            assert _engine(host).num_pages_used == 0
        finally:
            await lane.close()
            await grpc_only.close()

    _with_verifier(target, tmp_path, body)


def test_a_refused_round_carries_the_services_status_and_the_lane_stays(
    target: Path, tmp_path: Path
) -> None:
    async def body(host: ServiceHost, address: str) -> None:
        client = GrpcVerifierClient(address)
        try:
            unknown = VerifyInput("nobody", False, 5, [1], DraftTree())
            with pytest.raises(ServiceError) as refused:
                await client.verify([unknown])
            assert refused.value.code == Code.NOT_FOUND
            assert "'nobody'" in refused.value.message and "/" not in refused.value.message
            twice = VerifyInput("x", True, 0, PROMPT, DraftTree())
            with pytest.raises(ServiceError) as bad:
                await client.verify([twice, twice])
            assert bad.value.code == Code.INVALID_ARGUMENT
            assert len(await _decode(client, "b", 2)) >= 3  # the same connection goes on
            await client.release(["b"])
        finally:
            await client.close()
        path = lane_path(address)
        assert path is not None
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(frame(Kind.HELLO, new_token()) + frame(9, b""))
        status, message, _ = await read_frame(reader)
        assert status == STATUS[Code.INVALID_ARGUMENT] and b"kind 9" in message
        writer.write(frame(Kind.ROUND, b"\xff\xff"))
        status, message, _ = await read_frame(reader)
        assert status == STATUS[Code.INVALID_ARGUMENT] and message.startswith(b"bad message")
        writer.write(frame(Kind.RELEASE, b"", rows=b"\0" * 8))
        status, message, _ = await read_frame(reader)
        assert status == STATUS[Code.INVALID_ARGUMENT] and b"rows beside" in message
        request = VerifyInput("r", True, 0, PROMPT, DraftTree())
        body = convert.verify_request_to_proto([request]).SerializeToString()
        writer.write(frame(Kind.ROUND, body, rows=b"\0" * 8))  # a Verify request has no rows
        status, message, rows = await read_frame(reader)
        assert status == STATUS[Code.INVALID_ARGUMENT] and b"carries no rows" in message
        assert rows == b""
        writer.close()

    _with_verifier(target, tmp_path, body)


def test_a_reconnecting_client_keeps_its_sequences_that_no_other_client_can_name(
    target: Path, tmp_path: Path
) -> None:
    async def body(host: ServiceHost, address: str) -> None:
        owner, other = GrpcVerifierClient(address), GrpcVerifierClient(address)
        try:
            await _decode(owner, "s", 1)
            used = _engine(host).num_pages_used
            assert used > 0
            assert owner.lane is not None
            owner.lane.close()  # the connection broke (a round cancelled mid-way does this)
            assert len(await _decode_more(owner, "s")) == 2  # same token: same scope
            await other.release(["s"])  # another client's "s" is not the owner's
            assert _engine(host).num_pages_used == used
            with pytest.raises(ServiceError) as unknown:
                await other.verify([VerifyInput("s", False, 21, [3], DraftTree())])
            assert unknown.value.code == Code.NOT_FOUND
            kept = await owner.truncate([Truncation("s", len(PROMPT))])
            assert kept[0].found and kept[0].kv_committed_len == len(PROMPT)
            await owner.release(["s"])
            assert _engine(host).num_pages_used == 0
        finally:
            await owner.close()
            await other.close()

    _with_verifier(target, tmp_path, body)


async def _decode_more(client: GrpcVerifierClient, seq_id: str) -> list[int]:
    """One more round of a sequence _decode prefilled with one round: ask the service where
    it stands by a Truncate that keeps everything, then verify the next token."""
    (kept,) = await client.truncate([Truncation(seq_id, 10**6)])
    assert kept.found
    item = VerifyInput(seq_id, False, kept.kv_committed_len, [7], DraftTree())
    (out,) = await client.verify([item])
    return [*out.accepted_tokens, out.bonus_token, out.kv_committed_len]


def test_a_scope_with_two_live_connections_starts_its_orphan_grace_when_the_last_goes(
    target: Path, tmp_path: Path
) -> None:
    async def body(host: ServiceHost, address: str) -> None:
        client = GrpcVerifierClient(address)
        assert client.lane is not None
        try:
            await asyncio.gather(_decode(client, "a", 1), _decode(client, "b", 1, OTHER_PROMPT))
            scope = host.servable.scopes.find(client_key(client.lane.token.hex()))  # type: ignore[attr-defined]
            assert scope is not None and scope.num_streams == 2  # two connections, one scope
            first, second = client.lane.sockets.items
            assert first.is_open and second.is_open
            first.close()
            await _until(lambda: scope.num_streams == 1)
            assert scope.free_task is None  # one connection still lives: no grace runs
            assert len(await _decode_more(client, "a")) == 2  # its sequences are all there
        finally:
            await client.close()
        await _until(lambda: scope.num_streams == 0)
        assert scope.free_task is not None  # the last one went: the grace runs
        await _until(lambda: _engine(host).num_pages_used == 0)
        assert not _engine(host).seqs

    _with_verifier(target, tmp_path, body)


def test_a_client_gone_for_its_orphan_grace_leaves_no_kv(target: Path, tmp_path: Path) -> None:
    async def body(host: ServiceHost, address: str) -> None:
        client = GrpcVerifierClient(address)
        await _decode(client, "gone", 2)
        assert _engine(host).num_pages_used > 0
        await client.close()
        for _ in range(100):
            if _engine(host).num_pages_used == 0:
                break
            await asyncio.sleep(0.05)
        assert _engine(host).num_pages_used == 0 and not _engine(host).seqs

    _with_verifier(target, tmp_path, body)


def test_a_stopped_or_absent_service_is_unavailable(target: Path, tmp_path: Path) -> None:
    async def body(host: ServiceHost, address: str) -> None:
        client = GrpcVerifierClient(address)
        try:
            await _decode(client, "c", 1)
            await host.stop()
            assert not os.path.exists(lane_path(address) or "")
            for _ in range(2):  # the broken connection, then no service to reconnect to
                with pytest.raises(ServiceError) as down:
                    await client.verify([VerifyInput("c", False, 22, [3], DraftTree())])
                assert down.value.code == Code.UNAVAILABLE
                assert down.value.message.startswith("verifier: ")
        finally:
            await client.close()
        engine = _engine(host)  # a stopped service's engine is gone with its process
        engine.release(list(engine.seqs))

    _with_verifier(target, tmp_path, body)


def test_lane_paths_sit_beside_unix_sockets_only() -> None:
    assert lane_path("unix:/tmp/a/verifier.sock") == "/tmp/a/verifier.sock.rounds"
    assert lane_path("unix:///tmp/a/v.sock") == "/tmp/a/v.sock.rounds"
    assert lane_path("127.0.0.1:50062") is None
    assert HEADER.size == 9


def test_a_lane_path_too_long_for_a_socket_fails_the_start_with_its_path(tmp_path: Path) -> None:
    """gRPC takes a socket path of up to 107 bytes; the lane's is 7 longer."""
    room = 104 - len(f"{tmp_path}//v.sock")
    if room < 1:
        pytest.skip("the temporary directory's path is too long already")
    deep = tmp_path / ("d" * room)
    deep.mkdir()
    address = f"unix:{deep}/v.sock"

    async def run() -> None:
        host = ServiceHost(VerifierServicer(lambda: None), address, grace=0.1)  # type: ignore[arg-type,return-value]
        try:
            with pytest.raises(OSError, match=r"round lane .*v\.sock\.rounds"):
                await host.start()
        finally:
            await host.stop()

    asyncio.run(run())


class _Transport(asyncio.Transport):
    """What a FrameStream's reads need of a transport: closing."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _feed(stream: FrameStream, data: bytes, chunk: int) -> None:
    """`data` as the socket would hand it over, at most `chunk` bytes a read (as many as the
    buffer the stream offers takes)."""
    at = 0
    while at < len(data):
        buffer = stream.get_buffer(-1)
        n = min(chunk, len(buffer), len(data) - at)
        buffer[:n] = data[at : at + n]
        stream.buffer_updated(n)
        at += n


@pytest.mark.parametrize("chunk", [1, 3, 5, 7, 9, 4096, 1 << 20])
def test_frames_split_anywhere_by_the_socket_come_out_whole_and_in_order(chunk: int) -> None:
    fits = SCRATCH_BYTES - HEADER.size  # the longest frame the scratch buffer holds whole
    frames = [
        (Kind.HELLO, new_token(), b""),
        (Kind.ROUND, b"", b""),
        (Kind.ROUND, os.urandom(SCRATCH_BYTES + 1000), b""),  # read into a buffer of its own
        (Kind.ROUND, b"msg", os.urandom(SCRATCH_BYTES + 77)),  # its rows into one of their own
        (Kind.ROUND, os.urandom(SCRATCH_BYTES + 5), os.urandom(SCRATCH_BYTES + 3)),  # both
        (Kind.ROUND, b"", os.urandom(100)),  # rows without a body
        (Kind.RELEASE, bytes(range(256)) * 9, b""),
        (Kind.TRUNCATE, os.urandom(fits), b""),
        (Kind.ROUND, os.urandom(fits - 10), os.urandom(10)),  # just fits with its rows
        (Kind.ROUND, os.urandom(fits + 1), b""),
        (Kind.ROUND, os.urandom(fits - 10), os.urandom(11)),  # a byte too long with its rows
        (Kind.ROUND, b"x", b"y"),
    ]
    stream = FrameStream()
    stream.connection_made(_Transport())
    _feed(stream, b"".join(frame(*f) for f in frames), chunk)

    async def read_all() -> list[tuple[int, bytes, bytes]]:
        read = [await stream.read() for _ in frames]
        return [(f.kind, bytes(f.body), bytes(f.rows)) for f in read]

    assert asyncio.run(read_all()) == frames


def test_a_long_frames_rows_land_in_the_buffer_the_stream_was_given() -> None:
    """`FrameStream(rows_buffer)`: a long frame's rows are read into a buffer it makes (the
    drafter's page-locked memory on a GPU), the bytes that came with the header included;
    rows that come whole in the scratch buffer stay a copy of their own."""
    made: list[memoryview] = []

    def rows_buffer(n: int) -> memoryview:
        made.append(memoryview(bytearray(n)))
        return made[-1]

    long_rows, short_rows = os.urandom(3 * SCRATCH_BYTES + 11), os.urandom(40)
    stream = FrameStream(rows_buffer)
    stream.connection_made(_Transport())
    data = frame(Kind.ROUND, b"body", long_rows) + frame(Kind.ROUND, b"short", short_rows)
    _feed(stream, data, 4096)

    async def read_two() -> tuple[Frame, Frame]:
        return await stream.read(), await stream.read()

    first, second = asyncio.run(read_two())
    assert len(made) == 1 and first.rows is made[0] and bytes(first.rows) == long_rows
    assert bytes(first.body) == b"body"
    assert isinstance(second.rows, bytearray) and bytes(second.rows) == short_rows


def test_a_frame_over_the_limit_or_a_lost_connection_ends_the_reads() -> None:
    stream = FrameStream()
    transport = _Transport()
    stream.connection_made(transport)
    _feed(stream, HEADER.pack(Kind.ROUND, MAX_FRAME_BYTES // 2, MAX_FRAME_BYTES // 2 + 1), 64)
    assert transport.closed
    with pytest.raises(ConnectionError, match="at most"):
        asyncio.run(stream.read())
    ended = FrameStream()
    ended.connection_made(_Transport())
    _feed(ended, frame(Kind.ROUND, b"abc", b"de") + HEADER.pack(Kind.ROUND, 10, 0), 64)
    ended.connection_lost(None)  # a frame cut short by the peer

    async def reads() -> None:
        whole = await ended.read()  # what came whole stays
        assert (whole.kind, whole.body, whole.rows) == (Kind.ROUND, b"abc", b"de")
        with pytest.raises(EOFError):
            await ended.read()

    asyncio.run(reads())


def test_a_large_frame_crosses_a_real_socket_both_ways(tmp_path: Path) -> None:
    """Several MB (a round's feature rows at an 8B target's width), each way, byte for byte,
    in a body and beside it (from a tensor's memory)."""
    body = os.urandom(3 << 20)
    rows = torch.randn(128, 12288).to(torch.bfloat16)
    rows_bytes = bytes(wire_tensors.tensor_bytes(rows))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        path = str(tmp_path / "s")
        echoes: list[asyncio.Task[None]] = []

        async def echo(stream: FrameStream) -> None:
            got_frame = await stream.read()
            got, got_rows = got_frame.body, got_frame.rows
            stream.write(0, got, got_rows)

        def accept() -> FrameStream:
            stream = FrameStream()
            echoes.append(loop.create_task(echo(stream)))
            return stream

        server = await loop.create_unix_server(accept, path)
        _, client = await loop.create_unix_connection(FrameStream, path)
        client.write(Kind.ROUND, body, wire_tensors.tensor_bytes(rows))
        answer_frame = await client.read()
        status, answer, answer_rows = answer_frame.kind, answer_frame.body, answer_frame.rows
        assert status == 0 and answer == body and answer_rows == rows_bytes
        back = torch.frombuffer(answer_rows, dtype=torch.bfloat16).reshape(rows.shape)
        assert torch.equal(back, rows)
        await echoes[0]
        client.close()
        server.close()
        await server.wait_closed()

    asyncio.run(run())


def test_both_ends_ask_for_socket_buffers_that_hold_a_rounds_rows(tmp_path: Path) -> None:
    """A round's feature rows go in one send where the kernel allows it: each end's socket
    buffers grow to what was asked, capped at net.core.wmem_max / rmem_max."""
    caps = [Path(f"/proc/sys/net/core/{name}") for name in ("wmem_max", "rmem_max")]
    if not all(cap.exists() for cap in caps):
        pytest.skip("no Linux socket buffer limits to read")
    send_cap, receive_cap = (int(cap.read_text()) for cap in caps)

    async def run() -> list[tuple[int, int]]:
        loop = asyncio.get_running_loop()
        path = str(tmp_path / "s")
        served: list[FrameStream] = []

        def accept() -> FrameStream:
            served.append(FrameStream())
            return served[-1]

        server = await loop.create_unix_server(accept, path)
        _, client = await loop.create_unix_connection(FrameStream, path)
        await asyncio.sleep(0.01)  # the server's end is made
        sizes = []
        for stream in (client, served[0]):
            assert stream.transport is not None
            sock = stream.transport.get_extra_info("socket")
            sizes.append(
                (
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
                )
            )
        client.close()
        server.close()
        await server.wait_closed()
        return sizes

    for send, receive in asyncio.run(run()):  # Linux reports twice the size granted
        assert send >= min(SOCKET_BUFFER_BYTES, send_cap)
        assert receive >= min(SOCKET_BUFFER_BYTES, receive_cap)


def test_a_drafter_on_a_gpu_reads_lane_rows_into_page_locked_memory_or_its_own_if_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`DrafterServicer.rows_buffer` (the lane's buffer for a Draft's rows): host memory of its
    own until the engine is loaded; then the engine's choice (`DrafterEngine.rows_buffer`):
    plain memory on the CPU, page-locked memory on the engine's GPU (`pinned_bytes`, here a
    stand-in that records its calls: this machine may have no GPU), and, once that allocation
    fails, plain memory from then on without asking again, so that the lane goes on reading."""
    servicer = DrafterServicer(lambda: DrafterEngine.load("ngram", None))
    assert isinstance(servicer.rows_buffer(8), bytearray)  # not loaded yet
    asyncio.run(servicer.load())
    engine = servicer.engine.loaded
    assert engine is not None and isinstance(servicer.rows_buffer(8), bytearray)  # on the CPU
    asked: list[tuple[int, torch.device]] = []

    def pinned(num_bytes: int, device: torch.device) -> memoryview:
        asked.append((num_bytes, device))
        if len(asked) > 1:
            raise RuntimeError("CUDA error: out of memory")
        return memoryview(bytearray(num_bytes))

    monkeypatch.setattr("drafter.engine.pinned_bytes", pinned)
    engine.proposer.device = torch.device("cuda", 1)
    assert isinstance(servicer.rows_buffer(16), memoryview)
    with caplog.at_level("WARNING"):
        assert isinstance(servicer.rows_buffer(32), bytearray)  # the allocation failed
    assert "no page-locked memory" in caplog.text
    assert isinstance(servicer.rows_buffer(64), bytearray)
    assert asked == [(16, torch.device("cuda", 1)), (32, torch.device("cuda", 1))]
    servicer.engine.close()


@pytest.mark.parametrize("round_lane", [True, False], ids=["lane", "grpc"])
def test_a_rounds_device_time_reaches_the_gateway_in_its_answer(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, round_lane: bool
) -> None:
    """The verifier's device time for a round (`Launched.device_ns`, CUDA events on a GPU;
    stood in here by a fixed time a part, the CPU having no device clock) goes into its
    VerifyResponse.device_ns and the gateway's client reads it (last_device_seconds), on the
    lane and on gRPC, and into the verifier's specsplit_verify_device_seconds (the GPU's busy
    time); with its engine calls on a thread the service measures none (0)."""
    monkeypatch.setattr(Launched, "device_ns", lambda self: 1_500_000)

    def device_histogram() -> tuple[float, float]:
        name = "specsplit_verify_device_seconds"
        count, total = (REGISTRY.get_sample_value(f"{name}_{part}") for part in ("count", "sum"))
        return count or 0.0, total or 0.0

    # engine calls on the loop (pipelined rounds, as on a GPU): one part a round; on a thread
    for on_loop, device_seconds in ((True, 1.5e-3), (False, 0.0)):

        async def body(host: ServiceHost, address: str, expected: float = device_seconds) -> None:
            client = GrpcVerifierClient(address, round_lane=round_lane)
            try:
                assert await _decode(client, "a", 2)
                assert client.last_device_seconds == pytest.approx(expected)
                assert client.last_engine_seconds > 0
                await client.release(["a"])
            finally:
                await client.close()

        count, total = device_histogram()
        _with_verifier(target, tmp_path, body, calls_on_loop=on_loop)
        rounds, seconds = (
            after - before for after, before in zip(device_histogram(), (count, total), strict=True)
        )
        assert rounds == (3 if on_loop else 0)  # `_decode`'s prefill and two rounds
        assert seconds == pytest.approx(rounds * device_seconds)
