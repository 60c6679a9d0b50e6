"""Token ids -> text for the gateway: streaming detokenization (prompt encoding and chat
templates: specsplit/prompt.py).

Streaming uses the prefix_offset/read_offset technique of vLLM and TGI: decode a short window of
recent tokens twice (up to `read_offset`, the end of the text already emitted, and up to the last
token) and emit the difference. A window whose text ends with U+FFFD is an incomplete UTF-8
character (a byte-level token carries only some of its bytes): it is held back until the rest
arrives, so a multi-byte character never reaches the client broken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first generated token, so that tokenizers whose decoder
# depends on the left context (SentencePiece's leading space) stream the first token right.
INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a sequence's generated tokens into text deltas as they arrive, a round at a time.

    The concatenation of every `add` and the final `flush` is the text the generated tokens add
    after the prompt, `decode(prompt_ids + generated_ids)[len(decode(prompt_ids)):]`: for
    byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen) exactly `decode(generated_ids)`; a
    SentencePiece decoder, which drops the space of a decode's first token, keeps it here (as
    vLLM and TGI do). Decoding skips `clean_up_tokenization_spaces`: it cannot apply to a stream.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode_ids = _decoder(tokenizer, skip_special_tokens)
        # The decode window: _ids[:read_offset] is left context whose text is already emitted
        # (or is prompt), _ids[read_offset:] are tokens whose text is not emitted yet. The
        # window starts where the previous emission started (vLLM's prefix_offset).
        self._ids = list(prompt_ids[-INITIAL_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._flushed = False

    def add(self, new_ids: Sequence[int]) -> str:
        """Text newly complete after appending `new_ids`; may be "" (held back or no text)."""
        assert not self._flushed, "add() after flush()"
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._read_offset)
        # Emit up to the last token that ends on a complete character: usually the last one.
        for end in range(len(self._ids), self._read_offset, -1):
            text = self._decode(end)
            if text.endswith(REPLACEMENT_CHAR):
                continue
            if len(text) <= len(prefix_text):  # tokens without text, e.g. skipped specials
                return ""
            del self._ids[: self._read_offset]  # the emitted tokens become the left context
            self._read_offset = end - self._read_offset
            return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """The text held back at the end of the sequence (an incomplete character as U+FFFD)."""
        assert not self._flushed, "flush() twice"
        self._flushed = True
        return self._decode(len(self._ids))[len(self._decode(self._read_offset)) :]

    def _decode(self, end: int) -> str:
        """Text of the window's first `end` tokens."""
        return self._decode_ids(self._ids[:end])


def _decoder(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """ids -> text without clean-up. A fast tokenizer whose class keeps transformers' own
    decode is asked directly (the same text: transformers' decode adds only its clean-up, off
    here, around this call; a third of the time, and a round decodes every stream's window)."""
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and type(tokenizer).decode is PreTrainedTokenizerBase.decode
    ):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode(ids: list[int]) -> str:
        text = tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)
        return text

    return decode
