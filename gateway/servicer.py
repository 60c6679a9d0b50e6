"""The client API: Generate (server streaming). GenerateRequest -> validated GenerationRequest ->
the scheduler's chunks -> GenerateResponse. Every refusal is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from gateway.request import Chunk, GenerationRequest
from gateway.text import apply_chat_template, encode_prompt
from specsplit import convert
from specsplit.errors import invalid
from specsplit.server import service_errors, service_name
from specsplit.v1 import gateway_pb2, gateway_pb2_grpc

FINISH_REASONS = {
    None: gateway_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": gateway_pb2.FINISH_REASON_STOP,
    "length": gateway_pb2.FINISH_REASON_LENGTH,
}


class ChunkSource(Protocol):
    """The scheduler as the servicer sees it."""

    def generate(self, req: GenerationRequest) -> AsyncIterator[Chunk]: ...


@dataclass(frozen=True)
class ModelInfo:
    """What request validation needs to know about the target model."""

    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_context: int  # prompt + generated tokens must fit
    eos_token_ids: tuple[int, ...] = ()


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    service_name = service_name(gateway_pb2.DESCRIPTOR, "Gateway")

    def __init__(self, model: ModelInfo, scheduler: ChunkSource) -> None:
        self.model = model
        self.scheduler = scheduler
        # Tokenizing (and a chat template) can take milliseconds: keep it off the event loop,
        # on one thread so the tokenizer is never used by two threads for encoding at once.
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def register(self, server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(self, server)

    def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        arrival_ns = time.monotonic_ns()
        async with service_errors(context):
            loop = asyncio.get_running_loop()
            req = await loop.run_in_executor(
                self._tokenize, generation_request, request, self.model
            )
            chunks = self.scheduler.generate(req)
            try:
                async for chunk in chunks:
                    await context.write(chunk_to_proto(chunk, time.monotonic_ns() - arrival_ns))
            finally:
                # Client gone (the task is cancelled) or done: the scheduler frees the sequence.
                await _aclose(chunks)


async def _aclose(chunks: AsyncIterator[Chunk]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


def generation_request(msg: gateway_pb2.GenerateRequest, model: ModelInfo) -> GenerationRequest:
    """Validate and convert; raises ServiceError(INVALID_ARGUMENT) naming the field."""
    prompt_ids = _prompt_ids(msg, model)
    _check_vocab(msg.stop_token_ids, "stop_token_ids", model.vocab_size)
    if msg.max_new_tokens <= 0:
        raise invalid(f"max_new_tokens = {msg.max_new_tokens}: must be > 0")
    total = len(prompt_ids) + msg.max_new_tokens
    if total > model.max_context:
        raise invalid(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({msg.max_new_tokens}) = {total}"
            f" exceeds the model's context of {model.max_context} tokens"
        )
    sampling = convert.sampling_from_proto(msg.sampling)
    try:
        sampling.validate()
    except ValueError as err:
        raise invalid(f"sampling.{err}") from None
    for i, stop in enumerate(msg.stop):
        if not stop:
            raise invalid(f"stop[{i}] is empty")
    spec = None
    if msg.HasField("spec"):
        spec = convert.spec_from_proto(msg.spec)
        spec.validate()
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_new_tokens=msg.max_new_tokens,
        sampling=sampling,
        stop_strings=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        spec=spec,
        ignore_eos=msg.ignore_eos,
    )


def _prompt_ids(msg: gateway_pb2.GenerateRequest, model: ModelInfo) -> list[int]:
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise invalid("prompt: set one of text, chat, token_ids")
    if kind == "text":
        if not msg.text:
            raise invalid("prompt.text is empty")
        ids = encode_prompt(model.tokenizer, msg.text)
    elif kind == "chat":
        if not msg.chat.messages:
            raise invalid("prompt.chat.messages is empty")
        ids = apply_chat_template(
            model.tokenizer, [{"role": m.role, "content": m.content} for m in msg.chat.messages]
        )
    else:
        if not msg.token_ids.ids:
            raise invalid("prompt.token_ids.ids is empty")
        ids = list(msg.token_ids.ids)
        _check_vocab(ids, "prompt.token_ids.ids", model.vocab_size)
    if not ids:
        raise invalid(f"prompt.{kind} encodes to no tokens")
    return ids


def _check_vocab(ids: Sequence[int], field: str, vocab_size: int) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid(f"{field}[{i}] = {token} outside the vocabulary [0, {vocab_size})")


def chunk_to_proto(chunk: Chunk, elapsed_ns: int) -> gateway_pb2.GenerateResponse:
    """A streamed chunk; usage and spec stats ride on the last one (finish_reason set)."""
    msg = gateway_pb2.GenerateResponse(
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=FINISH_REASONS[chunk.finish_reason],
        elapsed_ns=elapsed_ns,
    )
    if chunk.finish_reason is not None:
        msg.usage.prompt_tokens = chunk.prompt_tokens
        msg.usage.completion_tokens = chunk.completion_tokens
    if chunk.stats is not None:
        msg.spec_stats.rounds = chunk.stats.rounds
        msg.spec_stats.num_accepted_drafts = chunk.stats.num_accepted_drafts
        msg.spec_stats.mean_accepted_tokens = chunk.stats.mean_accepted_tokens
    return msg
