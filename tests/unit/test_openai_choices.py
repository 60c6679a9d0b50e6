"""A body's several choices (gateway/openai_choices.py): each sample's seed, prompt-major order,
chunks merged as they come with their choice's index, an error or a refusal ending all of them,
and every stream closed whatever happens (each frees its sequence)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.openai_choices import choice_requests, close_all, merged
from gateway.openai_http import OpenAIServer
from gateway.request import Chunk, GenerationRequest, ModelInfo
from specsplit.errors import Code, ServiceError
from specsplit.sampling import SEED_SPACE, SamplingParams


def _request(prompt: list[int], seed: int | None) -> GenerationRequest:
    return GenerationRequest(prompt, 4, SamplingParams(temperature=1.0, seed=seed))


def test_sample_k_of_a_seeded_prompt_draws_with_seed_plus_k_prompt_major() -> None:
    requests = choice_requests([_request([1], SEED_SPACE - 2), _request([2], None)], 3)
    assert [r.prompt_ids for r in requests] == [[1], [1], [1], [2], [2], [2]]
    assert [r.sampling.seed for r in requests] == [SEED_SPACE - 2, SEED_SPACE - 1, 0] + [None] * 3
    assert requests[1].prompt_ids is not requests[0].prompt_ids  # each its own
    assert choice_requests([_request([1], 5)], 1)[0].sampling.seed == 5


class _Stream:
    """An async generator's surface: chunks after delays, then maybe an error; records aclose."""

    def __init__(self, delays: list[float], fail: bool = False) -> None:
        self.delays, self.fail, self.closed = delays, fail, False
        self.gen = self._chunks()

    async def _chunks(self) -> AsyncIterator[Chunk]:
        try:
            for i, delay in enumerate(self.delays):
                await asyncio.sleep(delay)
                last = i == len(self.delays) - 1
                yield Chunk([i], str(i), "length" if last and not self.fail else None)
            if self.fail:
                raise ServiceError(Code.UNAVAILABLE, "the verifier went away")
        finally:
            self.closed = True


def test_merged_yields_chunks_as_they_come_with_their_index() -> None:
    async def main() -> list[tuple[int, str]]:
        streams = [_Stream([0.0, 0.06]), _Stream([0.03, 0.0])]
        got = [(i, c.text) async for i, c in merged([s.gen for s in streams])]
        await close_all([s.gen for s in streams])
        assert all(s.closed for s in streams)
        return got

    assert asyncio.run(main()) == [(0, "0"), (1, "0"), (1, "1"), (0, "1")]


def test_one_streams_error_ends_the_merge_and_every_stream_closes() -> None:
    async def main() -> None:
        streams = [_Stream([0.0, 5.0]), _Stream([0.01], fail=True)]
        gens = [s.gen for s in streams]
        seen = []
        with pytest.raises(ServiceError):
            async for index, _ in merged(gens):
                seen.append(index)
        await close_all(gens)
        assert seen == [0, 1] and all(s.closed for s in streams)  # the slow one cut short

    asyncio.run(main())


class _Scheduler:
    """Streams one chunk a request; refuses (a full queue) where its requests and those asked
    for with them (`waiting_too`) would pass `room`, and the `refuse_at`-th request anyway."""

    def __init__(self, room: int, refuse_at: int | None = None) -> None:
        self.room, self.refuse_at, self.streams = room, refuse_at, []  # type: ignore[var-annotated]
        self.requests: list[GenerationRequest] = []

    def generate(self, req: GenerationRequest, waiting_too: int = 0) -> Any:
        if len(self.requests) + waiting_too >= self.room or len(self.requests) == self.refuse_at:
            raise ServiceError(Code.RESOURCE_EXHAUSTED, "the gateway's waiting queue is full")
        self.requests.append(req)
        stream = _Stream([0.0])
        self.streams.append(stream)
        return stream.gen


def _post(tokenizer: Any, scheduler: _Scheduler, body: dict[str, Any]) -> tuple[int, Any]:
    model = ModelInfo(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, max_context=2048)

    async def main() -> tuple[int, Any]:
        with ThreadPoolExecutor(1) as tokenize:
            server = OpenAIServer(model, scheduler, "m", tokenize)  # type: ignore[arg-type]
            server.ready = True
            async with TestClient(TestServer(server.app)) as client:
                response = await client.post("/v1/completions", json=body)
                return response.status, await response.json()

    return asyncio.run(main())


def test_a_body_asks_room_for_all_its_choices_at_once(smollm2_tokenizer) -> None:
    scheduler = _Scheduler(room=3)
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 4}
    status, answer = _post(smollm2_tokenizer, scheduler, body)
    assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded"
    assert scheduler.requests == []  # none of the four taken
    status, answer = _post(smollm2_tokenizer, _Scheduler(room=4), body)
    assert status == 200 and len(answer["choices"]) == 4


def test_a_refused_choice_refuses_the_body_and_closes_the_choices_queued(
    smollm2_tokenizer,
) -> None:
    scheduler = _Scheduler(room=99, refuse_at=2)
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 4}
    status, answer = _post(smollm2_tokenizer, scheduler, body)
    assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded"
    assert len(scheduler.streams) == 2  # (as the scheduler's: queued once iterated, never here)
    assert all(s.gen.ag_frame is None for s in scheduler.streams)  # each closed


def test_choices_come_in_prompt_major_order_with_usage_summed(smollm2_tokenizer) -> None:
    scheduler = _Scheduler(room=99)
    body = {"model": "m", "prompt": [[5, 6, 7], [8]], "n": 2, "max_tokens": 4, "seed": 1}
    status, answer = _post(smollm2_tokenizer, scheduler, body)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert [r.prompt_ids for r in scheduler.requests] == [[5, 6, 7], [5, 6, 7], [8], [8]]
    assert [r.sampling.seed for r in scheduler.requests] == [1, 2, 1, 2]
    assert all(s.closed for s in scheduler.streams)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "n": 65}, "n"),
        ({"prompt": ["a"] * 33, "n": 2}, "prompt"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
        ({"prompt": "a", "n": 2, "session_id": "s"}, "session_id"),
        ({"prompt": ["a", [1, 2]]}, "prompt"),
        ({"prompt": []}, "prompt"),
    ],
    ids=["n_over_64", "choices_over_64", "n_zero", "best_of", "session_n", "mixed", "empty"],
)
def test_bad_choice_counts_are_400_naming_the_param(
    smollm2_tokenizer, body: dict[str, Any], param: str
) -> None:
    scheduler = _Scheduler(room=99)
    status, answer = _post(smollm2_tokenizer, scheduler, {"model": "m", **body, "max_tokens": 4})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert scheduler.requests == []
