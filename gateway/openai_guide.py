"""An OpenAI body's guided decoding (gateway/guides.py): OpenAI's `response_format`
(`json_object`, `json_schema`) and vLLM's `guided_json`, `guided_regex`, `guided_choice`,
`guided_whitespace_pattern` and `structured_outputs` ({"json" | "regex" | "choice" |
"json_object"}); at most one guide a body. vLLM's `guided_decoding_backend` names an
implementation and changes nothing here. Grammars (`guided_grammar`, a structured_outputs
"grammar") are refused (openai_body.NOT_SUPPORTED)."""

from __future__ import annotations

import json
from typing import Any

from gateway.guides import GuideAsk
from gateway.openai_body import bad_param, body_field

_STRUCTURED = ("json", "regex", "choice", "json_object")  # vLLM's structured_outputs keys


def body_guide(body: dict[str, Any]) -> GuideAsk | None:
    """The body's guide, None for none; 400 naming the parameter for a malformed one or two."""
    asks = [
        ask
        for ask in (
            _response_format(body),
            _schema("guided_json", body.get("guided_json")),
            _regex("guided_regex", body.get("guided_regex")),
            _choice("guided_choice", body.get("guided_choice")),
            _structured(body.get("structured_outputs")),
        )
        if ask is not None
    ]
    if len(asks) > 1:
        raise bad_param(asks[1].field, f"one guide a request (and {asks[0].field})")
    whitespace = body_field(body, "guided_whitespace_pattern", str, None)
    if whitespace is None or not asks:
        return asks[0] if asks else None
    if asks[0].kind not in ("json_schema", "json_object"):
        raise bad_param("guided_whitespace_pattern", "only with a JSON guide")
    return GuideAsk(asks[0].field, asks[0].kind, asks[0].spec, whitespace)


def _response_format(body: dict[str, Any]) -> GuideAsk | None:
    value = body_field(body, "response_format", dict, None)
    if value is None or value.get("type") == "text":
        return None
    if value.get("type") == "json_object":
        return GuideAsk("response_format", "json_object")
    if value.get("type") == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise bad_param("response_format", "json_schema: an object with a schema")
        return GuideAsk("response_format", "json_schema", json.dumps(spec.get("schema", {})))
    raise bad_param("response_format", "type: one of text, json_object, json_schema")


def _schema(name: str, value: Any) -> GuideAsk | None:
    """A JSON schema given as an object or as its JSON text."""
    if value is None:
        return None
    if isinstance(value, str):
        return GuideAsk(name, "json_schema", value)
    if isinstance(value, dict | bool):
        return GuideAsk(name, "json_schema", json.dumps(value))
    raise bad_param(name, "a JSON schema: an object or its JSON text")


def _regex(name: str, value: Any) -> GuideAsk | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_param(name, "a regular expression (a non-empty string)")
    return GuideAsk(name, "regex", value)


def _choice(name: str, value: Any) -> GuideAsk | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise bad_param(name, "a non-empty list of strings")
    return GuideAsk(name, "choice", tuple(value))


def _structured(value: Any) -> GuideAsk | None:
    """vLLM's structured_outputs: one of its keys set (the others null or absent)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_param("structured_outputs", "an object")
    given = {k: v for k, v in value.items() if v not in (None, False)}
    unknown = sorted(set(given) - set(_STRUCTURED))
    if unknown:
        raise bad_param("structured_outputs", f"{unknown[0]}: not supported")
    if len(given) != 1:
        raise bad_param("structured_outputs", f"exactly one of {', '.join(_STRUCTURED)}")
    key, spec = next(iter(given.items()))
    name = f"structured_outputs.{key}"
    if key == "json_object":
        return GuideAsk(name, "json_object")
    return {"json": _schema, "regex": _regex, "choice": _choice}[key](name, spec)
