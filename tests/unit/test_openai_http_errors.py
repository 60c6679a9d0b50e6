"""Every refusal of the OpenAI-compatible HTTP API is a 4xx in OpenAI's JSON error shape, never a
plain-text 500: chat contents that are not text, unknown roles, lone surrogates, parameters that
would change the output but are not implemented (never ignored), a wrong method (405), a body
over the limit (413), a full waiting queue (429)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.openai_http import OpenAIServer
from gateway.request import DEFAULT_LIMITS, Chunk, GenerationRequest, Limits, ModelInfo
from gateway.scheduler import Scheduler
from specsplit.errors import Code, ServiceError
from specsplit.logit_rules import Penalties
from specsplit.messages import SpecParams


class _Scheduler:
    """Answers every request with one finished chunk, or refuses it like a full queue."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.requests: list[GenerationRequest] = []

    def generate(self, req: GenerationRequest, waiting_too: int = 0) -> AsyncIterator[Chunk]:
        if self.refuse:
            raise ServiceError(Code.RESOURCE_EXHAUSTED, "the gateway is busy")
        self.requests.append(req)

        async def chunks() -> AsyncIterator[Chunk]:
            yield Chunk(token_ids=[7], text="a", finish_reason="length", completion_tokens=1)

        return chunks()


Body = Callable[[TestClient, _Scheduler], Awaitable[None]]


def _run(
    tokenizer: Any, body: Body, scheduler: Any = None, limits: Limits = DEFAULT_LIMITS
) -> None:
    model = ModelInfo(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, max_context=2048)
    scheduler = scheduler or _Scheduler()

    async def main() -> None:
        with ThreadPoolExecutor(1) as tokenize:
            server = OpenAIServer(model, scheduler, "m", tokenize, limits=limits)
            server.ready = True
            async with TestClient(TestServer(server.app)) as client:
                await body(client, scheduler)

    asyncio.run(main())


async def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error  # type: ignore[no-any-return]


def _chat(content: Any, role: Any = "user") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": role, "content": content}], "max_tokens": 4}


def test_chat_content_that_is_a_number_or_an_object_is_400_json(smollm2_tokenizer) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        for content in (5, {"text": "hi"}, [{"type": "text", "text": 3}]):
            response = await client.post("/v1/chat/completions", json=_chat(content))
            error = await _error(response, 400)
            assert error["type"] == "invalid_request_error"
            assert error["param"] == "messages[0].content", error
        ok = await client.post("/v1/chat/completions", json=_chat([{"type": "text", "text": "hi"}]))
        assert ok.status == 200 and len(scheduler.requests) == 1

    _run(smollm2_tokenizer, body)


def test_unknown_chat_role_is_400(smollm2_tokenizer) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        response = await client.post("/v1/chat/completions", json=_chat("hi", role="wizard"))
        error = await _error(response, 400)
        assert error["param"] == "messages[0].role" and "wizard" in error["message"]
        assert scheduler.requests == []

    _run(smollm2_tokenizer, body)


def test_developer_message_is_the_system_message(smollm2_tokenizer) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        for role in ("developer", "system"):
            messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]
            chat = {"model": "m", "messages": messages, "max_tokens": 4}
            response = await client.post("/v1/chat/completions", json=chat)
            assert response.status == 200, await response.text()
        developer, system = scheduler.requests
        assert developer.prompt_ids == system.prompt_ids

    _run(smollm2_tokenizer, body)


def test_lone_surrogate_prompt_is_400_json(smollm2_tokenizer) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        raw = '{"model": "m", "prompt": "a\\ud800b", "max_tokens": 4}'  # JSON allows it
        headers = {"Content-Type": "application/json"}
        response = await client.post("/v1/completions", data=raw, headers=headers)
        error = await _error(response, 400)
        assert error["type"] == "invalid_request_error" and error["param"] == "prompt"
        chat = '{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}'
        response = await client.post("/v1/chat/completions", data=chat, headers=headers)
        assert (await _error(response, 400))["param"] == "messages"
        assert scheduler.requests == []

    _run(smollm2_tokenizer, body)


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", {"name": "f"}),
        ("echo", True),
        ("guided_grammar", "root ::= 'a'"),
        ("structured_outputs", {"grammar": "root ::= 'a'"}),
        ("prediction", {"type": "content", "content": "hello"}),
        ("use_beam_search", True),
        ("length_penalty", 0.5),
        ("add_generation_prompt", False),
        ("modalities", ["text", "audio"]),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_parameter_that_would_change_the_output_unimplemented_is_400(
    smollm2_tokenizer, param: str, value: Any
) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        response = await client.post("/v1/chat/completions", json={**_chat("hi"), param: value})
        error = await _error(response, 400)
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert "supported" in error["message"], error
        assert scheduler.requests == []

    _run(smollm2_tokenizer, body)


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.5),
        ("repetition_penalty", True),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {"7": 101}),
        ("logit_bias", {"7": "1"}),
        ("logit_bias", {"10000000": 1}),  # past the vocabulary
        ("logit_bias", [7, 1]),
        ("min_tokens", -1),
        ("min_tokens", 17),  # past max_tokens
        ("min_tokens", 2.5),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", 2048),  # (the context: no room for a generated token)
    ],
    ids=str,
)
def test_a_bias_or_penalty_out_of_range_is_400_naming_it(
    smollm2_tokenizer, param: str, value: Any
) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        for route in ("chat", "completion"):
            response = await _post(client, route, {param: value, "max_tokens": 16})
            error = await _error(response, 400)
            assert error["param"] == param, error
        assert scheduler.requests == []

    _run(smollm2_tokenizer, body)


def test_a_bias_and_penalties_reach_the_request(smollm2_tokenizer) -> None:
    """OpenAI's logit_bias (token ids as strings), presence and frequency penalties and vLLM's
    repetition_penalty become the request's Penalties, by token id."""
    extra = {
        "logit_bias": {"9": -100, "7": 2.5},
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.2,
        "min_tokens": 3,
        "stop_token_ids": [12, 5],
        "min_p": 0.05,
        "include_stop_str_in_output": True,
    }

    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        for route in ("chat", "completion"):
            response = await _post(client, route, extra)
            assert response.status == 200, await response.text()
        for request in scheduler.requests:  # (this model names no EOS)
            assert request.penalties == Penalties(
                ((7, 2.5), (9, -100.0)), 0.5, -1.0, 1.2, 3, (5, 12), min_p=0.05
            )
            assert request.min_tokens == 3 and request.include_stop_str

    _run(smollm2_tokenizer, body)


def test_those_parameters_where_they_change_nothing_are_served(smollm2_tokenizer) -> None:
    neutral = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": {},
        "min_p": 0,
        "logprobs": False,
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "function_call": "auto",
        "tools": [],
        "skip_special_tokens": True,
        "add_generation_prompt": True,
        "modalities": ["text"],
        "user": "someone",  # (no effect on the output by definition)
    }

    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        response = await client.post("/v1/chat/completions", json={**_chat("hi"), **neutral})
        assert response.status == 200, await response.text()
        assert len(scheduler.requests) == 1
        assert scheduler.requests[0].penalties is None

    _run(smollm2_tokenizer, body)


async def _post(client: TestClient, route: str, extra: dict[str, Any]) -> Any:
    """A chat body ("chat") or a completions body with `extra`'s fields."""
    if route == "chat":
        return await client.post("/v1/chat/completions", json={**_chat("hi"), **extra})
    return await client.post("/v1/completions", json={"model": "m", "prompt": "hi", **extra})


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"logprobs": 3}, "logprobs"),  # a completions body's form
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
        ("completions", {"top_logprobs": 2}, "top_logprobs"),  # a chat parameter
    ],
)
def test_logprobs_out_of_range_or_in_the_other_apis_form_is_400(
    smollm2_tokenizer, route: str, extra: dict[str, Any], param: str
) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        response = await _post(client, route, extra)
        error = await _error(response, 400)
        assert error["param"] == param, error
        assert scheduler.requests == []

    _run(smollm2_tokenizer, body)


@pytest.mark.parametrize(
    ("route", "extra", "asked"),
    [
        ("chat", {"logprobs": True}, 0),
        ("chat", {"logprobs": True, "top_logprobs": 20}, 20),
        ("chat", {"logprobs": False, "top_logprobs": 0}, None),
        ("completions", {"logprobs": 0}, 0),
        ("completions", {"logprobs": 5}, 5),
        ("completions", {"logprobs": None}, None),
    ],
)
def test_logprobs_asks_reach_the_request(
    smollm2_tokenizer, route: str, extra: dict[str, Any], asked: int | None
) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        response = await _post(client, route, extra)
        assert response.status == 200, await response.text()
        assert [r.logprobs for r in scheduler.requests] == [asked]

    _run(smollm2_tokenizer, body)


def test_405_and_413_are_invalid_request_errors(smollm2_tokenizer) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        error = await _error(await client.get("/v1/completions"), 405)
        assert error["type"] == "invalid_request_error"
        big = {"model": "m", "prompt": "x" * 5000, "max_tokens": 4}
        error = await _error(await client.post("/v1/completions", json=big), 413)
        assert error["type"] == "invalid_request_error"
        assert scheduler.requests == []

    _run(smollm2_tokenizer, body, limits=Limits(max_message_bytes=4096))


def test_full_waiting_queue_is_429(smollm2_tokenizer) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        for stream in (False, True):  # before any SSE header is sent
            request = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream}
            error = await _error(await client.post("/v1/completions", json=request), 429)
            assert error["code"] == "rate_limit_exceeded"

    _run(smollm2_tokenizer, body, _Scheduler(refuse=True))


def test_scheduler_refuses_past_max_waiting_at_once(smollm2_tokenizer) -> None:
    """The real scheduler's bound (not started: nothing leaves the queue)."""
    scheduler = Scheduler(None, None, smollm2_tokenizer, (), SpecParams(), max_waiting=2)  # type: ignore[arg-type]

    async def main() -> None:
        first = [scheduler.generate(GenerationRequest([1, 2], 4)) for _ in range(2)]
        waits = [asyncio.ensure_future(anext(g)) for g in first]  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert len(scheduler.waiting) == 2
        try:
            scheduler.generate(GenerationRequest([1, 2], 4))
        except ServiceError as err:
            assert err.code == Code.RESOURCE_EXHAUSTED and "waiting" in err.message
        else:
            raise AssertionError("the third request was queued")
        waits[0].cancel()  # a client gives up: its place is free again
        await asyncio.gather(waits[0], return_exceptions=True)
        assert scheduler.waiting[0].cancelled
        try:  # a body's further choices count before they wait: one place, two asked
            scheduler.generate(GenerationRequest([1, 2], 4), waiting_too=1)
        except ServiceError as err:
            assert err.code == Code.RESOURCE_EXHAUSTED
        else:
            raise AssertionError("room for two was found with one place left")
        scheduler.generate(GenerationRequest([1, 2], 4))
        waits[1].cancel()
        await asyncio.gather(waits[1], return_exceptions=True)

    asyncio.run(main())
