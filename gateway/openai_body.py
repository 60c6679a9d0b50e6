"""The OpenAI-compatible HTTP API's bodies (gateway/openai_http.py serves them): a completions
or chat body parsed and type-checked into OpenAIRequest (range checks are build_request's, as
for the gRPC API), errors in OpenAI's shape ({"error": {"message", "type", "param", "code"}},
from the services' codes), and the response's usage and choice blocks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

from gateway.guides import GuideAsk
from gateway.request import CHAT_ROLES, Chunk, InvalidField, PromptKind, SpecStats
from gateway.tools import ToolAsk, message_calls
from specsplit.errors import Code, ServiceError
from specsplit.logit_rules import Penalties, bias_of
from specsplit.sampling import SamplingParams

Kind = Literal["completion", "chat"]
HTTP_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.NOT_FOUND: 404,
    Code.FAILED_PRECONDITION: 409,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.UNAVAILABLE: 503,
    Code.INTERNAL: 500,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",  # a route called with the wrong method
    409: "invalid_request_error",  # a session turn while another runs
    413: "invalid_request_error",  # a body over the gateway's message limit
    429: "rate_limit_error",  # the gateway's waiting queue is full
    503: "service_unavailable",
}
# The domain's field names (gateway.request) as OpenAI calls them.
OPENAI_PARAMS = {"max_new_tokens": "max_tokens", "stop_token_ids": "stop_token_ids"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the context
# The most choices a body may ask for (n, times the prompts of a completions body): each is a
# sequence of its own in the gateway's batch.
MAX_CHOICES = 64
# OpenAI's and vLLM's parameters that would change what a request returns, which this server
# does not implement: a body may name them only where they change nothing (they are refused,
# 400, never ignored). These change nothing when off: null, false, 0, "", [] or {}.
NOT_SUPPORTED = (
    "suffix", "functions",
    "prediction", "audio", "guided_grammar",
    "continue_final_message", "use_beam_search", "logits_processors",
)  # fmt: skip
# These only at the values (besides null) that ask for what the server does anyway.
ONLY_AS_DONE = {
    "length_penalty": (1,),  # (beam search's)
    "function_call": ("none", "auto"),
    "add_generation_prompt": (True,),
    "modalities": (["text"],),
}


class OpenAIError(Exception):
    """An HTTP error in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        error_type = ERROR_TYPES.get(self.status, "server_error")
        code = "model_not_found" if self.param == "model" and self.status == 404 else None
        code = "rate_limit_exceeded" if self.status == 429 else code
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": code,
            }
        }


def bad_param(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param)


def from_service_error(err: ServiceError, kind: Kind) -> OpenAIError:
    if not isinstance(err, InvalidField):
        return OpenAIError(HTTP_STATUS[err.code], err.message)
    param = "messages" if err.field == "prompt" and kind == "chat" else err.field
    param = "top_logprobs" if err.field == "logprobs" and kind == "chat" else param
    param = OPENAI_PARAMS.get(param, param)
    message = err.message.removeprefix("sampling.").replace(err.field, param)
    return OpenAIError(400, message, param)


# -- request parsing -------------------------------------------------------------------------


@dataclass
class OpenAIRequest:
    """The fields of a completions / chat completions body this server acts on."""

    kind: Kind
    # (kind, prompt) each: "text" and a str, "token_ids" and a list of ids, or "chat" and a list
    # of {"role", "content"}; a completions body may hold several, a chat body holds one
    prompts: list[tuple[PromptKind, Any]]
    n: int  # samples of each prompt: choice j * n + k is prompt j's sample k
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    session_id: str | None = None  # extension: a session's turn (POST /v1/sessions)
    # each token's log-probability and this many most likely tokens' (chat: `logprobs` true
    # and `top_logprobs`; completions: `logprobs`); None: none
    logprobs: int | None = None
    echo: bool = False  # a completions body's: each choice's text starts with its prompt's
    # logit_bias, presence_penalty, frequency_penalty, vLLM's repetition_penalty and min_p (at
    # their defaults where not given: build_request drops them when they change nothing)
    penalties: Penalties = field(default_factory=Penalties)
    min_tokens: int = 0  # vLLM's: no stop before this many tokens
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last this many tokens
    skip_special_tokens: bool = True  # vLLM's
    guide: GuideAsk | None = None  # guided decoding (gateway/openai_guide.py)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens are generated
    bad_words: list[str] = field(default_factory=list)  # vLLM's: never generated
    tools: ToolAsk | None = None  # a chat's function tools (gateway/openai_tools.py)
    # vLLM's prompt_logprobs: the prompt's tokens' log-probabilities and this many most likely
    # tokens' (gateway/openai_logprobs.py); None: none
    prompt_logprobs: int | None = None

    @property
    def prompt_asks(self) -> int | None:
        """What the prompt's log-probabilities are asked for: vLLM's prompt_logprobs, or a
        completions body's echo with logprobs (the echoed prompt's block), the wider."""
        echoed = self.logprobs if self.echo else None
        asks = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return max(asks) if asks else None


def body_field(
    body: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any
) -> Any:
    """body[name], checked against `types` (bools are not numbers); null = default."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad_param(name, f"expected a number, got {value!r}")
    if not isinstance(value, types):
        raise bad_param(name, f"wrong type {type(value).__name__}")
    return value


def int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def body_prompts(body: dict[str, Any], kind: Kind) -> list[tuple[PromptKind, Any]]:
    """A body's (prompt_kind, prompt) pairs: the chat messages, or a completions body's text or
    token-id prompt, or a batch of them (a list of strings or of token-id lists)."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_param("messages", "must be a non-empty list of {role, content}")
        return [("chat", [_message(i, m) for i, m in enumerate(messages)])]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [("text", prompt)]
    if int_list(prompt) and prompt:
        return [("token_ids", prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [("text", p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(int_list(p) for p in prompt):
        return [("token_ids", p) for p in prompt]
    raise bad_param(
        "prompt", "must be a string, a list of token ids, or a list of either (a batch)"
    )


def _message(i: int, message: Any) -> dict[str, Any]:
    """messages[i] as {"role", "content"}: a known role; content a string, text parts or null;
    an assistant's `tool_calls` ({"name", "arguments"} each: gateway/tools.py) and a tool
    result's `tool_call_id` kept."""
    if not isinstance(message, dict):
        raise bad_param(f"messages[{i}]", "must be an object with a role and a content")
    role = message.get("role")
    if role == "developer":  # OpenAI's newer name for the system message
        role = "system"
    if role not in CHAT_ROLES:
        raise bad_param(f"messages[{i}].role", f"{role!r} is not one of {', '.join(CHAT_ROLES)}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise bad_param(f"messages[{i}].content", "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise bad_param(f"messages[{i}].content", "must be a string or a list of text parts")
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if role == "assistant" and message.get("tool_calls"):
        try:
            out["tool_calls"] = message_calls(message["tool_calls"])
        except ValueError as err:
            raise bad_param(f"messages[{i}].tool_calls", str(err)) from None
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """400 for a parameter of NOT_SUPPORTED that is on, or of ONLY_AS_DONE at another value."""
    for name in NOT_SUPPORTED:
        if body.get(name) not in (None, False, 0, "", [], {}):
            raise bad_param(name, "not supported")
    for name, values in ONLY_AS_DONE.items():
        value = body.get(name)
        if value is None:
            continue
        same_type = isinstance(value, bool) == isinstance(values[0], bool)  # true is not 1
        if not same_type or value not in values:
            allowed = " or ".join(json.dumps(v) for v in values)
            raise bad_param(name, f"only {allowed} is supported")


def parse_request(body: Any, kind: Kind) -> OpenAIRequest:
    """Type checks and OpenAI's defaults; range checks are build_request's."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    n = body_field(body, "n", int, 1)
    if n < 1:
        raise bad_param("n", f"n = {n}: must be >= 1")
    if body_field(body, "best_of", int, n) != n:
        raise bad_param("best_of", "only best_of = n is supported")
    _refuse_unsupported(body)
    prompts = body_prompts(body, kind)
    if n * len(prompts) > MAX_CHOICES:
        param = "n" if len(prompts) == 1 else "prompt"
        raise bad_param(param, f"{len(prompts)} prompts x n = {n}: at most {MAX_CHOICES} choices")
    session_id = body_field(body, "session_id", str, None) or None
    if session_id is not None and n * len(prompts) > 1:
        raise bad_param("session_id", "a session's turn is one prompt and n = 1")
    max_tokens = body_field(body, "max_completion_tokens", int, None)
    max_tokens = body_field(body, "max_tokens", int, max_tokens)
    if max_tokens is None and kind == "completion":
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    top_k = body_field(body, "top_k", int, 0)
    sampling = SamplingParams(
        temperature=float(body_field(body, "temperature", (int, float), 1.0)),
        top_p=float(body_field(body, "top_p", (int, float), 1.0)),
        top_k=0 if top_k == -1 else top_k,  # -1 = off, as in vLLM
        seed=body_field(body, "seed", int, None),
    )
    stop = body_field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise bad_param("stop", "must be a string or a list of strings")
    stop_token_ids = body_field(body, "stop_token_ids", list, [])
    if not int_list(stop_token_ids):
        raise bad_param("stop_token_ids", "must be a list of token ids")
    allowed_token_ids = body_field(body, "allowed_token_ids", list, None)
    if allowed_token_ids is not None and not int_list(allowed_token_ids):
        raise bad_param("allowed_token_ids", "must be a list of token ids")
    bad_words = body_field(body, "bad_words", list, [])
    if not all(isinstance(w, str) for w in bad_words):
        raise bad_param("bad_words", "must be a list of strings")
    options = body_field(body, "stream_options", dict, {})
    logprobs = _logprobs(body, kind)
    echo = body_field(body, "echo", bool, False)
    if echo and kind == "chat":
        raise bad_param("echo", "a completions parameter, not supported in chat")
    prompt_logprobs = body_field(body, "prompt_logprobs", int, None)
    stream = body_field(body, "stream", bool, False)
    return OpenAIRequest(
        kind=kind,
        prompts=prompts,
        n=n,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=body_field(body, "ignore_eos", bool, False),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        session_id=session_id,
        logprobs=logprobs,
        echo=echo,
        penalties=_penalties(body),
        min_tokens=body_field(body, "min_tokens", int, 0),
        include_stop_str=body_field(body, "include_stop_str_in_output", bool, False),
        truncate_prompt_tokens=body_field(body, "truncate_prompt_tokens", int, None),
        skip_special_tokens=body_field(body, "skip_special_tokens", bool, True),
        allowed_token_ids=allowed_token_ids,
        bad_words=bad_words,
        prompt_logprobs=prompt_logprobs,
    )


def _logprobs(body: dict[str, Any], kind: Kind) -> int | None:
    """How many most likely tokens each token's log-probability comes with, None for none: a
    chat body's `top_logprobs` (0 when not given) where its `logprobs` is true, a completions
    body's `logprobs` (0: the tokens' own alone). Ranges are build_request's."""
    if kind == "completion":
        if body.get("top_logprobs") is not None:
            raise bad_param("top_logprobs", "a chat parameter: completions take logprobs: N")
        return body_field(body, "logprobs", int, None)
    asked = body_field(body, "logprobs", bool, False)
    top = body_field(body, "top_logprobs", int, None)
    if top and not asked:  # (0 asks for nothing)
        raise bad_param("top_logprobs", "needs logprobs: true")
    return (top or 0) if asked else None


def _penalties(body: dict[str, Any]) -> Penalties:
    """The body's logit bias (token ids as strings or numbers, to biases) and penalties. Ranges
    are build_request's."""
    bias = body_field(body, "logit_bias", dict, {})
    entries = []
    for key, value in bias.items():
        token = key if isinstance(key, int) else int(key) if str(key).isdigit() else None
        if token is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_param("logit_bias", "must map token ids to numbers")
        entries.append((token, float(value)))
    return Penalties(
        bias_of(entries),
        float(body_field(body, "presence_penalty", (int, float), 0.0)),
        float(body_field(body, "frequency_penalty", (int, float), 0.0)),
        float(body_field(body, "repetition_penalty", (int, float), 1.0)),
        min_p=float(body_field(body, "min_p", (int, float), 0.0)),
    )


# -- response shapes -------------------------------------------------------------------------


def usage(lasts: list[Chunk], n: int) -> dict[str, Any]:
    """OpenAI's usage block over the choices' last chunks (n samples of each prompt: its prompt
    counted once), plus the speculative stats, summed, under "specsplit"."""
    prompt_tokens = sum(last.prompt_tokens for last in lasts[::n])
    completion_tokens = sum(last.completion_tokens for last in lasts)
    stats = SpecStats()
    for last in lasts:
        if last.stats is not None:
            stats.rounds += last.stats.rounds
            stats.num_accepted_drafts += last.stats.num_accepted_drafts
            stats.num_accepted_tokens += last.stats.num_accepted_tokens
            stats.num_reused_tokens += last.stats.num_reused_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "specsplit": {
            "rounds": stats.rounds,
            "num_accepted_drafts": stats.num_accepted_drafts,
            "mean_accepted_tokens": stats.mean_accepted_tokens,
            "num_reused_tokens": stats.num_reused_tokens,
        },
    }


def choice(
    kind: Kind,
    text: str | None,
    finish_reason: str | None,
    stream: bool,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict:
    """choices[i] of a response (stream=False) or of a streamed chunk; text None = no delta;
    logprobs: its block (gateway/openai_logprobs.py), None where not asked."""
    body: dict[str, Any] = {"index": index}
    if kind == "completion":
        body["text"] = text or ""
    elif stream:
        body["delta"] = {} if text is None else {"content": text}
    else:
        body["message"] = {"role": "assistant", "content": text}
    return {**body, "logprobs": logprobs, "finish_reason": finish_reason}


# -- the server ------------------------------------------------------------------------------
