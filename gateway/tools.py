"""Function calling as guided decoding: a request's tools and which call it forces
(`ToolAsk`), the guide that makes the output that call (a JSON schema, gateway/guides.py), and
the calls read back from a finished output (`read_calls`).

A named function's output is its arguments: a JSON object of the function's `parameters` schema.
"required" is a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`, each item one
tool's name and that tool's parameters (one item when parallel calls are off), as vLLM makes
them. "auto" (the model's own choice between text and a call) needs the model's own tool-call
format and a parser for it, which this server does not have."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.guides import GuideAsk

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's limit on a request's tools
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # `parameters` left out


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: str = json.dumps(NO_PARAMETERS)  # the JSON schema, as its JSON text

    def as_openai(self) -> dict[str, Any]:
        """The tool as an OpenAI body lists it (chat templates that render tools read this)."""
        function: dict[str, Any] = {"name": self.name, "parameters": json.loads(self.parameters)}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolAsk:
    """A request's tools and its choice: "none" (free text, no calls read), "required" (one
    or more calls of any of them) or a function's name (that call)."""

    tools: tuple[Tool, ...]
    choice: str = "none"
    parallel: bool = True  # "required": several calls allowed

    @property
    def calls(self) -> bool:
        """Whether the output is tool calls (not free text)."""
        return self.choice != "none"

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def guide(self) -> GuideAsk | None:
        """The guide that makes the output the calls (None for "none")."""
        if not self.calls:
            return None
        if self.choice != "required":
            return GuideAsk("tool_choice", "json_schema", self.tool(self.choice).parameters)
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.name},
                    "parameters": json.loads(t.parameters),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return GuideAsk("tool_choice", "json_schema", json.dumps(array))


@dataclass(frozen=True)
class Call:
    """One tool call of an answer: its id (call_<hex>), the function and its arguments (JSON
    text)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def read_calls(ask: ToolAsk, text: str) -> list[Call] | None:
    """The calls a finished output makes (each a new id), None where the text is not whole
    calls (the output was cut at max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if ask.choice != "required":
        return [Call(call_id(), ask.choice, text)] if isinstance(value, dict) else None
    if not isinstance(value, list) or not all(
        isinstance(v, dict) and isinstance(v.get("name"), str) for v in value
    ):
        return None
    return [Call(call_id(), v["name"], json.dumps(v.get("parameters", {}))) for v in value]


def message_calls(value: Any) -> list[dict[str, str]]:
    """An assistant message's OpenAI `tool_calls` as the chat templates take them
    (specsplit/prompt.py): {"name", "arguments"} each, the arguments a JSON object's text;
    ValueError saying what is wrong."""
    if not isinstance(value, list):
        raise ValueError("a list of calls")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError('each {"type": "function", "function": {"name", "arguments"}}')
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError("each call's arguments the JSON text of an object")
        calls.append({"name": function["name"], "arguments": arguments})
    return calls
