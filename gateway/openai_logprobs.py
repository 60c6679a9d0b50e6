"""The OpenAI HTTP API's log-probabilities (gateway/openai_http.py): a chat body's `logprobs` /
`top_logprobs`, a completions body's `logprobs`, and each choice's `logprobs` block made from a
chunk's (Chunk.logprobs, the target's raw distribution: before temperature, top-k and top-p).

A choice lists the tokens whose text it returns: a stop token or EOS that ends it is not listed
(its text is not returned either). A token's "token" is its text alone (special tokens as their
names); "bytes" its UTF-8 bytes, which for a token holding part of a character are that part."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.request import Chunk
from specsplit.guide.vocab import BYTE_OF_CHAR, BYTE_TOKEN


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
