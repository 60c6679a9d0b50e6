"""What one client request may ask of the gateway (gateway.request.Limits, DESIGN.md §8): tree
shape, max_new_tokens, prompt size checked before tokenizing, chat roles and text a tokenizer
cannot take; over gRPC (message size, undecodable strings) the same refusals are
INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from gateway.request import (
    DEFAULT_LIMITS,
    MAX_SCORED_PROMPT,
    Chunk,
    GenerationRequest,
    InvalidField,
    Limits,
    ModelInfo,
    build_request,
)
from gateway.servicer import GatewayServicer
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams
from specsplit.server import server_options
from specsplit.v1 import gateway_pb2

FIVE_MB = 5 * 1024 * 1024


class _CountingTokenizer:
    """A tokenizer that records being asked: a refused prompt must never reach it."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [1] * max(len(text) // 4, 1)

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> list[int]:
        self.calls += 1
        return [1] * sum(max(len(m["content"]) // 4, 1) for m in messages)


def _model(tokenizer: Any = None, max_context: int = 8192) -> ModelInfo:
    return ModelInfo(
        tokenizer=tokenizer or _CountingTokenizer(), vocab_size=100, max_context=max_context
    )


def _build(model: ModelInfo, kind: str, prompt: Any, **kwargs: Any) -> GenerationRequest:
    kwargs.setdefault("max_new_tokens", 8)
    return build_request(model, kind, prompt, sampling=SamplingParams(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (SpecParams(1000, 1000, 1000), "spec.num_steps"),  # the request
        (SpecParams(17, 1, 17), "spec.num_steps"),
        (SpecParams(2, 9, 18), "spec.topk"),
        (SpecParams(8, 8, 65), "spec.num_draft_tokens"),
    ],
)
def test_tree_shape_over_the_limits_is_invalid_argument_naming_the_field(
    spec: SpecParams, field: str
) -> None:
    with pytest.raises(InvalidField) as err:
        _build(_model(), "token_ids", [1, 2, 3], spec=spec)
    assert err.value.field == field and field in err.value.message
    assert _build(_model(), "token_ids", [1, 2], spec=SpecParams(16, 4, 64)).spec is not None


def test_max_new_tokens_over_the_limit_is_refused_and_the_chat_default_is_capped() -> None:
    limits = Limits(max_new_tokens=100)
    with pytest.raises(InvalidField) as err:
        _build(_model(), "token_ids", [1, 2], max_new_tokens=101, limits=limits)
    assert err.value.field == "max_new_tokens" and "limit of 100" in err.value.message
    # no max_tokens (OpenAI chat): the rest of the context, but never more than the limit
    req = _build(_model(), "token_ids", [1, 2], max_new_tokens=None, limits=limits)
    assert req.max_new_tokens == 100


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_5mb_prompt_is_refused_before_tokenizing(kind: str) -> None:
    tokenizer = _CountingTokenizer()
    text = "word " * (FIVE_MB // 5)
    prompt: Any = text if kind == "text" else [{"role": "user", "content": text}]
    started = time.perf_counter()
    with pytest.raises(InvalidField) as err:
        _build(_model(tokenizer), kind, prompt)
    assert time.perf_counter() - started < 0.5
    assert err.value.field == "prompt" and "limit of 262144 bytes" in err.value.message
    assert tokenizer.calls == 0
    # the limit counts UTF-8 bytes: 3 bytes per character here
    with pytest.raises(InvalidField):
        _build(_model(tokenizer), "text", "€" * 400, limits=Limits(max_prompt_bytes=1000))
    assert tokenizer.calls == 0
    _build(_model(tokenizer), "text", "€" * 300, limits=Limits(max_prompt_bytes=1000))
    assert tokenizer.calls == 1


def test_token_ids_beyond_the_context_are_refused_before_reading_them() -> None:
    with pytest.raises(InvalidField) as err:
        _build(_model(max_context=64), "token_ids", range(10**9))  # never iterated
    assert err.value.field == "prompt" and "64" in err.value.message


@pytest.mark.parametrize(
    "prompt",
    ["ab\ud800cd", [{"role": "user", "content": "x\udfff"}]],
    ids=["text", "chat"],
)
def test_a_lone_surrogate_is_invalid_argument_not_a_tokenizer_crash(prompt: Any) -> None:
    tokenizer = _CountingTokenizer()
    kind = "text" if isinstance(prompt, str) else "chat"
    with pytest.raises(InvalidField) as err:
        _build(_model(tokenizer), kind, prompt)
    assert err.value.field == "prompt" and "surrogate" in err.value.message
    assert tokenizer.calls == 0


@pytest.mark.parametrize("role", ["robot", "", None, "function"])
def test_unknown_chat_roles_are_refused(role: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    with pytest.raises(InvalidField) as err:
        _build(_model(), "chat", messages)
    assert err.value.field == "prompt" and "chat message 1: role" in err.value.message


# -- over gRPC -------------------------------------------------------------------------------


class _OneChunkScheduler:
    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    def generate(self, req: GenerationRequest, waiting_too: int = 0) -> AsyncIterator[Chunk]:
        self.requests.append(req)

        async def chunks() -> AsyncIterator[Chunk]:
            yield Chunk(token_ids=[7], text="a", finish_reason="length")

        return chunks()


async def _call(
    request: bytes, limits: Limits, tokenizer: Any
) -> tuple[grpc.StatusCode, str, _OneChunkScheduler]:
    """One Generate with a raw (possibly undecodable) request on an in-process gateway."""
    scheduler = _OneChunkScheduler()
    servicer = GatewayServicer(_model(tokenizer), scheduler, limits)
    server = grpc.aio.server(options=server_options(limits.max_message_bytes))
    servicer.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            generate = channel.unary_stream(
                "/specsplit.v1.Gateway/Generate",
                request_serializer=lambda b: b,
                response_deserializer=gateway_pb2.GenerateResponse.FromString,
            )
            try:
                async for _ in generate(request):
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details() or "", scheduler
            return grpc.StatusCode.OK, "", scheduler
    finally:
        servicer.close()
        await server.stop(None)


def _grpc(
    request: bytes | gateway_pb2.GenerateRequest,
    limits: Limits = DEFAULT_LIMITS,
    tokenizer: Any = None,
) -> tuple[grpc.StatusCode, str, _OneChunkScheduler]:
    data = request if isinstance(request, bytes) else request.SerializeToString()
    return asyncio.run(_call(data, limits, tokenizer or _CountingTokenizer()))


def test_invalid_utf8_over_grpc_is_invalid_argument_not_unknown() -> None:
    good = gateway_pb2.GenerateRequest(text="abcd", max_new_tokens=4).SerializeToString()
    code, details, scheduler = _grpc(good.replace(b"abcd", b"ab\xff\xfe"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "UTF-8" in details and scheduler.requests == []
    assert _grpc(good)[0] == grpc.StatusCode.OK


def test_grpc_refuses_the_tree_shape_naming_the_field() -> None:
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=[1, 2]), max_new_tokens=4
    )
    request.spec.num_steps, request.spec.topk, request.spec.num_draft_tokens = 1000, 1000, 1000
    code, details, scheduler = _grpc(request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "spec.num_steps" in details
    assert scheduler.requests == []


def test_grpc_refuses_a_5mb_prompt_before_tokenizing() -> None:
    tokenizer = _CountingTokenizer()
    request = gateway_pb2.GenerateRequest(text="x" * FIVE_MB, max_new_tokens=4)
    # the default message limit (4 MiB): gRPC refuses it before it is even parsed
    code, details, _ = _grpc(request, tokenizer=tokenizer)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    # a larger message limit: the prompt-size limit refuses it, still without the tokenizer
    code, details, _ = _grpc(request, Limits(max_message_bytes=2 * FIVE_MB), tokenizer)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in details, (code, details)
    assert tokenizer.calls == 0


def test_prompt_logprobs_of_a_prompt_past_the_scored_limit_are_refused() -> None:
    """Its first round's forward would hold every prompt row's logits at once."""
    prompt = [1] * (MAX_SCORED_PROMPT + 1)
    with pytest.raises(InvalidField) as err:
        _build(_model(), "token_ids", prompt, prompt_logprobs=0)
    assert err.value.field == "prompt_logprobs"
    assert _build(_model(), "token_ids", prompt[1:], prompt_logprobs=0).prompt_logprobs == 0
