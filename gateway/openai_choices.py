"""A body's several choices (`n` samples of each of a completions body's prompts), each a
generation of its own in the scheduler: each prompt's request (`prompt_requests`), the choices'
requests (sample k of a seeded body draws with seed + k), and their chunks as they come, each
with its choice's index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace

from gateway.openai_body import OpenAIRequest
from gateway.request import Chunk, GenerationRequest, Limits, ModelInfo, build_request
from specsplit.sampling import SEED_SPACE


def prompt_requests(
    model: ModelInfo, req: OpenAIRequest, limits: Limits
) -> list[GenerationRequest]:
    """Each prompt's request (validated and tokenized: off the event loop)."""
    return [
        build_request(
            model,
            prompt_kind,
            prompt,
            max_new_tokens=req.max_tokens,
            sampling=req.sampling,
            stop_strings=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            limits=limits,
            session_id=req.session_id,
            logprobs=req.logprobs,
            penalties=req.penalties,
            min_tokens=req.min_tokens,
            include_stop_str=req.include_stop_str,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            skip_special_tokens=req.skip_special_tokens,
            guide=req.guide,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            tools=() if req.tools is None else [t.as_openai() for t in req.tools.tools],
            prompt_logprobs=req.prompt_asks,
        )
        for prompt_kind, prompt in req.prompts
    ]


def choice_requests(per_prompt: Sequence[GenerationRequest], n: int) -> list[GenerationRequest]:
    """Each prompt's request `n` times, prompt-major (choice j * n + k: prompt j's sample k).
    Sample k > 0 of a seeded request draws with seed + k (mod 2**64): the choices differ, and
    each is the single request with that seed. Unseeded samples each draw their own seed."""
    requests = []
    for request in per_prompt:
        requests.append(request)
        seed = request.sampling.seed
        for k in range(1, n):
            sampling = replace(
                request.sampling, seed=None if seed is None else (seed + k) % SEED_SPACE
            )
            requests.append(
                replace(request, prompt_ids=list(request.prompt_ids), sampling=sampling)
            )
    return requests


async def merged(
    streams: Sequence[AsyncIterator[Chunk]],
) -> AsyncGenerator[tuple[int, Chunk], None]:
    """(index, chunk) of every stream's chunks as each comes, until all are done; one stream's
    error ends this with it (the caller closes the streams: `close_all`)."""
    if len(streams) == 1:  # (no tasks for the common case)
        async for chunk in streams[0]:
            yield 0, chunk
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):  # (ties in choice order)
                index = pending.pop(task)
                try:
                    chunk = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, chunk
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def close_all(streams: Sequence[AsyncIterator[Chunk]]) -> None:
    """Close every stream (done, failed or abandoned): each frees its sequence."""
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
