"""The Drafter gRPC service: protobuf in -> DrafterEngine on its thread -> protobuf out."""

from __future__ import annotations

from typing import Any

import grpc

from drafter.engine import DrafterEngine
from specsplit import metrics, rounds
from specsplit.engine_servicer import EngineServicer
from specsplit.server import service_name
from specsplit.v1 import drafter_pb2, drafter_pb2_grpc


class DrafterServicer(EngineServicer[DrafterEngine], drafter_pb2_grpc.DrafterServicer):
    name = "drafter"
    service_name = service_name(drafter_pb2.DESCRIPTOR, "Drafter")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        metrics.watch_rule_rows(self._rule_rows_bytes)

    def register(self, server: grpc.aio.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(self, server)

    def _rule_rows_bytes(self) -> int:
        """The rule tables' bytes (0 while loading, or before a request with rules made them;
        drafter/draft_rules.py). Read from the metrics thread."""
        engine = self.engine.loaded
        tables = None if engine is None else getattr(engine.proposer, "rule_tables", None)
        return 0 if tables is None else int(tables.nbytes)

    # DraftRequest in -> DrafterEngine.draft -> DraftResponse out, one per request, in order
    round_call = (rounds.DRAFT, DrafterEngine.draft)
    DraftStream = EngineServicer.round_stream

    def rows_buffer(self, num_bytes: int) -> bytearray | memoryview:
        """Where a Draft's rows are read on the lane: the engine's choice once it is loaded
        (`DrafterEngine.rows_buffer`: page-locked on a GPU)."""
        engine = self.engine.loaded
        return bytearray(num_bytes) if engine is None else engine.rows_buffer(num_bytes)
