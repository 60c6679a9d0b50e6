"""OpenAI's function calling over the chat API (gateway/tools.py does the calls): `tools`,
`tool_choice` and `parallel_tool_calls` read from a body (`body_tools`), the request's guide set
from them (`apply_tools`), and the answer shaped as OpenAI's: a message's `tool_calls` in place
of its content, finish_reason "tool_calls" (`shape_choice`), and streamed as `tool_calls` deltas
(`ToolStream`: a named function's arguments as they come, "required"'s calls once whole).

`tool_choice` "auto" (OpenAI's default with tools) leaves the text free and reads the calls the
model writes in it, in its chat template's format (gateway/tools.py:read_auto_calls,
gateway/call_formats.py): the text before them is the message's content; streamed, the text
goes out as content until the calls begin, and the calls whole at the end (text again where
they do not parse). Assistant
messages' `tool_calls` and "tool" messages are read as the conversation so far
(openai_body._message)."""

from __future__ import annotations

import json
from typing import Any

from gateway.call_formats import HERMES, CallFormat
from gateway.openai_body import OpenAIRequest, bad_param, body_field
from gateway.tools import (
    MAX_TOOLS,
    NAME,
    Call,
    Tool,
    ToolAsk,
    call_id,
    read_auto_calls,
    read_calls,
)


def body_tools(body: dict[str, Any], writes: CallFormat = HERMES) -> ToolAsk | None:
    """A chat body's tools and tool choice (`writes`: how the model writes calls, for "auto");
    None without tools; 400 naming the parameter."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad_param("tool_choice", "asks for a tool, and the body has no tools")
        return None
    listed = tool_list(tools)
    names = [t.name for t in listed]
    parallel = body_field(body, "parallel_tool_calls", bool, True)
    if choice in (None, "none", "auto", "required"):
        return ToolAsk(listed, choice or "auto", parallel, writes)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise bad_param(
            "tool_choice",
            'one of "none", "auto", "required" or {"type": "function", "function": {"name": N}} '
            "with N one of the tools",
        )
    return ToolAsk(listed, name, parallel)


def tool_list(tools: Any) -> tuple[Tool, ...]:
    """A body's `tools` (null: none); 400 naming the parameter for a malformed one."""
    if tools is None:
        return ()
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_param("tools", f"a list of at most {MAX_TOOLS} function tools")
    listed = tuple(_tool(i, t) for i, t in enumerate(tools))
    if len({t.name for t in listed}) < len(listed):
        raise bad_param("tools", "two tools of one name")
    return listed


def _tool(i: int, value: Any) -> Tool:
    function = value.get("function") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or value.get("type") != "function"
        or not isinstance(function, dict)
    ):
        raise bad_param(f"tools[{i}]", 'an object {"type": "function", "function": {...}}')
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_param(f"tools[{i}].function.name", "1 to 64 of a-z, A-Z, 0-9, _ and -")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise bad_param(f"tools[{i}].function.description", "a string")
    parameters = function.get("parameters")
    if parameters is None:
        return Tool(name, description)
    if not isinstance(parameters, dict):
        raise bad_param(f"tools[{i}].function.parameters", "a JSON schema (an object)")
    return Tool(name, description, json.dumps(parameters))


def apply_tools(req: OpenAIRequest, body: dict[str, Any], writes: CallFormat = HERMES) -> None:
    """The body's tools on `req` (after its guide is read): a call's guide as the request's;
    400 where the body also asks for what a call excludes. `writes`: how the model writes
    calls (the chat template's, gateway/call_formats.py)."""
    if req.kind != "chat":
        if body.get("tools") not in (None, []):
            raise bad_param("tools", "a chat completions parameter")
        return
    req.tools = body_tools(body, writes)
    if req.tools is None or not req.tools.reads:
        return
    if req.session_id is not None:
        raise bad_param("tools", "not supported in a session's turn")
    if req.logprobs is not None:
        raise bad_param("logprobs", "not supported with tool calls")
    if not req.tools.calls:  # ("auto": free text, its calls' special tokens decoded where they
        # begin with one: the format's to read, what vLLM's Mistral parser asks of a request)
        req.skip_special_tokens = req.skip_special_tokens and not writes.keeps_special
        return
    if req.guide is not None:
        raise bad_param(req.guide.field, "a tool call is a guide of its own (tool_choice)")
    req.guide = req.tools.guide()


def shape_choice(ask: ToolAsk, body: dict[str, Any]) -> dict[str, Any]:
    """A finished chat choice whose text is whole calls as OpenAI gives them: the message's
    `tool_calls` (content null: "auto"'s the text before them), finish_reason "tool_calls"; one
    cut short stays text."""
    text, content = body["message"]["content"] or "", None
    if ask.choice == "auto":
        found = read_auto_calls(ask, text)
        content, calls = (None, None) if found is None else found
    else:
        calls = read_calls(ask, text)
    if calls is None:
        return body
    tool_calls = [c.as_openai() for c in calls]
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    return {**body, "message": message, "finish_reason": "tool_calls"}


class ToolStream:
    """One streamed choice's tool calls as OpenAI streams them: a named function's first
    delta with the call's id and name, then its arguments as they come; "required"'s calls
    each whole once the output is (its array is only parsed then); text where the output was
    cut short of whole calls."""

    def __init__(self, ask: ToolAsk) -> None:
        self.ask = ask
        self.text: list[str] = []
        self.id = call_id()
        self.named = False  # a named call's first delta (id, name) sent
        self.output = ""  # "auto": the output so far
        self.sent = 0  # "auto": its characters streamed as content
        self.in_call = False  # "auto": the calls began

    def events(self, text: str, finish_reason: str | None) -> list[tuple[dict, str | None]]:
        """A chunk's (delta, finish_reason) events."""
        if self.ask.choice == "auto":
            return self._auto(text, finish_reason)
        self.text.append(text)
        out: list[tuple[dict, str | None]] = []
        if self.ask.choice != "required" and text:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self.named:  # (the call's first delta: its id and name)
                call = {**call, "id": self.id, "type": "function"}
                call["function"] = {"name": self.ask.choice, "arguments": text}
                self.named = True
            out.append(({"tool_calls": [call]}, None))
        if finish_reason is None:
            return out
        calls = read_calls(self.ask, "".join(self.text))
        if calls is None:  # cut short: what the named call streamed stands; "required"'s text
            if self.ask.choice == "required":
                out.append(({"content": "".join(self.text)}, None))
            return [*out, ({}, finish_reason)]
        if self.ask.choice == "required":
            out.append(({"tool_calls": [_delta(i, c) for i, c in enumerate(calls)]}, None))
        return [*out, ({}, "tool_calls")]

    def _auto(self, text: str, finish_reason: str | None) -> list[tuple[dict, str | None]]:
        """ "auto"'s events: the text as content up to where the calls begin (what may begin
        them held back), then at the end the calls whole, or the held text where they do not
        parse."""
        out: list[tuple[dict, str | None]] = []
        self.output += text
        whole = self.output
        if not self.in_call:
            writes = self.ask.writes
            at = writes.begins(whole)
            self.in_call = at >= 0
            cut = at if self.in_call else len(whole) - writes.held(whole)
            if finish_reason is not None and not self.in_call:
                cut = len(whole)  # (the end: nothing more can begin calls)
            if cut > self.sent:
                out.append(({"content": whole[self.sent : cut]}, None))
                self.sent = cut
        if finish_reason is None:
            return out
        found = read_auto_calls(self.ask, whole) if self.in_call else None
        if found is None:
            if len(whole) > self.sent:
                out.append(({"content": whole[self.sent :]}, None))
            return [*out, ({}, finish_reason)]
        out.append(({"tool_calls": [_delta(i, c) for i, c in enumerate(found[1])]}, None))
        return [*out, ({}, "tool_calls")]


def _delta(index: int, call: Call) -> dict[str, Any]:
    return {"index": index, **call.as_openai()}
