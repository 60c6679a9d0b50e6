"""vLLM's `bad_words` as a token guide (specsplit/guide/tokens.py:TokenGuide): each bad word is
a token sequence (`word_variants`: the word as the tokenizer encodes it, and with a leading space
where that is a word of its own), and its last token is refused wherever the output so far ends
with the rest of it; a one-token word is refused everywhere. The output is the generation's own
tokens (not the prompt's), as in vLLM.

A state is the longest suffix of the output that begins some bad word (Aho-Corasick's trie node,
over token ids), so the states are the words' prefixes: few, whatever the output's length."""

from __future__ import annotations

from typing import Any

import numpy as np

from specsplit.guide.tokens import DEAD, TokenGuide

MAX_BAD_WORDS = 256  # words a request may list


def word_variants(tokenizer: Any, words: list[str]) -> list[tuple[int, ...]]:
    """Each word's token ids, and those of " word" where the space makes tokens of the same
    count starting elsewhere (vLLM's `_get_bad_words_token_ids`)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [plain] if plain else []
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


class BadWords(TokenGuide):
    """The tokens refused after each output (`words`: token sequences, each non-empty)."""

    def __init__(self, words: list[tuple[int, ...]], vocab_size: int) -> None:
        assert words and all(words), "bad words are non-empty token sequences"
        super().__init__(vocab_size)
        # the states: every proper prefix of a word (the empty one is 0, the start)
        prefixes = sorted({w[:k] for w in words for k in range(len(w))}, key=len)
        self._ids = {p: i for i, p in enumerate(prefixes)}
        self._prefixes = prefixes
        self._refused = [  # per state the last tokens of the words whose rest its suffix is
            {w[-1] for w in words if p[len(p) - len(w) + 1 :] == w[:-1] and len(w) - 1 <= len(p)}
            for p in prefixes
        ]

    @property
    def num_states(self) -> int:
        return len(self._prefixes)

    def allowed_at(self, state: int) -> np.ndarray:
        allowed = np.ones(self.vocab_size, dtype=bool)
        allowed[list(self._refused[state])] = False
        return allowed

    def step(self, state: int, token: int) -> int:
        if state < 0 or token in self._refused[state]:
            return DEAD if state >= 0 else state
        suffix = (*self._prefixes[state], token)
        while suffix not in self._ids:  # the longest suffix that begins a word ((): always)
            suffix = suffix[1:]
        return self._ids[suffix]
