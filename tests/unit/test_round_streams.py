"""Several rounds in flight on one gateway client: each takes its own round stream (gRPC) or
lane connection (specsplit.lane) from the client's pool, opened as needed, all in the client's
one sequence-id scope on the service. Named invariants: rounds in flight at once answer what
they answer one after the other; one round at a time keeps to one stream; a sequence made on one
stream is found by a round on another; a cancelled round drops its own stream only; a round
past the cap waits for a stream given back; close() ends every stream, and the service frees
what they held. Each on the lane, on gRPC over the Unix socket and on gRPC over TCP (where the
service scopes by the TCP connection); two clients on one service have a scope each, known by
their tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.grpc_clients import GrpcVerifierClient
from specsplit.messages import Truncation, VerifyInput
from specsplit.pool import Pool
from specsplit.server import ServiceHost
from specsplit.tree import DraftTree
from tests.support import save_tiny_llama
from tests.unit.test_lane import (
    OTHER_PROMPT,
    PROMPT,
    _decode,
    _engine,
    _next,
    _until,
    _with_verifier,
)

TRANSPORTS = pytest.mark.parametrize("transport", ["lane", "grpc", "grpc-tcp"])

Body = Callable[[ServiceHost, GrpcVerifierClient, Pool[Any]], Awaitable[list[str]]]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("round_streams") / "target", seed=4)


def _with_client(target: Path, tmp_path: Path, transport: str, body: Body) -> None:
    """Run `body(host, client, pool)` with a verifier client on `transport` (`pool`: the
    client's round streams, or its lane connections when it takes the lane), then release the
    sequences it returns: the service holds no KV after."""

    async def run(host: ServiceHost, address: str) -> None:
        client = GrpcVerifierClient(address, round_lane=transport == "lane")
        assert (client.lane is not None) == (transport == "lane")
        try:
            pool = client.streams if client.lane is None else client.lane.sockets
            await client.release(await body(host, client, pool))
            assert _engine(host).num_pages_used == 0
        finally:
            await client.close()

    _with_verifier(target, tmp_path, run, tcp=transport == "grpc-tcp")


def _prefill(seq_id: str, prompt: list[int]) -> VerifyInput:
    return VerifyInput(seq_id, True, 0, prompt, DraftTree())


@TRANSPORTS
def test_two_rounds_in_flight_answer_what_they_answer_one_after_the_other(
    target: Path, tmp_path: Path, transport: str
) -> None:
    async def body(host: ServiceHost, client: GrpcVerifierClient, pool: Pool[Any]) -> list[str]:
        one_after_the_other = [
            await _decode(client, "a", 4),
            await _decode(client, "b", 4, OTHER_PROMPT),
        ]
        assert one_after_the_other[0] != one_after_the_other[1]  # a swap would show
        assert len(pool.items) == 1  # one round at a time: one stream, reused
        at_once = await asyncio.gather(
            _decode(client, "c", 4), _decode(client, "d", 4, OTHER_PROMPT)
        )
        assert at_once == one_after_the_other
        assert len(pool.items) == 2 and all(item.is_open for item in pool.items)
        return ["a", "b", "c", "d"]

    _with_client(target, tmp_path, transport, body)


@TRANSPORTS
def test_a_sequence_made_on_one_stream_is_found_by_a_round_on_another(
    target: Path, tmp_path: Path, transport: str
) -> None:
    async def body(host: ServiceHost, client: GrpcVerifierClient, pool: Pool[Any]) -> list[str]:
        expected = await _decode(client, "ref", 1)
        (made,) = await client.verify([_prefill("s", PROMPT)])
        busy = await pool.take()  # the stream "s" was made on: the next round opens another
        try:
            (found,) = await client.verify([_next("s", made)])
            (kept,) = await client.truncate([Truncation("s", len(PROMPT))])
        finally:
            pool.give(busy)
        assert len(pool.items) == 2
        assert [made.bonus_token, *found.accepted_tokens, found.bonus_token] == expected
        assert kept.found and kept.kv_committed_len == len(PROMPT)
        return ["s", "ref"]

    _with_client(target, tmp_path, transport, body)


@TRANSPORTS
def test_a_cancelled_round_drops_only_its_own_stream_and_the_client_goes_on(
    target: Path, tmp_path: Path, transport: str
) -> None:
    async def body(host: ServiceHost, client: GrpcVerifierClient, pool: Pool[Any]) -> list[str]:
        expected = await _decode(client, "ref", 1, OTHER_PROMPT)
        (a,), (b,) = await asyncio.gather(
            client.verify([_prefill("a", PROMPT)]), client.verify([_prefill("b", OTHER_PROMPT)])
        )
        assert len(pool.items) == 2
        cancelled = asyncio.create_task(client.verify([_next("a", a)]))
        answered = asyncio.create_task(client.verify([_next("b", b)]))
        await asyncio.sleep(0)  # each has taken a stream and waits for its answer
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        (b_next,) = await answered
        assert [b.bonus_token, *b_next.accepted_tokens, b_next.bonus_token] == expected
        assert sorted(item.is_open for item in pool.items) == [False, True]
        assert await _decode(client, "c", 1, OTHER_PROMPT) == expected  # it goes on
        assert len(pool.items) == 2
        return ["a", "b", "c", "ref"]  # "a"'s cancelled round: run before the release or refused

    _with_client(target, tmp_path, transport, body)


@TRANSPORTS
def test_a_round_past_the_cap_waits_for_a_stream_given_back(
    target: Path, tmp_path: Path, transport: str
) -> None:
    async def body(host: ServiceHost, client: GrpcVerifierClient, pool: Pool[Any]) -> list[str]:
        expected = await _decode(client, "ref", 0)
        held = [await pool.take() for _ in range(pool.cap)]  # all lent: as many rounds in flight
        waiting = asyncio.create_task(client.verify([_prefill("w", PROMPT)]))
        await asyncio.sleep(0)  # it has asked for a stream
        assert len(pool.items) == pool.cap and not waiting.done()  # none made past the cap
        for item in held:
            pool.give(item)
        (out,) = await waiting
        assert [out.bonus_token] == expected and len(pool.items) == pool.cap
        return ["w", "ref"]

    _with_client(target, tmp_path, transport, body)


@TRANSPORTS
def test_close_ends_every_stream_and_the_service_frees_what_they_held(
    target: Path, tmp_path: Path, transport: str
) -> None:
    async def body(host: ServiceHost, client: GrpcVerifierClient, pool: Pool[Any]) -> list[str]:
        await asyncio.gather(_decode(client, "a", 1), _decode(client, "b", 1, OTHER_PROMPT))
        assert len(pool.items) == 2 and all(item.is_open for item in pool.items)
        assert _engine(host).num_pages_used > 0
        await client.close()
        assert not any(item.is_open for item in pool.items)
        # the scope's last stream is gone: its orphan grace frees the sequences
        await _until(lambda: _engine(host).num_pages_used == 0)
        assert not _engine(host).seqs
        return []

    _with_client(target, tmp_path, transport, body)


@TRANSPORTS
def test_two_clients_on_one_service_have_a_scope_each(
    target: Path, tmp_path: Path, transport: str
) -> None:
    """Each client sends its own token (the lane's HELLO, gRPC metadata): on a Unix socket,
    where every gRPC peer is "unix:", two gateways still cannot see each other's sequences, and
    one client's lane and gRPC calls reach the same scope."""

    async def run(host: ServiceHost, address: str) -> None:
        lane = transport == "lane"
        first = GrpcVerifierClient(address, round_lane=lane)
        second = GrpcVerifierClient(address, round_lane=lane)
        try:
            (a,) = await first.verify([_prefill("s", PROMPT)])
            (b,) = await second.verify([_prefill("s", OTHER_PROMPT)])  # the same id: no clash
            assert len(_engine(host).seqs) == 2
            (gone,) = await second.truncate([Truncation("x", 1)])
            assert not gone.found  # nothing of the first client's is the second's to name
            await second.release(["s"])
            (still,) = await first.verify([_next("s", a)])
            assert still.kv_committed_len == a.kv_committed_len + 1
            if lane:  # the same client on gRPC (no lane) is in the same scope
                assert first.lane is not None
                first.lane = None
                (kept,) = await first.truncate([Truncation("s", len(PROMPT))])
                assert kept.found and kept.kv_committed_len == len(PROMPT)
            await first.release(["s"])
            assert _engine(host).num_pages_used == 0 and b.kv_committed_len == len(OTHER_PROMPT)
        finally:
            await first.close()
            await second.close()

    _with_verifier(target, tmp_path, run, tcp=transport == "grpc-tcp")
