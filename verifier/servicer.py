"""The Verifier gRPC service: protobuf in -> VerifierEngine on its thread -> protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from specsplit import convert, metrics, telemetry
from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.scopes import ORPHAN_GRACE_S
from specsplit.server import EngineServicer, service_errors, service_name
from specsplit.v1 import verifier_pb2, verifier_pb2_grpc
from verifier.engine import VerifierEngine


class VerifierServicer(EngineServicer[VerifierEngine], verifier_pb2_grpc.VerifierServicer):
    service_name = service_name(verifier_pb2.DESCRIPTOR, "Verifier")

    def __init__(
        self, load: Callable[[], VerifierEngine], orphan_grace_s: float = ORPHAN_GRACE_S
    ) -> None:
        super().__init__("verifier", load, orphan_grace_s)

    def register(self, server: grpc.aio.Server) -> None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(self, server)

    async def VerifyStream(
        self,
        request_iterator: AsyncIterator[verifier_pb2.VerifyRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[verifier_pb2.VerifyResponse]:
        """One VerifyResponse per VerifyRequest, in order; a refused round ends the
        stream. Sequence ids are this connection's own (specsplit.scopes)."""
        async with service_errors(context), self.scopes.stream(context.peer()) as scope:
            async for request in request_iterator:
                inputs = scope.enter(convert.verify_request_from_proto(request))
                with telemetry.service_span("specsplit.verify", request) as span:
                    outputs, verify_ns = await self.engine.run_timed(_verify, inputs)
                    span.set_attribute("specsplit.verify_ns", verify_ns)
                metrics.VERIFY_SECONDS.observe(verify_ns / 1e9)
                yield convert.verify_response_to_proto(scope.leave(outputs), verify_ns)


def _verify(engine: VerifierEngine, inputs: list[VerifyInput]) -> list[VerifyOutput]:
    return engine.verify(inputs)
