"""The OpenAI HTTP API's log-probabilities (gateway/openai_http.py): a chat body's `logprobs` /
`top_logprobs`, a completions body's `logprobs`, and each choice's `logprobs` block made from a
chunk's (Chunk.logprobs, the target's raw distribution: before temperature, top-k and top-p);
the prompt's (Chunk.prompt_logprobs) as vLLM's `prompt_logprobs` (`prompt_entries`) and as a
completions body's `echo` with `logprobs` lists them before the choice's tokens (`echo_block`).

A choice lists the tokens whose text it returns: a stop token or EOS that ends it is not listed
(its text is not returned either). A token's "token" is its text alone (special tokens as their
names); "bytes" its UTF-8 bytes, which for a token holding part of a character are that part."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.openai_body import OpenAIRequest
from gateway.request import Chunk
from specsplit.guide.vocab import BYTE_OF_CHAR, BYTE_TOKEN
from specsplit.messages import TokenLogprobs


class TokenTexts:
    """Each token id's text and bytes, made once per id (the tokenizer's vocabulary bounds it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._make(token_id)
        return known

    def _make(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id])
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8"))
        # part of a character: the token's own bytes, where its vocabulary entry says them
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if match := BYTE_TOKEN.fullmatch(piece):
                return text, [int(match.group(1), 16)]
            if piece and all(char in BYTE_OF_CHAR for char in piece):
                return text, [BYTE_OF_CHAR[char] for char in piece]
        return text, list(text.encode("utf-8"))


# a token a choice lists: its id, its log-probability, the most likely tokens' (id, log-prob)
Listed = tuple[int, float, list[tuple[int, float]]]


def listed_tokens(chunk: Chunk, stop_ids: frozenset[int]) -> list[Listed]:
    """The chunk's tokens a choice lists, each (id, log-probability, [(id, log-probability)] of
    the most likely), without a stop token that ends the choice."""
    lp = chunk.logprobs
    if lp is None:
        return []
    entries = [
        (token, value, list(zip(ids, values, strict=True)))
        for token, value, ids, values in zip(
            chunk.token_ids, lp.logprobs, lp.top_ids, lp.top_logprobs, strict=True
        )
    ]
    if chunk.finish_reason == "stop" and entries and entries[-1][0] in stop_ids:
        entries.pop()  # (its text is not returned)
    return entries


def chat_logprobs(entries: Iterable[Listed], texts: TokenTexts) -> dict[str, Any]:
    """A chat choice's (or a streamed chunk's delta's) `logprobs` block."""

    def one(token: int, value: float) -> dict[str, Any]:
        text, raw = texts(token)
        return {"token": text, "logprob": value, "bytes": raw}

    return {
        "content": [
            {**one(token, value), "top_logprobs": [one(t, v) for t, v in top]}
            for token, value, top in entries
        ]
    }


def completion_logprobs(
    entries: Iterable[Listed], texts: TokenTexts, offset: int
) -> tuple[dict[str, Any], int]:
    """A completions choice's (or streamed chunk's) `logprobs` block, its tokens' text offsets
    counted from `offset` (the characters of the choice's tokens before them), and the offset
    after them."""
    block: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token, value, top in entries:
        text, _ = texts(token)
        block["tokens"].append(text)
        block["token_logprobs"].append(value)
        block["top_logprobs"].append({texts(t)[0]: v for t, v in top})
        block["text_offset"].append(offset)
        offset += len(text)
    return block, offset


def prompt_entries(
    prompt: list[int], lp: TokenLogprobs, texts: TokenTexts, width: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per prompt token {token id: its
    log-probability, rank (None past the top `width`) and text} for it and the `width` most
    likely tokens at its place."""
    entries: list[dict[str, dict[str, Any]] | None] = [None]
    for token, value, ids, values in zip(
        prompt[1:], lp.logprobs, lp.top_ids, lp.top_logprobs, strict=True
    ):
        top = list(zip(ids[:width], values[:width], strict=True))
        rank = next((r for r, (t, _) in enumerate(top, start=1) if t == token), None)
        entry = {str(token): {"logprob": value, "rank": rank, "decoded_token": texts(token)[0]}}
        for r, (t, v) in enumerate(top, start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": texts(t)[0]})
        entries.append(entry)
    return entries


def echo_block(
    prompt: list[int], lp: TokenLogprobs, texts: TokenTexts, width: int
) -> tuple[dict[str, Any], int]:
    """A completions choice's `logprobs` block for its echoed prompt (the first token's
    log-probability and top tokens null, as OpenAI's), and the text offset after it."""
    listed = list(zip(prompt[1:], lp.logprobs, lp.top_ids, lp.top_logprobs, strict=True))
    entries = [(t, v, list(zip(ids[:width], vs[:width], strict=True))) for t, v, ids, vs in listed]
    first = texts(prompt[0])[0]
    block, offset = completion_logprobs(entries, texts, len(first))
    block["tokens"].insert(0, first)
    block["token_logprobs"].insert(0, None)
    block["top_logprobs"].insert(0, None)
    block["text_offset"].insert(0, 0)
    return block, offset


def joined(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two completions `logprobs` blocks as one, the first's tokens first."""
    return first if then is None else {key: first[key] + then[key] for key in first}


def add_prompt_logprobs(
    req: OpenAIRequest,
    choices: list[dict[str, Any]],
    prompts: list[list[int]],  # each choice's prompt ids
    asked: list[TokenLogprobs | None],  # each choice's first chunk's (Chunk.prompt_logprobs)
    texts: TokenTexts,
) -> dict[str, Any]:
    """The prompt's log-probabilities into a whole response: a completions choice's echoed
    prompt's ahead of its tokens' in its `logprobs` block (their offsets after the prompt's),
    vLLM's `prompt_logprobs` in each completions choice, or in a chat response (its fields to
    add: the chat's)."""
    if req.prompt_asks is None:
        return {}
    extra: dict[str, Any] = {}
    for body, prompt, lp in zip(choices, prompts, asked, strict=True):
        assert lp is not None and len(lp) == len(prompt) - 1, "the first chunk brings them"
        if req.echo and req.logprobs is not None:
            block, offset = echo_block(prompt, lp, texts, req.logprobs)
            then = body["logprobs"]
            if then is not None:
                then = {**then, "text_offset": [o + offset for o in then["text_offset"]]}
            body["logprobs"] = joined(block, then)
        if req.prompt_logprobs is not None:
            entries = prompt_entries(prompt, lp, texts, req.prompt_logprobs)
            if req.kind == "chat":
                extra["prompt_logprobs"] = entries
            else:
                body["prompt_logprobs"] = entries
    return extra


def prompt_parts(
    req: OpenAIRequest,
    prompt: list[int],
    lp: TokenLogprobs,
    texts: TokenTexts,
    echo: str | None,
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """A streamed choice's prompt, sent ahead of its first chunk's text: the event's choice's
    fields (a completions choice's echoed `text` and its `logprobs` block, vLLM's
    `prompt_logprobs`), the event's own (a chat's `prompt_logprobs`), and the text offset after
    the echoed prompt (where the generated tokens' offsets start), as `add_prompt_logprobs`
    makes them whole."""
    fields: dict[str, Any] = {}
    top: dict[str, Any] = {}
    offset = 0
    if echo is not None:
        fields["text"] = echo
        if req.logprobs is not None:
            fields["logprobs"], offset = echo_block(prompt, lp, texts, req.logprobs)
    if req.prompt_logprobs is not None:
        entries = prompt_entries(prompt, lp, texts, req.prompt_logprobs)
        (top if req.kind == "chat" else fields)["prompt_logprobs"] = entries
    return fields, top, offset


def logprobs_block(
    req: OpenAIRequest, entries: list[Listed], texts: TokenTexts, offset: int
) -> tuple[dict[str, Any] | None, int]:
    """A choice's (or a streamed chunk's) `logprobs` block of `entries` (None where the body
    asks for none), and a completions choice's text offset after them."""
    if req.logprobs is None:
        return None, offset
    if req.kind == "chat":
        return chat_logprobs(entries, texts), offset
    return completion_logprobs(entries, texts, offset)
