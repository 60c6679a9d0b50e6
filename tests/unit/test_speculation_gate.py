"""The speculation gate's choice (gateway/gate.py): per batch size, speculate only while its
rounds commit more tokens per second than plain rounds, measured; explore both modes first,
probe the other mode now and then, ignore the round after a switch."""

from __future__ import annotations

import pytest

from gateway.gate import SpeculationGate
from gateway.mode_gate import CUT_ROUNDS, MAX_BACKOFF, SETTLE


def _run(
    gate: SpeculationGate,
    rounds: int,
    spec: tuple[int, float],
    plain: tuple[int, float],
    batch_size: int = 1,
    most: int | None = None,
) -> list[bool]:
    """`rounds` rounds at `batch_size`, each committing (tokens, seconds) of its mode (a
    speculating one `most` tokens a sequence at best, None: not told); the modes the gate
    gave, in order."""
    modes = []
    for _ in range(rounds):
        speculate = gate.speculate(batch_size)
        tokens, seconds = spec if speculate else plain
        best = None if most is None or not speculate else most * batch_size
        gate.observe(batch_size, speculate, tokens * batch_size, seconds, most=best)
        modes.append(speculate)
    return modes


def test_speculation_that_loses_is_held_back_after_exploring_both() -> None:
    """Speculating commits 2.1 tokens in 7 ms, plain rounds 1 in 2.8 ms (the two-H200 figures):
    window rounds speculating, then plain ones (after the settle round), then plain."""
    gate = SpeculationGate(window=4, probe_every=20)
    modes = _run(gate, 4 + 4 + SETTLE + 10, spec=(2, 7e-3), plain=(1, 2.8e-3))
    assert modes[:4] == [True] * 4
    assert modes[4:] == [False] * (4 + SETTLE + 10)
    spec_rate, plain_rate = gate.rates(1)
    assert spec_rate is not None and plain_rate is not None and spec_rate < plain_rate


def test_speculation_that_pays_keeps_running() -> None:
    gate = SpeculationGate(window=4, probe_every=20)
    # within CUT of each other (750 and 500 tokens/s): each measured a whole window
    modes = _run(gate, 4 + 4 + SETTLE + 15, spec=(3, 4e-3), plain=(1, 2e-3))
    assert modes[:4] == [True] * 4 and modes[4 : 8 + SETTLE] == [False] * (4 + SETTLE)
    assert modes[8 + SETTLE :] == [True] * 15
    assert gate.num_switches == 2


def test_the_other_mode_is_probed_and_a_change_is_followed() -> None:
    """Held back, speculation is tried again every probe_every rounds; once its acceptance
    rose (the prompts changed), the probe finds it pays and it runs from then on."""
    gate = SpeculationGate(window=3, probe_every=10, probe_budget=1.0)  # rounds alone count
    _run(gate, 3 + 3 + SETTLE, spec=(1, 5e-3), plain=(1, 2e-3))  # explored: plain chosen
    modes = _run(gate, 10, spec=(1, 5e-3), plain=(1, 2e-3))
    assert modes == [False] * 10
    probe = _run(gate, SETTLE + 3, spec=(4, 5e-3), plain=(1, 2e-3))
    assert probe == [True] * (SETTLE + 3)  # the probe, then the choice
    assert _run(gate, 5, spec=(4, 5e-3), plain=(1, 2e-3)) == [True] * 5


def test_batch_sizes_choose_apart() -> None:
    """Speculation loses at batch 1 and pays at batch 8: each bucket chooses its own. Batch 1
    explores first and chooses; batch 8, still exploring then, takes that choice until its
    own probe finds speculation paying there."""
    gate = SpeculationGate(window=2, probe_every=4, probe_budget=1.0)
    for _ in range(20):
        _run(gate, 1, spec=(1, 5e-3), plain=(1, 2e-3), batch_size=1)
        _run(gate, 1, spec=(3, 5e-3), plain=(1, 4e-3), batch_size=8)
    assert not gate.speculate(1) and gate.speculate(8)
    assert gate.speculate(5)  # 5-8: batch 8's bucket
    assert not gate.speculate(2)  # met later: the nearest chosen bucket's choice (batch 1's)
    assert [SpeculationGate.bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_a_bucket_left_while_exploring_takes_the_first_choice() -> None:
    """A bucket met before any chose (the services' warm-up at batch 2) and left while still
    exploring does not explore later, when the batch comes back to it (a shrinking batch:
    resuming speculation there would verify every sequence's tokens again): it takes the
    choice of the bucket that chose first."""
    gate = SpeculationGate(window=2, probe_every=50, probe_budget=1.0)
    _run(gate, 1, spec=(1, 5e-3), plain=(1, 2e-3), batch_size=2)  # exploring: speculating
    assert gate.speculate(2)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 5e-3), plain=(1, 2e-3), batch_size=1)
    assert not gate.speculate(1)
    assert _run(gate, 10, spec=(1, 5e-3), plain=(1, 2e-3), batch_size=2) == [False] * 10


def test_speculation_must_beat_plain_by_the_margin() -> None:
    """1% more tokens per second is within noise: plain rounds (they cost no drafter)."""
    gate = SpeculationGate(window=2, probe_every=50, margin=1.03)
    modes = _run(gate, 2 + 2 + SETTLE + 3, spec=(101, 1e-2), plain=(100, 1e-2))
    assert modes[-3:] == [False] * 3


def test_the_round_after_a_switch_is_not_measured() -> None:
    """The first plain round after speculating (an EAGLE drafter's catch-up, the groups
    refilling) is slow; it does not count against plain rounds."""
    gate = SpeculationGate(window=2, probe_every=50)
    _run(gate, 2, spec=(2, 5e-3), plain=(1, 2e-3))
    assert not gate.speculate(1)
    gate.observe(1, False, 1, 1.0)  # the settle round: 1 s
    _run(gate, 2, spec=(2, 5e-3), plain=(1, 2e-3))
    assert not gate.speculate(1)  # chosen from the two measured plain rounds: plain


def test_a_round_of_the_other_mode_is_ignored() -> None:
    """A round measured in a mode the bucket no longer runs (it switched meanwhile) is not
    counted (nor does it move the bucket on)."""
    gate = SpeculationGate(window=2, probe_every=50)
    for _ in range(5):
        gate.observe(1, False, 100, 1e-3)  # plain rounds while the bucket speculates
    assert gate.rates(1) == (None, None) and gate.speculate(1)


def test_a_new_batch_size_starts_from_the_nearest_choice() -> None:
    """A batch that grows or shrinks meets new buckets: they take the nearest chosen bucket's
    choice at once (no exploring, no switch); a larger batch than one where plain rounds won
    probes after probe_every (a smaller one sooner:
    `test_a_smaller_batch_than_a_plain_one_probes_speculation_after_its_window`)."""
    gate = SpeculationGate(window=2, probe_every=6, probe_budget=1.0)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 5e-3), plain=(1, 2e-3), batch_size=16)
    assert not gate.speculate(16)
    switches = gate.num_switches
    assert _run(gate, 5, spec=(1, 5e-3), plain=(1, 2e-3), batch_size=32) == [False] * 5
    assert not gate.speculate(3) and gate.num_switches == switches  # nearest chosen: 16's
    assert gate.rates(32)[0] is not None  # the measurements came along
    assert _run(gate, 1, spec=(1, 5e-3), plain=(1, 2e-3), batch_size=32) == [False]
    assert gate.speculate(32)  # after probe_every rounds of its own: the probe


def test_the_choice_is_a_gauge_per_batch_bucket() -> None:
    """specsplit_speculating{batch_bucket} follows each bucket's choice (the dashboard's)."""
    from prometheus_client import REGISTRY

    def gauge(bucket: int) -> float | None:
        return REGISTRY.get_sample_value("specsplit_speculating", {"batch_bucket": str(bucket)})

    gate = SpeculationGate(window=2, probe_every=50, probe_budget=1.0)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 5e-3), plain=(1, 2e-3), batch_size=64)
    assert gauge(64) == 0
    gate.speculate(100)  # a new bucket takes the nearest choice, and shows it
    assert gauge(128) == 0
    # its probe after 50 rounds finds speculation paying at this batch size
    _run(gate, 50 + SETTLE + 2, spec=(4, 5e-3), plain=(1, 2e-3), batch_size=100)
    assert gate.speculate(100) and gauge(128) == 1 and gauge(64) == 0


def _probe_with_resume(gate: SpeculationGate, resume_seconds: float) -> list[bool]:
    """Plain rounds (2 ms) until the gate probes speculation; the probe's first round verifies
    the features' gap again (`resume_seconds`, not measured: the scheduler's `_gated`), then
    its rounds speculate (1 token in 5 ms) until plain rounds are chosen again and one is
    measured (after the settle round). The modes given, in order."""
    modes = []
    while not gate.speculate(1):
        gate.observe(1, False, 1, 2e-3)
        modes.append(False)
    gate.observe(1, True, 1, resume_seconds, measured=False)
    modes.append(True)
    while gate.speculate(1):
        gate.observe(1, True, 1, 5e-3)
        modes.append(True)
    for _ in range(SETTLE + 1):
        gate.observe(1, False, 1, 2e-3)
        modes.append(False)
    return modes


def test_a_costly_probe_spaces_the_next_out_to_the_budget() -> None:
    """A probe that costs 100 ms (its resume round) waits for 1 / budget x that in plain
    rounds before the next, although probe_every rounds passed long before: probing takes at
    most the budget's share of the time."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=0.05)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 5e-3), plain=(1, 2e-3))  # explored: plain chosen
    first = _probe_with_resume(gate, resume_seconds=0.1)
    # the first probe: its cost not known yet, at least the window's 2 x 5 ms, / the budget
    assert first.index(True) == round(2 * 5e-3 / 0.05 / 2e-3)
    # the probe: its resume round, its rounds speculating, the settle round back in plain
    probe_seconds = 0.1 + (SETTLE + 2) * 5e-3 + SETTLE * 2e-3
    second = _probe_with_resume(gate, resume_seconds=0.1)
    # probe_every doubled on confirmation (20 rounds), but the budget asks for far more: the
    # plain rounds since the switch (the settle round and the closing one included)
    plain_seconds = (SETTLE + 1 + second.index(True)) * 2e-3
    wait = probe_seconds / 0.05
    assert wait - 1e-9 <= plain_seconds <= wait + 2e-3 + 1e-9  # the first round past the wait


def test_a_cheap_probe_waits_for_probe_every_rounds() -> None:
    """Probes that cost little (no resume round) come as often as probe_every allows."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=0.5)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 5e-3), plain=(1, 2e-3))
    _probe_with_resume(gate, resume_seconds=0.0)
    second = _probe_with_resume(gate, resume_seconds=0.0)
    # probe_every doubled: 20 plain rounds in the mode, the settle and closing ones included
    assert second.index(True) == 20 - SETTLE - 1


def test_a_new_bucket_takes_the_nearest_probe_cost() -> None:
    """A batch size met for the first time waits as long as the nearest bucket's probe cost
    asks before its own first probe."""
    gate = SpeculationGate(window=2, probe_every=4, probe_budget=0.1)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 5e-3), plain=(1, 2e-3))
    _probe_with_resume(gate, resume_seconds=0.2)  # ~0.2 s: the next waits ~2 s
    modes = _run(gate, 100, spec=(1, 5e-3), plain=(1, 2e-3), batch_size=2)
    assert modes == [False] * 100  # 0.2 s of rounds: far from 2 s, though past probe_every


def test_one_stalled_round_does_not_decide_the_choice() -> None:
    """Speculation explored first pays (3 tokens in 4 ms against 1 in 2 ms), but its first
    measured round stalls for a second (a kernel built on first use): the window's slowest
    round is left out, so speculation is still chosen; two stalled rounds would decide."""
    gate = SpeculationGate(window=4, probe_every=100)
    gate.observe(1, True, 3, 1.0)  # the stall
    _run(gate, 3, spec=(3, 4e-3), plain=(1, 2e-3))
    modes = _run(gate, 4 + SETTLE + 5, spec=(3, 4e-3), plain=(1, 2e-3))
    assert modes[: 4 + SETTLE] == [False] * (4 + SETTLE) and modes[4 + SETTLE :] == [True] * 5
    assert gate.rates(1)[0] == pytest.approx(9 / 12e-3)  # the three rounds of 4 ms

    stalled_twice = SpeculationGate(window=4, probe_every=100)
    for _ in range(2):
        stalled_twice.observe(1, True, 3, 1.0)
    _run(stalled_twice, 2, spec=(3, 4e-3), plain=(1, 2e-3))
    modes = _run(stalled_twice, 4 + SETTLE + 5, spec=(3, 4e-3), plain=(1, 2e-3))
    assert modes[4 + SETTLE :] == [False] * 5


def test_speculation_that_cannot_win_at_its_best_is_probed_late() -> None:
    """Speculating rounds take 12 ms and could commit 4 tokens at best (a chain of 3 and the
    bonus token): 333 tokens/s even with every draft accepted, against plain rounds' 400. No
    change of acceptance can make it pay, so its first probe waits MAX_BACKOFF x probe_every
    rounds, not probe_every."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=1.0)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 12e-3), plain=(1, 2.5e-3), most=4)  # plain chosen
    assert gate.ceiling(1, "speculating") == pytest.approx(4 / 12e-3)
    modes = _run(gate, MAX_BACKOFF * 10, spec=(1, 12e-3), plain=(1, 2.5e-3), most=4)
    assert modes == [False] * (MAX_BACKOFF * 10)
    assert _run(gate, 1, spec=(1, 12e-3), plain=(1, 2.5e-3), most=4) == [True]


@pytest.mark.parametrize("most", [5, None], ids=["could-win", "best-not-told"])
def test_speculation_that_could_win_at_its_best_is_probed_as_before(most: int | None) -> None:
    """At 5 tokens a round at best (250 tokens/s against plain rounds' 200), or with its best
    not told, speculation that loses now is probed after probe_every rounds: higher
    acceptance could make it pay."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=1.0)
    _run(gate, 2 + 2 + SETTLE, spec=(2, 20e-3), plain=(1, 5e-3), most=most)
    modes = _run(gate, 11, spec=(2, 20e-3), plain=(1, 5e-3), most=most)
    assert modes == [False] * 10 + [True]


def test_a_hopeless_backoff_of_one_probes_as_before() -> None:
    """hopeless_backoff=1 (the scheduler tests that exercise probes): the first probe after
    probe_every rounds, however far speculation is from paying."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=1.0, hopeless_backoff=1)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 12e-3), plain=(1, 2.5e-3), most=4)
    assert _run(gate, 11, spec=(1, 12e-3), plain=(1, 2.5e-3), most=4) == [False] * 10 + [True]


def test_a_larger_batch_than_a_hopeless_one_waits_as_long() -> None:
    """Batch 1 finds speculation unable to win at its best; batch 8, met later, takes that
    choice and waits MAX_BACKOFF x probe_every rounds for its first probe too (a draft's gain
    shrinks as the batch grows). Batch 1, met after a hopeless batch 8, probes speculation once
    its own window is measured (a smaller batch does not know that the plain rounds win)."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=1.0)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 12e-3), plain=(1, 2.5e-3), most=4)
    modes = _run(gate, MAX_BACKOFF * 10, spec=(1, 12e-3), plain=(1, 2.5e-3), batch_size=8, most=4)
    assert modes == [False] * (MAX_BACKOFF * 10)
    assert _run(gate, 1, spec=(1, 12e-3), plain=(1, 2.5e-3), batch_size=8, most=4) == [True]

    smaller = SpeculationGate(window=2, probe_every=10, probe_budget=1.0)
    _run(smaller, 2 + 2 + SETTLE, spec=(1, 12e-3), plain=(1, 2.5e-3), batch_size=8, most=4)
    modes = _run(smaller, 3, spec=(1, 12e-3), plain=(1, 2.5e-3), most=4)
    assert modes == [False] * 2 + [True]


def test_a_slow_round_of_the_modes_own_counts() -> None:
    """Speculation's rounds are lumpy under arrivals (one in four holds a newcomer's prefill
    and its catch-up: 3x a round) while plain rounds pay theirs evenly: the slow rounds are
    speculation's speed, not a stall, and stay in its window. Left out, speculation would
    read 1.25x faster than it runs and win; kept, plain rounds (as fast) win."""
    gate = SpeculationGate(window=4, probe_every=100)
    for seconds in (10e-3, 10e-3, 10e-3, 30e-3):  # 4 x 30 tokens in 60 ms: 2000 tokens/s
        gate.observe(1, True, 30, seconds)
    gate.observe(1, False, 20, 10e-3, measured=True)  # the settle round
    for _ in range(4):
        gate.observe(1, False, 20, 10e-3)  # 2000 tokens/s
    spec_rate, plain_rate = gate.rates(1)
    assert spec_rate == pytest.approx(120 / 60e-3) and plain_rate == pytest.approx(2000)
    assert not gate.speculate(1)  # speculation must beat plain by the margin


def test_a_larger_batch_than_a_speculating_one_probes_plain_after_its_window() -> None:
    """Speculation pays at batch 8; batch 64, met later (a load spike), takes that choice but
    probes plain rounds once its own window is measured, however long the probe wait would be
    (its first probe is all it knows of speculation here), and keeps plain where they win.
    Later probes wait as any bucket's. A smaller batch (8, met after a speculating 64) waits
    probe_every as before."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=0.01)
    _run(gate, 2 + 2 + SETTLE, spec=(3, 4e-3), plain=(1, 3e-3), batch_size=8)
    assert gate.speculate(8)
    # at 64: speculating 2 tokens in 9 ms, plain 1 in 3 ms
    modes = _run(gate, 2 + SETTLE + 2 + 20, spec=(2, 9e-3), plain=(1, 3e-3), batch_size=64)
    assert modes[:2] == [True] * 2 and modes[2:] == [False] * (SETTLE + 2 + 20)
    assert gate.speculate(8)  # batch 8's choice stands
    spec_rate, plain_rate = gate.rates(64)
    assert spec_rate is not None and plain_rate is not None
    assert spec_rate == pytest.approx(2 * 64 / 9e-3)  # its own rounds, not batch 8's

    # where speculation pays there too, it goes back and waits as any bucket for the next
    paying = SpeculationGate(window=2, probe_every=10, probe_budget=0.01)
    _run(paying, 2 + 2 + SETTLE, spec=(3, 4e-3), plain=(1, 3e-3), batch_size=8)
    modes = _run(
        paying, 2 + SETTLE + 2 + SETTLE + 30, spec=(3, 4e-3), plain=(1, 3e-3), batch_size=64
    )
    assert modes[: 2 + SETTLE + 2 + SETTLE] == [True] * 2 + [False] * (SETTLE + 2) + [True] * SETTLE
    assert modes[2 + SETTLE + 2 + SETTLE :] == [True] * 30  # the budget's wait: no probe yet

    smaller = SpeculationGate(window=2, probe_every=10, probe_budget=1.0)
    _run(smaller, 2 + 2 + SETTLE, spec=(3, 4e-3), plain=(1, 3e-3), batch_size=64)
    assert _run(smaller, 10, spec=(3, 4e-3), plain=(1, 3e-3), batch_size=8) == [True] * 10


def test_a_probe_whose_best_is_not_told_keeps_the_hopeless_verdict() -> None:
    """Batch 1 finds speculation unable to win at its best; its later probe runs while the
    overlap gate explores a round kind (the scheduler then tells no round's best) and loses
    again. The verdict stands: batch 8, met after that probe, waits MAX_BACKOFF x probe_every
    rounds for its first probe (two H200s: batch 8 and 32 probed after 96 rounds and paid a
    0.36 s re-verify when the verdict was dropped)."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=1.0)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 12e-3), plain=(1, 2.5e-3), most=4)  # hopeless
    modes = _run(gate, MAX_BACKOFF * 10 + 2 + SETTLE + 1, spec=(1, 12e-3), plain=(1, 2.5e-3))
    assert modes[MAX_BACKOFF * 10 :] == [True] * (2 + SETTLE) + [False]  # the probe, untold
    assert gate.ceiling(1, "speculating") is None
    modes = _run(gate, MAX_BACKOFF * 10, spec=(1, 12e-3), plain=(1, 2.5e-3), batch_size=8)
    assert modes == [False] * (MAX_BACKOFF * 10)


def test_settled_once_chosen_and_not_while_probing() -> None:
    """`settled`: the bucket chose and runs its choice; not while exploring or probing (the
    scheduler then reports no speculating round's best to the speculation gate: a round of an
    overlap kind being explored is not speculation at its best)."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=1.0)
    assert not gate.settled(1)
    _run(gate, 2 + 2 + SETTLE, spec=(1, 5e-3), plain=(1, 2e-3))  # explored: plain chosen
    assert gate.settled(1)
    _run(gate, 10, spec=(1, 5e-3), plain=(1, 2e-3))
    assert gate.speculate(1) and not gate.settled(1)  # the probe


def test_a_choice_is_logged_with_each_modes_batch_and_round_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bucket spans batch sizes up to twice each other: the choice's log line says at which
    batch size and round time each mode was measured (speculating at 40, plain rounds at 64
    here), so that a choice made on unlike windows shows."""
    gate = SpeculationGate(window=4, probe_every=50)
    with caplog.at_level("INFO", logger="gateway.mode_gate"):
        _run(gate, 4, spec=(2, 8e-3), plain=(1, 5e-3), batch_size=40)
        _run(gate, 4 + SETTLE, spec=(2, 8e-3), plain=(1, 5e-3), batch_size=64)
    chosen = [r.getMessage() for r in caplog.records if "tokens/s" in r.getMessage()]
    assert chosen == [
        "speculation gate, batch <= 64: tokens/s speculating 10000.0 (8.0 ms at batch 40), "
        "plain rounds 12800.0 (5.0 ms at batch 64): plain rounds"
    ]


def test_a_smaller_batch_than_a_plain_one_probes_speculation_after_its_window() -> None:
    """Plain rounds win at batch 64 (a load spike); batch 8, met after it (the load falls: two
    H200s, 20 requests a second after 80), takes that choice but probes speculation once its
    own window is measured, however long the probe wait would be, and speculates where that
    pays; later probes wait as any bucket's. A larger batch than a plain one waits as before."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=0.01)
    _run(gate, 2 + 2 + SETTLE, spec=(2, 9e-3), plain=(1, 3e-3), batch_size=64)
    assert not gate.speculate(64)
    modes = _run(gate, 2 + SETTLE + 2 + SETTLE + 30, spec=(3, 4e-3), plain=(1, 3e-3), batch_size=8)
    assert modes[:2] == [False] * 2  # batch 64's choice, its own window measured
    assert modes[2 : 2 + SETTLE + 2] == [True] * (SETTLE + 2)  # the early probe
    assert modes[2 + SETTLE + 2 :] == [True] * (SETTLE + 30)  # chosen; the budget's wait
    assert not gate.speculate(64)  # batch 64's choice stands
    spec_rate, plain_rate = gate.rates(8)
    assert spec_rate == pytest.approx(3 * 8 / 4e-3) and plain_rate == pytest.approx(8 / 3e-3)

    larger = SpeculationGate(window=2, probe_every=10, probe_budget=1.0)
    _run(larger, 2 + 2 + SETTLE, spec=(2, 9e-3), plain=(1, 3e-3), batch_size=8)
    assert _run(larger, 10, spec=(3, 4e-3), plain=(1, 3e-3), batch_size=64) == [False] * 10


def test_buckets_exploring_when_a_larger_one_chooses_plain_all_probe_early() -> None:
    """Batches 1 to 16 were met while the load rose (each still exploring: too few rounds);
    batch 64 then chooses plain rounds and every exploring bucket takes its choice, the smaller
    ones from each other in turn: each still probes speculation once its own window is
    measured (two H200s: batch 1 did, batches 8 and 16, which took the choice from a smaller
    bucket that had taken it from 64, waited 200-235 rounds, 4.7 s)."""
    gate = SpeculationGate(window=2, probe_every=50, probe_budget=0.01)
    for batch in (1, 2, 4, 8, 16):
        _run(gate, 1, spec=(3, 4e-3), plain=(1, 3e-3), batch_size=batch)
    _run(gate, 2 + 2 + SETTLE, spec=(2, 9e-3), plain=(1, 3e-3), batch_size=64)
    assert not gate.speculate(64)
    for batch in (1, 2, 4, 8, 16):
        assert not gate.speculate(batch)  # batch 64's choice
    for batch in (16, 8, 1):
        modes = _run(gate, 2 + SETTLE + 2, spec=(3, 4e-3), plain=(1, 3e-3), batch_size=batch)
        assert True in modes[: 2 + SETTLE + 1], (batch, modes)


def test_a_mode_explored_at_under_half_the_measured_rate_is_cut_after_three_rounds() -> None:
    """Speculation explored first commits 3 tokens in 4 ms (750 tokens/s); plain rounds at 1 in
    3 ms (333) commit under half of it: they stop after CUT_ROUNDS measured rounds (not a
    window) and speculation is chosen; plain rounds keep no rate (their window unfilled)."""
    gate = SpeculationGate(window=8, probe_every=100)
    modes = _run(gate, 8 + SETTLE + CUT_ROUNDS + 5, spec=(3, 4e-3), plain=(1, 3e-3))
    assert modes[:8] == [True] * 8
    assert modes[8 : 8 + SETTLE + CUT_ROUNDS] == [False] * (SETTLE + CUT_ROUNDS)
    assert modes[8 + SETTLE + CUT_ROUNDS :] == [True] * 5
    assert gate.rates(1) == (pytest.approx(750.0), None)


def test_a_probe_at_under_half_the_chosen_rate_stops_after_three_rounds() -> None:
    """Chosen plain rounds (1 token in 2 ms, 500 tokens/s); the probe of speculation finds 1
    token in 5 ms (200): it stops after CUT_ROUNDS measured rounds and plain rounds run
    again; a probe within CUT of the choice runs its whole window."""
    gate = SpeculationGate(window=4, probe_every=10, probe_budget=1.0)  # rounds alone count
    _run(gate, 4 + 4 + SETTLE, spec=(1, 3e-3), plain=(1, 2e-3))  # explored: plain chosen
    assert gate.speculate(1) is False
    modes = _run(gate, 10 + SETTLE + CUT_ROUNDS + 3, spec=(1, 5e-3), plain=(1, 2e-3))
    assert modes == [False] * 10 + [True] * (SETTLE + CUT_ROUNDS) + [False] * 3
    # the probe confirmed plain rounds: the next after 20 rounds (3 of them run above)
    modes = _run(gate, 17 + SETTLE + 4 + 2, spec=(1, 3e-3), plain=(1, 2e-3))  # 333 vs 500
    assert modes == [False] * 17 + [True] * (SETTLE + 4) + [False] * 2


def test_a_cut_probe_reads_no_rounds_taken_from_another_bucket() -> None:
    """Batch 64 speculates (3 tokens in 10 ms against plain rounds' 1 in 5 ms); batch 8 takes
    its choice and its rounds, speculates at 6000 tokens/s of its own, and probes plain rounds
    at 2667: cut after CUT_ROUNDS. Their window holds those 3 rounds only, not batch 64's
    (which read 12800 tokens/s mixed in: plain rounds would have won), so speculation stays."""
    gate = SpeculationGate(window=4, probe_every=10, probe_budget=1.0)
    _run(gate, 4 + SETTLE + 4 + SETTLE, spec=(3, 10e-3), plain=(1, 5e-3), batch_size=64)
    assert gate.speculate(64)
    modes = _run(gate, 10 + SETTLE + CUT_ROUNDS + 5, spec=(3, 4e-3), plain=(1, 3e-3), batch_size=8)
    assert modes == [True] * 10 + [False] * (SETTLE + CUT_ROUNDS) + [True] * 5
    assert gate.rates(8) == (pytest.approx(3 * 8 / 4e-3), None)
    assert gate.rates(64)[1] == pytest.approx(64 / 5e-3)  # batch 64's own stay there


def test_a_probe_waits_for_the_chosen_modes_own_window() -> None:
    """Batch 8, exploring, takes batch 64's plain rounds with a switch (a settle round) and
    probes speculation early: only once plain rounds filled a window of their own at batch 8,
    so that the probe is weighed against them (plain 2667 tokens/s against 2000) and plain
    rounds stay; a window still short of its own rounds would have let speculation win unseen."""
    gate = SpeculationGate(window=2, probe_every=10, probe_budget=1.0)
    _run(gate, 1, spec=(1, 4e-3), plain=(1, 3e-3), batch_size=8)  # exploring: speculating
    _run(gate, 2 + SETTLE + 2, spec=(2, 9e-3), plain=(1, 3e-3), batch_size=64)
    assert not gate.speculate(64)  # 64 chose plain rounds; 8 took that with a switch
    modes = _run(gate, SETTLE + 2 + SETTLE + 2 + 4, spec=(1, 4e-3), plain=(1, 3e-3), batch_size=8)
    assert modes == [False] * (SETTLE + 2) + [True] * (SETTLE + 2) + [False] * 4
    assert gate.rates(8) == (pytest.approx(8 / 4e-3), pytest.approx(8 / 3e-3))
