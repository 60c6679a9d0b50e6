"""The prompt's log-probabilities over the HTTP API (gateway/openai_logprobs.py): a completions
body's `echo` with `logprobs` lists the echoed prompt's tokens ahead of the choice's (the first
one's null, as OpenAI's), vLLM's `prompt_logprobs` gives each prompt token's entry by id with its
rank and text (per completions choice; a chat response's at its top); the request asks the
verifier for the wider of the two; streamed, they come in an event of their own ahead of the
choice's first text, as the whole response has them; in a session's turn they are refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.request import Chunk, GenerationRequest
from specsplit.messages import TokenLogprobs
from tests.unit.test_openai_guide import _run


class _Prompted:
    """Answers with one generated token (id 7, log-probability -0.5), the first chunk bringing
    the prompt's log-probabilities where asked: token i's -0.1 * i, the top tokens ids 1, 2, 3
    (-0.01, -1, -2) at every place."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    def generate(self, req: GenerationRequest, waiting_too: int = 0) -> AsyncIterator[Chunk]:
        self.requests.append(req)
        n, width, k = len(req.prompt_ids) - 1, req.prompt_logprobs, req.logprobs
        prompt = None
        if width is not None:
            values = [-0.1 * i for i in range(1, n + 1)]
            prompt = TokenLogprobs(
                values, [[1, 2, 3][:width]] * n, [[-0.01, -1.0, -2.0][:width]] * n
            )
        tokens = None if k is None else TokenLogprobs([-0.5], [[7, 1][:k]], [[-0.5, -3.0][:k]])

        async def chunks() -> AsyncIterator[Chunk]:
            yield Chunk(
                token_ids=[7], text="x", finish_reason="length", completion_tokens=1,
                logprobs=tokens, prompt_logprobs=prompt,
            )  # fmt: skip

        return chunks()


def _completion(tokenizer: Any, **extra: Any) -> tuple[Any, _Prompted]:
    body = {"model": "m", "prompt": "The quick brown fox", "max_tokens": 1, **extra}
    answers, scheduler = _run(tokenizer, [body], _Prompted(), route="/v1/completions")
    return answers[0], scheduler


def test_echo_with_logprobs_lists_the_prompt_first(smollm2_tokenizer) -> None:
    out, scheduler = _completion(smollm2_tokenizer, echo=True, logprobs=2, temperature=0)
    prompt = scheduler.requests[0].prompt_ids
    assert scheduler.requests[0].prompt_logprobs == 2
    choice = out["choices"][0]
    block = choice["logprobs"]
    texts = [smollm2_tokenizer.decode([t]) for t in prompt]
    assert block["tokens"] == [*texts, smollm2_tokenizer.decode([7])]
    assert block["token_logprobs"][0] is None and block["top_logprobs"][0] is None
    assert block["token_logprobs"][1:] == pytest.approx(
        [-0.1 * i for i in range(1, len(prompt))] + [-0.5]
    )
    assert all(len(top) <= 2 for top in block["top_logprobs"][1:])
    offsets = block["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] == sum(len(t) for t in texts)  # (the generated token after the prompt)
    assert choice["text"].startswith("The quick brown fox") and "prompt_logprobs" not in choice


def test_prompt_logprobs_give_each_prompt_tokens_entry(smollm2_tokenizer) -> None:
    out, scheduler = _completion(smollm2_tokenizer, prompt_logprobs=2)
    prompt = scheduler.requests[0].prompt_ids
    entries = out["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for i, (token, entry) in enumerate(zip(prompt[1:], entries[1:], strict=True), start=1):
        assert entry[str(token)]["logprob"] == pytest.approx(-0.1 * i)
        assert entry[str(token)]["decoded_token"] == smollm2_tokenizer.decode([token])
        assert entry["1"]["rank"] == 1 and entry["2"]["rank"] == 2 and "3" not in entry
        assert entry[str(token)]["rank"] == (1 if token == 1 else 2 if token == 2 else None)
    assert out["choices"][0]["logprobs"] is None
    wider, scheduler = _completion(smollm2_tokenizer, prompt_logprobs=1, echo=True, logprobs=3)
    assert scheduler.requests[0].prompt_logprobs == 3  # (the wider of the two)
    assert all(len(e) <= 2 for e in wider["choices"][0]["prompt_logprobs"][1:])


def test_a_chat_response_carries_its_prompts_logprobs(smollm2_tokenizer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0}
    answers, scheduler = _run(smollm2_tokenizer, [body], _Prompted())
    entries = answers[0]["prompt_logprobs"]
    assert len(entries) == len(scheduler.requests[0].prompt_ids) and entries[0] is None
    assert all(len(e) == 1 for e in entries[1:])  # (the token's own alone)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "session_id": "s"}, "prompt_logprobs"),
    ],
    ids=["too-many", "negative", "session"],
)
def test_unsupported_prompt_logprobs_are_refused(
    smollm2_tokenizer, extra: dict[str, Any], param: str
) -> None:
    error, scheduler = _completion(smollm2_tokenizer, **extra)
    assert error["param"] == param, error
    assert not scheduler.requests


def _joined(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed completions choice made whole: its text, its logprobs blocks joined."""
    choices = [e["choices"][0] for e in events if e["choices"]]
    block: dict[str, list[Any]] = {}
    for c in choices:
        for key, values in (c.get("logprobs") or {}).items():
            block.setdefault(key, []).extend(values)
    return {"text": "".join(c["text"] for c in choices), "logprobs": block or None}


@pytest.mark.parametrize(
    "extra",
    [{"echo": True, "logprobs": 2}, {"prompt_logprobs": 2}, {"echo": True, "prompt_logprobs": 1}],
    ids=["echo-logprobs", "prompt-logprobs", "echo-prompt-logprobs"],
)
def test_streamed_prompt_logprobs_are_the_whole_responses(
    smollm2_tokenizer, extra: dict[str, Any]
) -> None:
    """Streamed, the prompt (echoed, its logprobs block, vLLM's entries) comes in an event ahead
    of the choice's first text: joined, the events are the whole response's choice."""
    whole, asked = _completion(smollm2_tokenizer, temperature=0, **extra)
    events, scheduler = _completion(smollm2_tokenizer, temperature=0, stream=True, **extra)
    assert scheduler.requests[0].prompt_logprobs == asked.requests[0].prompt_logprobs
    choice = whole["choices"][0]
    joined = _joined(events)
    assert joined["text"] == choice["text"]
    assert joined["logprobs"] == choice["logprobs"]
    first = events[0]["choices"][0]
    assert first.get("prompt_logprobs") == choice.get("prompt_logprobs")
    if extra.get("echo"):
        assert first["text"] == "The quick brown fox"


def test_a_streamed_chat_carries_its_prompts_logprobs_first(smollm2_tokenizer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0}
    whole, _ = _run(smollm2_tokenizer, [body], _Prompted())
    events, _ = _run(smollm2_tokenizer, [{**body, "stream": True}], _Prompted())
    carrying = [e for e in events[0] if "prompt_logprobs" in e]
    assert len(carrying) == 1 and carrying[0]["prompt_logprobs"] == whole[0]["prompt_logprobs"]
