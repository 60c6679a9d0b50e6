"""JSON schemas (OpenAI's `response_format` json_schema and json_object, vLLM's `guided_json`) and
lists of choices (vLLM's `guided_choice`) as regular expressions in the guide's regex dialect
(`regex_parse`: a subset of Python's `re`), for `regex_dfa` to compile.

A schema's regex fully matches only JSON texts valid under the schema, and every valid text
(within the supported subset below) that is written this way:
- `whitespace` (default `[ \\t\\n]*`; wrapped in a group if it has a `|`) between any two tokens,
  none before the first or after the last (a caller may wrap the regex in whitespace);
- an object's properties in the order of `properties`, each at most once;
- property names, `enum` and `const` values as `json.dumps(value, ensure_ascii=False)` writes them
  compactly (a key spelled with other escapes, or an enum array with spaces, does not match);
- any-value parts (`{}`, true, an object or array with no schema for its values) at most
  `max_depth` objects/arrays deep, counted from where each appears (any JSON is not regular);
- a recursive `$ref` (a pydantic model that holds itself) expanded at most `max_recursion` times
  inside itself: below that its values are dropped as a schema nothing satisfies would be (an
  optional property left out, an array empty, an `anyOf` branch gone; a required one makes the
  level above unsatisfiable in turn), so a tree is at most that deep (a recursive schema is not
  regular);
- the limits on strings and numbers that `json_values` lists.

Supported: `type` (one or a list: an alternation; absent: the types whose keywords appear, else any
value), `enum`, `const` (the values that also satisfy the schema's other keywords), `anyOf`,
`oneOf` (as anyOf: a text matching two branches matches, which oneOf rejects), `allOf` and `$ref`
to a local JSON pointer (`#/$defs/...`, `#/definitions/...`), both merged into their schema where
their keywords do not clash (`type` intersects, `required` unites), `{}` / true (any JSON value, at
most `max_depth` objects/arrays deep), false (nothing: an optional property or a branch dropped);
strings: `minLength`, `maxLength`, `pattern`, `format` (date, time, date-time, uuid, email);
integers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, exactly (draft 4's boolean
exclusive forms too); numbers: those bounds at 0 only (fixing the sign); objects: `properties`,
`required`, `additionalProperties` (absent, true or false alongside `properties`: no other key, as
outlines does; without `properties`: false gives `{}`, a schema any string keys with values under
it, true or absent any values); arrays: `items` (one schema; absent: any values), `minItems`,
`maxItems`.

Refused with a ValueError naming the JSON-pointer path and the keyword: remote `$ref`, `not`,
`if`/`then`/`else`, `patternProperties`, `dependentRequired`, `dependentSchemas`,
`dependencies`, `uniqueItems: true`, `multipleOf`,
`minProperties` > 0, `maxProperties`, `contains`, `propertyNames`, `unevaluated*`, `prefixItems`,
tuple `items`, `additionalProperties` as a schema next to `properties`, `required` without
`properties`, number bounds other than 0, other formats, `format` or `pattern` with a length, a
schema nothing satisfies. Annotations (`title`, `description`, `examples`, ...) and unknown
keywords are ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from specsplit.guide.json_values import (
    BOOLEAN,
    NULL,
    NUMBER,
    STRING,
    WHITESPACE,
    Unsatisfiable,
    alternate,
    count,
    escape,
    integer_schema,
    number_schema,
    quantifier,
    string_schema,
)

__all__ = ["WHITESPACE", "choice_regex", "escape", "json_object_regex", "schema_regex"]

TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
# keywords that constrain values of one type only (JSON Schema lets other types pass them); with
# no `type`, the types whose keywords appear are assumed (objects for `properties`, as outlines)
_TYPE_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
}
_CONSTRAINING = {"type"}.union(*_TYPE_KEYWORDS.values())
_UNSUPPORTED = {
    *("not", "if", "then", "else", "patternProperties", "propertyNames", "dependencies"),
    *("dependentRequired", "dependentSchemas", "uniqueItems", "multipleOf", "minProperties"),
    *("maxProperties", "contains", "minContains", "maxContains", "unevaluatedProperties"),
    *("unevaluatedItems", "prefixItems", "additionalItems", "$dynamicRef", "$recursiveRef"),
}
_INERT = {"uniqueItems": False, "minProperties": 0}  # unsupported keywords' values that say nothing
_NOT_MERGED = {  # annotations and definitions: what merging a subschema in leaves out
    *("title", "description", "$schema", "$id", "$comment", "examples", "default", "$defs"),
    *("definitions", "deprecated", "readOnly", "writeOnly"),
}


def schema_regex(
    schema: dict[str, Any] | bool,
    whitespace: str = WHITESPACE,
    max_depth: int = 3,
    max_recursion: int = 3,
) -> str:
    """The regex of the JSON texts valid under `schema` (module doc: the subset and its limits);
    ValueError naming the JSON-pointer path and keyword of anything unsupported or invalid."""
    _check_depth(max_depth, 0)
    _check_depth(max_recursion, 1, "max_recursion")
    return _Compiler(schema, whitespace, max_depth, max_recursion).value(schema, "#")


def json_object_regex(max_depth: int = 3, whitespace: str = WHITESPACE) -> str:
    """Any JSON object, nested at most `max_depth` objects/arrays deep counting itself (1: values
    are scalars): OpenAI's response_format json_object."""
    _check_depth(max_depth, 1)
    compiler = _Compiler(True, whitespace, max_depth)
    return compiler.pairs_object(compiler.any_value(max_depth - 1))


def choice_regex(choices: list[str]) -> str:
    """Exactly one of the strings (vLLM's guided_choice), each a literal, alternated."""
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"guided_choice: a list of strings, not {choices!r}")
    literals = [escape(c) for c in dict.fromkeys(choices) if c]
    if not literals:
        raise ValueError("guided_choice: no nonempty choice")
    body = "(?:" + "|".join(literals) + ")"
    return body + "?" if "" in choices else body  # the empty choice: no empty alternative


def _check_depth(max_depth: int, least: int, name: str = "max_depth") -> None:
    if not isinstance(max_depth, int) or max_depth < least:
        raise ValueError(f"{name} must be an integer >= {least}, not {max_depth!r}")


class _Compiler:
    """One schema document's compilation: its root (for `$ref`), whitespace and depth bound."""

    def __init__(self, root: Any, whitespace: str, max_depth: int, max_recursion: int = 1) -> None:
        self.root = root
        self.ws = f"(?:{whitespace})" if "|" in whitespace else whitespace
        self.max_depth = max_depth
        self.max_recursion = max_recursion  # how often one $ref is expanded inside itself
        self.refs = ["#"]  # the $refs being expanded (a repeat is recursion), the root first
        self.any_values: dict[int, str | None] = {}

    def value(self, schema: Any, path: str) -> str:
        """The regex of the values valid under `schema`, found at `path` in the document."""
        if schema is True:
            return self.any_value(self.max_depth) or ""  # max_depth >= 0: never None
        if schema is False:
            raise Unsatisfiable(f"{path}: the schema false matches nothing")
        if not isinstance(schema, dict):
            raise ValueError(f"{path}: a schema is an object or a boolean, not {schema!r}")
        for key in schema:  # constraints this module cannot express
            if key in _UNSUPPORTED and not (key in _INERT and _same(schema[key], _INERT[key])):
                raise ValueError(f"{path}: unsupported keyword {key!r}")
        if "allOf" in schema:
            return self.value(_all_of(schema, path), path)
        if "$ref" in schema:
            return self.ref(schema, path)
        if "anyOf" in schema or "oneOf" in schema:
            return self.any_of(schema, path)
        if "enum" in schema or "const" in schema:
            return self.enum(schema, path)
        kinds = _types(schema, path)
        if kinds is None:
            return self.value(True, path)
        return _alternatives([partial(self.of_type, kind, schema, path) for kind in kinds], path)

    def any_value(self, depth: int) -> str | None:
        """Any JSON value with at most `depth` nested objects/arrays; None below 0 (nothing)."""
        if depth < 0:
            return None
        if depth not in self.any_values:
            branches = [STRING, NUMBER, BOOLEAN, NULL]
            if depth > 0:
                inner = self.any_value(depth - 1)
                branches += [self.pairs_object(inner), self.sequence(inner, 0, None, "")]
            self.any_values[depth] = alternate(branches)
        return self.any_values[depth]

    def ref(self, schema: dict[str, Any], path: str) -> str:
        """The `$ref`'s target merged with the sibling keywords, compiled at the target's path."""
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"{path}: '$ref' {ref!r}: only local references (#/...) are supported")
        if self.refs.count(ref) >= self.max_recursion:  # (a recursive schema is not regular)
            raise Unsatisfiable(
                f"{path}: '$ref' {ref!r} recursive past {self.max_recursion} levels"
            )
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        merged = _merge(_merge({}, _resolve(self.root, ref, path), ref), rest, path)
        self.refs.append(ref)
        try:
            return self.value(merged, ref)
        finally:
            self.refs.pop()

    def any_of(self, schema: dict[str, Any], path: str) -> str:
        """Each branch merged with the sibling keywords; unsatisfiable branches dropped."""
        if "anyOf" in schema and "oneOf" in schema:
            raise ValueError(f"{path}: 'anyOf' with 'oneOf' is not supported")
        key = "anyOf" if "anyOf" in schema else "oneOf"
        branches = _nonempty_list(schema, key, path)
        rest = _merge({}, {k: v for k, v in schema.items() if k != key}, path)
        makers = [
            partial(self.merged, rest, branch, f"{path}/{key}/{i}")
            for i, branch in enumerate(branches)
        ]
        return _alternatives(makers, path)

    def merged(self, base: dict[str, Any], sub: Any, path: str) -> str:
        """The regex of `base` and `sub` merged into one schema (at `path`)."""
        return self.value(_merge(base, sub, path), path)

    def enum(self, schema: dict[str, Any], path: str) -> str:
        """The `enum`/`const` values, compact, that the schema's other keywords also allow."""
        values = _nonempty_list(schema, "enum", path) if "enum" in schema else [schema["const"]]
        if "const" in schema:
            values = [v for v in values if _same(v, schema["const"])]
        texts = list(dict.fromkeys(_dumps(v, path) for v in values))
        rest = {k: v for k, v in schema.items() if k in _CONSTRAINING}
        if rest:  # the other keywords filter the values
            allowed = re.compile(self.value(rest, path))
            texts = [text for text in texts if allowed.fullmatch(text)]
        if not texts:
            raise Unsatisfiable(f"{path}: no 'enum'/'const' value satisfies the schema")
        return alternate([escape(text) for text in texts])

    def of_type(self, kind: str, schema: dict[str, Any], path: str) -> str:
        """The values of one JSON type under the schema's keywords for that type."""
        if kind == "string":
            return string_schema(schema, path)
        if kind == "integer":
            return integer_schema(schema, path)
        if kind == "number":
            return number_schema(schema, path)
        if kind in ("boolean", "null"):
            return BOOLEAN if kind == "boolean" else NULL
        return self.obj(schema, path) if kind == "object" else self.array(schema, path)

    def obj(self, schema: dict[str, Any], path: str) -> str:
        extra = schema.get("additionalProperties")
        required = _required(schema, path)
        if "properties" not in schema:
            if required:
                raise ValueError(f"{path}: 'required' without 'properties' is not supported")
            if extra is False:
                return self.pairs_object(None)
            if extra is None or _same(extra, True) or _same(extra, {}):
                return self.pairs_object(self.any_value(self.max_depth - 1))
            return self.pairs_object(self.optional(extra, f"{path}/additionalProperties"))
        props = schema["properties"]
        if not isinstance(props, dict):
            raise ValueError(f"{path}: 'properties' must be an object")
        if not (extra is None or isinstance(extra, bool) or extra == {}):
            raise ValueError(f"{path}: 'additionalProperties' as a schema with 'properties'")
        for name in required:
            if name not in props:
                raise Unsatisfiable(f"{path}: 'required' {name!r} is not in 'properties'")
        members = []
        for name, sub in props.items():
            at = f"{path}/properties/" + name.replace("~", "~0").replace("/", "~1")
            value = self.value(sub, at) if name in required else self.optional(sub, at)
            if value is not None:
                members.append((f"{_key(name)}{self.ws}:{self.ws}{value}", name in required))
        return self.members_object(members)

    def optional(self, schema: Any, path: str) -> str | None:
        """The schema's regex, or None when nothing satisfies it."""
        try:
            return self.value(schema, path)
        except Unsatisfiable:
            return None

    def members_object(self, members: list[tuple[str, bool]]) -> str:
        """An object of the members (regex, required) in order, absent optional ones' commas
        absent too; linear in the members' size."""
        comma, ws = f"{self.ws},{self.ws}", self.ws
        if not members:
            body = ""
        elif any(req for _, req in members):  # the first required one anchors the commas
            first = next(i for i, (_, req) in enumerate(members) if req)
            body = "".join(f"(?:{m}{comma})?" for m, _ in members[:first]) + members[first][0]
            body += "".join(comma + m if r else f"(?:{comma}{m})?" for m, r in members[first + 1 :])
        else:  # any subset: P(k) = P(k-1) then optionally member k, or member k alone
            body = members[0][0]
            for m, _ in members[1:]:
                body = f"(?:{body}(?:{comma}{m})?|{m})"
            body = f"(?:{body})?"
        return rf"\{{{ws}{body}{ws}\}}"

    def pairs_object(self, value: str | None) -> str:
        """An object of any string keys, each value `value` (None: the empty object only)."""
        if value is None:
            return rf"\{{{self.ws}\}}"
        pair = f"{STRING}{self.ws}:{self.ws}{value}"
        return rf"\{{{self.ws}(?:{pair}(?:{self.ws},{self.ws}{pair})*)?{self.ws}\}}"

    def array(self, schema: dict[str, Any], path: str) -> str:
        items = schema.get("items")
        if isinstance(items, list):
            raise ValueError(f"{path}: 'items' as a list (tuple validation) is not supported")
        low = count(schema, "minItems", path) or 0
        high = count(schema, "maxItems", path)
        if items is None:
            item = self.any_value(self.max_depth - 1)
        else:
            at = f"{path}/items"
            item = self.value(items, at) if low else self.optional(items, at)
        return self.sequence(item, low, high, path)

    def sequence(self, item: str | None, low: int, high: int | None, path: str) -> str:
        """An array of `low` to `high` items (None: unbounded; item None: none can exist)."""
        if high is not None and low > high:
            raise Unsatisfiable(f"{path}: 'minItems' {low} > 'maxItems' {high}")
        if item is None or high == 0:
            if low:
                raise Unsatisfiable(f"{path}: 'minItems' {low} but no item can exist")
            return rf"\[{self.ws}\]"
        more = quantifier(max(low - 1, 0), None if high is None else high - 1)
        seq = item if high == 1 else f"{item}(?:{self.ws},{self.ws}{item}){more}"
        return rf"\[{self.ws}{seq if low else f'(?:{seq})?'}{self.ws}\]"


def _alternatives(makers: Sequence[Callable[[], str]], path: str) -> str:
    """The satisfiable alternatives' regexes, alternated; the first failure if none is."""
    found, failure = [], None
    for make in makers:
        try:
            found.append(make())
        except Unsatisfiable as error:
            failure = failure or error
    if not found:
        raise failure or Unsatisfiable(f"{path}: no alternative is satisfiable")
    return alternate(found)


def _types(schema: dict[str, Any], path: str) -> list[str] | None:
    """The schema's types; None for any value (no `type`, no type's keywords)."""
    kind = schema.get("type")
    if kind is None:
        inferred = [t for t, keys in _TYPE_KEYWORDS.items() if keys & schema.keys()]
        return inferred or None
    kinds = [kind] if isinstance(kind, str) else kind
    if not isinstance(kinds, list) or not kinds or any(k not in TYPES for k in kinds):
        raise ValueError(f"{path}: 'type' {kind!r} is not a JSON type or a list of them")
    return list(dict.fromkeys(kinds))


def _all_of(schema: dict[str, Any], path: str) -> dict[str, Any]:
    merged = {k: v for k, v in schema.items() if k != "allOf"}
    for i, sub in enumerate(_nonempty_list(schema, "allOf", path)):
        merged = _merge(merged, sub, f"{path}/allOf/{i}")
    return merged


def _merge(base: dict[str, Any], sub: Any, path: str) -> dict[str, Any]:
    """`base` and `sub` in one schema: sub's keywords added where base lacks them, annotations
    left out; the same keyword twice only if equal (`type` intersects, `required` unites)."""
    if sub is True:
        return base
    if sub is False:
        raise Unsatisfiable(f"{path}: the schema false matches nothing")
    if not isinstance(sub, dict):
        raise ValueError(f"{path}: a schema is an object or a boolean, not {sub!r}")
    out = dict(base)
    for key, value in sub.items():
        if key in _NOT_MERGED or (key in out and _same(out[key], value)):
            continue
        if key not in out:
            out[key] = value
        elif key == "type":
            mine = [out[key]] if isinstance(out[key], str) else list(out[key])
            out[key] = [t for t in mine if t in ([value] if isinstance(value, str) else value)]
            if not out[key]:
                raise Unsatisfiable(f"{path}: 'type' {value!r} excludes every other type")
        elif key == "required" and isinstance(value, list):
            out[key] = list(dict.fromkeys([*out[key], *value]))
        else:
            raise ValueError(f"{path}: two different {key!r} keywords (allOf/$ref/anyOf merge)")
    return out


def _resolve(root: Any, ref: str, path: str) -> Any:
    """The subschema at the local JSON pointer `ref` (`#/a/b`)."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ValueError(f"{path}: '$ref' {ref!r} points at nothing")
    return node


def _required(schema: dict[str, Any], path: str) -> list[str]:
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{path}: 'required' must be a list of property names")
    return required


def _nonempty_list(schema: dict[str, Any], key: str, path: str) -> list[Any]:
    value = schema[key]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{path}: {key!r} must be a nonempty list")
    return value


def _dumps(value: Any, path: str) -> str:
    """The compact JSON text of an `enum`/`const` value."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: 'enum'/'const' value {value!r} is not JSON: {error}") from error


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON (True is not 1)."""
    try:
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    except (TypeError, ValueError):
        return False


def _key(name: str) -> str:
    """A property name as its JSON string literal."""
    return escape(json.dumps(name, ensure_ascii=False))
