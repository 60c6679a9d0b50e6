"""The Drafter gRPC service: protobuf in -> DrafterEngine on its thread -> protobuf out."""

from __future__ import annotations

import logging

import grpc

from drafter.engine import DrafterEngine
from specsplit import rounds
from specsplit.engine_servicer import EngineServicer
from specsplit.model.batch import pinned_bytes
from specsplit.server import service_name
from specsplit.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)


class DrafterServicer(EngineServicer[DrafterEngine], drafter_pb2_grpc.DrafterServicer):
    name = "drafter"
    service_name = service_name(drafter_pb2.DESCRIPTOR, "Drafter")

    def register(self, server: grpc.aio.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(self, server)

    # DraftRequest in -> DrafterEngine.draft -> DraftResponse out, one per request, in order
    round_call = (rounds.DRAFT, DrafterEngine.draft)
    DraftStream = EngineServicer.round_stream
    _pinned_rows = False  # logged once
    _pinned_failed = False  # an allocation failed: pageable buffers since

    def rows_buffer(self, num_bytes: int) -> bytearray | memoryview:
        """A Draft's target features read from the lane into page-locked memory when the
        engine is on a GPU: they cross to the device from there in one asynchronous copy
        (HostRows.join), not first copied into a page-locked buffer (~0.45 ms at batch 32 with
        an 8B head's rows, bench/draft_step.py --phases)."""
        engine = self.engine.loaded
        if engine is None or engine.proposer.device.type != "cuda" or self._pinned_failed:
            return bytearray(num_bytes)
        try:
            buffer = pinned_bytes(num_bytes, engine.proposer.device)
        except RuntimeError as err:  # the lane must go on reading: its own memory, from now on
            self._pinned_failed = True
            log.warning("drafter: no page-locked memory for the lane's rows (%s): pageable", err)
            return bytearray(num_bytes)
        if not self._pinned_rows:
            self._pinned_rows = True
            log.info("drafter: the round lane reads feature rows into page-locked memory")
        return buffer
