"""A guide's DFA walked a token at a time (specsplit/guide/tokens.py) and the vocabulary's bytes
(specsplit/guide/vocab.py): at every state a token is allowed exactly when its bytes keep the
text a prefix of a match (brute force over the regex), the end tokens exactly where the text is a
whole match; special and empty tokens never; the state a token leads to is the bytes' walk; a
state no token can leave lets the output end; the vocabulary's bytes concatenate to the text the
tokenizer encoded."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from gateway.guides import round_allowed
from specsplit.guide.regex_dfa import compile_regex
from specsplit.guide.tokens import DEAD, ENDED, FixedTokens, TokenAutomaton
from specsplit.guide.vocab import vocabulary_bytes
from specsplit.logit_rules import NO_MASK
from specsplit.tree import DraftTree

END = 1
VOCAB: list[bytes | None] = [
    None, None, b"", b"a", b"b", b"ab", b"ba", b"abc", b"c", b"\"", b"\\", b"{", b"}", b"1",
    b"12", b"x1", "é".encode(), "é".encode()[:1], "é".encode()[1:], b" ", b"  ", b"a b",
]  # fmt: skip


# the bytes a match of the patterns below may continue with (é's second byte alone too)
EXTENSIONS = [b"a", b"b", b"c", b'"', b"{", b"}", b"1", b"2", b"x", b" ", "é".encode(), b"\xa9"]


@functools.cache
def _is_prefix(pattern: str, text: bytes) -> bool:
    """Whether `text` starts a match of `pattern`: it or an extension by up to 3 EXTENSIONS
    matches whole (enough for the patterns below)."""
    frontier = [text]
    for _ in range(4):
        for t in frontier:
            try:
                if re.fullmatch(pattern, t.decode("utf-8")):
                    return True
            except UnicodeDecodeError:
                pass
        frontier = [t + piece for t in frontier for piece in EXTENSIONS]
    return False


@pytest.mark.parametrize(
    "pattern",
    [r"(ab|ba)*c", r"\{\"[a-c]*\"\}", r"1[0-9]?|x1", r"[^a]{0,2}", r"é+ ?"],
    ids=["alternation", "quoted", "digits", "negated", "multibyte"],
)
def test_a_token_is_allowed_exactly_where_it_keeps_the_text_matchable(pattern: str) -> None:
    guide = TokenAutomaton(compile_regex(pattern), VOCAB, (END,))
    texts = [b"", b"a", b"ab", b'{"', b"1", "é".encode()[:1], "é".encode(), b"x"]
    for text in texts:
        state = guide.dfa.walk(text)
        if state < 0:
            continue
        nxt = guide.next_states(state)
        for token, raw in enumerate(VOCAB):
            if token == END:
                assert (nxt[token] == ENDED) == bool(guide.dfa.accepting[state])
                continue
            ok = bool(raw) and _is_prefix(pattern, text + (raw or b""))
            assert (nxt[token] != DEAD) == ok, (text, raw)
            if ok:
                assert nxt[token] == guide.dfa.walk(raw, state) == guide.step(state, token)
        assert (nxt[0], nxt[2]) == (DEAD, DEAD)  # (special, empty)


def test_masks_are_the_allowed_tokens_bits() -> None:
    guide = TokenAutomaton(compile_regex(r"a+b"), VOCAB, (END,))
    state = guide.dfa.walk(b"a")
    words = guide.mask(state)
    assert words is not None and words.dtype == np.uint32 and len(words) == 1
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: len(VOCAB)].astype(bool)
    assert np.array_equal(bits, guide.next_states(state) != DEAD)
    assert guide.mask(DEAD) is None and guide.mask(ENDED) is None
    assert guide.mask(state) is words  # (made once a state)


def test_a_state_no_token_can_leave_lets_the_output_end() -> None:
    guide = TokenAutomaton(compile_regex(r"a#"), VOCAB, (END,))  # no token holds "#"
    words = guide.mask(guide.dfa.walk(b"a"))
    assert words is not None and int(words[0]) == 1 << END


def test_the_walk_ends_at_an_end_token_only_after_a_whole_match() -> None:
    guide = TokenAutomaton(compile_regex(r"ab"), VOCAB, (END,))
    assert guide.walk(0, [3, 4, END]) == ENDED
    assert guide.walk(0, [3, END]) == DEAD
    assert guide.walk(0, [5]) == guide.dfa.walk(b"ab")
    assert guide.walk(0, [6]) == DEAD and guide.step(DEAD, 3) == DEAD


def test_round_masks_index_one_mask_per_state() -> None:
    guide = TokenAutomaton(compile_regex(r"(ab)*"), VOCAB, (END,))
    tree = DraftTree([3, 5, 4, 3, 8], [-1, -1, 0, 2, 3])  # a, ab, a>b, a>b>a, a>b>a>c
    allowed = round_allowed(guide, 0, tree)
    # rows: root (""), "a", "ab", "ab" again, "aba", then "c": refused
    assert allowed.rows[1] != allowed.rows[0] and allowed.rows[2] == allowed.rows[3] == 0
    assert allowed.rows[4] == allowed.rows[1] and allowed.rows[5] == NO_MASK
    assert len(allowed.masks(len(VOCAB))) == 2


def test_vocabulary_bytes_spell_the_encoded_text(smollm2_tokenizer) -> None:
    vocab = vocabulary_bytes(smollm2_tokenizer, len(smollm2_tokenizer) + 5)
    text = 'Zoë said: {"x": [1, 2.5e3]}\n\tok 中文 😀'
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(vocab[i] or b"" for i in ids).decode("utf-8") == text
    special = smollm2_tokenizer.all_special_ids
    assert all(vocab[i] is None for i in special) and vocab[-5:] == [None] * 5


def test_fixed_tokens_allow_the_same_tokens_everywhere() -> None:
    guide = FixedTokens((3, 5, 40), 70)
    words = guide.mask(0)
    assert words is not None and len(words) == 3
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [3, 5, 40]
    assert guide.walk(0, [5, 3, 40, 3]) == 0 and guide.walk(0, [5, 4, 3]) == DEAD
    assert guide.row_states(0, DraftTree([5, 6, 3], [-1, 0, 0])) == [0, 0, DEAD, 0]
    assert guide.mask(DEAD) is None
