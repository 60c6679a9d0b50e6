"""A Verify round's logit rules on the wire (VerifyRequest.rules; specsplit/convert.py calls
these): an entry for each sequence with rules, none for the others."""

from __future__ import annotations

from typing import Any

from specsplit.errors import invalid
from specsplit.logit_rules import Allowed, LogitRules, Penalties
from specsplit.messages import VerifyInput
from specsplit.wire_columns import indexed


def fill_rules(msg: Any, inputs: list[VerifyInput]) -> None:
    """VerifyRequest.rules: one entry per input with rules."""
    for i, item in enumerate(inputs):
        rules = item.rules
        if rules is None:
            continue
        if rules.kept >= 0:  # (the verifier's context, and the round's masks)
            entry = msg.rules.add(index=i, kept=True, output_len=rules.kept)
            _fill_allowed(entry, rules.allowed)
            continue
        p = rules.penalties
        entry = msg.rules.add(
            index=i,
            presence_penalty=p.presence,
            frequency_penalty=p.frequency,
            repetition_penalty=p.repetition,
            min_tokens=p.min_tokens,
            min_p=p.min_p,
        )
        entry.stop_tokens.extend(p.stop_ids)
        entry.bias_tokens.extend([token for token, _ in p.bias])
        entry.bias_values.extend([value for _, value in p.bias])
        entry.output_tokens.extend(rules.output)
        entry.output_counts.extend(rules.counts)
        entry.prompt_tokens.extend(rules.prompt)
        _fill_allowed(entry, rules.allowed)


def _fill_allowed(entry: Any, allowed: Allowed | None) -> None:
    if allowed is not None:
        entry.allowed_words = allowed.words
        entry.allowed_rows.extend(allowed.rows)


def read_rules(msg: Any, inputs: list[VerifyInput]) -> None:
    """Each input's rules from VerifyRequest.rules (range checks are the verifier's)."""
    for i, entry in indexed(msg.rules, len(inputs), "rules").items():
        allowed = (
            Allowed(entry.allowed_words, tuple(entry.allowed_rows)) if entry.allowed_rows else None
        )
        if entry.kept:
            if entry.output_len < 0:
                raise invalid("rules.output_len: the kept output's tokens, >= 0")
            inputs[i].rules = LogitRules(Penalties(), allowed=allowed, kept=entry.output_len)
            continue
        if len(entry.bias_tokens) != len(entry.bias_values):
            raise invalid("rules.bias_tokens and rules.bias_values differ in length")
        if len(entry.output_tokens) != len(entry.output_counts):
            raise invalid("rules.output_tokens and rules.output_counts differ in length")
        penalties = Penalties(
            tuple(zip(entry.bias_tokens, entry.bias_values, strict=True)),
            entry.presence_penalty,
            entry.frequency_penalty,
            entry.repetition_penalty or 1.0,
            entry.min_tokens,
            tuple(entry.stop_tokens),
            entry.min_p,
        )
        inputs[i].rules = LogitRules(
            penalties,
            tuple(entry.output_tokens),
            tuple(entry.output_counts),
            tuple(entry.prompt_tokens),
            allowed,
        )
