"""The regex -> byte-level DFA compiler (`specsplit.guide.regex_dfa`): on every supported pattern
it accepts exactly the strings `re.fullmatch` accepts (under `re.ASCII` where the pattern uses
`\\d \\w \\s`), over handwritten, random and DFA-sampled strings and over random patterns; classes
take exactly the valid UTF-8 encodings of their characters; the DFA is minimal, trimmed and
numbered from the start; unsupported syntax, Python's syntax errors and huge DFAs are refused."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from specsplit.guide.regex_dfa import ByteDFA, compile_regex, utf8_sequences

# letters, digits, JSON punctuation, whitespace, quote, backslash, 2-, 3- and 4-byte characters
ALPHABET = [*'ab0 9-._{}:,"\\\n\t\x0b', "é", "ÿ", "中", "龥", "😀"]

PATTERNS = [  # (id, pattern): all in the supported subset
    ("literal", "abc"),
    ("empty", ""),
    ("alternation", "a|b|ab"),
    ("empty_alternative", "(a|)b"),
    ("empty_group", "()a()"),
    ("star_of_alternation", "(a|b)*c"),
    ("nested_stars", "(a*b*)*"),
    ("star_of_optional", "(a?)*b"),
    ("plus_question", "a+b?"),
    ("counted", "a{3}"),
    ("counted_range", "(ab){1,3}"),
    ("counted_open", "a{2,}b"),
    ("counted_upto", "a{,2}b"),
    ("counted_zero", "a{0}b"),
    ("counted_any", "a{,}b"),
    ("brace_literals", "a{|{}|x{y}|{1,x}"),
    ("brace_json_like", '{"a":1}'),
    ("dot", "a.c"),
    ("dot_star", ".*"),
    ("escaped_punctuation", r"\\\.\"\/\-\[\]\(\)\{\}\*\+\?\|\^\$"),
    ("escaped_controls", r"\n\t\r\f\v\0\a"),
    ("octal", r"\011\0"),
    ("hex_escapes", r"\x61\u00e9\u4e2d\U0001F600"),
    ("escaped_non_ascii", r"\é\中"),
    ("shorthands", r"\d\w\s"),
    ("negated_shorthands", r"\D\W\S"),
    ("shorthand_runs", r"\w+@\w+\.[a-z]{2,3}"),
    ("class", "[abc]+"),
    ("class_range", "[a-z0-9_]*"),
    ("negated_class", r'[^"\\]*'),
    ("json_string", r'"([^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'),
    ("class_with_shorthands", r"[\d\s.]+"),
    ("negated_class_with_shorthand", r"[^\d]+"),
    ("class_bracket_first", "[]a]"),
    ("negated_class_bracket_first", "[^]a]"),
    ("class_dash_ends", "[-a][a-]"),
    ("class_escapes", r"[\]\\\-\n\b]"),
    ("class_hex_range", r"[\x00-\x1f\u00e0-\u00ff]"),
    ("class_latin_range", "[à-ÿ]+"),
    ("class_cjk_range", "[一-龥]+"),
    ("class_across_lengths", "[é-中]"),
    ("class_astral", "[😀-\U0010ffff]"),
    ("negated_non_ascii", "[^中é]"),
    ("non_ascii_literals", "é中😀"),
    ("anchors", "^a|b$"),
    ("anchor_only", "^$"),
    ("non_capturing", "(?:ab|cd)+"),
    ("named_group", "(?P<key>[a-z]+):(?P<value>[0-9]+)"),
    ("lazy", "a*?b+?c??d{1,2}?"),
    ("number", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"),
    ("choices", "yes|no|maybe|中文|😀"),
    ("whitespace", "[ \t\n]*:[ \t\n]*"),
    ("no_match_class", r"[^\s\S]"),
    ("surrogate_literal", "a\\ud800|b"),
]

JSON_PERSON = (
    r'\{[ \t\n]*"name"[ \t\n]*:[ \t\n]*"([^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"[ \t\n]*,'
    r'[ \t\n]*"age"[ \t\n]*:[ \t\n]*-?(0|[1-9][0-9]*)[ \t\n]*\}'
)
WORD_TEXT = (  # fifty words for an alternation
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
    "tau upsilon phi chi psi omega red orange yellow green blue indigo violet black white gray "
    "brown pink cyan magenta apple banana cherry grape lemon mango melon peach pear café 中文 naïve"
)
WORDS = WORD_TEXT.split()


def python_regex(pattern: str) -> re.Pattern[str]:
    """Python's compiled pattern; under re.ASCII where \\d \\w \\s take their ASCII meanings."""
    return re.compile(pattern, re.ASCII if re.search(r"\\[dDwWsS]", pattern) else 0)


def random_strings(rng: random.Random, alphabet: list[str], count: int) -> list[str]:
    return ["".join(rng.choices(alphabet, k=rng.randint(0, 7))) for _ in range(count)]


def sampled_matches(dfa: ByteDFA, rng: random.Random, count: int) -> list[str]:
    """Strings the DFA accepts, from random walks (which must decode: no invalid UTF-8)."""
    out = []
    for _ in range(count):
        data, state = bytearray(), 0
        for _ in range(40):
            live = np.flatnonzero(dfa.transitions[state] >= 0)
            if dfa.accepting[state] and (rng.random() < 0.3 or len(live) == 0):
                out.append(bytes(data).decode("utf-8"))
                break
            if len(live) == 0:  # only the start of a pattern that matches nothing
                break
            byte = int(rng.choice(live.tolist()))
            data.append(byte)
            state = int(dfa.transitions[state, byte])
    return out


def assert_matches_python(pattern: str, texts: list[str]) -> None:
    dfa, ref = compile_regex(pattern), python_regex(pattern)
    wrong = [t for t in texts if dfa.matches(t) != (ref.fullmatch(t) is not None)]
    assert not wrong, f"{pattern!r} disagrees with re.fullmatch on {wrong[:5]!r}"


@pytest.mark.parametrize("pattern", [p for _, p in PATTERNS], ids=[i for i, _ in PATTERNS])
def test_matches_python_re_fullmatch_on_random_strings(pattern: str) -> None:
    rng = random.Random(pattern)
    alphabet = ALPHABET + sorted(set(pattern) - {"\\"})
    texts = random_strings(rng, alphabet, 300) + sampled_matches(compile_regex(pattern), rng, 60)
    assert_matches_python(pattern, texts)


@pytest.mark.parametrize(
    ("pattern", "texts"),
    [
        (
            JSON_PERSON,
            [
                '{"name": "Jo\\u00e9 中", "age": -42}',
                '{"name":"","age":0}',
                '{"name": "a\\"b", "age": 01}',
                '{"name": "a"b", "age": 1}',
                '{ "name" : "😀\\n" ,\n "age" : 10 }',
                '{"name": "x", "age": 1.5}',
            ],
        ),
        ("|".join(WORDS), [*WORDS, "", "alph", "alphabeta", "cafe", "中", "pinks", "Red"]),
        (r"\d+", ["0", "123", "٣", "1a", ""]),
        (".", ["a", "\n", "é", "中", "😀", "ab", ""]),
    ],
    ids=["json_object", "fifty_words", "ascii_digits", "dot"],
)
def test_matches_python_re_fullmatch_on_handwritten_strings(pattern: str, texts: list[str]) -> None:
    assert_matches_python(pattern, texts)


def random_pattern(rng: random.Random, depth: int) -> str:
    """A random pattern of the supported subset."""
    atoms = ["a", "b", "é", "中", "😀", r"\"", r"\\", ".", r"\d", r"\W", "[ab]", r'[^"\\]',
             "[à-ÿ]", "[^a中]", "[é-中]", r"[\s0-9]", "{", r"\n", r"\u00e9"]  # fmt: skip
    roll = rng.random()
    if depth == 0 or roll < 0.3:
        return rng.choice(atoms)
    if roll < 0.55:
        return "".join(random_pattern(rng, depth - 1) for _ in range(rng.randint(2, 3)))
    if roll < 0.75:
        branches = [random_pattern(rng, depth - 1) if rng.random() < 0.85 else "" for _ in "ab"]
        return "(" + "|".join(branches) + ")"
    quantifier = rng.choice(["*", "+", "?", "{2}", "{1,3}", "{,2}", "{2,}", "{0}"])
    return f"(?:{random_pattern(rng, depth - 1)}){quantifier}{rng.choice(['', '?'])}"


def test_matches_python_re_fullmatch_on_random_patterns() -> None:
    rng = random.Random(7)
    for _ in range(150):
        pattern = random_pattern(rng, 4)
        dfa = compile_regex(pattern)
        texts = random_strings(rng, ALPHABET, 40) + sampled_matches(dfa, rng, 20)
        assert_matches_python(pattern, texts)


def test_negated_class_takes_any_multibyte_character() -> None:
    dfa = compile_regex(r'[^"\\]')
    for char in ["a", "\n", "\x00", "\x7f", "\x80", "é", "\u07ff", "\u0800", "中", "\ud7ff",
                 "\ue000", "\uffff", "😀", "\U00010000", "\U0010ffff"]:  # fmt: skip
        assert dfa.matches(char), repr(char)
    for text in ['"', "\\", "", "ab", "é中"]:
        assert not dfa.matches(text), repr(text)


@pytest.mark.parametrize(
    ("pattern", "low", "high"),
    [
        ("[à-ÿ]", 0xE0, 0xFF),
        ("[一-龥]", 0x4E00, 0x9FA5),
        ("[é-中]", 0xE9, 0x4E2D),
        ("[😀-🙏]", 0x1F600, 0x1F64F),
    ],
    ids=["latin", "cjk", "two_to_three_bytes", "emoji"],
)
def test_non_ascii_range_takes_exactly_its_characters(pattern: str, low: int, high: int) -> None:
    dfa = compile_regex(pattern)
    for code in [*range(low - 300, low + 300), *range(high - 300, high + 300)]:
        if 0 <= code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF:
            assert dfa.matches(chr(code)) == (low <= code <= high), hex(code)


def count_accepted_by_length(dfa: ByteDFA, longest: int) -> list[int]:
    """How many byte strings of each length 0..longest the DFA accepts."""
    ways = np.zeros(dfa.num_states, dtype=np.int64)
    ways[0] = 1
    counts = []
    for _ in range(longest + 1):
        counts.append(int(ways[dfa.accepting].sum()))
        nxt = np.zeros_like(ways)
        live = dfa.transitions >= 0
        np.add.at(nxt, dfa.transitions[live], np.broadcast_to(ways[:, None], live.shape)[live])
        ways = nxt
    return counts


def test_dot_accepts_exactly_the_valid_encodings_of_all_but_newline() -> None:
    dot = compile_regex(".")
    # per length as many strings as characters of that encoded length (surrogates not among them)
    counts = count_accepted_by_length(dot, 5)
    assert counts == [0, 0x80 - 1, 0x800 - 0x80, 0x10000 - 0x800 - 0x800, 0x110000 - 0x10000, 0]
    for first in range(256):  # and every string of one or two bytes: accepted iff it is one
        for data in [bytes([first]), *(bytes([first, second]) for second in range(256))]:
            try:
                char = data.decode("utf-8")
            except UnicodeDecodeError:
                char = ""
            state = dot.walk(data)
            assert (state >= 0 and dot.accepting[state]) == (len(char) == 1 and char != "\n"), data
    assert all(len(text) == 1 for text in sampled_matches(dot, random.Random(0), 500))


def test_invalid_utf8_never_matches() -> None:
    dfa = compile_regex(".*")
    invalid = [b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80",
               b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\xe4\xb8",
               b"\xe4\xb8a", b"a\xf0\x9f\x98"]  # fmt: skip
    for data in invalid:
        state = dfa.walk(data)
        assert state < 0 or not dfa.accepting[state], data
    rng = random.Random(3)
    for _ in range(3000):  # random byte strings, weighted toward lead and continuation bytes
        data = bytes(rng.choice([rng.randrange(256), rng.randrange(0x80, 0xC0)]) for _ in "abcd")
        data = data[: rng.randint(1, 4)]
        state = dfa.walk(data)
        try:
            valid = "\n" not in data.decode("utf-8")
        except UnicodeDecodeError:
            valid = False
        assert valid or state < 0 or not dfa.accepting[state], data
    assert not dfa.matches("a\ud800b")  # a lone surrogate is not a character


def test_utf8_sequences_split_the_code_space_as_re2_does() -> None:
    full = utf8_sequences(0, 0xD7FF) + utf8_sequences(0xE000, 0x10FFFF)
    assert full == [
        ((0x00, 0x7F),),
        ((0xC2, 0xDF), (0x80, 0xBF)),
        ((0xE0, 0xE0), (0xA0, 0xBF), (0x80, 0xBF)),
        ((0xE1, 0xEC), (0x80, 0xBF), (0x80, 0xBF)),
        ((0xED, 0xED), (0x80, 0x9F), (0x80, 0xBF)),
        ((0xEE, 0xEF), (0x80, 0xBF), (0x80, 0xBF)),
        ((0xF0, 0xF0), (0x90, 0xBF), (0x80, 0xBF), (0x80, 0xBF)),
        ((0xF1, 0xF3), (0x80, 0xBF), (0x80, 0xBF), (0x80, 0xBF)),
        ((0xF4, 0xF4), (0x80, 0x8F), (0x80, 0xBF), (0x80, 0xBF)),
    ]


TRIMMED = [(i, p) for i, p in PATTERNS if i != "no_match_class"]  # every state reaches acceptance
TRIMMED += [("json_object", JSON_PERSON), ("fifty_words", "|".join(WORDS))]
ALL_PATTERNS = [p for _, p in TRIMMED]
ALL_IDS = [i for i, _ in TRIMMED]


@pytest.mark.parametrize("pattern", ALL_PATTERNS, ids=ALL_IDS)
def test_every_state_can_reach_an_accepting_state(pattern: str) -> None:
    dfa = compile_regex(pattern)
    live = dfa.accepting.copy()
    for _ in range(dfa.num_states):
        live |= (np.where(dfa.transitions >= 0, live[dfa.transitions], False)).any(axis=1)
    assert live.all()


@pytest.mark.parametrize("pattern", ALL_PATTERNS, ids=ALL_IDS)
def test_states_are_numbered_breadth_first_from_the_start(pattern: str) -> None:
    dfa = compile_regex(pattern)
    order = [0]
    for state in order:  # grows as states are found: breadth-first, bytes in order
        row = dfa.transitions[state].tolist()
        order += [t for t in dict.fromkeys(row) if t >= 0 and t not in order]
    assert order == list(range(dfa.num_states))
    assert dfa.transitions.dtype == np.int32 and dfa.accepting.dtype == np.bool_
    assert dfa.transitions.shape == (dfa.num_states, 256)
    assert not dfa.transitions.flags.writeable


def distinguishable(dfa: ByteDFA) -> np.ndarray:
    """Table filling: [n, n] whether some string tells the two states apart."""
    n = dfa.num_states
    table = np.vstack([np.where(dfa.transitions >= 0, dfa.transitions, n), np.full((1, 256), n)])
    accepting = np.append(dfa.accepting, False)  # [n + 1]: state n is the dead one
    apart = accepting[:, None] != accepting[None, :]
    while True:  # apart if some byte leads to a pair already apart
        grown = apart | apart[table[:, None, :], table[None, :, :]].any(axis=2)
        if (grown == apart).all():
            return apart[:n, :n]
        apart = grown


@pytest.mark.parametrize("pattern", ALL_PATTERNS, ids=ALL_IDS)
def test_minimized_dfa_has_no_equivalent_states(pattern: str) -> None:
    dfa = compile_regex(pattern)
    apart = distinguishable(dfa)
    assert (apart | np.eye(dfa.num_states, dtype=bool)).all()


@pytest.mark.parametrize(
    ("pattern", "states"),
    [
        ("(a|b)*c", 2),
        ("", 1),
        ("a*", 1),
        (r"\w*", 1),
        ("abc|abd", 4),
        ("(ab|cd)*", 3),
        ("x*y*z*", 3),
        ("a{2,4}", 5),
        ("[à-ÿ]", 3),
        ("[一-龥]", 7),
        (r'[^"\\]*', 8),
        (".", 9),
        ("a{1000}", 1001),
    ],
)
def test_minimized_dfa_has_the_minimal_state_count(pattern: str, states: int) -> None:
    # '.': start, end, 1/2/3 continuation bytes to go, and the four leads with narrower seconds
    assert compile_regex(pattern).num_states == states


@pytest.mark.parametrize(
    ("greedy", "lazy"),
    [
        ("a*b", "a*?b"),
        ("(ab)+", "(ab)+?"),
        ("a?b", "a??b"),
        ("a{2,5}", "a{2,5}?"),
        ("a{3,}", "a{3,}?"),
        (r'"[^"]*"', r'"[^"]*?"'),
    ],
)
def test_lazy_quantifiers_match_the_same_language(greedy: str, lazy: str) -> None:
    a, b = compile_regex(greedy), compile_regex(lazy)  # minimal and numbered alike: equal arrays
    assert np.array_equal(a.transitions, b.transitions)
    assert np.array_equal(a.accepting, b.accepting)


def test_anchors_at_the_ends_are_ignored() -> None:
    assert np.array_equal(
        compile_regex("^(ab|c)$").transitions, compile_regex("(ab|c)").transitions
    )


def test_pattern_matching_nothing_is_one_dead_state() -> None:
    dfa = compile_regex(r"[^\s\S]|\ud800")
    assert dfa.num_states == 1 and not dfa.accepting[0] and (dfa.transitions == -1).all()


def test_walk_returns_minus_one_once_dead_and_resumes_from_a_state() -> None:
    dfa = compile_regex("ab*c")
    assert dfa.walk(b"x") == -1 and dfa.walk(b"xab") == -1 and dfa.walk(b"a", -1) == -1
    mid = dfa.walk(b"ab")
    assert mid >= 0 and dfa.walk(b"bbc", mid) == dfa.walk(b"abbbc")
    assert dfa.accepting[dfa.walk(b"abbbc")] and dfa.walk(b"") == 0
    dot = compile_regex(".")
    half = dot.walk("é".encode()[:1])  # half a character: alive, not accepting
    assert half >= 0 and not dot.accepting[half] and dot.accepting[dot.walk("é".encode()[1:], half)]


@pytest.mark.parametrize(
    ("pattern", "construct"),
    [
        (r"(a)\1", "backreference"),
        ("(?P<x>a)(?P=x)", "named backreference"),
        ("(?=a)a", "lookahead"),
        ("(?!a)b", "negative lookahead"),
        ("(?<=a)b", "lookbehind"),
        ("(?<!a)b", "negative lookbehind"),
        (r"\bword", "word boundary"),
        (r"a\B", "\\B"),
        (r"\Aa", "\\A"),
        (r"a\Z", "\\Z"),
        ("(?i)a", "inline flags"),
        ("(?i:a)", "inline flags"),
        ("a*+", "possessive"),
        ("a{2}+", "possessive"),
        ("(?>a)", "atomic group"),
        ("(?#note)a", "comment"),
        ("(a)(?(1)b|c)", "conditional"),
        (r"\N{DASH}", "\\N{"),
        ("a^b", "anchor '^'"),
        ("a$b", "anchor '$'"),
        ("(a$)", "anchor '$'"),
    ],
)
def test_unsupported_syntax_is_refused_with_its_name(pattern: str, construct: str) -> None:
    with pytest.raises(ValueError, match="unsupported") as refused:
        compile_regex(pattern)
    assert construct in str(refused.value) and "at position" in str(refused.value)


@pytest.mark.parametrize(
    "pattern",
    [
        "(",
        ")",
        "a)",
        "(?:a",
        "[a",
        "[]",
        "[^]",
        "a**",
        "a*??",
        "*a",
        "(|*)",
        "a{3,1}",
        "[z-a]",
        r"[\d-z]",
        r"\q",
        "\\",
        r"\x4",
        r"\u12",
        r"\U00110000",
        "(?P<1>a)",
        "(?P<a>x)(?P<a>y)",
        "(?P<a",
        "(?<name>a)",
    ],
)
def test_python_syntax_errors_are_refused(pattern: str) -> None:
    with pytest.raises(re.error):
        re.compile(pattern)
    with pytest.raises(ValueError, match="at position"):
        compile_regex(pattern)


def test_state_cap_refuses_huge_counts() -> None:
    with pytest.raises(ValueError, match="NFA states"):
        compile_regex("a{1000000000}")
    with pytest.raises(ValueError, match="max_states=50"):
        compile_regex("[a-z]{60}", max_states=50)
    assert compile_regex("[a-z]{40}", max_states=50).num_states == 41


def test_realistic_patterns_compile_to_small_dfas() -> None:
    # no timing assert: these compile in milliseconds (the whole file stays fast)
    person = compile_regex(JSON_PERSON)
    assert person.num_states < 60
    assert person.matches('{"name": "Jo\\u00e9 \\"中\\"", "age": 42}')
    assert not person.matches('{"name": "Jo", "age": 042}')
    words = compile_regex("|".join(WORDS))
    assert words.num_states < 300
    assert all(words.matches(word) for word in WORDS) and not words.matches("alphabeta")
