"""The Drafter gRPC service: protobuf in -> DrafterEngine on its thread -> protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from drafter.engine import DrafterEngine
from specsplit import convert, metrics, telemetry
from specsplit.messages import DraftInput, DraftOutput
from specsplit.scopes import ORPHAN_GRACE_S
from specsplit.server import EngineServicer, service_errors, service_name
from specsplit.v1 import drafter_pb2, drafter_pb2_grpc


class DrafterServicer(EngineServicer[DrafterEngine], drafter_pb2_grpc.DrafterServicer):
    service_name = service_name(drafter_pb2.DESCRIPTOR, "Drafter")

    def __init__(
        self, load: Callable[[], DrafterEngine], orphan_grace_s: float = ORPHAN_GRACE_S
    ) -> None:
        super().__init__("drafter", load, orphan_grace_s)

    def register(self, server: grpc.aio.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(self, server)

    async def DraftStream(
        self,
        request_iterator: AsyncIterator[drafter_pb2.DraftRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[drafter_pb2.DraftResponse]:
        """One DraftResponse per DraftRequest, in order; a refused round ends the
        stream. Sequence ids are this connection's own (specsplit.scopes)."""
        async with service_errors(context), self.scopes.stream(context.peer()) as scope:
            async for request in request_iterator:
                inputs = scope.enter(convert.draft_request_from_proto(request))
                with telemetry.service_span("specsplit.draft", request) as span:
                    outputs, draft_ns = await self.engine.run_timed(_draft, inputs)
                    span.set_attribute("specsplit.draft_ns", draft_ns)
                metrics.DRAFT_SECONDS.observe(draft_ns / 1e9)
                yield convert.draft_response_to_proto(scope.leave(outputs), draft_ns)


def _draft(engine: DrafterEngine, inputs: list[DraftInput]) -> list[DraftOutput]:
    return engine.draft(inputs)
