"""How a model writes tool calls into free text (`tool_choice` "auto", gateway/tools.py): the
formats the gateway reads back, each saying where the calls begin in the output so far
(`begins`), how much of its end streaming holds back because it may begin them (`held`), and the
text before them and the calls' JSON objects once the output is whole (`read`). The chat template
says which one the model was taught (`call_format`):

- `HERMES`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after any text
  (Qwen's, Hermes', SmolLM3's templates, and the gateway's fallback tools prompt,
  specsplit/prompt.py), as vLLM's `hermes` parser reads them;
- `LLAMA3_JSON`: the whole output one or more `{"name": ..., "parameters": {...}}` objects
  (`;` between them), the python tag before them dropped with the special tokens (Llama 3.1's
  and 3.2's templates ask for this), as vLLM's `llama3_json` parser reads them;
- `MISTRAL`: after any text, `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects
  (Mistral's v3 tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` a call each (v11 and later), as
  vLLM's `mistral` parser reads them. `[TOOL_CALLS]` is a special token, which decoded text drops:
  the format `keeps_special` tokens, and a request that may be answered with calls decodes its
  output with them (gateway/openai_tools.py, as vLLM's parser asks of its requests)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from gateway.stopping import held_prefix_len

PYTHON_TAG = "<|python_tag|>"  # (Llama 3's, before its calls where special tokens are kept)


class CallFormat:
    keeps_special = False  # whether its calls are read only where special tokens are decoded

    def begins(self, text: str) -> int:
        """Where calls begin in the output so far (-1: none yet)."""
        raise NotImplementedError

    def held(self, text: str) -> int:
        """How many characters at the end of the output so far may begin calls."""
        raise NotImplementedError

    def read(self, text: str) -> tuple[str, list[Any]] | None:
        """A whole output's text before its calls and the calls' JSON values; None where it
        has none or they are not JSON."""
        raise NotImplementedError


class Tagged(CallFormat):
    """A format whose calls begin with a tag, after any text."""

    tag = ""

    def begins(self, text: str) -> int:
        return text.find(self.tag)

    def held(self, text: str) -> int:
        return held_prefix_len(text, (self.tag,))


class Hermes(Tagged):
    tag = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)  # (the last may be open)

    def read(self, text: str) -> tuple[str, list[Any]] | None:
        start = self.begins(text)
        if start < 0:
            return None
        try:
            values = [json.loads(b.group(1)) for b in self._block.finditer(text, start)]
        except json.JSONDecodeError:
            return None
        return text[:start], values


class Llama3Json(CallFormat):
    _decoder = json.JSONDecoder()

    def begins(self, text: str) -> int:
        # (the whole output, blank beginning too: no text before the calls)
        return 0 if text.lstrip().startswith(("{", PYTHON_TAG)) else -1

    def held(self, text: str) -> int:
        # (blank so far, or a python tag's beginning: the output may yet be calls)
        return len(text) if PYTHON_TAG.startswith(text.lstrip()) else 0

    def read(self, text: str) -> tuple[str, list[Any]] | None:
        if self.begins(text) < 0:
            return None
        at = len(text) - len(text.lstrip())
        at += len(PYTHON_TAG) if text.startswith(PYTHON_TAG, at) else 0
        values = []
        while True:
            at = len(text) - len(text[at:].lstrip())
            try:
                value, at = self._decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return None
            values.append(value)
            rest = text[at:].lstrip()
            if not rest:
                return "", values
            if not rest.startswith(";"):
                return None
            at = len(text) - len(rest) + 1


class Mistral(Tagged):
    tag = "[TOOL_CALLS]"
    args = "[ARGS]"
    keeps_special = True
    _decoder = json.JSONDecoder()

    def read(self, text: str) -> tuple[str, list[Any]] | None:
        start = self.begins(text)
        if start < 0:
            return None
        values: list[Any] = []
        at = start
        while at < len(text):  # a tag, then its calls: an array (or object), or name[ARGS]{...}
            if not text.startswith(self.tag, at):
                return None
            at += len(self.tag)
            named = text.find(self.args, at)
            json_at = len(text) - len(text[at:].lstrip())
            try:
                if not text.startswith(("[", "{"), json_at) and named >= 0:
                    arguments, at = self._decoder.raw_decode(text, named + len(self.args))
                    values.append({"name": text[json_at:named].strip(), "arguments": arguments})
                else:
                    value, at = self._decoder.raw_decode(text, json_at)
                    values += value if isinstance(value, list) else [value]
            except json.JSONDecodeError:
                return None
            at = len(text) - len(text[at:].lstrip())
        return text[:start], values


HERMES = Hermes()
LLAMA3_JSON = Llama3Json()
MISTRAL = Mistral()
# what in a chat template says the model writes Llama 3's calls: its tag, or its instruction's
# "Respond in the format {"name": function name, "parameters": dictionary of argument name ..."
_LLAMA3_SIGNS = (PYTHON_TAG, '"parameters": dictionary of argument name')


def call_format(chat_template: str | Mapping[str, str] | None) -> CallFormat:
    """The format a tokenizer's chat template (transformers' `chat_template`: one, or named
    ones) teaches: Hermes' blocks where it names them or says nothing of calls (the fallback
    tools prompt asks for them), Llama 3's JSON or Mistral's tag where it asks for that."""
    if isinstance(template := chat_template, Mapping):
        template = "\n".join(template.values())
    text = template or ""
    if HERMES.tag in text:
        return HERMES
    if MISTRAL.tag in text:
        return MISTRAL
    if any(sign in text for sign in _LLAMA3_SIGNS):
        return LLAMA3_JSON
    return HERMES
