"""The Verifier gRPC service: protobuf in -> VerifierEngine on its thread -> protobuf out. On a
GPU (engine calls on the event loop) rounds run pipelined (verifier/pipelined.py): a round that
arrives while another verifies launches behind it."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import Message

from specsplit import convert_beside, metrics, rounds
from specsplit.engine_servicer import EngineServicer
from specsplit.scopes import Scope, grpc_scope_key
from specsplit.server import service_errors, service_name
from specsplit.v1 import verifier_pb2, verifier_pb2_grpc
from verifier.engine import VerifierEngine
from verifier.pipelined import PipelinedRounds


class VerifierServicer(EngineServicer[VerifierEngine], verifier_pb2_grpc.VerifierServicer):
    name = "verifier"
    service_name = service_name(verifier_pb2.DESCRIPTOR, "Verifier")
    _pipelined: PipelinedRounds | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        metrics.watch_rule_rows(self._rule_rows_bytes)

    def register(self, server: grpc.aio.Server) -> None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(self, server)

    def _rule_rows_bytes(self) -> int:
        """The logit-rules rows' bytes (0 while loading). Read from the metrics thread."""
        engine = self.engine.loaded
        return 0 if engine is None else engine.rule_rows.nbytes

    # VerifyRequest in -> VerifierEngine.verify -> VerifyResponse out, one per request, in order
    round_call = (rounds.VERIFY, VerifierEngine.verify)
    VerifyStream = EngineServicer.round_stream

    async def engine_round(self, inputs: list[Any]) -> tuple[list[Any], int, int]:
        pipelined = self.pipelined()
        if pipelined is None:  # on the engine thread: one whole round at a time
            return await super().engine_round(inputs)
        return await pipelined.verify(inputs)

    async def settle(self, seq_ids: list[str] | None) -> None:
        pipelined = self.pipelined()
        if pipelined is not None:
            await pipelined.settle(seq_ids)

    def hint_in(self, scope: Scope | None, body: bytes | bytearray | memoryview) -> Message:
        """The gateway's hints for rounds in flight (VerifierEngine.hint_next), for its own
        sequences. Handed to the engine at once, beside a round in flight (on a GPU the loop
        polls the device meanwhile; on the CPU the engine thread runs the round): a hint only
        stores a dict entry per sequence, and one waiting behind the round would come too
        late."""
        return self._hint(scope, verifier_pb2.VerifyHint.FromString(body))

    def _hint(
        self, scope: Scope | None, request: verifier_pb2.VerifyHint
    ) -> verifier_pb2.VerifyHintResponse:
        # a malformed one is refused from any client
        hints = convert_beside.hint_from_proto(request)
        if scope is not None:
            self.engine.warm().hint_next(scope.enter(hints))
        return verifier_pb2.VerifyHintResponse()

    async def Hint(
        self, request: verifier_pb2.VerifyHint, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.VerifyHintResponse:
        async with service_errors(context):
            key = grpc_scope_key(context.invocation_metadata(), context.peer())
            scope = self.scopes.find(key)
            return self._hint(scope, request)

    def pipelined(self) -> PipelinedRounds | None:
        """Pipelined rounds when engine calls run on the loop (None: on the engine thread).
        UNAVAILABLE until the engine is loaded and warm."""
        if not self.engine.calls_on_loop:
            return None
        if self._pipelined is None:
            self._pipelined = PipelinedRounds(self.engine.warm(), _on_loop)
        return self._pipelined


async def _on_loop(fn: Any, *args: Any) -> Any:
    return fn(*args)
