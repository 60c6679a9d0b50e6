"""The HTTP API's session routes, an extension (gateway/openai_http.py adds them; the sessions
are gateway/sessions.py's): POST /v1/sessions {"ttl_seconds": optional} opens one and answers
{"id", "object": "session", "ttl_seconds"}; DELETE /v1/sessions/{session_id} closes it and
answers {"id", "object": "session.deleted", "deleted": true, "num_tokens"}. A chat body's
`session_id` then runs a turn in it."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from gateway.openai_body import OpenAIError, body_field, from_service_error
from gateway.servicer import NOT_TAKING_REQUESTS
from gateway.sessions import SessionStore
from specsplit.errors import ServiceError


class SessionRoutes:
    def __init__(self, sessions: Callable[[], SessionStore], draining: Callable[[], bool]):
        """sessions: the scheduler's store; draining: whether the server takes no new work."""
        self.sessions = sessions
        self.draining = draining

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/sessions", self.open)
        app.router.add_delete("/v1/sessions/{session_id}", self.close)

    async def open(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        if not isinstance(body, dict):
            raise OpenAIError(400, "the body must be a JSON object")
        ttl = body_field(body, "ttl_seconds", (int, float), None)
        if self.draining():
            raise OpenAIError(503, NOT_TAKING_REQUESTS)
        try:
            session = self.sessions().open(None if ttl is None else float(ttl))
        except ServiceError as err:
            raise from_service_error(err, "chat") from None
        return web.json_response(
            {"id": session.session_id, "object": "session", "ttl_seconds": session.ttl_s}
        )

    async def close(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        try:
            num_tokens = await self.sessions().close(session_id)
        except ServiceError as err:
            raise from_service_error(err, "chat") from None
        answer = {"id": session_id, "object": "session.deleted", "deleted": True}
        return web.json_response({**answer, "num_tokens": num_tokens})
