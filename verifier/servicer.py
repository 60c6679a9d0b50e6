"""The Verifier gRPC service: protobuf in -> VerifierEngine on its thread -> protobuf out."""

from __future__ import annotations

import grpc

from specsplit import rounds
from specsplit.engine_servicer import EngineServicer
from specsplit.server import service_name
from specsplit.v1 import verifier_pb2, verifier_pb2_grpc
from verifier.engine import VerifierEngine


class VerifierServicer(EngineServicer[VerifierEngine], verifier_pb2_grpc.VerifierServicer):
    name = "verifier"
    service_name = service_name(verifier_pb2.DESCRIPTOR, "Verifier")

    def register(self, server: grpc.aio.Server) -> None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(self, server)

    # VerifyRequest in -> VerifierEngine.verify -> VerifyResponse out, one per request, in order
    round_call = (rounds.VERIFY, VerifierEngine.verify)
    VerifyStream = EngineServicer.round_stream
