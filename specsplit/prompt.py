"""Prompts to token ids: raw text as the tokenizer encodes it, chats through its template (the
gateway's requests and the drafter's training data alike)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a raw-text prompt, special tokens added as the tokenizer does by default."""
    return list(tokenizer.encode(text))


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] = (),
) -> list[int]:
    """Token ids of a chat rendered by the tokenizer's template, ending with the assistant prompt.

    `tools` (OpenAI's function tools) and an assistant's `tool_calls` ({"name", "arguments": JSON
    text} each) go to a template that renders tools as transformers passes them (the calls'
    arguments as objects); for one that does not (`renders_tools`), the tools are listed in the
    system message (`TOOLS_INTRO`, which asks for calls in Hermes' `<tool_call>` blocks: what a
    tool choice of "auto" reads back, gateway/tools.py) and the calls written so in the
    assistant's text.

    transformers 5 returns a BatchEncoding (`return_dict=True` is its default), 4.x a list.
    """
    native = renders_tools(tokenizer)
    chat = [_with_calls(m, native) for m in messages]
    if tools and not native:
        functions = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        listed = f"{TOOLS_INTRO}{functions}\n{TOOLS_FORMAT}"
        if chat and chat[0].get("role") == "system":
            chat[0]["content"] = f"{chat[0].get('content') or ''}\n\n{listed}".lstrip()
        else:
            chat.insert(0, {"role": "system", "content": listed})
    encoded = tokenizer.apply_chat_template(
        chat,
        tools=[dict(t) for t in tools] if tools and native else None,
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise TypeError(f"apply_chat_template returned {type(encoded).__name__}, not token ids")
    return cast("list[int]", ids)


# the system message's list of tools for a template that does not render them (one JSON object
# a function after it)
TOOLS_INTRO = "You can call these functions (name, description and JSON schema of parameters):\n"
TOOLS_FORMAT = (
    'To call one, answer with <tool_call>{"name": <its name>, "arguments": <an object of its '
    "parameters>}</tool_call>, one block a call."
)


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template reads `tools` (a named set of templates: assumed)."""
    template = tokenizer.chat_template
    return not isinstance(template, str) or "tools" in template


def _with_calls(message: Mapping[str, Any], native: bool) -> dict[str, Any]:
    """A message as the template takes it: an assistant's tool calls as transformers passes
    them (`native`), else appended to its text as `<tool_call>` blocks (`TOOLS_FORMAT`)."""
    out = dict(message)
    calls = out.pop("tool_calls", None)
    if not calls:
        return out
    if native:
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {"name": c["name"], "arguments": json.loads(c["arguments"])},
            }
            for c in calls
        ]
        return out
    written = "".join(
        f"<tool_call>{json.dumps({'name': c['name'], 'arguments': json.loads(c['arguments'])})}"
        "</tool_call>"
        for c in calls
    )
    out["content"] = f"{out.get('content') or ''}{written}"
    return out
