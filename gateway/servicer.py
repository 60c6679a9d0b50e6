"""The client API: Generate (server streaming). GenerateRequest -> validated GenerationRequest ->
the scheduler's chunks -> GenerateResponse. Every refusal is INVALID_ARGUMENT naming the field.
OpenSession / CloseSession manage sessions (gateway/sessions.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from gateway.guides import GuideAsk
from gateway.request import (
    DEFAULT_LIMITS,
    Chunk,
    GenerationRequest,
    Limits,
    ModelInfo,
    build_request,
)
from gateway.sessions import SessionStore
from specsplit import convert, telemetry
from specsplit.errors import Code, ServiceError, invalid
from specsplit.logit_rules import Penalties, bias_of
from specsplit.messages import TokenLogprobs
from specsplit.server import service_errors, service_name
from specsplit.v1 import gateway_pb2, gateway_pb2_grpc

FINISH_REASONS = {
    None: gateway_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": gateway_pb2.FINISH_REASON_STOP,
    "length": gateway_pb2.FINISH_REASON_LENGTH,
}


NOT_TAKING_REQUESTS = "the gateway is shutting down: not taking new requests"


class ChunkSource(Protocol):
    """The scheduler as the servicer sees it."""

    sessions: SessionStore

    def generate(self, req: GenerationRequest, waiting_too: int = 0) -> AsyncIterator[Chunk]: ...


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    service_name = service_name(gateway_pb2.DESCRIPTOR, "Gateway")

    def __init__(
        self, model: ModelInfo, scheduler: ChunkSource, limits: Limits = DEFAULT_LIMITS
    ) -> None:
        self.model = model
        self.scheduler = scheduler
        self.limits = limits
        # Tokenizing (and a chat template) can take milliseconds: keep it off the event loop,
        # on one thread so the tokenizer is never used by two threads for encoding at once.
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.draining = False  # shutting down: new requests get UNAVAILABLE

    def register(self, server: grpc.aio.Server) -> None:
        """gateway_pb2_grpc.add_GatewayServicer_to_server, but with a request parser that lets
        Generate refuse an undecodable message (a string that is not UTF-8) as INVALID_ARGUMENT,
        where gRPC would answer UNKNOWN."""
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate,
                request_deserializer=parse_generate_request,
                response_serializer=gateway_pb2.GenerateResponse.SerializeToString,
            ),
            "OpenSession": grpc.unary_unary_rpc_method_handler(
                self.OpenSession,
                request_deserializer=gateway_pb2.OpenSessionRequest.FromString,
                response_serializer=gateway_pb2.OpenSessionResponse.SerializeToString,
            ),
            "CloseSession": grpc.unary_unary_rpc_method_handler(
                self.CloseSession,
                request_deserializer=gateway_pb2.CloseSessionRequest.FromString,
                response_serializer=gateway_pb2.CloseSessionResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(self.service_name, handlers),)
        )
        server.add_registered_method_handlers(self.service_name, handlers)

    @property
    def tokenize_executor(self) -> ThreadPoolExecutor:
        """The tokenizer's one thread; the HTTP API (gateway.openai_http) shares it."""
        return self._tokenize

    def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        arrival_ns = time.monotonic_ns()
        client_trace = telemetry.incoming(context.invocation_metadata())  # W3C traceparent
        with telemetry.client_context(client_trace):  # the request span's parent
            async with service_errors(context):
                if isinstance(request, Undecodable):
                    raise invalid(f"GenerateRequest: {request.reason}")
                loop = asyncio.get_running_loop()
                req = await loop.run_in_executor(
                    self._tokenize, generation_request, request, self.model, self.limits
                )
                if self.draining:  # no await from here to the scheduler taking the request
                    raise ServiceError(Code.UNAVAILABLE, NOT_TAKING_REQUESTS)
                chunks = self.scheduler.generate(req)
                try:
                    async for chunk in chunks:
                        elapsed_ns = time.monotonic_ns() - arrival_ns
                        await context.write(chunk_to_proto(chunk, elapsed_ns, req.prompt_ids))
                finally:
                    # Client gone (the task is cancelled) or done: the scheduler frees the sequence.
                    await _aclose(chunks)

    async def OpenSession(
        self, request: gateway_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.OpenSessionResponse:
        async with service_errors(context):
            if self.draining:
                raise ServiceError(Code.UNAVAILABLE, NOT_TAKING_REQUESTS)
            ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
            session = self.scheduler.sessions.open(ttl)
        return gateway_pb2.OpenSessionResponse(
            session_id=session.session_id, ttl_seconds=session.ttl_s
        )

    async def CloseSession(
        self, request: gateway_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CloseSessionResponse:
        async with service_errors(context):
            num_tokens = await self.scheduler.sessions.close(request.session_id)
        return gateway_pb2.CloseSessionResponse(num_tokens=num_tokens)


async def _aclose(chunks: AsyncIterator[Chunk]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


class Undecodable:
    """A request protobuf could not parse (parse_generate_request); Generate refuses it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def parse_generate_request(data: bytes) -> gateway_pb2.GenerateRequest | Undecodable:
    try:
        return gateway_pb2.GenerateRequest.FromString(data)
    except DecodeError as err:  # e.g. a string field that is not valid UTF-8
        return Undecodable(f"cannot parse the message ({err}); are its strings valid UTF-8?")


def generation_request(
    msg: gateway_pb2.GenerateRequest, model: ModelInfo, limits: Limits = DEFAULT_LIMITS
) -> GenerationRequest:
    """Validate and convert (gateway.request.build_request); raises INVALID_ARGUMENT naming the
    field."""
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise invalid("prompt: set one of text, chat, token_ids")
    prompt: str | list[dict[str, str]] | list[int]
    if kind == "text":
        prompt = msg.text
    elif kind == "chat":
        prompt = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
    else:
        prompt = list(msg.token_ids.ids)
    return build_request(
        model,
        kind,
        prompt,
        max_new_tokens=msg.max_new_tokens,
        sampling=convert.sampling_from_proto(msg.sampling),
        stop_strings=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        spec=convert.spec_from_proto(msg.spec) if msg.HasField("spec") else None,
        ignore_eos=msg.ignore_eos,
        limits=limits,
        session_id=msg.session_id or None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        penalties=Penalties(
            bias_of(msg.logit_bias.items()),
            msg.presence_penalty,
            msg.frequency_penalty,
            msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            min_p=msg.min_p,
        ),
        min_tokens=msg.min_tokens,
        include_stop_str=msg.include_stop_str_in_output,
        truncate_prompt_tokens=(
            msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens") else None
        ),
        skip_special_tokens=(
            msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        ),
        guide=_guide_ask(msg.guide) if msg.HasField("guide") else None,
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        bad_words=list(msg.bad_words),
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def _guide_ask(msg: gateway_pb2.Guide) -> GuideAsk:
    kind = msg.WhichOneof("pattern")
    if kind is None or (kind == "json_object" and not msg.json_object):
        raise invalid("guide: set one of regex, json_schema, json_object (true), choice")
    if kind == "choice":
        return GuideAsk("guide", "choice", tuple(msg.choice.choices))
    return GuideAsk("guide", kind, None if kind == "json_object" else getattr(msg, kind))


def chunk_to_proto(
    chunk: Chunk, elapsed_ns: int, prompt_ids: Sequence[int] = ()
) -> gateway_pb2.GenerateResponse:
    """A streamed chunk; usage and spec stats ride on the last one (finish_reason set), the
    prompt's log-probabilities on the first (`prompt_ids`: the request's)."""
    msg = gateway_pb2.GenerateResponse(
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=FINISH_REASONS[chunk.finish_reason],
        elapsed_ns=elapsed_ns,
    )
    if chunk.finish_reason is not None:
        msg.usage.prompt_tokens = chunk.prompt_tokens
        msg.usage.completion_tokens = chunk.completion_tokens
    if chunk.logprobs is not None:
        _add_logprobs(msg.logprobs, chunk.token_ids, chunk.logprobs)
    if chunk.prompt_logprobs is not None:
        _add_logprobs(msg.prompt_logprobs, prompt_ids[1:], chunk.prompt_logprobs)
    if chunk.stats is not None:
        msg.spec_stats.rounds = chunk.stats.rounds
        msg.spec_stats.num_accepted_drafts = chunk.stats.num_accepted_drafts
        msg.spec_stats.mean_accepted_tokens = chunk.stats.mean_accepted_tokens
        msg.spec_stats.num_reused_tokens = chunk.stats.num_reused_tokens
    return msg


def _add_logprobs(entries: Any, tokens: Sequence[int], lp: TokenLogprobs) -> None:
    """TokenLogprob entries (a repeated field) of these tokens' log-probabilities."""
    for token, value, ids, values in zip(
        tokens, lp.logprobs, lp.top_ids, lp.top_logprobs, strict=True
    ):
        entry = entries.add(token_id=token, logprob=value)
        for top_id, top_value in zip(ids, values, strict=True):
            entry.top_logprobs.add(token_id=top_id, logprob=top_value)
