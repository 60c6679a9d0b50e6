"""A generation's rules for the target's logits (OpenAI's `logit_bias`, `presence_penalty` and
`frequency_penalty`, vLLM's `repetition_penalty`), applied by the verifier to every row it
accepts from (verifier/round_rules.py), before temperature, top-k and top-p: greedy takes the
argmax of the bent row, sampling draws from it, so speculation stays lossless against the
target with the same rules.

At a row, in this order (vLLM's):
1. `bias`: each listed token's logit plus its bias;
2. `repetition` (r != 1): each token of the prompt or of the output so far: a positive logit
   divided by r, a negative one multiplied by r;
3. `frequency` f and `presence` p: each token that occurs c > 0 times in the output so far:
   minus f * c + p.
The output so far at a row is the generation's output through the round's last pending token
(`LogitRules.counts`, the gateway's) and the tree's nodes from the root to the row's node.

`Penalties` are a request's settings; `LogitRules` adds a round's context, as the gateway sends
it each round (the verifier keeps nothing between rounds). `bend_row` is the plain reference
for one row that the tests compare the verifier's batched bending with.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_BIASED_TOKENS = 1024  # tokens one request may bias
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency: [-2, 2]


@dataclass(frozen=True)
class Penalties:
    """A request's rules; the defaults change nothing."""

    bias: tuple[tuple[int, float], ...] = ()  # (token, bias), by token id, each token once
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0  # > 0; 1 = off

    @property
    def active(self) -> bool:
        return bool(self.bias) or self.presence != 0 or self.frequency != 0 or self.repetition != 1

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the field (OpenAI's name) when a setting is out of range."""
        for name, value in (("presence_penalty", self.presence),
                            ("frequency_penalty", self.frequency)):  # fmt: skip
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # (also refuses nan)
                raise ValueError(f"{name} = {value}: must be in [-2, 2]")
        if not (math.isfinite(self.repetition) and self.repetition > 0):
            raise ValueError(f"repetition_penalty = {self.repetition}: must be > 0 (1 = off)")
        if len(self.bias) > MAX_BIASED_TOKENS:
            raise ValueError(f"logit_bias has {len(self.bias)} tokens: at most {MAX_BIASED_TOKENS}")
        tokens = [token for token, _ in self.bias]
        if tokens != sorted(set(tokens)):
            raise ValueError("logit_bias: each token once, by token id")
        for token, value in self.bias:
            if not 0 <= token < vocab_size:
                raise ValueError(
                    f"logit_bias: token {token} outside the vocabulary [0, {vocab_size})"
                )
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: {token}: {value} must be in [-100, 100]")


def bias_of(entries: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """A bias as Penalties holds it: by token id, a token given twice keeps its last value."""
    return tuple(sorted(dict(entries).items()))


@dataclass(frozen=True)
class LogitRules:
    """A round's rules for one sequence: its request's `penalties` and the context they read,
    the output so far through the round's last pending token."""

    penalties: Penalties
    counts: tuple[tuple[int, int], ...] = ()  # the output's tokens, (token, count > 0) by id
    prompt: tuple[int, ...] = ()  # the prompt's distinct tokens, by id (repetition != 1 only)
    _counter: Counter[int] = field(default_factory=Counter, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_counter", Counter(dict(self.counts)))

    def count(self, token: int) -> int:
        return self._counter[token]

    def after(self, tokens: Iterable[int]) -> LogitRules:
        """The rules of the round after this one appended `tokens` to the output."""
        counter = self._counter + Counter(tokens)
        return replace(self, counts=tuple(sorted(counter.items())))

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the field when the rules or their context are malformed."""
        self.penalties.validate(vocab_size)
        tokens = [token for token, _ in self.counts]
        if tokens != sorted(set(tokens)) or any(c <= 0 for _, c in self.counts):
            raise ValueError("rules.counts: distinct tokens by id, each counted > 0")
        if list(self.prompt) != sorted(set(self.prompt)):
            raise ValueError("rules.prompt: distinct tokens by id")
        for name, ids in (("counts", tokens), ("prompt", self.prompt)):
            if ids and not (ids[0] >= 0 and ids[-1] < vocab_size):
                raise ValueError(f"rules.{name}: a token outside the vocabulary [0, {vocab_size})")


def distinct(ids: Iterable[int]) -> tuple[int, ...]:
    """Token ids as LogitRules.prompt holds them: each once, by id."""
    return tuple(sorted(set(ids)))


def rules_for(
    penalties: Penalties | None, prompt: tuple[int, ...], output: Counter[int]
) -> LogitRules | None:
    """A round's rules from its request's penalties, its prompt's `distinct` tokens and its
    output so far (the gateway's); None where the penalties change nothing. The prompt goes
    only where it is read (a repetition penalty)."""
    if penalties is None or not penalties.active:
        return None
    prompt = prompt if penalties.repetition != 1 else ()
    return LogitRules(penalties, tuple(sorted(output.items())), prompt)


def bend_row(row: torch.Tensor, rules: LogitRules, path: list[int]) -> torch.Tensor:
    """The reference: a float32 logits row [V] bent by `rules` with `path` (the tree's tokens
    from the root to the row's node) appended to the output, one token at a time."""
    row = row.clone()
    p = rules.penalties
    for token, value in p.bias:
        row[token] += torch.tensor(value, dtype=row.dtype)
    counts = rules._counter + Counter(path)
    if p.repetition != 1:
        for token in sorted(set(rules.prompt) | set(counts)):
            x = row[token]
            row[token] = x / p.repetition if x > 0 else x * p.repetition
    if p.presence != 0 or p.frequency != 0:
        for token, c in counts.items():
            row[token] += torch.tensor(-(p.frequency * c + p.presence), dtype=row.dtype)
    return row
