"""The Drafter gRPC service: protobuf in -> DrafterEngine on its thread -> protobuf out."""

from __future__ import annotations

import grpc

from drafter.engine import DrafterEngine
from specsplit import rounds
from specsplit.engine_servicer import EngineServicer
from specsplit.server import service_name
from specsplit.v1 import drafter_pb2, drafter_pb2_grpc


class DrafterServicer(EngineServicer[DrafterEngine], drafter_pb2_grpc.DrafterServicer):
    name = "drafter"
    service_name = service_name(drafter_pb2.DESCRIPTOR, "Drafter")

    def register(self, server: grpc.aio.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(self, server)

    # DraftRequest in -> DrafterEngine.draft -> DraftResponse out, one per request, in order
    round_call = (rounds.DRAFT, DrafterEngine.draft)
    DraftStream = EngineServicer.round_stream

    def rows_buffer(self, num_bytes: int) -> bytearray | memoryview:
        """Where a Draft's rows are read on the lane: the engine's choice once it is loaded
        (`DrafterEngine.rows_buffer`: page-locked on a GPU)."""
        engine = self.engine.loaded
        return bytearray(num_bytes) if engine is None else engine.rows_buffer(num_bytes)
