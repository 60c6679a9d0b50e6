"""A generation's rules for the target's logits (OpenAI's `logit_bias`, `presence_penalty` and
`frequency_penalty`, vLLM's `repetition_penalty`, `min_tokens` and `min_p`), applied by the
verifier to
every row it
accepts from (verifier/round_rules.py), before temperature, top-k and top-p: greedy takes the
argmax of the bent row, sampling draws from it, so speculation stays lossless against the
target with the same rules.

At a row, in this order (vLLM's):
1. `bias`: each listed token's logit plus its bias;
2. `repetition` (r != 1): each token of the prompt or of the output so far: a positive logit
   divided by r, a negative one multiplied by r;
3. `frequency` f and `presence` p: each token that occurs c > 0 times in the output so far:
   minus f * c + p (in float32, as the logits are);
4. `min_tokens` m: while the output so far holds fewer than m tokens, the stop tokens' logits
   (`stop_ids`: EOS and the request's stop token ids) are -inf;
5. `allowed` (a guide's, specsplit/guide/): every token the row's mask leaves out is -inf;
6. `min_p` (a sampled round's, temperature T > 0): every token whose probability after the
   temperature is below min_p times the likeliest's is -inf (its logit below the row's largest
   plus T ln min_p); top-k and top-p then cut what is left.
The output so far at a row is the generation's output through the round's last pending token
(`LogitRules.output`, `counts`: the gateway's) and the tree's nodes from the root to the row's node.

`Penalties` are a request's settings; `LogitRules` adds a round's context, as the gateway sends
it each round. The verifier keeps each sequence's next rules (`after`, verifier/kept_rules.py)
and takes them for a round whose context equals them, checked once
(`checked_for`, `same_context`, `with_allowed`). A guide's masks are the gateway's,
one per row, since only the gateway walks the guide, so rounds with them carry no rules forward
(`LogitRules.carried`: no further decode steps, no step run ahead, no rounds launched on a
hint); other rules the verifier carries forward itself (`after`). `bend_row` is
the plain reference for one row that the tests compare the verifier's batched bending with.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_BIASED_TOKENS = 1024  # tokens one request may bias
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency: [-2, 2]
NO_MASK = -1  # Allowed.rows: a row the guide does not constrain (never accepted from)


def mask_words(vocab_size: int) -> int:
    """uint32 words in an allowed-tokens mask (bit t % 32 of word t // 32)."""
    return (vocab_size + 31) // 32


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """[vocab] bool as an allowed-tokens mask: uint32 words [mask_words(vocab)]."""
    bits = np.zeros(mask_words(len(allowed)) * 32, dtype=bool)
    bits[: len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").view(np.uint32)


def unpack_mask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """An allowed-tokens mask's words as [vocab_size] bool."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return bits.astype(bool)


@dataclass(frozen=True)
class Allowed:
    """A guide's tokens for each row of a round: `rows` (the root's, then each tree node's) index
    the masks `words` holds, each mask_words(vocab) little-endian uint32 words; NO_MASK: none."""

    words: bytes
    rows: tuple[int, ...]

    def masks(self, vocab_size: int) -> np.ndarray:
        """[num_masks, mask_words(vocab_size)] uint32."""
        return np.frombuffer(self.words, dtype="<u4").reshape(-1, mask_words(vocab_size))

    def validate(self, vocab_size: int, num_rows: int) -> None:
        if len(self.words) % (4 * mask_words(vocab_size)):
            raise ValueError("rules.allowed_words: whole masks of the vocabulary's bits")
        if len(self.rows) != num_rows:
            raise ValueError(f"rules.allowed_rows: {len(self.rows)} rows for a round of {num_rows}")
        num_masks = len(self.words) // (4 * mask_words(vocab_size))
        if self.rows and not (min(self.rows) >= NO_MASK and max(self.rows) < num_masks):
            raise ValueError(f"rules.allowed_rows: each a mask in [0, {num_masks}) or {NO_MASK}")
        masks = self.masks(vocab_size)
        tail = np.uint32((1 << (vocab_size % 32)) - 1) if vocab_size % 32 else ~np.uint32(0)
        if len(masks) and not (np.all(masks[:, -1] & ~tail == 0) and np.all(masks.any(axis=1))):
            raise ValueError("rules.allowed_words: each mask allows a token, none past the vocab")


@dataclass(frozen=True)
class Penalties:
    """A request's rules; the defaults change nothing."""

    bias: tuple[tuple[int, float], ...] = ()  # (token, bias), by token id, each token once
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0  # > 0; 1 = off
    min_tokens: int = 0  # no stop token before this many output tokens
    stop_ids: tuple[int, ...] = ()  # the tokens min_tokens holds back, by id, each once
    min_p: float = 0.0  # in [0, 1]; 0 = off (greedy rounds: no effect)

    @property
    def active(self) -> bool:
        return (
            bool(self.bias)
            or self.presence != 0
            or self.frequency != 0
            or self.repetition != 1
            or (self.min_tokens > 0 and bool(self.stop_ids))
            or self.min_p != 0
        )

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
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens = {self.min_tokens}: must be >= 0")
        if not 0 <= self.min_p <= 1:  # (also refuses nan)
            raise ValueError(f"min_p = {self.min_p}: must be in [0, 1]")
        if self.stop_ids:  # (numpy's checks only where there is something to check)
            check_ids(np.array(self.stop_ids, dtype=np.int64), vocab_size, "rules.stop_ids")
        if self.bias:
            tokens, values = self.bias_arrays
            check_ids(tokens, vocab_size, "logit_bias")
            if not np.all(np.abs(values) <= MAX_LOGIT_BIAS):  # (also refuses nan)
                raise ValueError("logit_bias: each bias must be in [-100, 100]")

    @functools.cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The biased tokens (int64) and their biases (float64)."""
        pairs = np.array(self.bias, dtype=np.float64).reshape(-1, 2)
        return pairs[:, 0].astype(np.int64), pairs[:, 1]


def check_ids(ids: np.ndarray, vocab_size: int, name: str) -> None:
    """ValueError naming `name` unless `ids` are distinct, by id, in [0, vocab_size)."""
    if len(ids) and not (ids[0] >= 0 and ids[-1] < vocab_size and np.all(ids[1:] > ids[:-1])):
        raise ValueError(f"{name}: distinct token ids in [0, {vocab_size}), by id")


def bias_of(entries: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """A bias as Penalties holds it: by token id, a token given twice keeps its last value."""
    return tuple(sorted(dict(entries).items()))


_CHECKED = "_checked_for"  # (LogitRules' cache: the vocabulary size its context passed)
# (LogitRules made by `after`: the rules it was made from, the tokens appended, and how many
# `after`s stand between them and rules that hold their output)
_APPENDED = "_appended"
MAX_APPENDED = 32


@dataclass(frozen=True)
class LogitRules:
    """A round's rules for one sequence: its request's `penalties` and the context they read,
    the output so far through the round's last pending token."""

    penalties: Penalties
    # the output's distinct tokens, by id, and how often each occurs (> 0); made on first read
    # where `after` made the rules (no class attribute then: `__getattr__` makes them)
    output: tuple[int, ...] = field(default_factory=tuple)
    counts: tuple[int, ...] = field(default_factory=tuple)
    prompt: tuple[int, ...] = ()  # the prompt's distinct tokens, by id (repetition != 1 only)
    allowed: Allowed | None = None  # a guide's masks for this round's rows (the gateway's)
    # >= 0: the context (penalties, output, prompt) is the one the verifier kept for the
    # sequence, whose output holds this many tokens (`kept_context`; the wire then carries none)
    kept: int = -1

    @property
    def carried(self) -> bool:
        """Whether the verifier can make the next round's rules (`after`): not with a guide."""
        return self.allowed is None

    @functools.cached_property
    def total(self) -> int:
        """The output's tokens."""
        return sum(self.counts)

    def kept_context(self) -> LogitRules:
        """These rules as a round sends them once the verifier keeps their context: their
        output's length and the round's masks."""
        return LogitRules(Penalties(), allowed=self.allowed, kept=self.total)

    @functools.cached_property
    def counter(self) -> Counter[int]:
        return Counter(dict(zip(self.output, self.counts, strict=True)))

    @functools.cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The output's tokens and counts and the prompt's tokens as int64 arrays (the
        verifier's checks and bending read them)."""
        return tuple(  # type: ignore[return-value]
            np.fromiter(ids, dtype=np.int64, count=len(ids))
            for ids in (self.output, self.counts, self.prompt)
        )

    def after(self, tokens: Iterable[int]) -> LogitRules:
        """The rules of the round after this one appended `tokens` to the output. O(tokens): their
        output and counts are made where they are first read (most rules the gateway and the
        verifier carry forward are only carried again: copying a long output's tuples each
        commit cost ~20 us a sequence at 3,000 distinct tokens), or once they stand on
        MAX_APPENDED `after`s."""
        assert self.carried, "a guide's masks are the gateway's to make"
        added = tuple(tokens)
        total = self.total + len(added)
        rules = object.__new__(LogitRules)
        state = rules.__dict__
        state.update(penalties=still_held(self.penalties, total), prompt=self.prompt)
        state.update(allowed=None, kept=-1, total=total)
        # (no arrays carried: the verifier keeps the counts on the device, verifier/rule_rows.py,
        # and makes them only where it fills a sequence's rows from a context again)
        if self.checked_for is not None:  # (the verifier's: its tokens are in the vocabulary)
            state[_CHECKED] = self.checked_for
        below = self.__dict__.get(_APPENDED)
        depth = 1 if below is None else below[2] + 1
        state[_APPENDED] = (self, added, depth)
        if depth >= MAX_APPENDED:
            rules._make_output()
        return rules

    def _make_output(self) -> None:
        """`output` and `counts` made from the nearest rules below that hold them and the tokens
        each `after` since appended; the rules below let go."""
        chain = []
        rules = self
        while (appended := rules.__dict__.get(_APPENDED)) is not None:
            rules = appended[0]
            chain.append(appended[1])
        output, counts = list(rules.output), list(rules.counts)
        for added in reversed(chain):
            for token in added:  # (in place, by id: a Counter's sum and sort cost more)
                i = bisect.bisect_left(output, token)
                if i < len(output) and output[i] == token:
                    counts[i] += 1
                else:
                    output.insert(i, token)
                    counts.insert(i, 1)
        self.__dict__.update(output=tuple(output), counts=tuple(counts))
        self.__dict__.pop(_APPENDED, None)  # (after them: another thread may read them at once)

    if not TYPE_CHECKING:  # (mypy would take any attribute then)

        def __getattr__(self, name: str) -> tuple[int, ...]:
            """`output` and `counts` of rules `after` made, made on first read."""
            if name in ("output", "counts") and _APPENDED in self.__dict__:
                self._make_output()
                return self.__dict__[name]
            raise AttributeError(f"'LogitRules' object has no attribute {name!r}")

    @property
    def checked_for(self) -> int | None:
        """The vocabulary size `validate` passed the rules' context for (None: not yet)."""
        return self.__dict__.get(_CHECKED)

    def same_context(self, other: LogitRules) -> bool:
        """Whether `other` reads the same penalties, output and prompt (its masks aside)."""
        return (
            self.output == other.output
            and self.counts == other.counts
            and self.penalties == other.penalties
            and self.prompt == other.prompt
        )

    def with_allowed(self, allowed: Allowed | None) -> LogitRules:
        """These rules with a guide's masks for a round (or none), their arrays and checks
        kept (and their output not made where `after` has not made it yet)."""
        if allowed is self.allowed:
            return self
        rules = object.__new__(LogitRules)
        rules.__dict__.update(self.__dict__)  # (the fields, and what is cached of them)
        rules.__dict__["allowed"] = allowed
        return rules

    def validate(self, vocab_size: int, num_rows: int) -> None:
        """Raise ValueError naming the field when the rules or their context are malformed;
        num_rows: the round's rows (its tree's nodes + 1). The context once for a vocabulary
        (`checked_for`): the masks each round."""
        if self.kept >= 0:
            raise ValueError(
                "rules.kept: the sequence's context is not kept (FAILED_PRECONDITION first)"
            )
        if self.allowed is not None:
            self.allowed.validate(vocab_size, num_rows)
        if self.checked_for == vocab_size:
            return
        self._check(vocab_size)
        self.__dict__[_CHECKED] = vocab_size

    def _check(self, vocab_size: int) -> None:
        self.penalties.validate(vocab_size)
        if len(self.output) != len(self.counts):
            raise ValueError("rules.output and rules.counts differ in length")
        if not (self.output or self.prompt):
            return  # (a guide's alone)
        tokens, counts, prompt = self.arrays
        check_ids(tokens, vocab_size, "rules.output")
        if not np.all(counts > 0):
            raise ValueError("rules.counts: each token counted > 0")
        check_ids(prompt, vocab_size, "rules.prompt")


def still_held(penalties: Penalties, total: int) -> Penalties:
    """`penalties` for an output of `total` tokens: min_tokens and its stop tokens gone once the
    output holds that many (the gateway's rules and the verifier's `after` alike)."""
    if penalties.min_tokens and total >= penalties.min_tokens:
        return replace(penalties, min_tokens=0, stop_ids=())  # (held back no longer)
    return penalties


def distinct(ids: Iterable[int]) -> tuple[int, ...]:
    """Token ids as LogitRules.prompt holds them: each once, by id."""
    return tuple(sorted(set(ids)))


def start_context(penalties: Penalties | None, prompt_ids: Iterable[int]) -> LogitRules | None:
    """A generation's rules before its output (`round_rules` reads them each round, `after`
    carries them through each commit): the prompt's distinct tokens where a repetition penalty
    reads them; None without penalties."""
    if penalties is None:
        return None
    return LogitRules(penalties, prompt=distinct(prompt_ids) if penalties.repetition != 1 else ())


def round_rules(
    context: LogitRules | None, allowed: Allowed | None = None, kept: bool = False
) -> LogitRules | None:
    """A round's rules from a generation's context (`start_context`, then `after`) and a
    guide's masks; None where they change nothing (penalties none or inactive, no guide). `kept`:
    the verifier keeps the context as the last round left it, the rules say so
    (`kept_context`) in place of sending it."""
    if context is not None and context.penalties.active:
        rules = context.with_allowed(allowed)
        return rules.kept_context() if kept else rules
    # (a guide alone, or penalties that change nothing now: the masks, no context to read)
    return None if allowed is None else LogitRules(Penalties(), allowed=allowed)


def min_p_cut(min_p: float, temperature: float) -> float:
    """How far below a row's largest logit min_p cuts (T ln min_p); -inf: no cut (off, or a
    greedy round)."""
    return temperature * math.log(min_p) if min_p > 0 and temperature > 0 else -math.inf


def bend_row(
    row: torch.Tensor, rules: LogitRules, path: list[int], temperature: float = 0.0, at: int = 0
) -> torch.Tensor:
    """The reference: a float32 logits row [V] bent by `rules` with `path` (the tree's tokens
    from the root to the row's node) appended to the output, one token at a time; `temperature`:
    the round's (min_p reads it); `at`: the row's place in the round (0 the root's, 1 + j tree
    node j's: the guide's mask it takes)."""
    row = row.clone()
    p = rules.penalties
    for token, value in p.bias:
        row[token] += torch.tensor(value, dtype=row.dtype)
    counts = rules.counter + Counter(path)
    if p.repetition != 1:
        for token in sorted(set(rules.prompt) | set(counts)):
            x = row[token]
            row[token] = x / p.repetition if x > 0 else x * p.repetition
    if p.presence != 0 or p.frequency != 0:
        frequency, presence = (torch.tensor(v, dtype=row.dtype) for v in (p.frequency, p.presence))
        for token, c in counts.items():
            row[token] = row[token] - (frequency * c + presence)
    if counts.total() < p.min_tokens:
        row[list(p.stop_ids)] = -math.inf
    if rules.allowed is not None and rules.allowed.rows[at] != NO_MASK:
        words = rules.allowed.masks(len(row))[rules.allowed.rows[at]]
        row[torch.from_numpy(~unpack_mask(words, len(row)))] = -math.inf
    cut = min_p_cut(p.min_p, temperature)
    if cut > -math.inf:
        row[row < row.max() + torch.tensor(cut, dtype=row.dtype)] = -math.inf
    return row
