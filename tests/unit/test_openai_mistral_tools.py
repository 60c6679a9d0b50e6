"""Mistral's tool calls under "auto" (gateway/call_formats.py `MISTRAL`): a chat template that
names `[TOOL_CALLS]` picks the format; a request that may be answered with calls then decodes
its output with special tokens kept (the tag is one, which decoded text otherwise drops), and
only then; the calls are read back after any text, as v3's JSON array or v11's `name[ARGS]{...}`
pairs, streamed as text until the tag begins; what is not a call of the tools stays text."""

from __future__ import annotations

import copy
import json
from typing import Any

from gateway.call_formats import MISTRAL, call_format
from gateway.text import IncrementalDetokenizer
from gateway.tools import Tool, ToolAsk, read_auto_calls
from tests.unit.test_openai_tools import _body, _post

# a chat template of our own that renders tools and names Mistral's tag, as Mistral's do
MISTRAL_TEMPLATE = (
    "{% for m in messages %}[INST] {{ m.content }}"
    "{% if tools and loop.last %} [AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[/INST]{% endfor %}"
    "{% if messages[-1].tool_calls %}[TOOL_CALLS]{% endif %}"
)
V3_CALLS = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'  # noqa: E501
V11_CALLS = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'


def _mistral(smollm2_tokenizer: Any) -> Any:
    """The tokenizer with Mistral's template and its tags as special tokens."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    return tokenizer


def test_the_template_picks_mistrals_format_and_keeps_special_tokens(smollm2_tokenizer) -> None:
    """Mistral's template: "auto" requests (the default) decode with special tokens kept, so
    the tag reaches the text; without tools, or with "none" or a named call (guided: no tag),
    they are skipped as asked."""
    assert call_format(MISTRAL_TEMPLATE) is MISTRAL
    assert call_format(smollm2_tokenizer.chat_template) is not MISTRAL
    tokenizer = _mistral(smollm2_tokenizer)
    named = {"type": "function", "function": {"name": "add"}}
    cases = [(_body(), False), (_body(tool_choice="auto"), False)]
    cases += [(_body(tool_choice="none"), True), (_body(tool_choice=named), True)]
    cases += [({**_body(), "tools": []}, True)]
    for body, skips in cases:
        _, scheduler = _post(tokenizer, body, ["ok"])
        assert scheduler.requests[0].skip_special_tokens is skips, body.get("tool_choice")
    _, hermes = _post(smollm2_tokenizer, _body(), ["ok"])
    assert hermes.requests[0].skip_special_tokens is True
    ids = tokenizer.encode(V11_CALLS, add_special_tokens=False)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert kept.add(ids) + kept.flush() == V11_CALLS
    skipped = IncrementalDetokenizer(tokenizer, [])
    assert "[TOOL_CALLS]" not in skipped.add(ids) + skipped.flush()


def test_v3_and_v11_calls_are_read_back_after_any_text(smollm2_tokenizer) -> None:
    tokenizer = _mistral(smollm2_tokenizer)
    for calls in (V3_CALLS, V11_CALLS):
        out, _ = _post(tokenizer, _body(), ["Let me see. ", calls[:30], calls[30:]])
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me see."
        got = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in got] == ["add", "get_weather"]
        assert json.loads(got[1]["function"]["arguments"]) == {"city": "Rome"}
    for text in [
        "[TOOL_CALLS] [{",  # (cut short)
        '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]',
        '[TOOL_CALLS]add[ARGS]{"a": 1} trailing words',
        "No calls here.",
    ]:
        out, _ = _post(tokenizer, _body(), [text])
        assert out["choices"][0]["message"] == {"role": "assistant", "content": text}


def test_streamed_text_goes_out_until_the_tag_begins(smollm2_tokenizer) -> None:
    tokenizer = _mistral(smollm2_tokenizer)
    pieces = ["Sum [1] and [TOOL", "_CALLS]add[ARGS]", '{"a": 1, "b": 2}']
    events, _ = _post(tokenizer, _body(stream=True), pieces)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "Sum [1] and "
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "add"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [MISTRAL.held(t) for t in ["a [", "a [TOOL_CA", "a [b", "x"]] == [1, 8, 0, 0]
    ask = ToolAsk((Tool("add"),), "auto", writes=MISTRAL, parallel=False)
    found = read_auto_calls(ask, V11_CALLS.replace("get_weather", "add"))
    assert found is not None and found[0] is None and len(found[1]) == 1
