"""The adaptive speculation policy (gateway/adaptive.py): climbs on full acceptance, descends on
none, holds for MIN_ROUNDS_PER_RUNG rounds between switches, never leaves the ladder."""

from __future__ import annotations

import pytest

from gateway.adaptive import (
    CLIMB_FRACTION,
    DEFAULT_LADDER,
    DEFAULT_RUNGS,
    DESCEND_FRACTION,
    MIN_ROUNDS_PER_RUNG,
    AdaptiveSpec,
    build_ladder,
    format_ladder,
    parse_ladder,
)
from specsplit.messages import SpecParams

CHAIN_1, CHAIN_3, CHAIN_5 = SpecParams(1, 1, 1), SpecParams(3, 1, 3), SpecParams(5, 1, 5)
TREE = SpecParams(5, 4, 16)


def _policy(rung: int = 1) -> AdaptiveSpec:
    return AdaptiveSpec(DEFAULT_RUNGS, rung)


def _run(policy: AdaptiveSpec, fraction: float, num_rounds: int) -> list[SpecParams]:
    """`num_rounds` rounds accepting `fraction` of the current depth; the spec before each."""
    seen = []
    for _ in range(num_rounds):
        seen.append(policy.spec)
        depth = policy.spec.num_steps
        policy.observe(round(fraction * depth), depth)
    return seen


def test_the_default_ladder_goes_from_cheap_to_deep() -> None:
    assert DEFAULT_RUNGS == (CHAIN_1, CHAIN_3, CHAIN_5, TREE)
    assert format_ladder(DEFAULT_RUNGS) == DEFAULT_LADDER


def test_climbs_one_rung_after_min_rounds_of_full_acceptance() -> None:
    policy = _policy(rung=0)
    seen = _run(policy, 1.0, 3 * MIN_ROUNDS_PER_RUNG)
    n = MIN_ROUNDS_PER_RUNG
    assert seen == [CHAIN_1] * n + [CHAIN_3] * n + [CHAIN_5] * n
    assert policy.spec == TREE and policy.num_switches == 3


def test_descends_one_rung_after_min_rounds_of_zero_acceptance() -> None:
    policy = _policy(rung=3)
    seen = _run(policy, 0.0, 3 * MIN_ROUNDS_PER_RUNG)
    n = MIN_ROUNDS_PER_RUNG
    assert seen == [TREE] * n + [CHAIN_5] * n + [CHAIN_3] * n
    assert policy.spec == CHAIN_1


def test_hysteresis_holds_the_rung_for_min_rounds_after_a_switch() -> None:
    policy = _policy(rung=1)
    _run(policy, 1.0, MIN_ROUNDS_PER_RUNG)
    assert policy.spec == CHAIN_5  # climbed
    # acceptance collapses at once: the new rung holds for MIN_ROUNDS_PER_RUNG rounds anyway
    seen = _run(policy, 0.0, MIN_ROUNDS_PER_RUNG)
    assert seen == [CHAIN_5] * MIN_ROUNDS_PER_RUNG
    assert policy.spec == CHAIN_3 and policy.num_switches == 2


def test_one_bad_round_does_not_undo_a_good_running_mean() -> None:
    policy = _policy(rung=1)
    for accepted in (3, 3, 0, 3):  # mean 1 -> 1 -> 0.75 -> 0.8125 >= CLIMB_FRACTION
        policy.observe(accepted, 3)
    assert policy.spec == CHAIN_5


def test_middling_acceptance_stays_on_its_rung() -> None:
    policy = _policy(rung=1)
    assert DESCEND_FRACTION <= 1 / 2 < CLIMB_FRACTION
    for _ in range(10 * MIN_ROUNDS_PER_RUNG):
        policy.observe(1, 2)  # half of each draft accepted
    assert policy.spec == CHAIN_3 and policy.num_switches == 0


def test_never_leaves_the_ladder() -> None:
    top = _policy(rung=3)
    _run(top, 1.0, 10 * MIN_ROUNDS_PER_RUNG)
    assert top.spec == TREE and top.num_switches == 0
    bottom = _policy(rung=0)
    _run(bottom, 0.0, 10 * MIN_ROUNDS_PER_RUNG)
    assert bottom.spec == CHAIN_1 and bottom.num_switches == 0


def test_rounds_without_a_draft_carry_nothing() -> None:
    policy = _policy(rung=1)
    for _ in range(10 * MIN_ROUNDS_PER_RUNG):
        policy.observe(0, 0)  # drafter down: empty trees
    assert policy.spec == CHAIN_3 and policy.num_rounds_on_rung == 0


def test_ratio_is_taken_over_the_depth_actually_drafted() -> None:
    policy = _policy(rung=1)
    for _ in range(MIN_ROUNDS_PER_RUNG):
        policy.observe(1, 1)  # capped to depth 1 near max_new_tokens, all accepted
    assert policy.spec == CHAIN_5


def test_build_ladder_inserts_the_default_in_cost_order() -> None:
    assert build_ladder(CHAIN_3) == DEFAULT_RUNGS
    tree_3 = SpecParams(3, 2, 5)
    assert build_ladder(tree_3) == (CHAIN_1, CHAIN_3, tree_3, CHAIN_5, TREE)
    assert build_ladder(CHAIN_3, [CHAIN_5, CHAIN_1]) == (CHAIN_1, CHAIN_3, CHAIN_5)
    assert build_ladder(SpecParams(0, 1, 0)) == (SpecParams(0, 1, 0),)  # no drafting: no ladder


def test_parse_ladder() -> None:
    assert parse_ladder("2, 4x2 ,6x3x10") == (
        SpecParams(2, 1, 2),
        SpecParams(4, 2, 8),
        SpecParams(6, 3, 10),
    )
    assert parse_ladder(format_ladder(DEFAULT_RUNGS)) == DEFAULT_RUNGS


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("3,x", "not STEPS"),
        ("", "not STEPS"),
        ("3x1x2x1", "not STEPS"),
        ("0", "drafts nothing"),
        ("3x2x1", "num_draft_tokens = 1"),
        ("2x0", "topk = 0"),
    ],
)
def test_parse_ladder_refuses_bad_rungs(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_ladder(text)
