"""The OpenAI-compatible HTTP API of the gateway: /v1/models, /v1/completions, /v1/chat/completions,
and sessions as an extension: POST /v1/sessions, DELETE /v1/sessions/{id}, and a `session_id`
field in a completions or chat body (its prompt or messages are the session's next turn).

    JSON body -> OpenAIRequest (parsed here) -> build_request (the validation the gRPC API uses)
    -> the scheduler's chunks -> one JSON response, or SSE `data: {...}` chunks and `data: [DONE]`

Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad
parameter, 404 for an unknown route or model, 503 while the backend is unavailable. A client that
disconnects cancels its handler (handler_cancellation), which closes the scheduler's generator
and so frees the sequence's KV on drafter and verifier.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from gateway.auth import ApiKeys
from gateway.request import (
    CHAT_ROLES,
    DEFAULT_LIMITS,
    Chunk,
    GenerationRequest,
    InvalidField,
    Limits,
    ModelInfo,
    build_request,
)
from gateway.servicer import NOT_TAKING_REQUESTS, ChunkSource
from specsplit.errors import Code, ServiceError
from specsplit.sampling import SamplingParams

log = logging.getLogger(__name__)

Kind = Literal["completion", "chat"]
HTTP_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.NOT_FOUND: 404,
    Code.FAILED_PRECONDITION: 409,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.UNAVAILABLE: 503,
    Code.INTERNAL: 500,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",  # a route called with the wrong method
    409: "invalid_request_error",  # a session turn while another runs
    413: "invalid_request_error",  # a body over the gateway's message limit
    429: "rate_limit_error",  # the gateway's waiting queue is full
    503: "service_unavailable",
}
# The domain's field names (gateway.request) as OpenAI calls them.
OPENAI_PARAMS = {"max_new_tokens": "max_tokens", "stop_token_ids": "stop_token_ids"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the context


class OpenAIError(Exception):
    """An HTTP error in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        error_type = ERROR_TYPES.get(self.status, "server_error")
        code = "model_not_found" if self.param == "model" and self.status == 404 else None
        code = "rate_limit_exceeded" if self.status == 429 else code
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": code,
            }
        }


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param)


def from_service_error(err: ServiceError, kind: Kind) -> OpenAIError:
    if not isinstance(err, InvalidField):
        return OpenAIError(HTTP_STATUS[err.code], err.message)
    param = "messages" if err.field == "prompt" and kind == "chat" else err.field
    param = OPENAI_PARAMS.get(param, param)
    message = err.message.removeprefix("sampling.").replace(err.field, param)
    return OpenAIError(400, message, param)


# -- request parsing -------------------------------------------------------------------------


@dataclass
class OpenAIRequest:
    """The fields of a completions / chat completions body this server acts on."""

    kind: Kind
    prompt_kind: Literal["text", "chat", "token_ids"]
    prompt: Any  # str, list of token ids, or a list of {"role", "content"}
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    session_id: str | None = None  # extension: a session's turn (POST /v1/sessions)


def _get(body: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    """body[name], checked against `types` (bools are not numbers); null = default."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _bad(name, f"expected a number, got {value!r}")
    if not isinstance(value, types):
        raise _bad(name, f"wrong type {type(value).__name__}")
    return value


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompt(body: dict[str, Any], kind: Kind) -> tuple[Any, Any]:
    """(prompt_kind, prompt) of a body: one text or token-id prompt, or the chat messages."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "must be a non-empty list of {role, content}")
        return "chat", [_message(i, m) for i, m in enumerate(messages)]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return "text", prompt
    if _int_list(prompt):
        return "token_ids", prompt
    raise _bad("prompt", "must be a string or a list of token ids (one prompt per request)")


def _message(i: int, message: Any) -> dict[str, str]:
    """messages[i] as {"role", "content"}: a known role; content a string, text parts or null."""
    if not isinstance(message, dict):
        raise _bad(f"messages[{i}]", "must be an object with a role and a content")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise _bad(f"messages[{i}].role", f"{role!r} is not one of {', '.join(CHAT_ROLES)}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise _bad(f"messages[{i}].content", "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
    return {"role": role, "content": content or ""}


def parse_request(body: Any, kind: Kind) -> OpenAIRequest:
    """Type checks and OpenAI's defaults; range checks are build_request's."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    if _get(body, "n", int, 1) != 1:
        raise _bad("n", "only n = 1 is supported")
    if _get(body, "best_of", int, 1) != 1:
        raise _bad("best_of", "only best_of = 1 is supported")
    for name in ("echo", "logprobs", "top_logprobs", "suffix", "tools", "logit_bias"):
        if body.get(name) not in (None, False, 0, "", [], {}):
            raise _bad(name, "not supported")
    prompt_kind, prompt = _prompt(body, kind)
    max_tokens = _get(body, "max_completion_tokens", int, None)
    max_tokens = _get(body, "max_tokens", int, max_tokens)
    if max_tokens is None and kind == "completion":
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    top_k = _get(body, "top_k", int, 0)
    sampling = SamplingParams(
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)),
        top_k=0 if top_k == -1 else top_k,  # -1 = off, as in vLLM
        seed=_get(body, "seed", int, None),
    )
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "must be a string or a list of strings")
    stop_token_ids = _get(body, "stop_token_ids", list, [])
    if not _int_list(stop_token_ids):
        raise _bad("stop_token_ids", "must be a list of token ids")
    options = _get(body, "stream_options", dict, {})
    return OpenAIRequest(
        kind=kind,
        prompt_kind=prompt_kind,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=_get(body, "ignore_eos", bool, False),
        stream=_get(body, "stream", bool, False),
        include_usage=bool(options.get("include_usage", False)),
        session_id=_get(body, "session_id", str, None) or None,
    )


# -- response shapes -------------------------------------------------------------------------


def usage(last: Chunk) -> dict[str, Any]:
    """OpenAI's usage block plus the speculative stats under "specsplit"."""
    stats = last.stats
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
        "specsplit": {
            "rounds": stats.rounds if stats else 0,
            "num_accepted_drafts": stats.num_accepted_drafts if stats else 0,
            "mean_accepted_tokens": stats.mean_accepted_tokens if stats else 0.0,
            "num_reused_tokens": stats.num_reused_tokens if stats else 0,
        },
    }


def choice(kind: Kind, text: str | None, finish_reason: str | None, stream: bool) -> dict:
    """choices[0] of a response (stream=False) or of a streamed chunk; text None = no delta."""
    body: dict[str, Any] = {"index": 0}
    if kind == "completion":
        body["text"] = text or ""
    elif stream:
        body["delta"] = {} if text is None else {"content": text}
    else:
        body["message"] = {"role": "assistant", "content": text}
    return {**body, "logprobs": None, "finish_reason": finish_reason}


# -- the server ------------------------------------------------------------------------------


class OpenAIServer:
    """The HTTP API over the gateway's scheduler; 503 until `ready` is set."""

    def __init__(
        self,
        model: ModelInfo,
        scheduler: ChunkSource,
        model_name: str,
        tokenize: Executor,
        api_keys: ApiKeys | None = None,
        *,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        """api_keys: who may call (gateway.auth; None = everyone). limits: what a request may
        ask (bodies over limits.max_message_bytes are refused with 413)."""
        self.model = model
        self.limits = limits
        self.scheduler = scheduler
        self.model_name = model_name
        self.tokenize = tokenize  # the servicer's tokenizer thread: one encoder at a time
        self.ready = False
        self.draining = False  # shutting down: new requests get 503
        self.created = int(time.time())
        auth = [] if api_keys is None else [api_keys.http_middleware]  # outermost: first
        self.app = web.Application(
            middlewares=[*auth, self._errors], client_max_size=limits.max_message_bytes
        )
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model}", self.model_card)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/sessions", self.open_session)
        self.app.router.add_delete("/v1/sessions/{session_id}", self.close_session)
        self._runner: web.AppRunner | None = None

    async def start(
        self, address: str, grace: float = 5.0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        """Listen on "host:port" ("[::]:8000" for IPv6); HTTPS with `ssl_context`. grace: how
        long stop() lets handlers still running finish before it cancels them."""
        host, _, port = address.rpartition(":")
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=grace
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, host.strip("[]") or None, int(port), ssl_context=ssl_context
        )
        await site.start()
        scheme = "https" if ssl_context is not None else "http"
        log.info(
            "OpenAI-compatible HTTP API on %s (%s), model %r", address, scheme, self.model_name
        )

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except OpenAIError as err:
            return web.json_response(err.body(), status=err.status)
        except web.HTTPException as err:  # unknown route (404), wrong method (405), 413
            message = f"{request.method} {request.path}: {err.reason}"
            return web.json_response(OpenAIError(err.status, message).body(), status=err.status)
        except Exception:  # a bug: still OpenAI's shape, never aiohttp's plain-text 500
            log.exception("%s %s failed", request.method, request.path)
            body = OpenAIError(500, "internal error in the gateway").body()
            return web.json_response(body, status=500)

    # -- routes ------------------------------------------------------------------------------

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "specsplit",
            "max_model_len": self.model.max_context,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return web.json_response(self._card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def open_session(self, request: web.Request) -> web.Response:
        """Extension: {"ttl_seconds": optional} -> {"id", "object": "session", "ttl_seconds"}."""
        body = await request.json() if request.can_read_body else {}
        if not isinstance(body, dict):
            raise OpenAIError(400, "the body must be a JSON object")
        ttl = _get(body, "ttl_seconds", (int, float), None)
        if self.draining:
            raise OpenAIError(503, NOT_TAKING_REQUESTS)
        try:
            session = self.scheduler.sessions.open(None if ttl is None else float(ttl))
        except ServiceError as err:
            raise from_service_error(err, "chat") from None
        return web.json_response(
            {"id": session.session_id, "object": "session", "ttl_seconds": session.ttl_s}
        )

    async def close_session(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        try:
            num_tokens = await self.scheduler.sessions.close(session_id)
        except ServiceError as err:
            raise from_service_error(err, "chat") from None
        return web.json_response(
            {
                "id": session_id,
                "object": "session.deleted",
                "deleted": True,
                "num_tokens": num_tokens,
            }
        )

    def _check_model(self, name: Any) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(
                404, f"model {name!r} does not exist (serving {self.model_name!r})", "model"
            )

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            raise OpenAIError(400, "the body is not valid JSON") from None
        req = parse_request(body, kind)
        self._check_model(body.get("model"))
        if not self.ready:
            raise OpenAIError(503, "the gateway is waiting for the verifier")
        loop = asyncio.get_running_loop()
        try:
            gen_req = await loop.run_in_executor(self.tokenize, self._build, req)
        except ServiceError as err:
            raise from_service_error(err, kind) from None
        response_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        header = {"id": response_id, "created": int(time.time()), "model": self.model_name}
        if self.draining:  # no await from here to the scheduler taking the request
            raise OpenAIError(503, NOT_TAKING_REQUESTS)
        try:
            chunks = self.scheduler.generate(gen_req)
        except ServiceError as err:  # the waiting queue is full (429)
            raise from_service_error(err, kind) from None
        try:
            if req.stream:
                return await self._stream(request, req, header, chunks)
            return await self._complete(req, header, chunks)
        finally:  # done, failed or the client went away (cancelled): free the sequence
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def _build(self, req: OpenAIRequest) -> GenerationRequest:
        return build_request(
            self.model,
            req.prompt_kind,
            req.prompt,
            max_new_tokens=req.max_tokens,
            sampling=req.sampling,
            stop_strings=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            limits=self.limits,
            session_id=req.session_id,
        )

    async def _complete(
        self, req: OpenAIRequest, header: dict[str, Any], chunks: AsyncIterator[Chunk]
    ) -> web.Response:
        texts, last = [], None
        try:
            async for chunk in chunks:
                texts.append(chunk.text)
                last = chunk
        except ServiceError as err:
            raise from_service_error(err, req.kind) from None
        assert last is not None and last.finish_reason is not None, "a stream ends finished"
        obj = "text_completion" if req.kind == "completion" else "chat.completion"
        return web.json_response(
            {
                **header,
                "object": obj,
                "choices": [choice(req.kind, "".join(texts), last.finish_reason, stream=False)],
                "usage": usage(last),
            }
        )

    async def _stream(
        self,
        request: web.Request,
        req: OpenAIRequest,
        header: dict[str, Any],
        chunks: AsyncIterator[Chunk],
    ) -> web.StreamResponse:
        obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)

        async def send(data: dict[str, Any] | str) -> None:
            payload = data if isinstance(data, str) else json.dumps(data)
            await response.write(f"data: {payload}\n\n".encode())

        def event(text: str | None, finish_reason: str | None) -> dict[str, Any]:
            event = {
                **header,
                "object": obj,
                "choices": [choice(req.kind, text, finish_reason, stream=True)],
            }
            return {**event, "usage": None} if req.include_usage else event

        if req.kind == "chat":  # the role comes first, as OpenAI sends it
            first = event("", None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            await send(first)
        try:
            async for chunk in chunks:
                if chunk.text or chunk.finish_reason is not None:
                    text = chunk.text if chunk.text or req.kind == "completion" else None
                    await send(event(text, chunk.finish_reason))
                if chunk.finish_reason is not None and req.include_usage:
                    await send({**header, "object": obj, "choices": [], "usage": usage(chunk)})
        except ServiceError as err:  # headers are sent: the error becomes an event
            await send(from_service_error(err, req.kind).body())
        await send("[DONE]")
        await response.write_eof()
        return response
