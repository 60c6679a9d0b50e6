"""Function calling as guided decoding: a request's tools and which call it forces
(`ToolAsk`), the guide that makes the output that call (a JSON schema, gateway/guides.py), and
the calls read back from a finished output (`read_calls`).

A named function's output is its arguments: a JSON object of the function's `parameters` schema.
"required" is a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`, each item one
tool's name and that tool's parameters (one item when parallel calls are off), as vLLM makes
them. "auto" (the model's own choice between text and calls) is not guided: the calls are read
back from the text (`read_auto_calls`) in the format the chat template teaches
(gateway/call_formats.py: Hermes' `<tool_call>` blocks, which the fallback tools prompt asks for
too, Llama 3's JSON, or Mistral's `[TOOL_CALLS]`)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.call_formats import HERMES, CallFormat
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
    """A request's tools and its choice: "none" (free text, no calls read), "auto" (free text,
    calls read from it), "required" (one or more calls of any of them) or a function's name
    (that call)."""

    tools: tuple[Tool, ...]
    choice: str = "none"
    parallel: bool = True  # "required": several calls allowed
    writes: CallFormat = HERMES  # "auto": how the model writes calls (the chat template's)

    @property
    def calls(self) -> bool:
        """Whether the output is tool calls (not free text): a guide makes them."""
        return self.choice not in ("none", "auto")

    @property
    def reads(self) -> bool:
        """Whether calls are read from the output (forced, or the model's choice)."""
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


def read_auto_calls(ask: ToolAsk, text: str) -> tuple[str | None, list[Call]] | None:
    """Under "auto": the text before the first call (None where blank) and the calls the
    output makes in the model's format (`ask.writes`; Hermes' last block may be cut short of
    its closing tag; one only without parallel calls); None where it has none, or one is not a
    call of one of the tools (its JSON {"name": N, "arguments": {...}}; "parameters" read too):
    it stays text."""
    found = ask.writes.read(text)
    if found is None or not found[1]:
        return None
    names = {t.name for t in ask.tools}
    calls = []
    for value in found[1]:
        if not isinstance(value, dict) or value.get("name") not in names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append(Call(call_id(), value["name"], json.dumps(arguments)))
    return found[0].strip() or None, calls if ask.parallel else calls[:1]


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
