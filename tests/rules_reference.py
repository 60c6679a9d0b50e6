"""A round's logit rules made afresh from the whole output, as the gateway made them before it
carried them through its commits (specsplit/logit_rules.py:start_context, `after`,
`round_rules`): the tests build rounds' rules with it and compare the carried ones against it."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from specsplit.logit_rules import Allowed, LogitRules, Penalties, still_held


def with_output(penalties: Penalties, output: Counter[int], prompt: tuple[int, ...]) -> LogitRules:
    """Rules reading `output` (token -> count)."""
    tokens = tuple(sorted(output))
    return LogitRules(penalties, tokens, tuple(output[t] for t in tokens), prompt)


def rules_for(
    penalties: Penalties | None,
    prompt: tuple[int, ...],
    output: Counter[int],
    allowed: Allowed | None = None,
) -> LogitRules | None:
    """A round's rules from its request's penalties, its prompt's `distinct` tokens, its
    output so far (the gateway's) and a guide's masks; None where they change nothing. The
    prompt goes only where it is read (a repetition penalty)."""
    if penalties is not None:
        penalties = still_held(penalties, output.total())
    if penalties is None or not penalties.active:
        if allowed is None:
            return None
        penalties = Penalties()
    rules = with_output(penalties, output, prompt if penalties.repetition != 1 else ())
    return rules if allowed is None else replace(rules, allowed=allowed)
