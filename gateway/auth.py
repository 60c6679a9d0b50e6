"""API keys on the gateway (DESIGN.md §8), the vLLM / SGLang convention.

Clients send `authorization: Bearer KEY` (gRPC metadata or HTTP header). A missing or wrong
key is UNAUTHENTICATED / HTTP 401; gRPC health checks and reflection and HTTP /health stay
open. Each key may hold at most `max_concurrent_per_key` calls at once (0 = no limit); one more
is RESOURCE_EXHAUSTED / HTTP 429. Keys are compared in constant time (their SHA-256 digests,
so neither the content nor the length of a key shows in the timing). No keys = open.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from aiohttp import web

BEARER = "bearer "
# gRPC methods every client may call: load balancers and grpcurl need them without a key
OPEN_GRPC_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
OPEN_HTTP_PATHS = frozenset({"/health", "/ping"})  # every other route needs a key


class Refused(Exception):
    """A call the keys do not let in: status 401 (no or wrong key) or 429 (over the limit)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def grpc_code(self) -> grpc.StatusCode:
        if self.status == 401:
            return grpc.StatusCode.UNAUTHENTICATED
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def openai_body(self) -> dict[str, Any]:
        """OpenAI's error shape, with OpenAI's type and code for these two cases."""
        if self.status == 401:
            kind, code = "invalid_request_error", "invalid_api_key"
        else:
            kind, code = "requests", "rate_limit_exceeded"
        return {"error": {"message": self.message, "type": kind, "param": None, "code": code}}


def parse_keys(flags: Iterable[str] | None, env: str | None) -> tuple[str, ...]:
    """Keys from repeated --api-key flags, else $SPECSPLIT_API_KEY (comma-separated)."""
    given = list(flags or []) or (env or "").split(",")
    return tuple(dict.fromkeys(key.strip() for key in given if key.strip()))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The gateway's keys and the calls each has in flight."""

    def __init__(self, keys: Iterable[str], max_concurrent_per_key: int = 0) -> None:
        self._digests = [_digest(key) for key in keys]
        self.max_concurrent_per_key = max_concurrent_per_key
        self._in_flight: Counter[int] = Counter()  # key index -> calls holding a slot

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def describe(self) -> str:
        """A startup log line: open, or how many keys and their limit."""
        if not self.enabled:
            return "no API key configured: every client is let in (set --api-key)"
        limit = self.max_concurrent_per_key or "no limit on"
        return f"{len(self._digests)} API key(s); {limit} concurrent calls per key"

    def identify(self, authorization: str | None) -> int:
        """Index of the key `authorization` ("Bearer KEY") carries; Refused(401) otherwise.
        Every key is compared, in constant time."""
        if authorization is None or not authorization.lower().startswith(BEARER):
            raise Refused(401, "missing API key: send the header 'authorization: Bearer KEY'")
        presented = _digest(authorization[len(BEARER) :].strip())
        found = -1
        for index, digest in enumerate(self._digests):
            if hmac.compare_digest(presented, digest):
                found = index
        if found < 0:
            raise Refused(401, "invalid API key")
        return found

    def acquire(self, authorization: str | None, count: int = 1) -> Callable[[], None]:
        """Take `count` of the key's concurrent calls (an HTTP body's further choices take one
        each); returns what gives them back. Refused (401 or 429) when they may not go on: all
        or none. Open gateway: nothing to take."""
        if not self.enabled or count <= 0:
            return _nothing
        index = self.identify(authorization)
        limit = self.max_concurrent_per_key
        if limit and self._in_flight[index] + count > limit:
            in_flight = self._in_flight[index]
            raise Refused(
                429,
                f"this API key has {in_flight} calls in flight and the limit is {limit}"
                + (f"; this one asks for {count} more" if count > 1 else ""),
            )
        self._in_flight[index] += count

        def release() -> None:
            self._in_flight[index] -= count
            if not self._in_flight[index]:
                del self._in_flight[index]

        return release

    def in_flight(self) -> int:
        """Calls holding a slot, over all keys."""
        return sum(self._in_flight.values())

    # -- gRPC ------------------------------------------------------------------------------

    def grpc_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _GrpcKeys(self)

    # -- HTTP ------------------------------------------------------------------------------

    @web.middleware
    async def http_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not self.enabled or request.path in OPEN_HTTP_PATHS:
            return await handler(request)
        try:
            release = self.acquire(request.headers.get("Authorization"))
        except Refused as refused:
            headers = {"WWW-Authenticate": "Bearer"} if refused.status == 401 else None
            return web.json_response(refused.openai_body(), status=refused.status, headers=headers)
        try:
            return await handler(request)
        finally:
            release()


def _metadata(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value if isinstance(value, str) else value.decode()
    return None


class _GrpcKeys(grpc.aio.ServerInterceptor):
    """Every method but the open ones holds a slot of its key (ApiKeys.acquire) while it runs."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or not self.keys.enabled or method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        for kind, make in _HANDLER_KINDS.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(  # type: ignore[no-any-return]
                    self._guard(behavior),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _guard(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        keys = self.keys

        async def admit(context: grpc.aio.ServicerContext) -> Callable[[], None]:
            try:
                return keys.acquire(_metadata(context, "authorization"))
            except Refused as refused:
                await context.abort(refused.grpc_code, refused.message)
                raise AssertionError("unreachable: context.abort raises") from None

        if inspect.isasyncgenfunction(behavior):  # a method that yields its responses

            async def streaming(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                release = await admit(context)
                try:
                    async for response in behavior(request, context):
                        yield response
                finally:
                    release()

            return streaming

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            release = await admit(context)
            try:
                return await behavior(request, context)
            finally:
                release()

        return call


def _nothing() -> None:
    pass


_HANDLER_KINDS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}
