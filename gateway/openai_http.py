"""The OpenAI-compatible HTTP API of the gateway: /v1/models, /v1/completions, /v1/chat/completions,
and sessions as an extension: POST /v1/sessions, DELETE /v1/sessions/{id}, and a `session_id`
field in a completions or chat body (its prompt or messages are the session's next turn). GET
/health and /ping (no API key) answer 200 while requests are taken, 503 before and after. POST
/tokenize and /detokenize as vLLM serves them (gateway/openai_tokens.py).

    JSON body -> OpenAIRequest (gateway/openai_body.py) -> build_request (the validation the
    gRPC API uses) -> the scheduler's chunks -> one JSON response, or SSE `data: {...}` chunks
    and `data: [DONE]`

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
from contextlib import aclosing
from typing import Any

from aiohttp import web

from gateway.auth import OPEN_HTTP_PATHS, ApiKeys, Refused
from gateway.call_formats import call_format
from gateway.openai_body import (
    Kind,
    OpenAIError,
    OpenAIRequest,
    choice,
    from_service_error,
    parse_request,
    usage,
)
from gateway.openai_choices import choice_requests, close_all, merged, prompt_requests
from gateway.openai_guide import body_guide
from gateway.openai_logprobs import (
    Listed,
    TokenTexts,
    add_prompt_logprobs,
    listed_tokens,
    logprobs_block,
    prompt_parts,
)
from gateway.openai_sessions import SessionRoutes
from gateway.openai_tokens import TokenRoutes
from gateway.openai_tools import ToolStream, apply_tools, shape_choice
from gateway.request import (
    DEFAULT_LIMITS,
    Chunk,
    GenerationRequest,
    Limits,
    ModelInfo,
    ending_ids,
)
from gateway.servicer import NOT_TAKING_REQUESTS, ChunkSource
from specsplit.errors import ServiceError
from specsplit.messages import TokenLogprobs

log = logging.getLogger(__name__)


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
        self.api_keys = api_keys
        self.token_texts = TokenTexts(model.tokenizer)  # the logprobs blocks' token texts
        self.call_format = call_format(getattr(model.tokenizer, "chat_template", None))
        auth = [] if api_keys is None else [api_keys.http_middleware]  # outermost: first
        self.app = web.Application(
            middlewares=[*auth, self._errors], client_max_size=limits.max_message_bytes
        )
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model}", self.model_card)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        SessionRoutes(lambda: self.scheduler.sessions, lambda: self.draining).add_to(self.app)
        for path in OPEN_HTTP_PATHS:  # load balancers' and orchestrators' probes, keyless
            self.app.router.add_get(path, self.health)
        TokenRoutes(model, limits, tokenize, self._check_model).add_to(self.app)
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

    async def health(self, request: web.Request) -> web.Response:
        """GET /health (and /ping): 200 while requests are taken, as the gRPC health service's
        SERVING; 503 before the verifier is SERVING and once shutting down."""
        if self.draining:
            raise OpenAIError(503, NOT_TAKING_REQUESTS)
        if not self.ready:
            raise OpenAIError(503, "the gateway is waiting for the verifier")
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return web.json_response(self._card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

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
        req.guide = body_guide(body)
        apply_tools(req, body, self.call_format)
        self._check_model(body.get("model"))
        if not self.ready:
            raise OpenAIError(503, "the gateway is waiting for the verifier")
        loop = asyncio.get_running_loop()
        try:
            per_prompt = await loop.run_in_executor(self.tokenize, self._build, req)
        except ServiceError as err:
            raise from_service_error(err, kind) from None
        echoes = None  # each choice's prompt text, where the body echoes it
        if req.echo:
            echoes = await loop.run_in_executor(self.tokenize, self._echoes, req)
        response_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        header = {"id": response_id, "created": int(time.time()), "model": self.model_name}
        if self.draining:  # no await from here to the scheduler taking the requests
            raise OpenAIError(503, NOT_TAKING_REQUESTS)
        # each further choice is a call of the key's too (--max-concurrent-per-key)
        release = None
        if self.api_keys is not None:
            authorization = request.headers.get("Authorization")
            try:
                release = self.api_keys.acquire(authorization, req.n * len(per_prompt) - 1)
            except Refused as refused:
                raise OpenAIError(refused.status, refused.message) from None
        streams: list[AsyncIterator[Chunk]] = []
        try:
            # (the first asks for room for them all: the others wait once iterated)
            requests = choice_requests(per_prompt, req.n)
            streams.append(self.scheduler.generate(requests[0], waiting_too=len(requests) - 1))
            for gen_req in requests[1:]:
                streams.append(self.scheduler.generate(gen_req))
            prompts = [r.prompt_ids for r in requests]
            if req.stream:
                return await self._stream(request, req, header, streams, echoes, prompts)
            return await self._complete(req, header, streams, echoes, prompts)
        except ServiceError as err:  # the waiting queue is full (429): no choice runs
            raise from_service_error(err, kind) from None
        finally:  # done, failed or the client went away (cancelled): free the sequences
            await close_all(streams)
            if release is not None:
                release()

    def _stop_ids(self, req: OpenAIRequest) -> frozenset[int]:
        """The tokens that end a choice of `req` without their text (EOS, stop_token_ids)."""
        return frozenset(ending_ids(self.model.eos_token_ids, req.ignore_eos, req.stop_token_ids))

    def _echoes(self, req: OpenAIRequest) -> list[str]:
        """Each choice's prompt as text (`echo`): a text prompt as sent, token ids decoded."""
        texts = [
            prompt if kind == "text" else self.model.tokenizer.decode(prompt)
            for kind, prompt in req.prompts
        ]
        return [text for text in texts for _ in range(req.n)]

    def _build(self, req: OpenAIRequest) -> list[GenerationRequest]:
        """Each prompt's request (validated and tokenized)."""
        return prompt_requests(self.model, req, self.limits)

    async def _complete(
        self,
        req: OpenAIRequest,
        header: dict[str, Any],
        streams: list[AsyncIterator[Chunk]],
        echoes: list[str] | None,
        prompts: list[list[int]],  # each choice's prompt ids
    ) -> web.Response:
        texts: list[list[str]] = [
            [] if echoes is None else [echoes[i]] for i in range(len(streams))
        ]
        lasts: list[Chunk | None] = [None] * len(streams)
        listed: list[list[Listed]] = [[] for _ in streams]
        asked: list[TokenLogprobs | None] = [None] * len(streams)  # the prompts' (first chunks')
        stop_ids = self._stop_ids(req)
        try:
            async with aclosing(merged(streams)) as chunks:  # (closed before the streams are)
                async for index, chunk in chunks:
                    texts[index].append(chunk.text)
                    lasts[index] = chunk
                    listed[index] += listed_tokens(chunk, stop_ids)
                    if chunk.prompt_logprobs is not None:  # (the first chunk's)
                        asked[index] = chunk.prompt_logprobs
        except ServiceError as err:
            raise from_service_error(err, req.kind) from None
        done = [last for last in lasts if last is not None and last.finish_reason is not None]
        assert len(done) == len(streams), "every stream ends finished"
        obj = "text_completion" if req.kind == "completion" else "chat.completion"
        choices = [
            choice(
                req.kind, "".join(text), last.finish_reason, stream=False, index=i,
                logprobs=logprobs_block(req, entries, self.token_texts, 0)[0],
            )
            for i, (text, last, entries) in enumerate(zip(texts, done, listed, strict=True))
        ]  # fmt: skip
        if req.tools is not None and req.tools.reads:
            choices = [shape_choice(req.tools, body) for body in choices]
        extra = add_prompt_logprobs(req, choices, prompts, asked, self.token_texts)
        return web.json_response(
            {**header, "object": obj, "choices": choices, **extra, "usage": usage(done, req.n)}
        )

    async def _stream(
        self,
        request: web.Request,
        req: OpenAIRequest,
        header: dict[str, Any],
        streams: list[AsyncIterator[Chunk]],
        echoes: list[str] | None,
        prompts: list[list[int]],  # each choice's prompt ids
    ) -> web.StreamResponse:
        obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)

        async def send(data: dict[str, Any] | str) -> None:
            payload = data if isinstance(data, str) else json.dumps(data)
            await response.write(f"data: {payload}\n\n".encode())

        offsets = [0] * len(streams)  # each completions choice's characters listed so far
        stop_ids = self._stop_ids(req)

        def event(
            index: int,
            text: str | None,
            finish_reason: str | None,
            chunk: Chunk | None = None,
            delta: dict[str, Any] | None = None,
        ) -> dict[str, Any]:
            logprobs = None
            if chunk is not None:
                entries = listed_tokens(chunk, stop_ids)
                texts, at = self.token_texts, offsets[index]
                logprobs, offsets[index] = logprobs_block(req, entries, texts, at)
            body = choice(
                req.kind, text, finish_reason, stream=True, index=index, logprobs=logprobs
            )
            if delta is not None:  # (a tool call's)
                body["delta"] = delta
            event = {**header, "object": obj, "choices": [body]}
            return {**event, "usage": None} if req.include_usage else event

        if req.kind == "chat":  # each choice's role comes first, as OpenAI sends it
            for index in range(len(streams)):
                first = event(index, "", None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                await send(first)
        asks = req.prompt_asks is not None  # (then each prompt goes with its first chunk's)
        for index, echo in enumerate(() if asks else echoes or ()):  # each prompt, then its text
            await send(event(index, echo, None))
        finished: dict[int, Chunk] = {}  # each choice's last chunk
        calls = None  # each choice's tool calls as they stream, where the output is calls
        if req.tools is not None and req.tools.reads:
            calls = [ToolStream(req.tools) for _ in streams]
        try:
            async with aclosing(merged(streams)) as chunks:  # (closed before the streams are)
                async for index, chunk in chunks:
                    if chunk.prompt_logprobs is not None:  # (the first chunk's: the prompt first)
                        echoed = None if echoes is None else echoes[index]
                        texts, lp = self.token_texts, chunk.prompt_logprobs
                        fields, top, offsets[index] = prompt_parts(
                            req, prompts[index], lp, texts, echoed
                        )
                        first = event(index, fields.pop("text", None), None)
                        first["choices"][0].update(fields)
                        await send({**first, **top})
                    if calls is not None:  # (no logprobs with calls: apply_tools)
                        for delta, reason in calls[index].events(chunk.text, chunk.finish_reason):
                            await send(event(index, None, reason, delta=delta))
                    # (a chunk whose text is held back still sends its tokens' logprobs)
                    lists = req.logprobs is not None and bool(chunk.token_ids)
                    if calls is None and (chunk.text or chunk.finish_reason is not None or lists):
                        text = chunk.text if chunk.text or req.kind == "completion" else None
                        await send(event(index, text, chunk.finish_reason, chunk))
                    if chunk.finish_reason is not None:
                        finished[index] = chunk
            if req.include_usage:  # once every choice finished
                lasts = [finished[i] for i in range(len(streams))]
                await send({**header, "object": obj, "choices": [], "usage": usage(lasts, req.n)})
        except ServiceError as err:  # headers are sent: the error becomes an event
            await send(from_service_error(err, req.kind).body())
        await send("[DONE]")
        await response.write_eof()
        return response
