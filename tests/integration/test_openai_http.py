"""The gateway's OpenAI-compatible HTTP API, driven by the official `openai` client against the
three real processes (a tiny random Llama with SmolLM2's tokenizer; draft == target)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import openai
import pytest

from specsplit.v1 import gateway_pb2
from tests.integration.services import (
    TINY_MODEL_NAME,
    Services,
    generate,
    ids_of,
    token_request,
)

MODEL_NAME = TINY_MODEL_NAME
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def services(tiny_http_services: Services) -> Services:
    return tiny_http_services


@pytest.fixture(scope="module")
def client(services: Services) -> openai.OpenAI:
    base_url = f"http://{services.address('http')}/v1"
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)


def _grpc_text(services: Services, request: gateway_pb2.GenerateRequest) -> str:
    return "".join(r.text for r in generate(services.gateway(), request))


def test_models_lists_the_served_model_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_greedy_completion_equals_grpc_generate_and_usage_is_exact(
    services: Services, client: openai.OpenAI, smollm2_tokenizer
) -> None:
    expected = _grpc_text(
        services, gateway_pb2.GenerateRequest(text=PROMPT, max_new_tokens=12, ignore_eos=True)
    )
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert out.id.startswith("cmpl-")
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "length"
    num_prompt = len(smollm2_tokenizer.encode(PROMPT))
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (num_prompt, 12)
    assert out.usage.total_tokens == num_prompt + 12
    spec = (out.usage.model_extra or {})["specsplit"]
    assert 0 < spec["rounds"] < 12  # draft == target: speculation saves rounds
    assert spec["mean_accepted_tokens"] > 1.0 and spec["num_accepted_drafts"] > 0


def test_token_id_prompt_equals_grpc_token_ids(services: Services, client: openai.OpenAI) -> None:
    prompt = [100 + 13 * j for j in range(9)]
    grpc_out = generate(services.gateway(), token_request(prompt, 10, ignore_eos=True))
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == "".join(r.text for r in grpc_out)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == len(ids_of(grpc_out)) == 10


def test_streamed_completion_concatenates_to_the_non_streamed_text(
    client: openai.OpenAI,
) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    events = list(
        client.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text_events, usage_event = events[:-1], events[-1]
    assert "".join(e.choices[0].text for e in text_events) == whole.choices[0].text
    assert [e.choices[0].finish_reason for e in text_events][-1] == "length"
    assert all(e.usage is None for e in text_events)
    assert usage_event.choices == [] and usage_event.usage is not None
    assert usage_event.usage.completion_tokens == 12
    assert usage_event.usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


def test_chat_completion_equals_grpc_chat_streamed_and_not(
    services: Services, client: openai.OpenAI
) -> None:
    messages = [{"role": "user", "content": "Say hello"}]
    request = gateway_pb2.GenerateRequest(max_new_tokens=10)
    request.chat.messages.add(role="user", content="Say hello")
    expected = _grpc_text(services, request)
    kwargs = {"model": MODEL_NAME, "messages": messages, "max_tokens": 10, "temperature": 0}
    out = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 10
    events = list(client.chat.completions.create(**kwargs, stream=True))  # type: ignore[call-overload]
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == expected
    assert events[-1].choices[0].finish_reason == out.choices[0].finish_reason
    services.wait_no_pages_used()


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[8:11]
    assert stop.strip(), repr(full)
    for stream in (False, True):
        if stream:
            events = client.completions.create(
                **kwargs, stop=[stop, "never-seen"], stream=True, extra_body={"ignore_eos": True}
            )
            pieces = [(e.choices[0].text, e.choices[0].finish_reason) for e in events]
            text, finish = "".join(p for p, _ in pieces), pieces[-1][1]
        else:
            choice = client.completions.create(
                **kwargs, stop=stop, extra_body={"ignore_eos": True}
            ).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert (text, finish) == (full[: full.index(stop)], "stop"), stream


def test_n_samples_are_each_the_single_request_with_seed_plus_k(
    services: Services, client: openai.OpenAI
) -> None:
    kwargs = {"model": MODEL_NAME, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(prompt=PROMPT, temperature=1.0, seed=7, n=3, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    singles = [
        client.completions.create(prompt=PROMPT, temperature=1.0, seed=7 + k, **kwargs)
        for k in range(3)
    ]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in out.choices}) > 1  # seeds 7, 8, 9 draw apart
    assert out.usage is not None and singles[0].usage is not None
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counted once
    assert out.usage.completion_tokens == 3 * 8
    greedy = client.completions.create(prompt=PROMPT, temperature=0, n=2, **kwargs)
    assert greedy.choices[0].text == greedy.choices[1].text
    services.wait_no_pages_used()


def test_batched_prompts_are_prompt_major_choices_each_the_single_request(
    client: openai.OpenAI,
) -> None:
    prompts = [PROMPT, "Once upon a time", [100 + 13 * j for j in range(5)]]
    kwargs = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0}
    kwargs["extra_body"] = {"ignore_eos": True}
    singles = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
    out = client.completions.create(prompt=prompts[:2], n=2, **kwargs)
    assert [c.text for c in out.choices] == [singles[0]] * 2 + [singles[1]] * 2
    ids = client.completions.create(prompt=[prompts[2], prompts[2]], **kwargs)
    assert [c.text for c in ids.choices] == [singles[2]] * 2
    events = list(client.completions.create(prompt=prompts[:2], stream=True, **kwargs))
    texts = ["".join(e.choices[0].text for e in events if e.choices[0].index == i) for i in (0, 1)]
    assert texts == singles[:2]
    finished = [e.choices[0].index for e in events if e.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_streamed_chat_with_n_sends_each_choice_its_role_and_usage_once(
    services: Services, client: openai.OpenAI
) -> None:
    messages = [{"role": "user", "content": "Say hello"}]
    kwargs = {"model": MODEL_NAME, "messages": messages, "max_tokens": 6, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    events = list(
        client.chat.completions.create(  # type: ignore[call-overload]
            **kwargs, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    usage_events = [e for e in events if e.usage is not None]
    assert len(usage_events) == 1 and usage_events[0] is events[-1]
    assert usage_events[0].usage.completion_tokens == 2 * whole.usage.completion_tokens
    choice_events = events[:-1]
    for index in (0, 1):
        mine = [e.choices[0] for e in choice_events if e.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[0].message.content
        assert mine[-1].finish_reason == whole.choices[0].finish_reason
    services.wait_no_pages_used()


def test_more_choices_than_the_limit_is_400_naming_n(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, n=65)
    assert err.value.status_code == 400
    error = err.value.response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "n")
    assert "64" in error["message"]


@pytest.mark.parametrize(
    ("case", "params", "param"),
    [
        ("negative_temperature", {"temperature": -0.5}, "temperature"),
        ("top_p_above_one", {"top_p": 1.5}, "top_p"),
        ("temperature_not_a_number", {"temperature": "hot"}, "temperature"),
        ("max_tokens_zero", {"max_tokens": 0}, "max_tokens"),
        ("over_context", {"max_tokens": 100_000}, "max_tokens"),
        ("empty_stop", {"stop": [""]}, "stop"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_parameter_is_400_naming_the_param(
    services: Services, client: openai.OpenAI, case: str, params: dict, param: str
) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, **params}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**body)
    error = err.value.response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert param in error["message"]
    services.wait_no_pages_used()


def test_unknown_model_and_route_are_404(services: Services, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert err.value.response.json()["error"]["param"] == "model"
    url = f"http://{services.address('http')}/v1/embeddings"
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(urllib.request.Request(url, data=b"{}"), timeout=10)
    assert http_err.value.code == 404
    assert "message" in json.loads(http_err.value.read())["error"]


def test_closed_stream_frees_kv_on_both_services(services: Services, client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for received, _ in enumerate(stream, start=1):
        if received == 2:
            break
    assert services.pages_used()["verifier"] > 0  # the sequence is live
    stream.close()
    services.wait_no_pages_used()
    # still serving
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_chat_logprobs_list_each_returned_token_as_grpc_gives_them(
    services: Services, client: openai.OpenAI
) -> None:
    """Greedy: each token is its place's most likely, its bytes make up the returned text, and
    the gRPC API's log-probabilities (which also list the EOS that ends it) are the same."""
    messages = [{"role": "user", "content": "Say hello"}]
    kwargs = {"model": MODEL_NAME, "messages": messages, "max_tokens": 12, "temperature": 0}
    out = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3)  # type: ignore[call-overload]
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    text = b"".join(bytes(entry.bytes or []) for entry in content)
    assert text.decode("utf-8", errors="replace") == choice.message.content
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.logprob <= 0.0
    request = gateway_pb2.GenerateRequest(max_new_tokens=12, logprobs=3)
    request.chat.messages.add(role="user", content="Say hello")
    responses = generate(services.gateway(), request)
    listed = [entry for r in responses for entry in r.logprobs]
    assert [entry.token_id for entry in listed] == ids_of(responses)
    assert len(listed) - len(content) == (choice.finish_reason == "stop")  # (the EOS)
    for grpc_entry, http_entry in zip(listed, content, strict=False):
        assert grpc_entry.logprob == pytest.approx(http_entry.logprob, abs=1e-4)
        assert len(grpc_entry.top_logprobs) == 3
    plain = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert plain.choices[0].message.content == choice.message.content
    assert plain.choices[0].logprobs is None
    services.wait_no_pages_used()


def test_streamed_completion_logprobs_add_up_to_the_whole(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    kwargs["extra_body"] = {"ignore_eos": True}
    whole = client.completions.create(**kwargs, logprobs=2).choices[0]
    assert whole.logprobs is not None and whole.logprobs.tokens is not None
    assert len(whole.logprobs.tokens) == 12
    assert whole.logprobs.text_offset == [
        sum(len(t) for t in whole.logprobs.tokens[:i]) for i in range(12)
    ]
    assert all(len(top) <= 2 for top in whole.logprobs.top_logprobs or [])
    events = list(client.completions.create(**kwargs, logprobs=2, stream=True))
    streamed = [e.choices[0].logprobs for e in events if e.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens or []] == whole.logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs or []] == pytest.approx(
        whole.logprobs.token_logprobs, abs=1e-6
    )
    assert [o for lp in streamed for o in lp.text_offset or []] == whole.logprobs.text_offset


def test_echo_starts_each_choice_with_its_prompt(client: openai.OpenAI, smollm2_tokenizer) -> None:
    ids = [100 + 13 * j for j in range(5)]
    kwargs = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0}
    kwargs["extra_body"] = {"ignore_eos": True}
    prompts = [PROMPT, "Once upon a time"]
    plain = client.completions.create(prompt=prompts, **kwargs).choices
    echoed = client.completions.create(prompt=prompts, echo=True, n=2, **kwargs).choices
    pairs = zip(prompts, plain, strict=True)
    assert [c.text for c in echoed] == [p + c.text for p, c in pairs for _ in range(2)]
    from_ids = client.completions.create(prompt=ids, **kwargs).choices[0].text
    echoed_ids = client.completions.create(prompt=ids, echo=True, **kwargs).choices[0].text
    assert echoed_ids == smollm2_tokenizer.decode(ids) + from_ids
    events = list(client.completions.create(prompt=PROMPT, echo=True, stream=True, **kwargs))
    assert events[0].choices[0].text == PROMPT
    assert "".join(e.choices[0].text for e in events) == PROMPT + plain[0].text
    listed = list(
        client.completions.create(prompt=PROMPT, echo=True, logprobs=1, stream=True, **kwargs)
    )
    assert listed[0].choices[0].text == PROMPT  # (the prompt's block with it)
    assert "".join(e.choices[0].text for e in listed) == PROMPT + plain[0].text


def test_streamed_chat_logprobs_add_up_to_the_whole(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count to five"}]
    kwargs = {"model": MODEL_NAME, "messages": messages, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=1)  # type: ignore[call-overload]
    events = list(
        client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=1, stream=True)  # type: ignore[call-overload]
    )
    streamed = [e for e in events if e.choices and e.choices[0].logprobs is not None]
    tokens = [c.token for e in streamed for c in e.choices[0].logprobs.content or []]
    assert whole.choices[0].logprobs is not None
    assert tokens == [c.token for c in whole.choices[0].logprobs.content or []]


def test_guided_outputs_match_their_guides_over_http_and_grpc(
    services: Services, client: openai.OpenAI
) -> None:
    """A JSON schema (response_format), a regex (gRPC's guide) and a choice (vLLM's
    guided_choice), greedy and sampled, through the real services (the target drafts for
    itself): each output is a whole match, ended by EOS; no KV is left behind."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
        "required": ["ok", "n"],
    }
    for temperature in (0, 1.0):
        out = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Answer in JSON."}],
            max_tokens=120,
            temperature=temperature,
            seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content or "")
        assert isinstance(value["ok"], bool) and isinstance(value["n"], int) and value["n"] <= 99
        picked = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=temperature, seed=4,
            extra_body={"guided_choice": ["lazy dog", "cat"]},
        )  # fmt: skip
        assert picked.choices[0].text in ("lazy dog", "cat")
    guide = gateway_pb2.Guide(regex=r"[0-9]{2}-[a-z]{1,4}")
    text = _grpc_text(
        services, gateway_pb2.GenerateRequest(text=PROMPT, max_new_tokens=16, guide=guide)
    )
    assert re.fullmatch(r"[0-9]{2}-[a-z]{1,4}", text), text
    services.wait_no_pages_used()


def test_tool_calls_over_http_are_the_tools_calls(
    services: Services, client: openai.OpenAI
) -> None:
    """Function calling through the real services with OpenAI's client: a named tool choice,
    greedy and sampled, answers a call whose arguments are the function's parameters; streamed
    (greedy) its arguments arrive as deltas that make the whole answer's; "required" without
    parallel calls answers one call of one of the tools; the conversation then goes on with the
    call and its result; "auto" answers text or calls of the tools, streamed alike. No KV is left
    behind."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city for some days",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Rome"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    }
    add = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 99, "minimum": 0}},
                "required": ["a"],
            },
        },
    }
    messages: list = [{"role": "user", "content": "What is the weather in Rome?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL_NAME, messages=messages, tools=[weather, add], max_tokens=80)
    calls = []
    for temperature in (0, 1.0):
        out = client.chat.completions.create(
            **kwargs,
            tool_choice=named,
            temperature=temperature,
            seed=5,  # type: ignore[arg-type]
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 7
        calls.append(call)
    stream = client.chat.completions.create(
        **kwargs,
        tool_choice=named,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    deltas = [c.choices[0].delta for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].tool_calls[0].function.name == "get_weather"  # type: ignore[index]
    streamed = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)  # type: ignore[index]
    assert streamed == calls[0].function.arguments
    out = client.chat.completions.create(
        **kwargs,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,  # type: ignore[arg-type]
    )
    (call,) = out.choices[0].message.tool_calls or []
    assert call.function.name in ("get_weather", "add")
    assert isinstance(json.loads(call.function.arguments), dict)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C and sunny"},
    ]
    after = client.chat.completions.create(
        **kwargs,
        tool_choice="none",
        temperature=0,  # type: ignore[arg-type]
    )
    assert after.choices[0].message.content and not after.choices[0].message.tool_calls
    # "auto" (the default): free text, calls read from it; streamed, the same answer
    auto = client.chat.completions.create(**kwargs, temperature=0)  # type: ignore[arg-type]
    message = auto.choices[0].message
    for call in message.tool_calls or []:
        assert call.function.name in ("get_weather", "add")
        assert isinstance(json.loads(call.function.arguments), dict)
    assert (auto.choices[0].finish_reason == "tool_calls") == bool(message.tool_calls)
    chunks = list(client.chat.completions.create(**kwargs, temperature=0, stream=True))  # type: ignore[arg-type]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    named = [
        t.function.name for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []
    ]
    assert named == [call.function.name for call in message.tool_calls or []]
    if not message.tool_calls:
        assert streamed == message.content
    services.wait_no_pages_used()


def test_prompt_logprobs_over_http(services: Services, client: openai.OpenAI) -> None:
    """A completions body's echo with logprobs, vLLM's prompt_logprobs, and gRPC's
    GenerateRequest.prompt_logprobs, through the real services: the echoed prompt's tokens come
    first in the choice's block (the first's null), each prompt token's log-probability is the
    same both ways and the generated token's is the one a body without them gets; the first
    round read every prompt row; streamed, the prompt's come first, the same. No KV left behind."""
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0)
    echoed = client.completions.create(**kwargs, echo=True, logprobs=2)  # type: ignore[arg-type]
    vllm = client.completions.create(**kwargs, extra_body={"prompt_logprobs": 2})  # type: ignore[arg-type]
    plain = client.completions.create(**kwargs, logprobs=2)  # type: ignore[arg-type]
    block = echoed.choices[0].logprobs
    assert block is not None and block.token_logprobs is not None and block.tokens is not None
    entries = vllm.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert entries[0] is None and block.token_logprobs[0] is None
    assert len(block.tokens) == len(entries) + 1  # (the prompt's, then the generated one)
    assert echoed.choices[0].text.startswith(PROMPT)
    url = f"http://{services.address('http')}/tokenize"
    request = urllib.request.Request(
        url, json.dumps({"prompt": PROMPT}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        ids = json.loads(response.read())["tokens"]
    for token, value, entry in zip(ids[1:], block.token_logprobs[1:-1], entries[1:], strict=True):
        assert value is not None and value <= 0
        assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-6), (token, entry)
        assert len(entry) <= 3  # (the token's own and the 2 most likely)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.token_logprobs
    assert block.token_logprobs[-1] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0])
    request = gateway_pb2.GenerateRequest(text=PROMPT, max_new_tokens=1, prompt_logprobs=2)
    first = next(iter(generate(services.gateway(), request)))
    assert [e.token_id for e in first.prompt_logprobs] == ids[1:]
    for entry, value in zip(first.prompt_logprobs, block.token_logprobs[1:-1], strict=True):
        assert entry.logprob == pytest.approx(value, abs=1e-6) and len(entry.top_logprobs) == 2
    # streamed: the echoed prompt and its block first, the same values as the whole response's
    events = list(client.completions.create(**kwargs, echo=True, logprobs=2, stream=True))  # type: ignore[arg-type]
    streamed = [e.choices[0] for e in events if e.choices]
    assert "".join(c.text for c in streamed) == echoed.choices[0].text
    values = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs or []]
    assert values[0] is None and values[1:] == pytest.approx(block.token_logprobs[1:], abs=1e-6)
    services.wait_no_pages_used()
