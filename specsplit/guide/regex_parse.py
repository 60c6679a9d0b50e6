"""Parse a regular expression, a subset of Python `re` syntax, into a tree over code-point sets for
`regex_dfa` to compile to a byte-level DFA.

Supported: literal characters; escaped punctuation (`\\.`, `\\{`, ...: any escaped character that
is not an ASCII letter or digit is itself); `\\n \\t \\r \\f \\v \\a`, `\\0` (with up to two more
octal digits), `\\xHH`, `\\uHHHH`, `\\UHHHHHHHH`; `\\d \\w \\s \\D \\W \\S` with their ASCII
meanings (`\\d` = [0-9], `\\w` = [A-Za-z0-9_], `\\s` = [ \\t\\n\\r\\f\\v]: Python's own, without
`re.ASCII`, also take non-ASCII digits, letters and spaces); `.` (any character but `\\n`);
bracket classes `[...]` and `[^...]` with ranges, escapes and `\\d \\w \\s` inside (`\\b` there is
backspace, as in Python); groups `(...)`, `(?:...)`, `(?P<name>...)`, all plain groups; `|` with
empty alternatives; quantifiers `* + ? {m} {m,} {m,n} {,n}` and their lazy forms (the same
language); `^` as the pattern's first character and `$` as its last, ignored (a match is a whole
string anyway). A `{` that does not start a valid quantifier is a literal `{`, as in Python.

Refused with a ValueError naming the construct and its position: backreferences, lookarounds,
atomic groups, conditionals, comments and inline flags (`(?...)` other than `(?:` and `(?P<`),
`\\b \\B \\A \\Z`, `\\N{...}`, `\\1`-`\\9` (backreference or octal), possessive quantifiers,
`^`/`$` anywhere else, and everything Python itself rejects (bad escapes, bad ranges, unbalanced
parentheses, nothing to repeat, multiple repeats).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: never in a set, never matched

Ranges: TypeAlias = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code-point ranges


@dataclass(frozen=True)
class Chars:
    """One character from a set of code points (empty: matches nothing)."""

    ranges: Ranges


@dataclass(frozen=True)
class Concat:
    """The items one after another; () is the empty string."""

    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    """Any one of the items (two or more)."""

    items: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    """The item `low` to `high` times (None: unbounded)."""

    item: Node
    low: int
    high: int | None


Node: TypeAlias = Chars | Concat | Alt | Repeat


def normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """The ranges sorted, merged where they touch, surrogates cut out."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out: list[tuple[int, int]] = []
    for lo, hi in merged:
        for part in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            if part[0] <= part[1]:
                out.append(part)
    return tuple(out)


def complement(ranges: Ranges) -> Ranges:
    """Every character not in `ranges` (normalized)."""
    out: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return normalize(out)


DIGIT = normalize([(0x30, 0x39)])
WORD = normalize([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = normalize([(0x09, 0x0D), (0x20, 0x20)])  # \t \n \v \f \r and space
SHORTHANDS = {"d": DIGIT, "w": WORD, "s": SPACE}
SHORTHANDS |= {k.upper(): complement(v) for k, v in SHORTHANDS.items()}
ANY_BUT_NEWLINE = complement(((0x0A, 0x0A),))
SIMPLE_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "a": 0x07}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}  # the escape's letter: its count of hex digits
REFUSED_ESCAPES = {
    "b": "word boundary \\b",
    "B": "non-word-boundary \\B",
    "A": "start-of-string anchor \\A",
    "Z": "end-of-string anchor \\Z",
    "N": "named character escape \\N{...}",
}
REFUSED_EXTENSIONS = (  # what follows "(?": the construct's name
    ("P=", "named backreference (?P=...)"),
    ("=", "lookahead (?=...)"),
    ("!", "negative lookahead (?!...)"),
    ("<=", "lookbehind (?<=...)"),
    ("<!", "negative lookbehind (?<!...)"),
    (">", "atomic group (?>...)"),
    ("#", "comment group (?#...)"),
    ("(", "conditional group (?(...)...)"),
)
FLAG_LETTERS = "aiLmsux-"
DIGITS = "0123456789"
HEX_DIGITS = DIGITS + "abcdefABCDEF"


def parse(pattern: str) -> Node:
    """The tree of `pattern`; ValueError for syntax outside the supported subset (module doc)."""
    parser = _Parser(pattern)
    node = parser.alternation()
    if parser.pos < len(pattern):  # only a ')' ends an alternation early
        raise parser.bad("unbalanced parenthesis ')'", parser.pos)
    return node


class _Parser:
    """Recursive descent over `pattern`; `pos` is the next character to read."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.pos = 0
        self.group_names: set[str] = set()

    def bad(self, what: str, at: int) -> ValueError:
        shown = self.pattern if len(self.pattern) <= 80 else self.pattern[:77] + "..."
        return ValueError(f"{what} at position {at} of regex {shown!r}")

    def refuse(self, construct: str, at: int) -> ValueError:
        return self.bad(f"unsupported regex syntax: {construct}", at)

    def peek(self, ahead: int = 0) -> str:
        """The character `ahead` past pos, or "" past the end."""
        at = self.pos + ahead
        return self.pattern[at] if at < len(self.pattern) else ""

    def alternation(self) -> Node:
        branches = [self.concat()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.concat())
        return branches[0] if len(branches) == 1 else Alt(tuple(branches))

    def concat(self) -> Node:
        items: list[Node] = []
        while self.peek() not in ("", "|", ")"):
            start = self.pos
            atom = self.atom()
            at = self.pos
            bounds = self.quantifier()
            if bounds is None:
                items.extend([] if atom is None else [atom])
                continue
            if atom is None:
                raise self.bad("nothing to repeat", start)
            if self.peek() in ("*", "+", "?") or self.braces(self.pos) is not None:
                raise self.bad("multiple repeat", at)
            items.append(Repeat(atom, *bounds))
        return items[0] if len(items) == 1 else Concat(tuple(items))

    def atom(self) -> Node | None:
        """The atom at pos, consumed; None for an ignored anchor."""
        at, c = self.pos, self.pattern[self.pos]
        self.pos += 1
        if c == "(":
            return self.group(at)
        if c == "[":
            return Chars(self.bracket(at))
        if c == ".":
            return Chars(ANY_BUT_NEWLINE)
        if c == "\\":
            code = self.escape(at, in_class=False)
            return Chars(code if isinstance(code, tuple) else normalize([(code, code)]))
        if (c == "^" and at == 0) or (c == "$" and at == len(self.pattern) - 1):
            return None
        if c in "^$":
            raise self.refuse(f"anchor {c!r} other than at the pattern's start (^) or end ($)", at)
        if c in "*+?" or (c == "{" and self.braces(at) is not None):
            raise self.bad("nothing to repeat", at)
        return Chars(normalize([(ord(c), ord(c))]))

    def quantifier(self) -> tuple[int, int | None] | None:
        """The bounds of the quantifier at pos, consumed with its lazy '?'; None if none is."""
        at, c = self.pos, self.peek()
        bounds: tuple[int, int | None] | None
        if c in ("*", "+", "?"):
            bounds = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            self.pos += 1
        else:
            braces = self.braces(at)
            if braces is None:
                return None
            bounds, self.pos = braces
        if self.peek() == "?":
            self.pos += 1  # lazy: a whole-string match takes the same strings
        elif self.peek() == "+":
            raise self.refuse("possessive quantifier", at)
        return bounds

    def braces(self, at: int) -> tuple[tuple[int, int | None], int] | None:
        """A `{m}`, `{m,}`, `{,n}`, `{m,n}` or `{,}` quantifier at `at`: its bounds and end; None
        if there is none there (the `{` is then a literal, as in Python)."""
        text = self.pattern
        if text[at : at + 1] != "{":
            return None
        i = self._digits(at + 1)
        low, high = text[at + 1 : i], text[at + 1 : i]
        comma = text[i : i + 1] == ","
        if comma:
            j = self._digits(i + 1)
            high, i = text[i + 1 : j], j
        if text[i : i + 1] != "}" or not (low or comma):
            return None
        bounds = (int(low) if low else 0, int(high) if high else None)
        if bounds[1] is not None and bounds[1] < bounds[0]:
            raise self.bad("min repeat greater than max repeat", at)
        return bounds, i + 1

    def _digits(self, at: int) -> int:
        """The index past the ASCII digits from `at`."""
        while at < len(self.pattern) and self.pattern[at] in DIGITS:
            at += 1
        return at

    def group(self, at: int) -> Node:
        """The group opened at `at` (pos is past its '(')."""
        if self.peek() == "?":
            self.extension(at)
        body = self.alternation()
        if self.peek() != ")":
            raise self.bad("missing ), unterminated subpattern", at)
        self.pos += 1
        return body

    def extension(self, at: int) -> None:
        """Consume the '?:' or '?P<name>' after a '(', refusing every other '(?'."""
        rest = self.pattern[self.pos + 1 : self.pos + 3]
        if rest.startswith(":"):
            self.pos += 2
            return
        if rest == "P<":
            end = self.pattern.find(">", self.pos + 3)
            if end < 0:
                raise self.bad("missing >, unterminated name", at)
            name = self.pattern[self.pos + 3 : end]
            if not name.isidentifier():
                raise self.bad(f"bad character in group name {name!r}", at)
            if name in self.group_names:
                raise self.bad(f"redefinition of group name {name!r}", at)
            self.group_names.add(name)
            self.pos = end + 1
            return
        for prefix, construct in REFUSED_EXTENSIONS:
            if rest.startswith(prefix):
                raise self.refuse(construct, at)
        if rest[:1] and rest[0] in FLAG_LETTERS:
            raise self.refuse("inline flags (?...)", at)
        raise self.refuse(f"unknown extension (?{rest[:1]}", at)

    def escape(self, at: int, in_class: bool) -> int | Ranges:
        """The escape whose backslash is at `at` (pos is past it), consumed: a code point, or the
        ranges of a shorthand class (\\d \\w \\s and their negations)."""
        c = self.peek()
        if not c:
            raise self.bad("trailing backslash", at)
        self.pos += 1
        if c in SHORTHANDS:
            return SHORTHANDS[c]
        if c in SIMPLE_ESCAPES:
            return SIMPLE_ESCAPES[c]
        if c == "b" and in_class:
            return 0x08  # backspace, as in Python
        if c in HEX_ESCAPES:
            return self.hex_escape(at, HEX_ESCAPES[c])
        if c == "0":
            end = self.pos
            while end < min(self.pos + 2, len(self.pattern)) and self.pattern[end] in "01234567":
                end += 1
            code, self.pos = int(self.pattern[at + 1 : end], 8), end
            return code
        if c in DIGITS:
            raise self.refuse(f"backreference or octal escape \\{c}", at)
        if c in REFUSED_ESCAPES:
            raise self.refuse(REFUSED_ESCAPES[c], at)
        if c.isascii() and c.isalpha():
            raise self.bad(f"bad escape \\{c}", at)
        return ord(c)

    def hex_escape(self, at: int, count: int) -> int:
        digits = self.pattern[self.pos : self.pos + count]
        if len(digits) != count or any(d not in HEX_DIGITS for d in digits):
            raise self.bad(f"incomplete escape {self.pattern[at : self.pos + count]}", at)
        self.pos += count
        code = int(digits, 16)
        if code > MAX_CODE_POINT:
            raise self.bad(f"bad escape {self.pattern[at : self.pos]}", at)
        return code

    def bracket(self, at: int) -> Ranges:
        """The class opened at `at` (pos is past its '['), consumed with its ']'."""
        negate = self.peek() == "^"
        self.pos += negate
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if not self.peek():
                raise self.bad("unterminated character set", at)
            if self.peek() == "]" and not first:
                self.pos += 1
                break
            first = False
            low = self.class_item()
            if self.peek() != "-" or self.peek(1) in ("]", ""):
                ranges.extend(low if isinstance(low, tuple) else [(low, low)])
                continue
            dash = self.pos
            self.pos += 1
            high = self.class_item()
            if isinstance(low, tuple) or isinstance(high, tuple) or high < low:
                raise self.bad("bad character range", dash)
            ranges.append((low, high))
        out = normalize(ranges)
        return complement(out) if negate else out

    def class_item(self) -> int | Ranges:
        at, c = self.pos, self.pattern[self.pos]
        self.pos += 1
        return self.escape(at, in_class=True) if c == "\\" else ord(c)
