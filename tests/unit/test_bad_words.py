"""vLLM's bad_words as a token guide (specsplit/guide/bad_words.py): a token is refused exactly
where the output with it would end with a bad word (brute force over random outputs), a
one-token word everywhere; the states stay the words' prefixes however long the output; each
word also counts with a leading space where that encodes to a word of its own."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specsplit.guide.bad_words import BadWords, word_variants
from specsplit.guide.tokens import DEAD

WORDS = [(3,), (5, 6), (5, 5, 7), (6, 5, 6, 1)]
VOCAB = 9


def _refused_by_brute_force(output: list[int], token: int) -> bool:
    text = (*output, token)
    return any(len(w) <= len(text) and text[len(text) - len(w) :] == w for w in WORDS)


def test_a_token_is_refused_exactly_where_it_ends_a_bad_word() -> None:
    guide = BadWords(WORDS, VOCAB)
    rng = random.Random(0)
    for _ in range(400):
        output: list[int] = []  # a random output holding no bad word, as the guide lets it grow
        state = 0
        while len(output) < rng.randint(0, 12):
            t = rng.choice([1, 5, 6, 7])
            if not _refused_by_brute_force(output, t):
                output.append(t)
                state = guide.step(state, t)
        words = guide.mask(state)
        assert words is not None
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB]
        for token in range(VOCAB):
            refused = _refused_by_brute_force(output, token)
            assert bits[token] == (not refused), (output, token)
            assert (guide.step(state, token) == DEAD) == refused


def test_the_states_are_the_words_prefixes_whatever_the_output() -> None:
    guide = BadWords(WORDS, VOCAB)
    seen = {guide.walk(0, [6, 5, 5, 1] * k + [6, 5]) for k in range(50)}
    assert guide.num_states == 6  # (), 5, 6, 5 5, 6 5, 6 5 6
    assert len(seen) == 1 and seen <= set(range(guide.num_states))


@pytest.mark.parametrize("word", ["hello", " hello", "Hello world"])
def test_a_word_counts_with_and_without_a_leading_space(smollm2_tokenizer, word: str) -> None:
    variants = word_variants(smollm2_tokenizer, [word])
    plain = tuple(smollm2_tokenizer.encode(word.lstrip(), add_special_tokens=False))
    spaced = tuple(smollm2_tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
    assert variants[0] == plain
    assert (spaced in variants) == (len(spaced) == len(plain) and spaced[0] != plain[0])
