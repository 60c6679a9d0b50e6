"""The HTTP API's tokenizer routes, as vLLM and SGLang serve them (gateway/openai_http.py adds
them): POST /tokenize takes a completions body's `prompt` (text) or a chat body's `messages` (and
`tools`) and answers {"count", "max_model_len", "tokens"}: the ids a generation of that body reads
(the same encoding, the chat template with the assistant's prompt), so a client can count a prompt
against the context before it sends it. POST /detokenize takes {"tokens": [ids]} and answers
{"prompt": text}. Both check sizes as a generation does (prompt bytes, the context) and answer
without the verifier (no 503 before it is ready)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial
from typing import Any

from aiohttp import web

from gateway.openai_body import (
    Kind,
    OpenAIError,
    bad_param,
    body_field,
    body_prompts,
    from_service_error,
    int_list,
)
from gateway.openai_tools import tool_list
from gateway.request import InvalidField, Limits, ModelInfo, check_vocab, checked_prompt_ids
from specsplit.errors import ServiceError

# these only at the value (besides null) the generation routes use
AS_GENERATION = {"add_special_tokens": True, "add_generation_prompt": True}


class TokenRoutes:
    def __init__(
        self,
        model: ModelInfo,
        limits: Limits,
        tokenize: Executor,
        check_model: Callable[[Any], None],  # 404 for a `model` this server does not serve
    ) -> None:
        self.model = model
        self.limits = limits
        self.check_model = check_model
        self.tokenize = tokenize  # the servicer's tokenizer thread: one encoder at a time

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize_route)
        app.router.add_post("/detokenize", self.detokenize_route)

    async def tokenize_route(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        kind: Kind = "chat" if "messages" in body else "completion"
        if kind == "completion" and not isinstance(body.get("prompt"), str):
            raise bad_param("prompt", "must be a string (or send `messages`)")
        for name, value in AS_GENERATION.items():
            if body_field(body, name, bool, value) != value:
                raise bad_param(name, f"only {str(value).lower()} is supported")
        [(prompt_kind, prompt)] = body_prompts(body, kind)
        tools = [t.as_openai() for t in tool_list(body.get("tools"))] if kind == "chat" else []
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(
                self.tokenize,
                partial(checked_prompt_ids, tools=tools),
                self.model,
                prompt_kind,
                prompt,
                self.limits,
            )
        except ServiceError as err:
            raise from_service_error(err, kind) from None
        return web.json_response(
            {"count": len(ids), "max_model_len": self.model.max_context, "tokens": ids}
        )

    async def detokenize_route(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = body.get("tokens")
        if not int_list(tokens):
            raise bad_param("tokens", "must be a list of token ids")
        if len(tokens) > self.model.max_context:
            raise bad_param(
                "tokens", f"{len(tokens)} tokens: over the context of {self.model.max_context}"
            )
        try:
            check_vocab(tokens, "tokens", self.model.vocab_size)
        except InvalidField as err:
            raise from_service_error(err, "completion") from None
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(self.tokenize, self.model.tokenizer.decode, tokens)
        return web.json_response({"prompt": text})

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise OpenAIError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the body must be a JSON object")
        self.check_model(body.get("model"))
        return body
