"""Prompts to token ids: raw text as the tokenizer encodes it, chats through its template (the
gateway's requests and the drafter's training data alike)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a raw-text prompt, special tokens added as the tokenizer does by default."""
    return list(tokenizer.encode(text))


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]]
) -> list[int]:
    """Token ids of a chat rendered by the tokenizer's template, ending with the assistant prompt.

    transformers 5 returns a BatchEncoding (`return_dict=True` is its default), 4.x a list.
    """
    encoded = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
    )
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise TypeError(f"apply_chat_template returned {type(encoded).__name__}, not token ids")
    return cast("list[int]", ids)
