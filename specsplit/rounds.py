"""Each engine service's round as both ends of its bidi stream see it: the stub, the stream
method, the four conversions and the latency histogram. The servicers run it with
`specsplit.engine_servicer.round_stream`, the gateway with `gateway.grpc_clients.StreamClient`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from prometheus_client import Histogram

from specsplit import convert, metrics, wire_tensors
from specsplit.messages import DraftInput, DraftOutput, VerifyInput, VerifyOutput
from specsplit.scopes import Keyed
from specsplit.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

In = TypeVar("In", bound=Keyed)  # a round's input: DraftInput / VerifyInput
Out = TypeVar("Out", bound=Keyed)  # a round's output: DraftOutput / VerifyOutput


@dataclass(frozen=True)
class RoundRpc(Generic[In, Out]):
    """One service's round: a request of inputs in, a response of outputs back."""

    service: str  # "drafter": in logs and error messages
    span: str  # the service's span, "specsplit.draft"; its engine time is "specsplit.draft_ns"
    stub: Callable[[grpc.aio.Channel], Any]  # the generated stub class, with Release
    stream: str  # the stub's bidi round method, "DraftStream"
    request_type: Any  # the request and response message classes (the round lane parses them)
    response_type: Any
    # the conversions; a message's feature rows beside it (wire_tensors.Beside) or in it (None)
    request_to_proto: Callable[[list[In], wire_tensors.Beside | None], Any]
    request_from_proto: Callable[[Any, bytearray | memoryview | None], list[In]]
    response_to_proto: Callable[[list[Out], int, wire_tensors.Beside | None], Any]  # engine ns
    response_from_proto: Callable[[Any, bytearray | memoryview | None], list[Out]]
    engine_ns: Callable[[Any], int]  # the engine time a response reports
    device_ns: Callable[[Any], int]  # and its device time (0: not measured)
    seconds: Histogram  # engine time on the service, round trip on the gateway


DRAFT: RoundRpc[DraftInput, DraftOutput] = RoundRpc(
    service="drafter",
    span="specsplit.draft",
    stub=drafter_pb2_grpc.DrafterStub,
    stream="DraftStream",
    request_type=drafter_pb2.DraftRequest,
    response_type=drafter_pb2.DraftResponse,
    request_to_proto=convert.draft_request_to_proto,
    request_from_proto=convert.draft_request_from_proto,
    response_to_proto=convert.draft_response_to_proto,
    response_from_proto=convert.draft_response_from_proto,
    engine_ns=lambda response: response.draft_ns,
    device_ns=lambda response: 0,
    seconds=metrics.DRAFT_SECONDS,
)

VERIFY: RoundRpc[VerifyInput, VerifyOutput] = RoundRpc(
    service="verifier",
    span="specsplit.verify",
    stub=verifier_pb2_grpc.VerifierStub,
    stream="VerifyStream",
    request_type=verifier_pb2.VerifyRequest,
    response_type=verifier_pb2.VerifyResponse,
    request_to_proto=convert.verify_request_to_proto,
    request_from_proto=convert.verify_request_from_proto,
    response_to_proto=convert.verify_response_to_proto,
    response_from_proto=convert.verify_response_from_proto,
    engine_ns=lambda response: response.verify_ns,
    device_ns=lambda response: response.device_ns,
    seconds=metrics.VERIFY_SECONDS,
)
