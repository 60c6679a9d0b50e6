"""Guided decoding on the gateway: what a client asks for (a regex, a JSON schema, any JSON
object, one of some choices) made a TokenAutomaton once per pattern (specsplit/guide/), and a
sequence's walk through it: each round's masks for the verifier (`round_allowed`), the state
moved by what each round commits."""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from gateway.invalid import InvalidField, check_vocab
from specsplit.guide.bad_words import MAX_BAD_WORDS, BadWords, word_variants
from specsplit.guide.json_schema import (
    WHITESPACE,
    choice_regex,
    json_object_regex,
    schema_regex,
)
from specsplit.guide.regex_dfa import compile_regex
from specsplit.guide.tokens import FixedTokens, TokenAutomaton, TokenGuide, TokenTable
from specsplit.guide.vocab import vocabulary_bytes
from specsplit.logit_rules import NO_MASK, Allowed, distinct
from specsplit.tree import DraftTree

GuideKind = Literal["regex", "json_schema", "json_object", "choice"]
MAX_GUIDES = 32  # compiled guides kept per model, the least recently used dropped first
MAX_CHOICES = 1024  # strings a guided choice may list
MAX_PATTERN_BYTES = 64 * 1024  # a regex (or a schema's) as compiled


@dataclass(frozen=True)
class GuideAsk:
    """A request's guide as its API named it: `field` (the parameter, for errors), `kind` and
    `spec` (a regex, a JSON schema as its JSON text, None, or the choices)."""

    field: str
    kind: GuideKind
    spec: str | tuple[str, ...] | None = None
    whitespace: str | None = None  # a JSON guide's between its tokens (None: WHITESPACE)

    def pattern(self) -> str:
        """The regex whose whole matches the output must be; ValueError when unsupported."""
        if self.kind == "regex":
            assert isinstance(self.spec, str)
            return self.spec
        whitespace = WHITESPACE if self.whitespace is None else self.whitespace
        if self.kind == "json_object":
            return json_object_regex(whitespace=whitespace)
        if self.kind == "choice":
            assert isinstance(self.spec, tuple)
            if not 1 <= len(self.spec) <= MAX_CHOICES:
                raise ValueError(f"1 to {MAX_CHOICES} choices")
            return choice_regex(list(self.spec))
        assert isinstance(self.spec, str)
        try:
            schema = json.loads(self.spec)
        except json.JSONDecodeError as err:
            raise ValueError(f"the schema is not JSON: {err}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("the schema must be a JSON object (or a boolean)")
        return schema_regex(schema, whitespace=whitespace)


class GuideCache:
    """A model's compiled guides by (pattern, end tokens), and its vocabulary's bytes (made on the
    first guide). Compiling takes time: call it off the event loop."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._known: OrderedDict[tuple[str, tuple[int, ...]], TokenAutomaton] = OrderedDict()

    @functools.cached_property
    def vocab(self) -> TokenTable:
        """The vocabulary's token bytes, laid out once for every guide."""
        return TokenTable(vocabulary_bytes(self.tokenizer, self.vocab_size))

    def automaton(self, pattern: str, end_ids: tuple[int, ...]) -> TokenAutomaton:
        """ValueError where the pattern is too long, unsupported, or has too many states."""
        if len(pattern.encode("utf-8")) > MAX_PATTERN_BYTES:
            raise ValueError(f"the pattern is over {MAX_PATTERN_BYTES} bytes")
        key = (pattern, end_ids)
        with self._lock:
            known = self._known.get(key)
            if known is not None:
                self._known.move_to_end(key)
                return known
        made = TokenAutomaton(compile_regex(pattern), self.vocab, end_ids)
        with self._lock:
            self._known[key] = made
            while len(self._known) > MAX_GUIDES:
                self._known.popitem(last=False)
        return made


class GuidedModel(Protocol):
    """What building a request's guide reads of the model (gateway/request.py:ModelInfo)."""

    @property
    def tokenizer(self) -> Any: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def guides(self) -> GuideCache: ...


def token_guide(
    model: GuidedModel,
    guide: GuideAsk | None,
    allowed_token_ids: Sequence[int] | None,
    bad_words: Sequence[str],
    ignore_eos: bool,
    min_tokens: int,
) -> TokenGuide | None:
    """A request's guide, at most one of: a pattern (`guide`), allowed token ids, bad words;
    InvalidField naming the parameter otherwise."""
    asked = [name for name, value in (
        (None if guide is None else guide.field, guide),
        ("allowed_token_ids", allowed_token_ids),
        ("bad_words", bad_words or None),
    ) if value is not None]  # fmt: skip
    if len(asked) > 1:
        raise InvalidField(asked[1] or "", f"{asked[1]}: not with {asked[0]}")
    if guide is not None:
        return _compiled(model, guide, ignore_eos, min_tokens)
    if min_tokens and (allowed_token_ids is not None or bad_words):  # (it could refuse all)
        raise InvalidField("min_tokens", f"min_tokens: not with {asked[0]}")
    if allowed_token_ids is not None:
        check_vocab(allowed_token_ids, "allowed_token_ids", model.vocab_size)
        if not allowed_token_ids:
            raise InvalidField("allowed_token_ids", "allowed_token_ids: at least one token id")
        return FixedTokens(distinct(allowed_token_ids), model.vocab_size)
    if bad_words:
        if len(bad_words) > MAX_BAD_WORDS:
            raise InvalidField("bad_words", f"bad_words: at most {MAX_BAD_WORDS} words")
        if not all(isinstance(w, str) and w.strip() for w in bad_words):
            raise InvalidField("bad_words", "bad_words: each a non-empty string")
        variants = word_variants(model.tokenizer, list(bad_words))
        check_vocab([t for v in variants for t in v], "bad_words", model.vocab_size)
        return BadWords(variants, model.vocab_size)
    return None


def _compiled(
    model: GuidedModel, guide: GuideAsk, ignore_eos: bool, min_tokens: int
) -> TokenAutomaton:
    """The guide's automaton, its output ended by EOS."""
    for name, value in (("ignore_eos", ignore_eos), ("min_tokens", min_tokens)):
        if value:  # (EOS, allowed where the text matches, must end the output; nothing else may)
            raise InvalidField(name, f"{name}: not with a guide ({guide.field})")
    if not model.eos_token_ids:
        raise InvalidField(guide.field, f"{guide.field}: the model has no EOS to end a match")
    try:
        return model.guides.automaton(guide.pattern(), distinct(model.eos_token_ids))
    except ValueError as err:
        raise InvalidField(guide.field, f"{guide.field}: {err}") from None


def round_allowed(guide: TokenGuide, state: int, tree: DraftTree) -> Allowed:
    """A round's masks from the output's `state` (through the pending token): the root's row's,
    then each tree node's after its path; rows past a token the guide refuses get none (the
    verifier never accepts from them)."""
    index: dict[int, int] = {}
    masks: list[np.ndarray] = []
    rows = []
    for row_state in guide.row_states(state, tree):
        words = guide.mask(row_state)
        if words is None:
            rows.append(NO_MASK)
            continue
        if row_state not in index:
            index[row_state] = len(masks)
            masks.append(words)
        rows.append(index[row_state])
    return Allowed(b"".join(m.tobytes() for m in masks), tuple(rows))
