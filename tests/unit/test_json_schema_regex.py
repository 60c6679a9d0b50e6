"""JSON schemas, json_object and choices as regexes (specsplit.guide.json_schema): valid instances
match in every serialization style, every match is valid, invalid texts do not match, every regex
stays inside the guide's dialect, unsupported keywords are refused by name and path."""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from functools import cache
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

import jsonschema
import pytest

from specsplit.guide.json_schema import (
    WHITESPACE,
    choice_regex,
    escape,
    json_object_regex,
    schema_regex,
)

try:  # the DFA compiler's parser, where this checkout has it: every regex must parse there too
    from specsplit.guide import regex_parse
except ImportError:
    regex_parse = None  # type: ignore[assignment]

# ---------------------------------------------------------------- the dialect, sampling, checking

_OPS = {sre.LITERAL, sre.NOT_LITERAL, sre.IN, sre.ANY, sre.BRANCH, sre.SUBPATTERN, sre.MAX_REPEAT}
_SET_OPS = {sre.LITERAL, sre.RANGE, sre.NEGATE, sre.CATEGORY}
_ESCAPE = re.compile(r"\\(?:[nrt]|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|d|[^A-Za-z0-9])")


def _in_dialect(items: Any) -> None:
    """Only the dialect's constructs: no anchors, lookarounds, backreferences, lazy repeats,
    flags or capturing groups, no class shorthand but \\d."""
    for op, av in items:
        assert op in _OPS, op
        if op is sre.SUBPATTERN:
            assert av[0] is None and not av[1] and not av[2], "a capturing group or flags"
            _in_dialect(av[3])
        elif op is sre.BRANCH:
            for branch in av[1]:
                _in_dialect(branch)
        elif op is sre.MAX_REPEAT:
            _in_dialect(av[2])
        elif op is sre.IN:
            assert all(o in _SET_OPS for o, _ in av)
            assert all(a is sre.CATEGORY_DIGIT for o, a in av if o is sre.CATEGORY)


@cache
def _compiled(regex: str) -> re.Pattern[str]:
    """`regex` compiled, once it is checked to be inside the dialect."""
    _in_dialect(sre_parse.parse(regex))
    unescaped = _ESCAPE.sub("", regex.replace("\\\\", ""))
    assert "\\" not in unescaped, f"an escape outside the dialect in {regex[:200]!r}"
    assert "(?" not in unescaped.replace("(?:", ""), "a group other than (?:...)"
    if regex_parse is not None:
        regex_parse.parse(regex)
    return re.compile(regex)


def _matches(regex: str, text: str) -> bool:
    return _compiled(regex).fullmatch(text) is not None


_POOL = string.printable + "\x00\x01\x1f\x7féü€日本😀"


def _member(items: Any, ch: str) -> bool:
    hit = False
    for op, av in items:
        if op is sre.LITERAL:
            hit |= ord(ch) == av
        elif op is sre.RANGE:
            hit |= av[0] <= ord(ch) <= av[1]
        elif op is sre.CATEGORY:
            hit |= ch in string.digits
    return hit != any(op is sre.NEGATE for op, _ in items)


_CANDIDATES: dict[tuple[Any, int], tuple[Any, list[str]]] = {}


def _candidates(op: Any, av: Any) -> list[str]:
    """The pool's characters that a one-character item matches (memo by the parsed item)."""
    key = (op, id(av))
    if key not in _CANDIDATES or _CANDIDATES[key][0] is not av:
        if op is sre.NOT_LITERAL:
            chars = [c for c in _POOL if ord(c) != av]
        elif op is sre.ANY:
            chars = [c for c in _POOL if c != "\n"]
        else:
            chars = [c for c in _POOL if _member(av, c)]
        _CANDIDATES[key] = (av, chars)
    return _CANDIDATES[key][1]


def _sample_items(items: Any, rng: random.Random, out: list[str]) -> None:
    """A random string matching the parsed regex, appended to `out` (repeats capped)."""
    for op, av in items:
        if op is sre.LITERAL:
            out.append(chr(av))
        elif op in (sre.NOT_LITERAL, sre.ANY, sre.IN):
            out.append(rng.choice(_candidates(op, av)))
        elif op is sre.BRANCH:
            _sample_items(rng.choice(av[1]), rng, out)
        elif op is sre.SUBPATTERN:
            _sample_items(av[3], rng, out)
        else:  # MAX_REPEAT
            low, high, sub = av
            for _ in range(rng.randint(low, min(high, low + 3))):
                _sample_items(sub, rng, out)


@cache
def _parsed(regex: str) -> Any:
    _compiled(regex)
    return sre_parse.parse(regex)


def _sample(regex: str, rng: random.Random) -> str:
    out: list[str] = []
    _sample_items(_parsed(regex), rng, out)
    return "".join(out)


_CHECKER = jsonschema.FormatChecker()


@_CHECKER.checks("date-time")
def _is_date_time(text: object) -> bool:
    return not isinstance(text, str) or datetime.fromisoformat(text).tzinfo is not None


@_CHECKER.checks("time", raises=ValueError)
def _is_time(text: object) -> bool:
    return not isinstance(text, str) or time.fromisoformat(text).tzinfo is not None


def _valid(schema: Any, text: str) -> bool:
    """`text` is JSON and valid under `schema` (jsonschema, formats asserted)."""
    value = json.loads(text, parse_float=Decimal)
    validator = jsonschema.Draft202012Validator(schema, format_checker=_CHECKER)
    return validator.is_valid(value)


# ------------------------------------------------------------------ schemas and their instances

PERSON = {
    "title": "Person",
    "description": "annotations are ignored",
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20, "examples": ["Ann"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "score": {"type": "number", "minimum": 0, "default": 1},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 5},
            "minItems": 1,
            "maxItems": 3,
        },
        "nickname": {"type": ["string", "null"]},
        "role": {"enum": ["admin", "user", None, 3]},
        "kind": {"const": "person"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
REFS = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
        }
    },
    "definitions": {"color": {"enum": ["red", "green"]}},
    "type": "object",
    "properties": {
        "start": {"$ref": "#/$defs/point"},
        "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 4},
        "color": {"$ref": "#/definitions/color", "description": "a sibling annotation"},
    },
    "required": ["start"],
}
ANY_OF = {
    "type": "object",
    "properties": {
        "id": {
            "anyOf": [
                {"type": "integer", "exclusiveMinimum": 0},
                {"type": "string", "format": "uuid"},
            ]
        },
        "when": {"type": "string", "format": "date-time"},
        "day": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "time"},
        "value": {
            "oneOf": [
                {"type": "boolean"},
                {"type": "null"},
                {"type": "number", "exclusiveMaximum": 0},
            ]
        },
    },
    "required": ["id", "value"],
}
FREE = {
    "type": "object",
    "properties": {
        "meta": {},
        "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
        "list": {"type": "array"},
        "anything": True,
    },
}
NESTED = {
    "$defs": {"word": {"type": "string", "pattern": "^[a-z]{1,3}(?:-[0-9]+)?$"}},
    "type": "array",
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {
            "a": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "maxItems": 2,
            },
            "b": {"allOf": [{"$ref": "#/$defs/word"}], "description": "pydantic's form"},
            "c": {"type": ["integer", "boolean", "null"], "maximum": -10},
        },
        "required": ["a"],
    },
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": PERSON,
    "refs": REFS,
    "any_of": ANY_OF,
    "free": FREE,
    "nested": NESTED,
}


def _resolve(root: dict[str, Any], ref: str) -> Any:
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _any_json(rng: random.Random, depth: int) -> Any:
    kinds = ["str", "int", "float", "bool", "null"] + ["list", "dict"] * (depth > 0)
    kind = rng.choice(kinds)
    if kind == "list":
        return [_any_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {_text(rng, 0, 5): _any_json(rng, depth - 1) for _ in range(rng.randint(0, 3))}
    scalars = {
        "str": lambda: _text(rng, 0, 6),
        "int": lambda: rng.randint(-(10**6), 10**6),
        "float": lambda: rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-8, 8),
        "bool": lambda: rng.random() < 0.5,
        "null": lambda: None,
    }
    return scalars[kind]()


def _text(rng: random.Random, low: int, high: int) -> str:
    alphabet = string.ascii_letters + ' "\\/\n\t\x01\x7féü€日本'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))


def _formatted(fmt: str, rng: random.Random) -> str:
    day = date(1, 1, 1) + timedelta(days=rng.randrange(3_652_058))
    clock = f"{rng.randrange(24):02}:{rng.randrange(60):02}:{rng.randrange(60):02}"
    clock += rng.choice(["", ".5", ".123456"]) + rng.choice(["Z", "+05:30", "-11:00"])
    return {
        "date": day.isoformat(),
        "time": clock,
        "date-time": f"{day.isoformat()}T{clock}",
        "uuid": str(uuid.UUID(int=rng.getrandbits(128))),
        "email": rng.choice(["ann", "bo.b", "c+d_e"]) + "@" + rng.choice(["x.io", "a-b.c.org"]),
    }[fmt]


def _instance(schema: Any, rng: random.Random, root: dict[str, Any]) -> Any:
    """A random value valid under `schema` (the subset these tests' schemas use)."""
    if schema is True or schema == {}:
        return _any_json(rng, 2)
    if "$ref" in schema:
        return _instance(_resolve(root, schema["$ref"]), rng, root)
    if "allOf" in schema:
        return _instance(schema["allOf"][0], rng, root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return _instance(rng.choice(schema[key]), rng, root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"] if isinstance(schema["type"], str) else rng.choice(schema["type"])
    if kind == "string":
        if "format" in schema:
            return _formatted(schema["format"], rng)
        if "pattern" in schema:
            return _sample(schema["pattern"].strip("^$"), rng)
        return _text(rng, schema.get("minLength", 0), schema.get("maxLength", 8))
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", -1000) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 1000) - 1)
        value = rng.randint(low, high)
        return value if kind == "integer" or rng.random() < 0.3 else value + rng.random() / 2
    if kind in ("boolean", "null"):
        return rng.random() < 0.5 if kind == "boolean" else None
    if kind == "array":
        count = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [_instance(schema.get("items", True), rng, root) for _ in range(count)]
    required = schema.get("required", [])
    return {
        name: _instance(sub, rng, root)
        for name, sub in schema.get("properties", {}).items()
        if name in required or rng.random() < 0.5
    }


def _styles(value: Any) -> list[str]:
    return [
        json.dumps(value, separators=(",", ":")),
        json.dumps(value),
        json.dumps(value, indent=2),
        json.dumps(value, ensure_ascii=False, separators=(",", ":")),
    ]


# ------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", SCHEMAS)
def test_generated_instances_match_in_every_style(name: str) -> None:
    schema, rng = SCHEMAS[name], random.Random(name)
    regex = schema_regex(schema)
    for _ in range(40):
        value = _instance(schema, rng, schema)
        for text in _styles(value):
            assert _valid(schema, text), text
            assert _matches(regex, text), text


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_sampled_match_is_valid(name: str) -> None:
    schema, rng = SCHEMAS[name], random.Random(name)
    regex = schema_regex(schema)
    for _ in range(60):
        text = _sample(regex, rng)
        assert _matches(regex, text)
        assert _valid(schema, text), text


BASE = '"name":"Ann","age":30,"kind":"person"'


@pytest.mark.parametrize(
    "text",
    [
        '{"name":"Ann","kind":"person"}',  # missing required property
        "{" + BASE + ',"x":1}',  # extra property
        '{"name":5,"age":30,"kind":"person"}',  # wrong type
        '{"name":"Ann","age":"30","kind":"person"}',
        '{"name":"Ann","age":30.5,"kind":"person"}',
        "{" + BASE + ',"role":"root"}',  # wrong enum value
        "{" + BASE + ',"role":"3"}',
        '{"name":"Ann","age":30,"kind":"animal"}',  # wrong const
        '{"name":"' + "x" * 21 + '","age":30,"kind":"person"}',  # string too long
        '{"name":"","age":30,"kind":"person"}',  # string too short
        "{" + BASE + ',"tags":["a","b","c","d"]}',  # array too long
        "{" + BASE + ',"tags":[]}',  # array too short
        "{" + BASE + ',"tags":["abcdef"]}',
        "{" + BASE + ",}",  # trailing comma
        "{," + BASE + "}",
        "{" + BASE + ',"tags":["a",]}',
        '{"name":"A\nn","age":30,"kind":"person"}',  # unescaped control characters
        '{"name":"A\tn","age":30,"kind":"person"}',
        '{"name":"A"n","age":30,"kind":"person"}',  # unescaped quote
        '{"name":"A\\qn","age":30,"kind":"person"}',  # bad escape
        '{"name":"Ann","age":030,"kind":"person"}',  # leading zeros
        "{" + BASE + ',"score":00.5}',
        "{" + BASE + ',"score":-1}',  # below minimum
        '{"name":"Ann","age":-1,"kind":"person"}',
        '{"name":"Ann","age":151,"kind":"person"}',
        "{" + BASE + ',"email":"ann@"}',
        '{"name":"Ann","name":"Bob","age":30,"kind":"person"}',
        '{"age":30,"name":"Ann","kind":"person"}',  # out of order: documented as unmatched
        " {" + BASE + "}",  # whitespace before or after the whole text
        "{" + BASE + "}\n",
    ],
)
def test_invalid_person_does_not_match(text: str) -> None:
    assert _matches(schema_regex(PERSON), "{" + BASE + "}")
    assert not _matches(schema_regex(PERSON), text)


@pytest.mark.parametrize(
    "text",
    [
        '{"id":0,"value":null}',  # exclusiveMinimum 0
        '{"id":"not-a-uuid","value":null}',
        '{"id":1,"value":0}',  # exclusiveMaximum 0: negative numbers only
        '{"id":1,"value":-0.0}',
        '{"id":1,"value":null,"when":"2024-01-01T10:00:00"}',  # no offset
        '{"id":1,"value":null,"day":"2023-02-29"}',  # not a leap year
        '{"id":1,"value":null,"at":"24:00:00Z"}',
    ],
)
def test_invalid_any_of_does_not_match(text: str) -> None:
    assert _matches(schema_regex(ANY_OF), '{"id":1,"value":-0.5}')
    assert not _matches(schema_regex(ANY_OF), text)


def _combo_texts(props: list[str], present: list[bool]) -> str:
    return "{" + ",".join(f'"{p}":1' for p, on in zip(props, present, strict=True) if on) + "}"


@pytest.mark.parametrize("required", [["b", "d"], []])
def test_optional_property_combinations_match_and_stray_commas_do_not(required: list[str]) -> None:
    props = ["a", "b", "c", "d"]
    schema: dict[str, Any] = {"type": "object", "required": required}
    schema["properties"] = {p: {"type": "integer"} for p in props}
    regex = schema_regex(schema)
    for mask in range(16):
        present = [bool(mask >> i & 1) for i in range(4)]
        text = _combo_texts(props, present)
        assert _matches(regex, text) == all(present[props.index(r)] for r in required), text
        if text != "{}":
            strays = ["{," + text[1:], text[:-1] + ",}"] + [text.replace(",", ",,")] * ("," in text)
            assert not any(_matches(regex, stray) for stray in strays), strays
        spaced = json.dumps(
            dict.fromkeys((p for p, on in zip(props, present, strict=True) if on), 1), indent=2
        )
        assert _matches(regex, spaced) == _matches(regex, text)


def test_refs_nullable_enum_const_and_any_of() -> None:
    cases: list[tuple[Any, list[str], list[str]]] = [
        (
            REFS,
            ['{"start":{"x":1,"y":-2},"color":"red"}'],
            ['{"start":{"x":1}}', '{"color":"red"}'],
        ),
        ({"type": ["string", "null"], "maxLength": 2}, ['"ab"', "null"], ['"abc"', "nul", '""x']),
        (
            {"enum": ["a", 1, 2.5, True, None, [1, "x"], {"k": "v"}]},
            ['"a"', "1", "2.5", "true", "null", '[1,"x"]', '{"k":"v"}'],
            ['"1"', "false", "2", '[1, "x"]', '"b"'],  # composite values compact only
        ),
        ({"type": "string", "enum": ["a", 1]}, ['"a"'], ["1"]),  # enum filtered by the type
        ({"type": "integer", "minimum": 2, "enum": [1, 2, 3]}, ["2", "3"], ["1"]),
        ({"const": {"a": [1, 2]}}, ['{"a":[1,2]}'], ['{"a":[1]}']),
        ({"enum": ['é "q"\n']}, ['"é \\"q\\"\\n"'], ['"\\u00e9 \\"q\\"\\n"']),
        ({"anyOf": [False, {"type": "null"}]}, ["null"], ["false"]),
        ({"allOf": [{"type": "integer"}], "maximum": 3}, ["3", "-7"], ["4", "true"]),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
            },
            ['{"a":1}', '{"b":1}', '{"a":1,"b":2}'],
            ["{}"],
        ),
        (
            {"type": "object", "properties": {"a": False, "b": {"type": "integer"}}},
            ['{"b":1}', "{}"],
            ['{"a":1,"b":1}'],
        ),
        ({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, ["1"], ["0", "-0"]),
        ({"type": "integer", "exclusiveMinimum": 2.5, "maximum": 7.9}, ["3", "7"], ["2", "8"]),
        ({"type": "array", "uniqueItems": False, "maxItems": 1}, ["[]", "[{}]"], ["[1,2]"]),
        ({"minLength": 2}, ['"ab"'], ['"a"', "7"]),  # no type: the keywords' types assumed
        ({"properties": {"a": {}}}, ['{"a":[]}'], ["1"]),  # properties: objects assumed
        ({"type": "object", "properties": {}}, ["{}"], ['{"a":1}']),
        ({"type": "object", "additionalProperties": False}, ["{ }"], ['{"a":1}']),
    ]
    for schema, good, bad in cases:
        regex = schema_regex(schema)
        for text in good:
            assert _matches(regex, text), (schema, text)
        for text in bad:
            assert not _matches(regex, text), (schema, text)


def test_string_lengths_count_escapes_as_characters() -> None:
    regex = schema_regex({"type": "string", "minLength": 2, "maxLength": 3})
    for text in ['"ab"', '"a\\n"', '"\\u00e9x"', '"日本語"', '"\\"\\\\/"']:
        assert _matches(regex, text) and 2 <= len(json.loads(text)) <= 3
    for text in ['"a"', '"abcd"', '"\\u00e9"', '"a\\"']:
        assert not _matches(regex, text)


def test_pattern_matches_the_whole_contents() -> None:
    regex = schema_regex({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"})
    assert _matches(regex, '"ab-12"')
    assert not any(_matches(regex, t) for t in ['"ab-1"', '"xab-12y"', '"AB-12"', "ab-12"])
    assert _matches(schema_regex({"type": "string", "pattern": "a\\$"}), '"a$"')


def test_integer_ranges_are_exact() -> None:
    bounds = [None, -1000, -101, -100, -99, -10, -9, -1, 0, 1, 9, 10, 11, 99, 100, 101, 999, 1234]
    pairs = [(lo, hi) for lo in bounds for hi in bounds if lo is None or hi is None or lo <= hi]
    pairs += [(lo, hi) for lo in range(-12, 13) for hi in range(lo, 13)]
    for lo, hi in pairs:
        schema = {"type": "integer", "minimum": lo, "maximum": hi}
        regex = _compiled(schema_regex({k: v for k, v in schema.items() if v is not None}))
        for n in range(-1300, 1301):
            inside = (lo is None or lo <= n) and (hi is None or n <= hi)
            assert (regex.fullmatch(str(n)) is not None) == inside, (lo, hi, n)
        assert (regex.fullmatch("-0") is not None) == bool(regex.fullmatch("0"))
        assert not any(regex.fullmatch(t) for t in ["00", "01", "-01", "+1", "1.0", "-", "1e2"])
    rng = random.Random(7)
    for _ in range(150):  # wide bounds, checked near their edges and powers of ten
        lo, hi = sorted(rng.randint(-(10**9), 10**9) // 10 ** rng.randint(0, 8) for _ in "ab")
        regex = _compiled(schema_regex({"type": "integer", "minimum": lo, "maximum": hi}))
        probes = [b + d for b in (lo, hi, 0) for d in range(-30, 31)]
        probes += [s * (10**k + d) for k in range(11) for d in (-1, 0, 1) for s in (1, -1)]
        for n in probes + [rng.randint(lo, hi) for _ in range(50)]:
            assert (regex.fullmatch(str(n)) is not None) == (lo <= n <= hi), (lo, hi, n)


NUMBER_TEXTS = ["0", "-0", "0.0", "-0.000", "0e5", "-0E-3", "1", "-1", "0.5", "-0.001", "1e-9"]
NUMBER_TEXTS += ["-2E+3", "10.25", "0.01e2", "3", "-7.5e1"]


@pytest.mark.parametrize(
    "bounds",
    [{"minimum": 0}, {"exclusiveMinimum": 0}, {"maximum": 0}, {"exclusiveMaximum": 0}, {}],
)
def test_number_bounds_fix_the_sign(bounds: dict[str, int]) -> None:
    schema = {"type": "number", **bounds}
    regex = schema_regex(schema)
    for text in NUMBER_TEXTS:
        assert _matches(regex, text) == _valid(schema, text), text
    for text in ["01", "1.", ".5", "+1", "1e", "--1", "0x1", "1.5.2", "Infinity", "NaN"]:
        assert not _matches(regex, text)


def test_date_format_is_calendar_exact() -> None:
    regex = _compiled(schema_regex({"type": "string", "format": "date"}))
    for year in (1, 4, 100, 400, 1900, 2000, 2023, 2024, 9999):
        for month in range(14):
            for day in range(33):
                text = f"{year:04}-{month:02}-{day:02}"
                try:
                    valid = date.fromisoformat(text) is not None
                except ValueError:
                    valid = False
                assert (regex.fullmatch(json.dumps(text)) is not None) == valid, text
    assert not regex.fullmatch('"0000-01-01"')


def test_time_formats_parse() -> None:
    at = schema_regex({"type": "string", "format": "time"})
    when = schema_regex({"type": "string", "format": "date-time"})
    for text in ["00:00:00Z", "23:59:59.999+14:00", "12:30:00-05:30"]:
        assert _matches(at, f'"{text}"') and _is_time(text)
        assert _matches(when, f'"2024-02-29T{text}"') and _is_date_time(f"2024-02-29T{text}")
    for text in ["24:00:00Z", "12:60:00Z", "12:00:00", "12:00Z", "12:00:00+1:00", "12:00:00z"]:
        assert not _matches(at, f'"{text}"'), text


UNSUPPORTED = [
    ({"type": "object", "properties": {"x": {"not": {"type": "null"}}}}, "not", "#/properties/x"),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if", "#"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties", "#"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "#"),
    (
        {"type": "object", "properties": {"t": {"uniqueItems": True}}},
        "uniqueItems",
        "#/properties/t",
    ),
    ({"type": "integer", "multipleOf": 3}, "multipleOf", "#"),
    ({"type": "object", "minProperties": 1}, "minProperties", "#"),
    ({"type": "array", "contains": {"type": "string"}}, "contains", "#"),
    ({"type": "array", "items": {"prefixItems": [{}]}}, "prefixItems", "#/items"),
    ({"type": "array", "items": [{"type": "string"}]}, "items", "#"),
    ({"type": "string", "format": "uri"}, "format", "#"),
    ({"type": "number", "minimum": 1.5}, "minimum", "#"),
    (
        {"properties": {"a": {}}, "additionalProperties": {"type": "string"}},
        "additionalProperties",
        "#",
    ),
    ({"type": "object", "required": ["a"]}, "required", "#"),
    ({"$ref": "https://example.com/s.json"}, "$ref", "#"),
    ({"$ref": "#/$defs/missing"}, "$ref", "#"),
    (  # (each level needs the next: no finite instance)
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"next": {"$ref": "#/$defs/node"}},
                    "required": ["next"],
                }
            },
            "$ref": "#/$defs/node",
        },
        "$ref",
        "#/$defs/node/properties/next",
    ),
    ({"type": "strng"}, "type", "#"),
    ({"type": "string", "minLength": -1}, "minLength", "#"),
    ({"type": "integer", "minimum": "3"}, "minimum", "#"),
    ({"properties": {"a/b": {"type": "string", "pattern": "(x"}}}, "pattern", "#/properties/a~1b"),
    ({"enum": []}, "enum", "#"),
    ({"allOf": [{"type": "string", "maxLength": 3}, {"maxLength": 4}]}, "maxLength", "#/allOf/1"),
    ({"type": "string", "format": "date", "maxLength": 10}, "maxLength", "#"),
    ({"anyOf": [{}], "oneOf": [{}]}, "oneOf", "#"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength", "#"),
    ({"properties": {"a": {"type": "string"}}, "required": ["b"]}, "required", "#"),
    ({"properties": {"a": False}, "required": ["a"]}, "false", "#/properties/a"),
    ({"enum": [1], "const": True}, "enum", "#"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "minimum", "#"),
    ({"type": "array", "items": False, "minItems": 1}, "false", "#/items"),
]


@pytest.mark.parametrize(("schema", "keyword", "path"), UNSUPPORTED)
def test_unsupported_or_invalid_is_refused_by_keyword_and_path(
    schema: Any, keyword: str, path: str
) -> None:
    with pytest.raises(ValueError) as refused:
        schema_regex(schema)
    assert keyword in str(refused.value) and f"{path}:" in str(refused.value), refused.value


TREE = {  # pydantic's form of a model holding a list of itself
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
            },
            "required": ["name", "children"],
        }
    },
    "$ref": "#/$defs/Node",
}
REPLY = {  # the root holding itself, nullable
    "type": "object",
    "properties": {
        "text": {"type": "string"},
        "reply": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    },
    "required": ["text", "reply"],
}


def _tree(depth: int) -> dict[str, Any]:
    return {"name": f"n{depth}", "children": [_tree(depth - 1)] if depth > 1 else []}


def _reply(depth: int) -> dict[str, Any]:
    return {"text": "t", "reply": _reply(depth - 1) if depth > 1 else None}


@pytest.mark.parametrize("max_recursion", [1, 2, 3])
def test_recursive_refs_expand_to_max_recursion(max_recursion: int) -> None:
    """A recursive $ref is expanded max_recursion times inside itself: instances that deep
    match in every style, one level deeper does not; every sampled match is valid."""
    rng = random.Random(max_recursion)
    for schema, instance in ((TREE, _tree), (REPLY, _reply)):
        regex = schema_regex(schema, max_recursion=max_recursion)
        for depth in range(1, max_recursion + 1):
            assert all(_matches(regex, text) for text in _styles(instance(depth))), depth
        assert not _matches(regex, json.dumps(instance(max_recursion + 1)))
        for _ in range(20):
            sampled = _sample(regex, rng)
            assert _valid(schema, sampled), sampled
    with pytest.raises(ValueError, match="max_recursion must be an integer >= 1"):
        schema_regex(TREE, max_recursion=0)


def test_json_object_regex_nests_to_max_depth() -> None:
    deep = _compiled(json_object_regex(3))
    for text in ["{}", '{"a":{"b":{"c":1}}}', '{"a":[[1]],"b":"x"}', '{\n  "a": [ {} ]\n}']:
        assert deep.fullmatch(text), text
    for text in ['{"a":{"b":{"c":{}}}}', '{"a":[[[1]]]}', "[1]", '"s"', "1", "null", "{,}"]:
        assert not deep.fullmatch(text), text
    flat = _compiled(json_object_regex(1))
    assert flat.fullmatch('{"a":1,"b":"x","c":null}') and not flat.fullmatch('{"a":{}}')
    rng = random.Random(3)
    for _ in range(30):
        value = {"k": _any_json(rng, 2), "m": _any_json(rng, 1)}
        assert all(deep.fullmatch(text) for text in _styles(value)), value
        sampled = json.loads(_sample(json_object_regex(3), rng))
        assert isinstance(sampled, dict) and _depth(sampled) <= 3
    with pytest.raises(ValueError, match="max_depth"):
        json_object_regex(0)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def test_empty_schema_is_any_value_to_max_depth() -> None:
    assert _matches(schema_regex({}), '[{"a":[1]}]')
    assert not _matches(schema_regex(True), "[[[[1]]]]")
    assert _matches(schema_regex({}, max_depth=0), '"x"')
    assert not _matches(schema_regex({}, max_depth=0), "[]")
    with pytest.raises(ValueError, match="false"):
        schema_regex(False)


def test_whitespace_is_the_callers_pattern_between_tokens() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array"}}}
    assert WHITESPACE == r"[ \t\n]{0,20}"
    compact = schema_regex(schema, whitespace="")
    assert _matches(compact, '{"a":[1,2]}') and not _matches(compact, '{"a": [1,2]}')
    spaced = schema_regex(schema, whitespace="(?: |\n)")
    assert _matches(spaced, '{ "a" : [ 1 , 2 ] }') and not _matches(spaced, '{"a":[1,  2]}')


CHOICES = ["a.b", "(x|y)", "1+1=2?", "[tag]", "back\\slash", "naïve café", "日本語", "$5^2", "{}"]
CHOICES += ["new\nline", "tab\there", "*", "a", "\x00nul"]


def test_choice_regex_matches_exactly_the_choices() -> None:
    regex = choice_regex(CHOICES)
    for choice in CHOICES:
        assert _matches(regex, choice), choice
    near = ["axb", "x", "x|y", "1+1=2", "11=2", "tag", "naive café", "", "a.bb", "A", "ab"]
    near += [a + b for a in CHOICES[:4] for b in CHOICES[:4]]
    assert not any(_matches(regex, text) for text in near if text not in CHOICES)
    assert _matches(choice_regex(["", "x"]), "") and not _matches(choice_regex(["x"]), "")
    with pytest.raises(ValueError):
        choice_regex([])


def test_escape_is_a_literal_of_the_text() -> None:
    rng = random.Random(5)
    alphabet = string.printable + "\x00\x7fé日😀"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        assert _matches(escape(text), text)
        assert not _matches(escape(text), text + "x") and not _matches(escape(text), text[1:])


def test_regex_size_is_linear_in_properties() -> None:
    def schema(n: int, required: list[str]) -> dict[str, Any]:
        props = {f"field_{i}": {"type": "string", "maxLength": 50} for i in range(n)}
        return {"type": "object", "properties": props, "required": required}

    ten, twenty = len(schema_regex(schema(10, []))), len(schema_regex(schema(20, [])))
    assert ten < 20_000 and twenty < 2.2 * ten
    assert len(schema_regex(schema(10, ["field_5"]))) < 20_000
    assert len(schema_regex({})) < 20_000 and len(json_object_regex(3)) < 20_000
