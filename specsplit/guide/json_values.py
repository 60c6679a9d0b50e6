"""Regexes of JSON's primitive values, in the guide's regex dialect (`regex_parse`: a subset of
Python's `re`), for `json_schema` to assemble.

Covers: JSON strings (any, a range of lengths, a `format`, or a caller's `pattern` for the
contents), integers within any range [lo, hi] (exactly: every integer of the range in its canonical
form, plus "-0" where 0 is in it, and nothing else), numbers bounded by sign only (a bound of 0),
true/false/null, and `escape` for a literal.

Limits (all narrow what matches but the first, and the caller's `pattern`):
- a string's length counts characters and escapes: an escaped surrogate pair (`\\ud83d\\ude00`)
  counts 2 where JSON Schema counts one character (a `minLength` may pass a string short by it);
- formats: "date" (calendar-exact, years 0001-9999), "time" and "date-time" (RFC 3339 with a
  required offset `Z` or `+hh:mm`, upper-case `T`/`Z`, no leap second), "uuid", "email" (a simple
  dot-atom address with a dotted domain); no escapes inside them;
- a `pattern` matches the whole raw contents between the quotes (a leading `^` and trailing `$`
  are dropped), where JSON Schema searches: the caller's risk that it matches only legal JSON
  string contents (no bare `"`, `\\` or control characters).
"""

from __future__ import annotations

import math
import re
from typing import Any

# between JSON tokens: outlines' [ \t\n]* bounded, so that a model cannot loop on whitespace
# (20: a newline and the indent of pretty-printed JSON 4 deep at 4 spaces a level, with room)
WHITESPACE = r"[ \t\n]{0,20}"

# one character of a JSON string's contents: unescaped (not a quote, backslash or control
# character) or an escape
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
_FRACTION = r"(?:\.[0-9]+)?"
_EXPONENT = r"(?:[eE][+\-]?[0-9]+)?"
NUMBER = INTEGER + _FRACTION + _EXPONENT
BOOLEAN = "(?:true|false)"
NULL = "null"

# numbers by sign: a nonzero magnitude, and the spellings of zero (-0.0e5 is 0 too)
_POSITIVE = rf"(?:[1-9][0-9]*{_FRACTION}|0\.[0-9]*[1-9][0-9]*){_EXPONENT}"
_ZERO = rf"-?0(?:\.0+)?{_EXPONENT}"

_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999
_BY_FOUR = r"(?:0[48]|[2468][048]|[13579][26])"  # 04..96, the multiples of 4
_LEAP_YEAR = rf"(?:[0-9]{{2}}{_BY_FOUR}|{_BY_FOUR}00)"
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_HOUR_MINUTE = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = rf"{_HOUR_MINUTE}:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+\-]{_HOUR_MINUTE})"
_HEX = "[0-9a-fA-F]"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9\-]*[a-zA-Z0-9])?"
_ATOM = r"[a-zA-Z0-9_%+\-]+"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "email": rf"{_ATOM}(?:\.{_ATOM})*@(?:{_LABEL}\.)+[a-zA-Z]{{2,}}",
}

_META = frozenset("\\.^$*+?{}[]()|")
_NAMED_ESCAPES = {"\n": r"\n", "\t": r"\t", "\r": r"\r"}


class Unsatisfiable(ValueError):
    """A (sub)schema that no JSON value satisfies; an enclosing alternative or optional property
    may drop it."""


def escape(text: str) -> str:
    """`text` as a literal of the dialect: metacharacters backslashed, control characters as
    `\\n \\t \\r \\xHH`, everything else (non-ASCII included) as itself."""
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ch in _NAMED_ESCAPES:
            out.append(_NAMED_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def alternate(branches: list[str]) -> str:
    """One of the branches (duplicates dropped); a single branch bare. Every pattern built here
    has no top-level `|`, so it concatenates safely."""
    unique = list(dict.fromkeys(branches))
    if not unique:
        raise Unsatisfiable("no alternative left")
    return unique[0] if len(unique) == 1 else "(?:" + "|".join(unique) + ")"


def quantifier(low: int, high: int | None) -> str:
    """The shortest quantifier for `low` to `high` (None: unbounded) repetitions; not (0, 0)."""
    if high is None:
        return {0: "*", 1: "+"}.get(low, f"{{{low},}}")
    if (low, high) == (0, 1):
        return "?"
    if low == high:
        return "" if low == 1 else f"{{{low}}}"
    return f"{{{low},{high}}}"


def string_of_length(low: int, high: int | None) -> str:
    """A JSON string of `low` to `high` characters (each an unescaped character or an escape)."""
    if high is not None and low > high:
        raise Unsatisfiable(f"minLength {low} > maxLength {high}")
    if high == 0:
        return '""'
    return f'"{STRING_CHAR}{quantifier(low, high)}"'


def string_of_pattern(pattern: str) -> str:
    """A JSON string whose raw contents fully match `pattern` (anchors `^...$` dropped);
    re.error if Python's `re` cannot compile it."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$"):  # dropped unless escaped: an odd run of backslashes before it
        backslashes = len(body) - 1 - len(body[:-1].rstrip("\\"))
        body = body if backslashes % 2 else body[:-1]
    re.compile(body)
    return f'"(?:{body})"' if body else '""'


def number_by_sign(negative: bool, zero: bool, positive: bool) -> str:
    """A JSON number of the allowed signs (zero in any spelling: 0, -0, 0.00, 0e7)."""
    if negative and zero and positive:
        return NUMBER
    parts = (["-" + _POSITIVE] if negative else []) + ([_ZERO] if zero else [])
    return alternate(parts + ([_POSITIVE] if positive else []))


def integer_range(low: int | None, high: int | None) -> str:
    """A JSON integer n with low <= n <= high (None: unbounded), canonical digits only."""
    if low is None and high is None:
        return INTEGER
    if low is not None and high is not None and low > high:
        raise Unsatisfiable(f"no integer in [{low}, {high}]")
    parts = []
    if low is None or low < 0:  # the negatives: magnitudes in [max(1, -high), -low]
        least = 1 if high is None or high >= 0 else -high
        parts.append("-" + _natural_range(least, None if low is None else -low))
    if (low is None or low <= 0) and (high is None or high >= 0):
        parts.append("-?0")
    if high is None or high > 0:
        parts.append(_natural_range(max(1, low or 0), high))
    return alternate(parts)


def _natural_range(low: int, high: int | None) -> str:
    """The decimal numerals of low..high (1 <= low; None: unbounded), without leading zeros."""
    width = len(str(low))
    if high is None and low == 10 ** (width - 1):  # every numeral of `width` digits or more
        return f"[1-9][0-9]{quantifier(width - 1, None)}"
    branches: list[str] = []
    top = width if high is None else len(str(high))
    for digits in range(width, top + 1):  # one run of equal-width numerals per width
        first = max(low, 10 ** (digits - 1))
        last = 10**digits - 1 if high is None else min(high, 10**digits - 1)
        branches += _same_width(str(first), str(last))
    if high is None:
        branches.append(f"[1-9][0-9]{quantifier(width, None)}")
    return alternate(branches)


def _same_width(first: str, last: str) -> list[str]:
    """Branches matching the equal-width digit strings first..last (first <= last), leading zeros
    kept: the standard split into a ragged low end, a run of full middle digits, a ragged top."""
    if first == last:
        return [first]
    if first[0] == last[0]:
        return [first[0] + alternate(_same_width(first[1:], last[1:]))]
    rest = len(first) - 1
    tail = "[0-9]" + quantifier(rest, rest) if rest else ""
    branches = []
    low_digit, high_digit = int(first[0]), int(last[0])
    if first[1:] != "0" * rest:  # first's own digit then its ragged rest
        branches.append(first[0] + alternate(_same_width(first[1:], "9" * rest)))
        low_digit += 1
    ragged_top = last[1:] != "9" * rest
    middle_high = high_digit - 1 if ragged_top else high_digit
    if low_digit <= middle_high:
        digit = str(low_digit) if low_digit == middle_high else f"[{low_digit}-{middle_high}]"
        branches.append(digit + tail)
    if ragged_top:
        branches.append(last[0] + alternate(_same_width("0" * rest, last[1:])))
    return branches


def string_schema(schema: dict[str, Any], path: str) -> str:
    """A JSON string under the schema's `format`, `pattern` or lengths (one kind of them)."""
    low = count(schema, "minLength", path) or 0
    high = count(schema, "maxLength", path)
    fmt, pattern = schema.get("format"), schema.get("pattern")
    for key, value in (("format", fmt), ("pattern", pattern)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{path}: {key!r} must be a string, not {value!r}")
    if (fmt is not None or pattern is not None) and (low or high is not None):
        raise ValueError(f"{path}: 'minLength'/'maxLength' with 'format' or 'pattern'")
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"{path}: 'format' {fmt!r} is not supported ({', '.join(FORMATS)})")
        if pattern is not None:
            raise ValueError(f"{path}: 'format' with 'pattern' is not supported")
        return f'"{FORMATS[fmt]}"'
    if pattern is not None:
        try:
            return string_of_pattern(pattern)
        except re.error as error:
            raise ValueError(f"{path}: 'pattern' {pattern!r} is not a regex: {error}") from error
    if high is not None and low > high:
        raise Unsatisfiable(f"{path}: 'minLength' {low} > 'maxLength' {high}")
    return string_of_length(low, high)


def _bounds(schema: dict[str, Any], path: str) -> list[tuple[str, float, bool, bool]]:
    """The numeric bounds: (keyword, value, is a lower bound, exclusive); draft 4's boolean
    `exclusiveMinimum`/`exclusiveMaximum` make `minimum`/`maximum` exclusive."""
    out = []
    for key, lower in (("minimum", True), ("maximum", False)):
        flag = "exclusiveM" + key[1:]
        for name in (key, flag):
            value = schema.get(name)
            if value is None or (name == flag and isinstance(value, bool)):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{path}: {name!r} must be a number, not {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{path}: {name!r} must be a finite number, not {value!r}")
            out.append((name, value, lower, name == flag or schema.get(flag) is True))
    return out


def integer_schema(schema: dict[str, Any], path: str) -> str:
    """Integers within the bounds, exactly."""
    bounds = _bounds(schema, path)
    lows = [math.floor(v) + 1 if ex else math.ceil(v) for _, v, lower, ex in bounds if lower]
    highs = [math.ceil(v) - 1 if ex else math.floor(v) for _, v, lower, ex in bounds if not lower]
    low, high = max(lows, default=None), min(highs, default=None)
    if low is not None and high is not None and low > high:
        raise Unsatisfiable(f"{path}: no integer within 'minimum'/'maximum' ({low} > {high})")
    return integer_range(low, high)


def number_schema(schema: dict[str, Any], path: str) -> str:
    """Numbers bounded by sign: each bound must be 0."""
    signs = {"negative": True, "zero": True, "positive": True}
    for name, value, lower, exclusive in _bounds(schema, path):
        if value != 0:
            raise ValueError(f"{path}: {name!r} {value} on a number (only 0, or type integer)")
        signs["negative" if lower else "positive"] = False
        signs["zero"] = signs["zero"] and not exclusive
    if not any(signs.values()):
        raise Unsatisfiable(f"{path}: no number within 'minimum'/'maximum'")
    return number_by_sign(**signs)


def count(schema: dict[str, Any], key: str, path: str) -> int | None:
    """The schema's non-negative integer `key` (minLength, maxItems, ...), None if absent."""
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{path}: {key!r} must be a non-negative integer, not {value!r}")
    return value
