"""Guided decoding's OpenAI and vLLM parameters (gateway/openai_guide.py) over the HTTP API: each
form (`response_format` json_object / json_schema, `guided_json` as an object or its text,
`guided_regex`, `guided_choice`, `structured_outputs`) reaches the request as an automaton of the
pattern it names, compiled once a pattern; `guided_whitespace_pattern` sets a JSON guide's
whitespace; a malformed guide, two guides, or one with ignore_eos is a 400 naming the parameter,
and nothing reaches the scheduler."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.openai_http import OpenAIServer
from gateway.request import ModelInfo
from specsplit.guide.bad_words import BadWords, word_variants
from specsplit.guide.tokens import DEAD, FixedTokens, TokenAutomaton
from tests.unit.test_openai_http_errors import _chat, _error, _Scheduler

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _format(schema: Any) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


def _run(
    tokenizer: Any,
    bodies: list[dict[str, Any]],
    scheduler: Any = None,
    route: str = "/v1/chat/completions",
) -> tuple[list[Any], Any]:
    """Each body posted to `route`: its response's JSON (a streamed one's: its events' JSON),
    or its error's for a 400; and the scheduler (default: one finished chunk each)."""
    model = ModelInfo(tokenizer, tokenizer.vocab_size, 2048, (tokenizer.eos_token_id,))
    scheduler = scheduler or _Scheduler()
    answers: list[Any] = []

    async def main() -> None:
        with ThreadPoolExecutor(1) as tokenize:
            server = OpenAIServer(model, scheduler, "m", tokenize)
            server.ready = True
            async with TestClient(TestServer(server.app)) as client:
                for body in bodies:
                    response = await client.post(route, json=body)
                    if response.status != 200:
                        answers.append(await _error(response, 400))
                    elif body.get("stream"):
                        lines = (await response.text()).split("\n\n")
                        events = [line.removeprefix("data: ") for line in lines if line]
                        assert events[-1] == "[DONE]"
                        answers.append([json.loads(e) for e in events[:-1]])
                    else:
                        answers.append(await response.json())

    asyncio.run(main())
    return answers, scheduler


@pytest.mark.parametrize(
    ("extra", "good", "bad"),
    [
        ({"response_format": {"type": "json_object"}}, '{"a": [1, {"b": null}]}', "[1]"),
        (
            _format(SCHEMA),
            '{"n": 3}',
            '{"n": "3"}',
        ),
        ({"guided_json": SCHEMA}, '{ "n" : -4 }', '{"m": 1}'),
        ({"guided_json": json.dumps(SCHEMA)}, '{"n":0}', '{"n":01}'),
        ({"guided_regex": r"[0-9]{3}-[a-z]+"}, "123-abc", "12-abc"),
        ({"guided_choice": ["red", "green"]}, "green", "blue"),
        ({"structured_outputs": {"json": SCHEMA}}, '{"n": 1}', "{}"),
        ({"structured_outputs": {"regex": "a+b", "json": None}}, "aab", "b"),
        ({"structured_outputs": {"choice": ["x y", "z"]}}, "x y", "x"),
        ({"structured_outputs": {"json_object": True}}, "{}", "1"),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": ""}, '{"n":1}', '{"n": 1}'),
    ],
    ids=[
        "json-object", "json-schema", "guided-json", "guided-json-text", "guided-regex",
        "guided-choice", "structured-json", "structured-regex", "structured-choice",
        "structured-json-object", "whitespace-pattern",
    ],
)  # fmt: skip
def test_each_guide_parameter_reaches_the_request_as_its_pattern(
    smollm2_tokenizer, extra: dict[str, Any], good: str, bad: str
) -> None:
    answers, scheduler = _run(smollm2_tokenizer, [{**_chat("hi"), **extra}])
    assert answers[0]["object"] == "chat.completion"
    guide = scheduler.requests[0].guide
    assert isinstance(guide, TokenAutomaton)
    assert guide.dfa.matches(good) and not guide.dfa.matches(bad)
    assert guide.end_ids == (smollm2_tokenizer.eos_token_id,)


def test_allowed_token_ids_reach_the_request_as_fixed_tokens(smollm2_tokenizer) -> None:
    _, scheduler = _run(smollm2_tokenizer, [{**_chat("hi"), "allowed_token_ids": [9, 4, 9]}])
    guide = scheduler.requests[0].guide
    assert isinstance(guide, FixedTokens) and guide.allowed == {4, 9}


def test_bad_words_reach_the_request_as_their_tokens(smollm2_tokenizer) -> None:
    _, scheduler = _run(smollm2_tokenizer, [{**_chat("hi"), "bad_words": ["hello", "big cat"]}])
    guide = scheduler.requests[0].guide
    assert isinstance(guide, BadWords)
    for word in word_variants(smollm2_tokenizer, ["hello", "big cat"]):
        assert guide.step(guide.walk(0, list(word[:-1])), word[-1]) == DEAD


def test_a_pattern_compiles_once_for_every_request_that_names_it(smollm2_tokenizer) -> None:
    body = {**_chat("hi"), "guided_regex": "(ab)+", "n": 2}
    _, scheduler = _run(smollm2_tokenizer, [body, body])
    guides = [req.guide for req in scheduler.requests]
    assert len(guides) == 4 and all(g is guides[0] for g in guides)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (_format({"not": {}}), "response_format"),
        ({"guided_regex": "(?=a)a"}, "guided_regex"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{oops"}, "guided_json"),
        ({"guided_json": 3}, "guided_json"),
        ({"structured_outputs": {"grammar": "x"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
        ({"guided_regex": "a", "min_tokens": 2}, "min_tokens"),
        ({"guided_regex": "a{20000}"}, "guided_regex"),
        ({"allowed_token_ids": [3, 10**8]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": ["3"]}, "allowed_token_ids"),
        ({"allowed_token_ids": [3], "guided_regex": "a"}, "allowed_token_ids"),
        ({"allowed_token_ids": [3], "min_tokens": 1}, "min_tokens"),
        ({"bad_words": ["x", 3]}, "bad_words"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": ["x"], "guided_choice": ["a"]}, "bad_words"),
        ({"bad_words": ["x"], "allowed_token_ids": [3]}, "bad_words"),
        ({"bad_words": ["x"], "min_tokens": 1}, "min_tokens"),
    ],
    ids=[
        "regex-and-choice", "format-and-json", "unknown-type", "unsupported-keyword",
        "lookahead", "empty-regex", "no-choices", "json-text-malformed", "json-a-number",
        "grammar", "two-structured", "whitespace-without-json", "ignore-eos", "min-tokens",
        "too-many-states", "allowed-past-vocab", "allowed-empty", "allowed-strings",
        "allowed-and-guide", "allowed-and-min-tokens", "bad-words-number", "bad-words-blank",
        "bad-words-and-guide", "bad-words-and-allowed", "bad-words-and-min-tokens",
    ],
)  # fmt: skip
def test_a_guide_that_cannot_be_held_is_400_naming_the_parameter(
    smollm2_tokenizer, extra: dict[str, Any], param: str
) -> None:
    answers, scheduler = _run(smollm2_tokenizer, [{**_chat("hi"), **extra}])
    assert answers[0]["type"] == "invalid_request_error" and answers[0]["param"] == param, answers
    assert scheduler.requests == []
