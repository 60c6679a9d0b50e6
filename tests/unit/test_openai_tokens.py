"""POST /tokenize and /detokenize (vLLM's routes): a text prompt's and a chat's ids are those a
generation of that body reads (with the chat template's assistant prompt, and its tools),
counted against the context; ids decode back to text; bad bodies are 400s in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient

from gateway.request import Limits
from specsplit.prompt import apply_chat_template, encode_prompt
from tests.unit.test_openai_http_errors import _error, _run, _Scheduler

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_tokenize_gives_the_ids_a_generation_reads(smollm2_tokenizer) -> None:
    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        text = await client.post("/tokenize", json={"model": "m", "prompt": "Hello there"})
        assert text.status == 200, await text.text()
        ids = encode_prompt(smollm2_tokenizer, "Hello there")
        assert await text.json() == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
        chat = await (await client.post("/tokenize", json={"messages": MESSAGES})).json()
        assert chat["tokens"] == apply_chat_template(smollm2_tokenizer, MESSAGES)
        assert chat["count"] == len(chat["tokens"])
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        sent = {"messages": MESSAGES, "tools": tools}
        with_tools = await (await client.post("/tokenize", json=sent)).json()
        assert with_tools["tokens"] == apply_chat_template(smollm2_tokenizer, MESSAGES, tools)
        assert with_tools["count"] > chat["count"]  # (the tools in the prompt)
        back = await client.post("/detokenize", json={"tokens": ids})
        assert (await back.json())["prompt"] == smollm2_tokenizer.decode(ids)
        assert scheduler.requests == []  # (no generation)

    _run(smollm2_tokenizer, body)


def test_bad_token_bodies_are_400_naming_the_field(smollm2_tokenizer) -> None:
    cases: list[tuple[str, Any, str | None]] = [
        ("/tokenize", {"prompt": [1, 2]}, "prompt"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": False}, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "x" * 5000}, "prompt"),  # over the prompt bytes
        ("/tokenize", [1, 2], None),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1, True]}, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [1] * 2049}, "tokens"),
    ]

    async def body(client: TestClient, scheduler: _Scheduler) -> None:
        for route, sent, param in cases:
            error = await _error(await client.post(route, json=sent), 400)
            assert error["param"] == param, (route, sent, error)
        error = await _error(
            await client.post("/tokenize", json={"model": "x", "prompt": "a"}), 404
        )
        assert error["param"] == "model"

    _run(smollm2_tokenizer, body, limits=Limits(max_prompt_bytes=4096))
