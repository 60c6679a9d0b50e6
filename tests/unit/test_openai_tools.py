"""Function calling over the chat API (gateway/openai_tools.py, gateway/tools.py): a named
tool choice guides the output to that function's parameters, "required" to a JSON array of
calls of the tools; the answer carries `tool_calls` (finish_reason "tool_calls"), streamed as
OpenAI streams them; an output cut short stays text; the tools reach the prompt through the
chat template, or a system message where the template does not render them; earlier calls and
their results are read as the conversation; "auto" (the default) leaves the text free and reads
the calls the model writes in `<tool_call>` blocks, or as Llama 3's JSON where the chat template
asks for that (streamed: the text as content until the calls begin, the calls whole at the end);
malformed tools are a 400 naming the parameter, and nothing reaches the scheduler."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.call_formats import HERMES, LLAMA3_JSON, call_format
from gateway.request import Chunk, GenerationRequest
from gateway.tools import Tool, ToolAsk, read_auto_calls, read_calls
from specsplit.guide.tokens import TokenAutomaton
from specsplit.prompt import TOOLS_FORMAT, TOOLS_INTRO, apply_chat_template
from tests.unit.test_openai_guide import _run

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ROME = {"name": "get_weather", "arguments": '{"city": "Rome"}'}  # an earlier call
BAD_CALL = {  # arguments not an object's JSON
    "role": "assistant",
    "content": "",
    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
}


class _Scripted:
    """Answers every request with `pieces` of text, the last chunk finished by `finish`."""

    def __init__(self, pieces: list[str], finish: str = "stop") -> None:
        self.pieces, self.finish = pieces, finish
        self.requests: list[GenerationRequest] = []

    def generate(self, req: GenerationRequest, waiting_too: int = 0) -> AsyncIterator[Chunk]:
        self.requests.append(req)

        async def chunks() -> AsyncIterator[Chunk]:
            for i, piece in enumerate(self.pieces):
                last = i == len(self.pieces) - 1
                yield Chunk(
                    token_ids=[7], text=piece, finish_reason=self.finish if last else None,
                    completion_tokens=i + 1,
                )  # fmt: skip

        return chunks()


def _post(
    tokenizer: Any, body: dict[str, Any], pieces: list[str], finish: str = "stop"
) -> tuple[Any, _Scripted]:
    """The body posted to chat completions, answered with `pieces` (gateway._run)."""
    answers, scheduler = _run(tokenizer, [body], _Scripted(pieces, finish))
    return answers[0], scheduler


def _body(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    return {"model": "m", "messages": messages, "tools": [WEATHER, ADD], **extra}


def test_a_named_choice_guides_to_its_parameters_and_answers_a_call(smollm2_tokenizer) -> None:
    arguments = '{"city": "Paris", "unit": "c"}'
    out, scheduler = _post(
        smollm2_tokenizer, _body(tool_choice=NAMED), [arguments[:9], arguments[9:]]
    )
    guide = scheduler.requests[0].guide
    assert isinstance(guide, TokenAutomaton)
    assert guide.dfa.matches('{"city": "Oslo"}') and not guide.dfa.matches('{"unit": "c"}')
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": arguments}


def test_required_guides_to_an_array_of_the_tools_calls(smollm2_tokenizer) -> None:
    text = json.dumps(
        [
            {"name": "add", "parameters": {"a": 1, "b": 2}},
            {"name": "get_weather", "parameters": {"city": "X"}},
        ]
    )
    out, scheduler = _post(smollm2_tokenizer, _body(tool_choice="required"), [text])
    guide = scheduler.requests[0].guide
    assert isinstance(guide, TokenAutomaton) and guide.dfa.matches(text)
    for refused in ('[{"name": "sub", "parameters": {}}]', "[]", '{"a": 1, "b": 2}'):
        assert not guide.dfa.matches(refused)
    calls = out["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert len({c["id"] for c in calls}) == 2
    _, scheduler = _post(
        smollm2_tokenizer, _body(tool_choice="required", parallel_tool_calls=False), [text]
    )
    guide = scheduler.requests[0].guide
    assert isinstance(guide, TokenAutomaton) and not guide.dfa.matches(text)
    assert guide.dfa.matches('[{"name": "add", "parameters": {"a": 1, "b": 2}}]')


def test_an_output_cut_short_stays_text(smollm2_tokenizer) -> None:
    out, _ = _post(smollm2_tokenizer, _body(tool_choice="required"), ['[{"name": "ad'], "length")
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == '[{"name": "ad'


def test_a_named_call_streams_its_arguments_as_they_come(smollm2_tokenizer) -> None:
    pieces = ['{"city"', ': "Par', 'is"}']
    events, _ = _post(smollm2_tokenizer, _body(tool_choice=NAMED, stream=True), pieces)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == "".join(pieces)
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "tool_calls"


def test_required_streams_each_call_whole_once_the_output_is(smollm2_tokenizer) -> None:
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
    events, _ = _post(
        smollm2_tokenizer, _body(tool_choice="required", stream=True), [text[:5], text[5:]]
    )
    calls = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    cut, _ = _post(
        smollm2_tokenizer, _body(tool_choice="required", stream=True), [text[:9]], "length"
    )
    assert [e["choices"][0]["delta"].get("content") for e in cut][1] == text[:9]
    assert cut[-1]["choices"][0]["finish_reason"] == "length"


def test_tool_choice_none_answers_text_with_the_tools_in_the_prompt(smollm2_tokenizer) -> None:
    out, scheduler = _post(smollm2_tokenizer, _body(tool_choice="none"), ["Sunny."])
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Sunny."}
    assert scheduler.requests[0].guide is None
    prompt = smollm2_tokenizer.decode(scheduler.requests[0].prompt_ids)
    assert TOOLS_INTRO.strip() in prompt and '"name": "get_weather"' in prompt


def test_a_template_without_tools_gets_them_in_the_system_message(smollm2_tokenizer) -> None:
    """The embedded model's template renders no tools: they join the system message (or make
    one), and an assistant's earlier calls are written as its text in the blocks the prompt asks
    for, a "tool" message kept."""
    tools = [WEATHER]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [ROME]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ]  # fmt: skip
    text = smollm2_tokenizer.decode(apply_chat_template(smollm2_tokenizer, messages, tools))
    assert text.index("Be brief.") < text.index(TOOLS_INTRO.strip()) < text.index("Weather?")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in text
    assert "18 C" in text
    alone = smollm2_tokenizer.decode(apply_chat_template(smollm2_tokenizer, messages[1:2], tools))
    assert alone.index(TOOLS_INTRO.strip()) < alone.index("Weather?")


def test_a_template_that_renders_tools_gets_them_as_transformers_passes_them(
    smollm2_tokenizer,
) -> None:
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }};{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}"
        "CALL {{ c.function.name }} {{ c.function.arguments.city }};"
        "{% endfor %}{% endfor %}<assistant>"
    )
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [ROME]},
    ]  # fmt: skip
    text = tokenizer.decode(apply_chat_template(tokenizer, messages, [WEATHER, ADD]))
    assert text.startswith("TOOL get_weather;TOOL add;<user>Weather?")
    assert "CALL get_weather Rome;" in text and TOOLS_INTRO.strip() not in text


def test_a_conversation_with_calls_and_their_results_is_read(smollm2_tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": ROME},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]  # fmt: skip
    out, scheduler = _post(
        smollm2_tokenizer, _body(messages=messages, tool_choice="none"), ["It is 18 C."]
    )
    assert out["choices"][0]["message"]["content"] == "It is 18 C."
    prompt = smollm2_tokenizer.decode(scheduler.requests[0].prompt_ids)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    assert call in prompt and "18 C" in prompt


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
         "tools[0].function.name"),
                ({"tools": [{"type": "code"}], "tool_choice": "required"}, "tools[0]"),
        ({"tools": [ADD, ADD], "tool_choice": "required"}, "tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tool_choice": "required", "logprobs": True}, "logprobs"),
        ({"logprobs": True}, "logprobs"),  # ("auto")
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": NAMED, "messages": [BAD_CALL]}, "messages[0].tool_calls"),
    ],
    ids=[
        "unknown-name", "bad-name", "not-function", "twice",
        "with-response-format", "with-logprobs", "auto-with-logprobs", "choice-without-tools",
        "bad-call-arguments",
    ],
)  # fmt: skip
def test_malformed_or_unsupported_tool_bodies_are_refused(
    smollm2_tokenizer, extra: dict[str, Any], param: str
) -> None:
    error, scheduler = _post(smollm2_tokenizer, _body(**extra), ["x"])
    assert error["param"] == param, error
    assert not scheduler.requests


def test_read_calls_takes_whole_calls_only() -> None:
    ask = ToolAsk((Tool("f"),), "required")
    assert read_calls(ask, '[{"name": "f", "parameters": {}}]') is not None
    assert read_calls(ask, '[{"name": "f", "param') is None
    assert read_calls(ToolAsk((Tool("f"),), "f"), "[1]") is None


ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.mark.parametrize("choice", [None, "auto"], ids=["default", "auto"])
def test_auto_reads_the_calls_the_model_writes(smollm2_tokenizer, choice: str | None) -> None:
    """No guide: the text before the blocks is the content, each block a call (finish_reason
    "tool_calls"); text without blocks, or a block that is not a call of the tools, stays text;
    the prompt asks for the blocks (the template renders no tools)."""
    body = _body() if choice is None else _body(tool_choice=choice)
    out, scheduler = _post(smollm2_tokenizer, body, ["Let me add.\n", ADD_CALL, ADD_CALL])
    assert scheduler.requests[0].guide is None
    assert TOOLS_FORMAT in smollm2_tokenizer.decode(scheduler.requests[0].prompt_ids)
    choice_out = out["choices"][0]
    assert choice_out["finish_reason"] == "tool_calls"
    message = choice_out["message"]
    assert message["content"] == "Let me add."
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["add", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[0]["id"] != calls[1]["id"]
    for text in ["It is sunny.", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>']:
        out, _ = _post(smollm2_tokenizer, _body(), [text])
        assert out["choices"][0]["message"] == {"role": "assistant", "content": text}
        assert out["choices"][0]["finish_reason"] == "stop"
    one, _ = _post(smollm2_tokenizer, _body(parallel_tool_calls=False), [ADD_CALL * 2])
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1


def test_auto_streams_text_until_a_call_begins_then_the_calls_whole(smollm2_tokenizer) -> None:
    """The text streams as content; what may begin a block is held back (a tag split across
    chunks), text that turns out not to be one goes on; the calls come whole at the end."""
    pieces = ["Sum: 1 <", "3 and <tool", "_call>", ADD_CALL[len("<tool_call>") :]]
    events, _ = _post(smollm2_tokenizer, _body(stream=True), pieces)
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Sum: 1 <3 and "
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "add"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    cut = ["Hmm <tool", '_call>{"name": "add", "argum']  # cut short: text
    events, _ = _post(smollm2_tokenizer, _body(stream=True), cut, "length")
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "".join(cut)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_read_auto_calls_and_what_streaming_holds_back() -> None:
    ask = ToolAsk((Tool("f"),), "auto")
    block = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    assert read_auto_calls(ask, "plain text") is None
    found = read_auto_calls(ask, f"  \n{block}\n{block[:-12]}")  # (the last left open)
    assert found is not None and found[0] is None and len(found[1]) == 2
    assert read_auto_calls(ask, '<tool_call>{"name": "f", "parameters": {}}') is not None
    assert read_auto_calls(ask, '<tool_call>{"name": "f", "arguments": [1]}') is None
    assert read_auto_calls(ask, "<tool_call>{") is None
    texts = ["abc", "a <", "a <tool_", "<tool_call", "a <b"]
    assert [HERMES.held(t) for t in texts] == [0, 1, 6, 10, 0]


# a chat template of our own that renders tools and asks for Llama 3's calls, in its words
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if tools and loop.last %}\nGiven these functions, answer with a call in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}:'
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_JSON = '{"name": "get_weather", "parameters": {"city": "Rome"}}'


def test_the_chat_template_says_how_calls_are_written(smollm2_tokenizer) -> None:
    """Hermes' blocks where the template names them or says nothing of calls (the fallback
    prompt asks for them), Llama 3's JSON where it asks for that or has its python tag."""
    assert call_format(smollm2_tokenizer.chat_template) is HERMES
    assert call_format(None) is HERMES
    assert call_format(LLAMA3_TEMPLATE) is LLAMA3_JSON
    assert call_format({"default": "x", "tool_use": "{{ '<|python_tag|>' }}"}) is LLAMA3_JSON
    assert call_format("<tool_call> ... <|python_tag|>") is HERMES


def test_llama3_json_calls_are_read_back_and_streamed(smollm2_tokenizer) -> None:
    """A template asking for Llama 3's calls: an output of `;`-separated call objects (after
    blank text, or the python tag where special tokens are kept) is the calls, content null;
    other text, or an object that is not a call of the tools, stays text; streamed, a blank
    beginning is held back, text goes out as it comes, calls whole at the end."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = LLAMA3_TEMPLATE
    out, scheduler = _post(
        tokenizer,
        _body(),
        ["\n", WEATHER_JSON, '; {"name": "add",', ' "parameters": {"a": 1, "b": 2}}'],
    )
    prompt = tokenizer.decode(scheduler.requests[0].prompt_ids)
    assert '"parameters": dictionary' in prompt and '"name": "get_weather"' in prompt
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    for text in [
        "Sunny. " + WEATHER_JSON,
        '{"name": "nope", "parameters": {}}',
        WEATHER_JSON + " ok",
    ]:
        out, _ = _post(tokenizer, _body(), [text])
        assert out["choices"][0]["message"] == {"role": "assistant", "content": text}
    ask = ToolAsk((Tool("get_weather"),), "auto", writes=LLAMA3_JSON)
    found = read_auto_calls(ask, f"<|python_tag|>{WEATHER_JSON}")
    assert found is not None and found[0] is None and len(found[1]) == 1
    assert [LLAMA3_JSON.held(t) for t in [" \n", "<|python", "{", "Hi"]] == [2, 8, 0, 0]
    events, _ = _post(tokenizer, _body(stream=True), [" ", WEATHER_JSON[:20], WEATHER_JSON[20:]])
    deltas = [e["choices"][0]["delta"] for e in events]
    assert not any(d.get("content") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    events, _ = _post(tokenizer, _body(stream=True), [" ", "It is", " {sunny}"])
    deltas = [e["choices"][0]["delta"] for e in events]
    assert [d.get("content") for d in deltas if d.get("content")] == [" It is", " {sunny}"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
