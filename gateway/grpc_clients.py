"""The gateway's clients of the drafter and verifier over gRPC (gateway/clients.py protocols).

Each client keeps long-lived bidi streams to its service and runs one round at a time on each:
write one request, read one response (DESIGN.md §4: a stream round trip is ~2.5x cheaper than a
unary call). One stream serves a client with one round in flight; rounds in flight at once
(disjoint sequences) each take their own stream, up to MAX_ROUND_STREAMS, opened as needed and
kept. A broken stream is dropped and reopened by its next round. A service on a Unix socket is
reached on its round lane instead (specsplit.lane: the same messages as frames on a plain
socket, about half gRPC's round trip; a connection per round in flight likewise), health still
over gRPC. gRPC errors become ServiceError: INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED
pass through with the service's message, anything else (service down, stream broken, internal
error) is UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.health import Health
from specsplit import convert_beside, metrics, rounds, telemetry, wire_tensors
from specsplit.errors import Code, ServiceError, backend_error
from specsplit.lane import LaneConnection, lane_path
from specsplit.lane_frames import Kind, new_token
from specsplit.messages import (
    DraftInput,
    DraftOutput,
    NextTrees,
    Truncated,
    Truncation,
    VerifyInput,
    VerifyOutput,
)
from specsplit.pool import Pool
from specsplit.rounds import In, Out, RoundRpc
from specsplit.scopes import SCOPE_METADATA
from specsplit.server import CHANNEL_OPTIONS
from specsplit.tls import TLSFiles, channel
from specsplit.v1 import common_pb2, verifier_pb2

log = logging.getLogger(__name__)


CONNECT_TIMEOUT_S = 2.0  # opening a round stream waits at most this long for a connection
HEALTH_TIMEOUT_S = 1.0  # a health check that takes longer counts as no answer
MAX_ROUND_STREAMS = 4  # a client's rounds in flight at once on gRPC, one stream each

Req = TypeVar("Req")
Resp = TypeVar("Resp")
M = TypeVar("M", bound=Message)  # a unary call's response message


def service_error(err: grpc.aio.AioRpcError, service: str) -> ServiceError:
    return backend_error(service, err.code().name, err.details() or "")


class RoundStream(Generic[Req, Resp]):
    """One bidi stream used as a request/response pipe, lent to one round at a time (a
    StreamClient's `Pool`): opened on first use, dropped when a round on it broke or was
    cancelled, reopened by its next round."""

    def __init__(
        self,
        service: str,
        open_call: Callable[[], grpc.aio.StreamStreamCall],
        connect: Callable[[], Awaitable[bool]],
    ) -> None:
        self.service = service
        self._open_call = open_call
        self._connect = connect
        self._call: grpc.aio.StreamStreamCall | None = None

    @property
    def is_open(self) -> bool:
        return self._call is not None

    async def round(self, request: Req) -> Resp:
        if self._call is not None and self._call.done():  # ended between rounds
            self._drop()
        if self._call is None:
            # a stream opened on a channel still connecting can wait forever on its first
            # write: wait (bounded) for the channel to be READY, failing fast when it is not
            if not await self._connect():
                raise ServiceError(Code.UNAVAILABLE, f"{self.service}: not reachable")
            self._call = self._open_call()
        call = self._call
        try:
            await call.write(request)
            response = await call.read()
        except grpc.aio.AioRpcError as err:
            self._drop()
            raise service_error(err, self.service) from err
        except asyncio.InvalidStateError:  # the call ended under us ("RPC already finished")
            self._drop()
            code, details = await call.code(), await call.details()
            raise ServiceError(
                Code.UNAVAILABLE, f"{self.service}: stream ended: {code.name}: {details}"
            ) from None
        except BaseException:  # cancelled mid-round: the answer would pair with the next
            self._drop()
            raise
        if response is grpc.aio.EOF:
            self._drop()
            raise ServiceError(Code.UNAVAILABLE, f"{self.service}: the stream ended")
        return response  # type: ignore[no-any-return]

    def close(self) -> None:
        self._drop()

    def _drop(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


class StreamClient(Generic[In, Out]):
    """A service's client: a lazily opened channel (aio channels belong to the event loop that
    first uses them), its round streams (one per round in flight), Release and health. tls: the
    gateway's client certificate and the CA of the service's (mutual TLS), or none."""

    rpc: RoundRpc[In, Out]  # the service's round (the subclasses': DRAFT, VERIFY)

    def __init__(
        self,
        address: str,
        tls: TLSFiles | None = None,
        round_lane: bool = True,
        lane_poll_s: float = 0.0,
    ) -> None:
        """round_lane: rounds, Release and Truncate on the service's round lane
        (specsplit.lane) when `address` is a Unix socket; off: all on gRPC. lane_poll_s: how
        long the event loop polls for a lane's answer before sleeping (0 = not at all)."""
        self.service = self.rpc.service
        self.address = address
        self.tls = tls or TLSFiles()
        # the client's scope on the service, whichever stream or connection carries a call
        # (specsplit.scopes): the lane's HELLO, the gRPC calls' metadata
        self.token = new_token()
        self._metadata = ((SCOPE_METADATA, self.token.hex()),)
        self._channel: grpc.aio.Channel | None = None
        self.streams: Pool[RoundStream[Any, Any]] = Pool(
            lambda: RoundStream(self.service, self._open, self._connect), MAX_ROUND_STREAMS
        )
        path = lane_path(address) if round_lane and not self.tls.enabled else None
        self.lane = None
        if path is not None:
            self.lane = LaneConnection(self.service, path, lane_poll_s, token=self.token)
        self.last_engine_seconds = 0.0  # the engine time of the last round, as reported
        self.last_device_seconds = 0.0  # and its device time (the verifier's on a GPU; 0: none)
        # a round's histograms, labelled once: a child's lookup costs about what its
        # observation does, on the path between the drafter's answer and the next round
        self._overhead_seconds = metrics.RPC_OVERHEAD_SECONDS.labels(self.service)
        self._stage_seconds = [
            metrics.RPC_STAGE_SECONDS.labels(self.service, stage) for stage in metrics.RPC_STAGES
        ]
        # on the round's span too: "specsplit.verifier_rpc.request_ns", ...
        self._stage_spans = [
            f"specsplit.{self.service}_rpc.{stage}_ns" for stage in metrics.RPC_STAGES
        ]

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = channel(self.address, self.tls, CHANNEL_OPTIONS)
        return self._channel

    async def round(self, inputs: list[In]) -> list[Out]:
        """One round on an idle stream (or lane connection): inputs out, outputs back, timed
        and traced. Rounds in flight at once must name disjoint sequences."""
        start = time.perf_counter_ns()
        beside = wire_tensors.Beside()  # on the lane a round's rows go beside its messages
        request = self.rpc.request_to_proto(inputs, None if self.lane is None else beside)
        telemetry.inject(request.trace_context)  # the round span: parent of the service's span
        lane_stamps = None  # (sent, answer read, task resumed): the gateway's side of the stages
        with metrics.timed(self.rpc.seconds):
            if self.lane is None:
                async with self.streams.lent() as stream:
                    response = await stream.round(request)
                rows = None
            else:
                body = request.SerializeToString()
                sent = time.perf_counter_ns()
                answer = await self.lane.request(Kind.ROUND, body, beside.data())
                lane_stamps = (sent, answer.read_ns, time.perf_counter_ns())
                response = self.rpc.response_type.FromString(answer.body)
                rows = answer.rows
        outputs = self.rpc.response_from_proto(response, rows)
        end = time.perf_counter_ns()
        engine_ns = self.rpc.engine_ns(response)
        self.last_engine_seconds = engine_ns / 1e9
        self.last_device_seconds = self.rpc.device_ns(response) / 1e9
        self._overhead_seconds.observe(max(end - start - engine_ns, 0) / 1e9)
        if lane_stamps is not None and response.received_ns and response.answered_ns:
            sent, read, resumed = lane_stamps
            received, answered = response.received_ns, response.answered_ns
            self._observe_stages((start, sent, received, answered, read, resumed, end))
        return outputs

    def _observe_stages(self, stamps: tuple[int, ...]) -> None:
        """The lane round's stages (metrics.RPC_STAGES) between its seven stamps in time order:
        started, sent, received, answered (the service's: the same clock on the one host a
        Unix socket joins), answer read, round task resumed, converted."""
        stages = [max(end - begin, 0) for begin, end in itertools.pairwise(stamps)]
        for histogram, ns in zip(self._stage_seconds, stages, strict=True):
            histogram.observe(ns / 1e9)
        if telemetry.enabled():
            telemetry.annotate(dict(zip(self._stage_spans, stages, strict=True)))

    async def release(self, seq_ids: list[str]) -> None:
        if not seq_ids:
            return
        request = common_pb2.ReleaseRequest(seq_ids=seq_ids)
        await self._unary(Kind.RELEASE, "Release", request, common_pb2.ReleaseResponse)

    async def truncate(self, items: list[Truncation]) -> list[Truncated]:
        """Keep a prefix of each sequence (a session's turn boundary)."""
        if not items:
            return []
        request = convert_beside.truncate_request_to_proto(items)
        response = await self._unary(
            Kind.TRUNCATE, "Truncate", request, common_pb2.TruncateResponse
        )
        return convert_beside.truncate_response_from_proto(response)

    async def _unary(self, kind: Kind, method: str, request: Message, response_type: type[M]) -> M:
        """One request and its answer: a frame of `kind` on the round lane when there is one,
        else the unary gRPC `method` (its errors as ServiceError)."""
        if self.lane is not None:
            answer = await self.lane.request(kind, request.SerializeToString())
            return response_type.FromString(answer.body)
        try:
            response: M = await getattr(self.rpc.stub(self.channel), method)(
                request, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as err:
            raise service_error(err, self.service) from err
        return response

    async def health(self) -> Health:
        """The service's health over this client's channel (its credentials, its address)."""
        status = await health_status(self.channel, "", HEALTH_TIMEOUT_S)
        if status is None:
            return Health.DOWN
        serving = status == health_pb2.HealthCheckResponse.SERVING
        return Health.SERVING if serving else Health.LOADING

    async def close(self) -> None:
        self.streams.close()
        if self.lane is not None:
            self.lane.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _open(self) -> grpc.aio.StreamStreamCall:
        return getattr(self.rpc.stub(self.channel), self.rpc.stream)(metadata=self._metadata)

    async def _connect(self) -> bool:
        """Whether the channel is (or within CONNECT_TIMEOUT_S becomes) READY; False at once
        when connecting failed (TRANSIENT_FAILURE: the backend is down or refusing)."""
        ready, failed = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        state = self.channel.get_state(try_to_connect=True)
        while state not in (ready, failed):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.channel.wait_for_state_change(state), left)
            except TimeoutError:
                return False
            state = self.channel.get_state(try_to_connect=True)
        return state == ready


class GrpcDrafterClient(StreamClient[DraftInput, DraftOutput]):
    rpc = rounds.DRAFT

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        return await self.round(inputs)


class GrpcVerifierClient(StreamClient[VerifyInput, VerifyOutput]):
    rpc = rounds.VERIFY

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        return await self.round(inputs)

    async def hint(self, hints: list[NextTrees]) -> None:
        """On the lane when there is one (another connection than the round's in flight),
        else the unary Hint."""
        if not hints:
            return
        request = convert_beside.hint_to_proto(hints)
        await self._unary(Kind.HINT, "Hint", request, verifier_pb2.VerifyHintResponse)


async def health_status(
    channel: grpc.aio.Channel, service: str = "", timeout: float = 1.0
) -> int | None:
    """The service's HealthCheckResponse.ServingStatus, or None when it does not answer."""
    try:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.aio.AioRpcError:
        return None
    return int(response.status)


async def wait_ready(
    address: str,
    timeout: float | None,
    *,
    service: str = "",
    interval: float = 0.2,
    tls: TLSFiles | None = None,
) -> bool:
    """Poll `address`'s health until `service` ("" = the server) is SERVING: True, or False
    once `timeout` seconds (None = forever) have passed. tls: as the service's clients connect."""
    deadline = None if timeout is None else time.monotonic() + timeout
    async with channel(address, tls or TLSFiles(), CHANNEL_OPTIONS) as health_channel:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            check_timeout = 1.0 if left is None else max(min(1.0, left), 0.01)
            status = await health_status(health_channel, service, check_timeout)
            if status == health_pb2.HealthCheckResponse.SERVING:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(interval)
