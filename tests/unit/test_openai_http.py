"""gateway.openai_http in-process over a fake scheduler: what the real services cannot show
deterministically (a disconnect closes the generator; 503 before the backend is ready)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import aiohttp

from gateway.openai_http import OpenAIServer
from gateway.request import Chunk, GenerationRequest, ModelInfo
from tests.integration.services import free_port

MODEL = ModelInfo(tokenizer=None, vocab_size=100, max_context=64)


class EndlessScheduler:
    """Streams one chunk, then nothing ever again; records when its generator is closed."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.requests: list[GenerationRequest] = []

    async def generate(self, req: GenerationRequest, waiting_too: int = 0) -> AsyncIterator[Chunk]:
        self.requests.append(req)
        try:
            yield Chunk(token_ids=[7], text="a")
            await asyncio.Event().wait()
        finally:
            self.closed.set()


def _run(body: Callable[[EndlessScheduler, OpenAIServer, str], Awaitable[None]]) -> None:
    async def main() -> None:
        scheduler = EndlessScheduler()
        with ThreadPoolExecutor(1) as tokenize:
            server = OpenAIServer(MODEL, scheduler, "m", tokenize)
            address = f"127.0.0.1:{free_port()}"
            await server.start(address, grace=0.5)
            try:
                await body(scheduler, server, f"http://{address}/v1")
            finally:
                await server.stop()

    asyncio.run(main())


def test_client_disconnect_mid_stream_closes_the_generator() -> None:
    async def body(scheduler: EndlessScheduler, server: OpenAIServer, url: str) -> None:
        server.ready = True
        request = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "stream": True}
        async with aiohttp.ClientSession() as session:
            response = await session.post(f"{url}/completions", json=request)
            line = await response.content.readline()
            assert json.loads(line.removeprefix(b"data: "))["choices"][0]["text"] == "a"
            assert not scheduler.closed.is_set()
            response.close()  # the client goes away mid-stream
        await asyncio.wait_for(scheduler.closed.wait(), timeout=5)
        assert scheduler.requests[0].prompt_ids == [1, 2, 3]
        assert scheduler.requests[0].max_new_tokens == 8

    _run(body)


def test_not_ready_is_503_in_openai_error_shape() -> None:
    async def body(scheduler: EndlessScheduler, server: OpenAIServer, url: str) -> None:
        request = {"model": "m", "prompt": [1, 2], "max_tokens": 4}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/completions", json=request) as response,
        ):
            assert response.status == 503
            error = (await response.json())["error"]
            assert error["type"] == "service_unavailable" and "verifier" in error["message"]
        assert scheduler.requests == []

    _run(body)


def test_health_is_503_until_ready_200_then_503_once_draining() -> None:
    async def body(scheduler: EndlessScheduler, server: OpenAIServer, url: str) -> None:
        root = url.removesuffix("/v1")
        async with aiohttp.ClientSession() as session:

            async def statuses() -> list[int]:
                found = []
                for path in ("/health", "/ping"):
                    async with session.get(f"{root}{path}") as response:
                        found.append(response.status)
                        if response.status == 503:
                            error = (await response.json())["error"]
                            assert error["type"] == "service_unavailable", error
                        else:
                            assert await response.json() == {"status": "ok"}
                return found

            assert await statuses() == [503, 503]  # the verifier not yet SERVING
            server.ready = True
            assert await statuses() == [200, 200]
            server.draining = True  # shutting down: no new requests
            assert await statuses() == [503, 503]

    _run(body)
