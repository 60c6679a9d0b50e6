"""How many decode steps the verifier runs ahead after a round's last step (AheadDepth): fixed,
or as many as cover the trip between rounds, measured per batch size."""

from __future__ import annotations

import logging

import pytest

from verifier.ahead_depth import (
    CHURN_DEPTH,
    HYSTERESIS,
    MAX_DEPTH,
    MAX_TRIP_NS,
    STABLE_ROUNDS,
    AheadDepth,
)


def test_a_fixed_depth_is_kept_whatever_is_measured() -> None:
    depth = AheadDepth(2)
    assert not depth.auto and AheadDepth().auto  # (the engine measures only for auto)
    depth.observe_trip(8, 5_000_000)
    depth.observe_step(8, 1_000_000)
    assert depth.depth(8) == depth.depth(1) == 2


@pytest.mark.parametrize("fixed", [-1, MAX_DEPTH + 1])
def test_a_depth_out_of_range_is_refused(fixed: int) -> None:
    with pytest.raises(ValueError, match="decode-ahead depth"):
        AheadDepth(fixed)


def test_auto_runs_one_step_until_the_trip_and_a_step_are_measured() -> None:
    depth = AheadDepth()
    assert depth.depth(32) == 1
    depth.observe_trip(32, 2_300_000)
    assert depth.depth(32) == 1  # no step's device time yet (the CPU never has one)
    depth.observe_step(32, 0)
    assert depth.depth(32) == 1
    depth.observe_step(32, 1_100_000)
    assert depth.depth(32) == 3  # ceil(2.3 / 1.1)
    assert depth.depth(8) == 1  # measured per batch size


@pytest.mark.parametrize(
    ("trip_ms", "step_ms", "expected"),
    [(0.2, 0.5, 1), (0.5, 0.5, 1), (0.68, 0.54, 2), (2.2, 1.1, 2), (2.27, 1.14, 2), (9.0, 1.0, 3)],
)
def test_auto_covers_the_trip_with_the_fewest_steps(
    trip_ms: float, step_ms: float, expected: int
) -> None:
    depth = AheadDepth()
    depth.observe_trip(1, round(trip_ms * 1e6))
    depth.observe_step(1, round(step_ms * 1e6))
    assert depth.depth(1) == expected


def test_auto_follows_the_running_means_and_skips_pauses() -> None:
    depth = AheadDepth()
    depth.observe_step(4, 1_000_000)
    depth.observe_trip(4, 900_000)
    assert depth.depth(4) == 1
    depth.observe_trip(4, MAX_TRIP_NS + 1)  # the streams paused: not a trip between rounds
    assert depth.depth(4) == 1
    for _ in range(20):  # the trips grow (more streams' work on the gateway)
        depth.observe_trip(4, 1_800_000)
    assert depth.depth(4) == 2


def test_auto_logs_each_change_of_depth_once(caplog: pytest.LogCaptureFixture) -> None:
    depth = AheadDepth()
    depth.observe_step(32, 1_100_000)
    depth.observe_trip(32, 2_300_000)
    with caplog.at_level(logging.INFO, logger="verifier.ahead_depth"):
        assert [depth.depth(32) for _ in range(3)] == [3, 3, 3]
        depth.observe_trip(32, 0)
        depth.observe_trip(32, 0)
        depth.observe_trip(32, 0)
        assert depth.depth(32) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("decode-ahead depth 3 at 32 sequences: the trip between rounds")
    assert messages[1].startswith("decode-ahead depth 2 at 32 sequences")


def _settle(depth: AheadDepth, trip_ms: float, launch_ms: float, step_ms: float) -> int:
    """The depth at batch 8 once the running means have reached these values."""
    for _ in range(60):
        depth.observe_trip(8, round(trip_ms * 1e6))
        depth.observe_launch(8, round(launch_ms * 1e6))
        depth.observe_step(8, round(step_ms * 1e6))
    return depth.depth(8)


def test_auto_covers_the_next_steps_launch_after_the_trip_too() -> None:
    """A trip shorter than a step still leaves the device idle while the host takes the step
    run ahead and launches the next (fifty-seventh session: trip 1.25 ms, step 1.3 ms at 32
    streams, the GPU busy 0.87-0.90 with one step ahead)."""
    assert _settle(AheadDepth(), trip_ms=0.9, launch_ms=0.0, step_ms=1.0) == 1
    assert _settle(AheadDepth(), trip_ms=0.9, launch_ms=0.4, step_ms=1.0) == 2


def test_auto_keeps_its_depth_while_the_ratio_stays_near_it() -> None:
    """A ratio (trip + launch) / step near an integer flipped the depth round by round; it
    changes only once the ratio leaves the depth's range (d - 1, d] by HYSTERESIS."""
    depth = AheadDepth()
    near = HYSTERESIS / 2
    assert _settle(depth, trip_ms=1.0 + near, launch_ms=0.0, step_ms=1.0) == 1
    assert _settle(depth, trip_ms=1.0 + 2 * HYSTERESIS, launch_ms=0.0, step_ms=1.0) == 2
    assert _settle(depth, trip_ms=1.0 - near, launch_ms=0.0, step_ms=1.0) == 2
    assert _settle(depth, trip_ms=1.0 - 2 * HYSTERESIS, launch_ms=0.0, step_ms=1.0) == 1
    assert _settle(depth, trip_ms=2.5, launch_ms=0.5, step_ms=1.0) == 3


def test_auto_queues_at_most_two_steps_while_batches_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A step run ahead dropped (a sequence joined, left or stopped) caps auto at CHURN_DEPTH
    until STABLE_ROUNDS trips in a row took their step: under arrivals three queued steps cost
    the newcomers that drop them (fifty-eighth session)."""
    depth = AheadDepth()
    assert _settle(depth, trip_ms=2.3, launch_ms=0.7, step_ms=1.1) == 3  # 60 trips: stable
    with caplog.at_level(logging.INFO, logger="verifier.ahead_depth"):
        depth.observe_drop()
        depth.observe_drop()  # (logged once)
    assert depth.depth(8) == CHURN_DEPTH
    assert [r.getMessage() for r in caplog.records] == [
        "decode-ahead depth at most 2: batches change"
    ]
    for _ in range(STABLE_ROUNDS - 1):
        depth.observe_trip(8, 2_300_000)
    assert depth.depth(8) == CHURN_DEPTH
    depth.observe_trip(8, 2_300_000)
    assert depth.depth(8) == 3
    assert AheadDepth(3).depth(8) == 3  # a fixed depth is kept: drops are not even counted
    assert _settle(AheadDepth(), trip_ms=0.9, launch_ms=0.4, step_ms=1.0) == 2  # below: as is
