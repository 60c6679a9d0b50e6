"""Adaptive speculation: per sequence, the draft shape moves along a ladder of pre-built
SpecParams, from cheap to deep, following how much of its drafts the target accepts.

The rule, per sequence (only for requests that leave their spec to the gateway's default):
- the ladder is the configured rungs plus the gateway's default spec, cheapest first (by depth,
  then nodes); a sequence starts on the default spec's rung;
- after each round that drafted something, `ratio = num_accepted_drafts / depth` of the tree
  actually drafted (0..1; rounds without a draft - drafter down, no room left - carry nothing)
  enters an exponential running mean, `mean += EMA_WEIGHT * (ratio - mean)`, started afresh
  on each rung;
- after at least MIN_ROUNDS_PER_RUNG rounds on a rung (hysteresis): mean >= CLIMB_FRACTION
  moves one rung deeper, mean < DESCEND_FRACTION one rung cheaper; the ends of the ladder hold.

With the default thresholds and ladder, a chain climbs from depth 1 to 3 once ~70% of single
drafts are accepted and from 3 to 5 at a per-token acceptance near 0.83; at a constant per-token
acceptance the fractions are far enough apart that a rung reached by climbing never descends
straight back (nor one reached by descending climbs back). Only the draft shape changes: the
verifier's acceptance is the same lossless rule at every rung, so the output is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from specsplit.errors import ServiceError
from specsplit.spec_params import SpecParams

EMA_WEIGHT = 0.25  # weight of the newest round in the running mean
CLIMB_FRACTION = 0.7  # mean accepted drafts >= 0.7 x depth: one rung deeper
DESCEND_FRACTION = 0.3  # mean accepted drafts < 0.3 x depth: one rung cheaper
MIN_ROUNDS_PER_RUNG = 4  # rounds on a rung before the next switch

DEFAULT_LADDER = "1,3,5,5x4x16"  # chains of 1, 3, 5 drafts, then a tree of depth 5, topk 4


def parse_ladder(text: str) -> tuple[SpecParams, ...]:
    """Rungs from text like "1,3,5,5x4x16": STEPS[xTOPK[xNODES]] each, NODES defaulting to
    STEPS * TOPK (as --num-draft-tokens does). Raises ValueError on a malformed or invalid rung."""
    rungs = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"ladder rung {item!r} is not STEPS[xTOPK[xNODES]]")
        numbers = [int(p) for p in parts]
        steps = numbers[0]
        topk = numbers[1] if len(numbers) > 1 else 1
        nodes = numbers[2] if len(numbers) > 2 else steps * topk
        rung = SpecParams(steps, topk, nodes)
        if steps == 0:
            raise ValueError(f"ladder rung {item!r} drafts nothing")
        try:
            rung.validate()
        except ServiceError as err:
            raise ValueError(f"ladder rung {item!r}: {err.message}") from None
        rungs.append(rung)
    return tuple(rungs)


DEFAULT_RUNGS = parse_ladder(DEFAULT_LADDER)


def format_ladder(rungs: Sequence[SpecParams]) -> str:
    """The inverse of parse_ladder: "1,3,5,5x4x16"."""
    return ",".join(
        str(s.num_steps) if s.topk == 1 else f"{s.num_steps}x{s.topk}x{s.num_draft_tokens}"
        for s in rungs
    )


def build_ladder(
    default: SpecParams, rungs: Sequence[SpecParams] | None = None
) -> tuple[SpecParams, ...]:
    """`rungs` (None = DEFAULT_RUNGS) and `default`, cheapest first, without repeats. A default
    that drafts nothing stays alone: the gateway was told not to speculate."""
    if default.num_steps == 0:
        return (default,)
    unique = dict.fromkeys([*(DEFAULT_RUNGS if rungs is None else rungs), default])
    return tuple(sorted(unique, key=lambda s: (s.num_steps, s.num_draft_tokens, s.topk)))


class AdaptiveSpec:
    """One sequence's position on the ladder and its running mean acceptance ratio."""

    def __init__(
        self,
        ladder: Sequence[SpecParams],
        rung: int,
        *,
        min_rounds: int = MIN_ROUNDS_PER_RUNG,
        climb_fraction: float = CLIMB_FRACTION,
        descend_fraction: float = DESCEND_FRACTION,
    ) -> None:
        assert ladder and 0 <= rung < len(ladder), (len(ladder), rung)
        assert 0.0 <= descend_fraction < climb_fraction <= 1.0, (descend_fraction, climb_fraction)
        self.ladder = tuple(ladder)
        self.rung = rung
        self.min_rounds = min_rounds
        self.climb_fraction = climb_fraction
        self.descend_fraction = descend_fraction
        self.mean_ratio: float | None = None  # None until a round on this rung drafted
        self.num_rounds_on_rung = 0
        self.num_switches = 0

    @property
    def spec(self) -> SpecParams:
        """The draft shape of the next round (before capping to the tokens left)."""
        return self.ladder[self.rung]

    def observe(self, num_accepted_drafts: int, depth: int) -> None:
        """One round's outcome: `depth` = the drafted tree's depth (0 = nothing drafted)."""
        if depth == 0:
            return
        assert 0 <= num_accepted_drafts <= depth, (num_accepted_drafts, depth)
        ratio = num_accepted_drafts / depth
        mean = ratio if self.mean_ratio is None else self.mean_ratio
        self.mean_ratio = mean + EMA_WEIGHT * (ratio - mean)
        self.num_rounds_on_rung += 1
        if self.num_rounds_on_rung < self.min_rounds:
            return
        if self.mean_ratio >= self.climb_fraction and self.rung + 1 < len(self.ladder):
            self._move(+1)
        elif self.mean_ratio < self.descend_fraction and self.rung > 0:
            self._move(-1)

    def _move(self, step: int) -> None:
        self.rung += step
        self.mean_ratio = None
        self.num_rounds_on_rung = 0
        self.num_switches += 1
