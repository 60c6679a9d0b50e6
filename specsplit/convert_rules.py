"""Logit rules on the wire (specsplit/convert.py calls these): a Verify round's
(VerifyRequest.rules, an entry for each sequence with rules, none for the others) and a Draft's
(SequenceDraftOptions.rules, where the drafter is to take others)."""

from __future__ import annotations

from typing import Any

from specsplit.errors import invalid
from specsplit.logit_rules import Allowed, LogitRules, Penalties
from specsplit.messages import DraftRules, VerifyInput
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
        entry = msg.rules.add(index=i, min_p=rules.penalties.min_p)
        _fill_penalties(entry, rules.penalties)
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
        if len(entry.output_tokens) != len(entry.output_counts):
            raise invalid("rules.output_tokens and rules.output_counts differ in length")
        penalties = _read_penalties(entry, entry.min_p)
        inputs[i].rules = LogitRules(
            penalties,
            tuple(entry.output_tokens),
            tuple(entry.output_counts),
            tuple(entry.prompt_tokens),
            allowed,
        )


def fill_draft_rules(entry: Any, rules: DraftRules) -> None:
    """SequenceDraftOptions.rules from `rules` (min_p stays behind: the drafter applies none)."""
    _fill_penalties(entry, rules.penalties)
    entry.output_start = rules.output_start


def read_draft_rules(entry: Any) -> DraftRules:
    """SequenceDraftOptions.rules as DraftRules (range checks are the drafter's)."""
    return DraftRules(_read_penalties(entry), entry.output_start)


def _fill_penalties(entry: Any, p: Penalties) -> None:
    """A SequenceRules' or a DraftRules' bias, penalties and min_tokens."""
    entry.presence_penalty = p.presence
    entry.frequency_penalty = p.frequency
    entry.repetition_penalty = p.repetition
    entry.min_tokens = p.min_tokens
    entry.stop_tokens.extend(p.stop_ids)
    entry.bias_tokens.extend([token for token, _ in p.bias])
    entry.bias_values.extend([value for _, value in p.bias])


def _read_penalties(entry: Any, min_p: float = 0.0) -> Penalties:
    """A SequenceRules' or a DraftRules' Penalties (with `min_p`)."""
    if len(entry.bias_tokens) != len(entry.bias_values):
        raise invalid("rules.bias_tokens and rules.bias_values differ in length")
    return Penalties(
        tuple(zip(entry.bias_tokens, entry.bias_values, strict=True)),
        entry.presence_penalty,
        entry.frequency_penalty,
        entry.repetition_penalty or 1.0,
        entry.min_tokens,
        tuple(entry.stop_tokens),
        min_p,
    )
