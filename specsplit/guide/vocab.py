"""Each vocabulary token's bytes, as they add to a generation's text: a byte-level BPE piece's
bytes (GPT-2's byte-to-character table), a SentencePiece piece's text ("▁" a space, "<0xHH>" its
byte); an added token's content; None for special tokens and ids past the tokenizer's (they hold
no text a pattern could match)."""

from __future__ import annotations

import re
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}  # byte-level BPE
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
SENTENCEPIECE_SPACE = "\u2581"


def piece_bytes(piece: str, byte_level: bool) -> bytes:
    """A vocabulary entry's bytes (byte_level: a byte-level BPE vocabulary's)."""
    if byte_level:
        return bytes(BYTE_OF_CHAR[char] for char in piece)
    if match := BYTE_TOKEN.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    return piece.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")


def vocabulary_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """Per token id in [0, vocab_size) its bytes (the module docstring)."""
    known = min(vocab_size, len(tokenizer))
    pieces: list[str | None] = tokenizer.convert_ids_to_tokens(list(range(known)))
    added = getattr(tokenizer, "added_tokens_decoder", {})
    plain = [p for i, p in enumerate(pieces) if i not in added and p is not None]
    byte_level = all(char in BYTE_OF_CHAR for p in plain for char in p)
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in added:
            token = added[i]
            out.append(None if token.special else token.content.encode("utf-8"))
        else:
            out.append(None if piece is None else piece_bytes(piece, byte_level))
    return out + [None] * (vocab_size - known)
