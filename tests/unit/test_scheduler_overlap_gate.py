"""Overlap "gated" (gateway/gate.py OverlapGate): speculating rounds run as pipelined groups,
draft-ahead or serial rounds, whichever commits the most tokens per second at the batch size.
The gate keeps serial rounds where a Verify of half the batch costs what one of the whole batch
does (a large memory-bound target), groups where the draft and the verify grow with the batch,
draft-ahead where its guesses hit and the draft costs what the verify does, and the output is
the target's own greedy output across its switches, a verifier restart included, with no KV
left."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from gateway.gate import OverlapGate
from gateway.mode_gate import CUT_ROUNDS, SETTLE
from gateway.request import GenerationRequest
from gateway.scheduler import Scheduler
from inprocess.stack import LocalStack
from specsplit.messages import SpecParams, VerifyInput, VerifyOutput
from tests.support import (
    RestartingVerifier,
    TimedClients,
    generate_all,
    generated_ids,
    make_stack,
    mixed_requests,
    save_tiny_llama,
    target_only_ids,
)

MAX_NEW_TOKENS = 24
WINDOW = 2  # measured rounds per mode: the gate chooses within a short generation
MODES = ("groups", "ahead", "ahead-plain", "serial")  # the overlap gate's
THREE = ("groups", "ahead", "serial")  # the unit tests' gates
CHAIN3 = SpecParams(3, 1, 3)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("overlap_gate")
    return {
        "target": save_tiny_llama(root / "target", seed=0),
        "draft": save_tiny_llama(root / "draft", seed=1, num_layers=1),
    }


def _requests(
    batch_size: int, seed: int, max_new_tokens: int = MAX_NEW_TOKENS
) -> list[GenerationRequest]:
    return mixed_requests(batch_size, seed, max_new_tokens)


def _gated_stack(
    models: dict[str, Path],
    tokenizer: object,
    spec: SpecParams = CHAIN3,
    page_size: int = 16,
    modes: tuple[str, ...] = MODES,
    draft: str = "draft",
    window: int = WINDOW,
) -> LocalStack:
    """A stack whose random draft model is accepted now and then (many rounds a request; draft
    "target": the target drafts, always accepted), its overlap gate choosing among `modes`
    after `window` measured rounds of each."""
    stack = make_stack(
        models["target"],
        "model",
        tokenizer,
        spec,
        draft_dir=models[draft],
        page_size=page_size,
        overlap="gated",
    )
    stack.scheduler.overlap_gate = OverlapGate(modes, window=window, probe_every=1000)
    return stack


def _timed_run(
    stack: LocalStack,
    batch_size: int,
    seed: int,
    max_new_tokens: int = MAX_NEW_TOKENS,
    **delays: float,
) -> tuple[OverlapGate, TimedClients]:
    """`batch_size` requests through a gated stack whose Draft and Verify take `delays`
    (TimedClients' verify_delay, per_seq_delay) more; each request generates its every token."""
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, **delays)
    stack.scheduler.drafter = timed.drafter_client()
    stack.scheduler.verifier = timed.verifier_client()
    out = generate_all(stack, _requests(batch_size, seed, max_new_tokens))  # and no KV is left
    assert all(len(generated_ids(c)) == max_new_tokens for c in out)
    gate = stack.scheduler.overlap_gate
    assert gate is not None
    return gate, timed


def _rates(gate: OverlapGate, batch_size: int) -> dict[str, float | None]:
    return {mode: gate.rate(batch_size, mode) for mode in gate.modes}


def _gauges(batch_bucket: int, modes: tuple[str, ...] = MODES) -> tuple[float | None, ...]:
    """The specsplit_overlap_mode gauge of each of `modes`."""
    return tuple(
        REGISTRY.get_sample_value(
            "specsplit_overlap_mode", {"batch_bucket": str(batch_bucket), "mode": mode}
        )
        for mode in modes
    )


@pytest.mark.parametrize(
    ("spec", "batch_size", "page_size"),
    [(SpecParams(3, 1, 3), 4, 16), (SpecParams(3, 2, 6), 5, 1), (SpecParams(2, 1, 2), 6, 1)],
)
def test_gated_overlap_equals_target_greedy_across_its_switches(
    models, smollm2_tokenizer, spec: SpecParams, batch_size: int, page_size: int
) -> None:
    """Explored groups, then draft-ahead, then serial rounds, then the choice: leaving groups
    commits the group left uncommitted and drops the trees drafted for the other; groups after
    draft-ahead take the trees drafted ahead (trees of topk > 1 draft nothing ahead)."""
    expected = target_only_ids(models["target"], smollm2_tokenizer, _requests(batch_size, 1))
    stack = _gated_stack(models, smollm2_tokenizer, spec, page_size)
    out = generate_all(stack, _requests(batch_size, 1))  # checks that no KV is left
    assert [generated_ids(chunks) for chunks in out] == expected
    gate = stack.scheduler.overlap_gate
    assert gate is not None and gate.num_switches >= 2


def test_gated_overlap_keeps_serial_rounds_where_a_half_batch_verify_costs_a_whole_one(
    models, smollm2_tokenizer
) -> None:
    """Every Verify takes 40 ms whatever its batch (an 8B target at small batches), the draft
    nothing: a group's round commits half the tokens of a serial round in the same time."""
    stack = _gated_stack(models, smollm2_tokenizer, modes=("groups", "serial"))
    gate, _ = _timed_run(stack, 4, seed=2, verify_delay=0.04)
    rates = _rates(gate, 4)
    assert rates["groups"] is not None and rates["serial"] is not None
    assert rates["serial"] > rates["groups"]
    assert gate.mode(4) == "serial"


def test_gated_overlap_keeps_groups_where_draft_and_verify_grow_with_the_batch(
    models, smollm2_tokenizer
) -> None:
    """Draft and Verify each take 10 ms a sequence: a group's Verify hides the other group's
    draft, so groups commit about twice the tokens per second of serial rounds (80 against 44
    here). Draft-ahead is left out: it ran 0.75-0.8x groups here (59-64 tokens/s), close
    enough that one stall of a loaded machine in groups' measured rounds put it ahead (twice in
    two sessions' CI-sized runs, at two and at four rounds a mode). The gate's choice among
    three modes: `test_overlap_gate_explores_each_mode_in_order_then_keeps_the_fastest`."""
    modes = ("groups", "serial")
    stack = _gated_stack(models, smollm2_tokenizer, modes=modes, window=4)
    gate, timed = _timed_run(stack, 4, seed=3, verify_delay=0.0, per_seq_delay=0.01)
    rates = _rates(gate, 4)
    assert None not in rates.values(), rates
    assert gate.mode(4) == "groups", rates
    assert gate.num_switches >= 2  # explored serial rounds, then back
    assert timed.overlapping_drafts() > 0
    assert _gauges(4, modes) == (1, 0)


def test_gated_overlap_drafts_ahead_where_its_guesses_hit(models, smollm2_tokenizer) -> None:
    """One request; the target drafts a chain of 1 for itself (every draft accepted, so every
    outcome is guessed), Draft and Verify 30 ms each: a draft-ahead round hides the Draft
    behind the Verify, a serial round pays both (and one request makes no two groups)."""
    stack = _gated_stack(models, smollm2_tokenizer, SpecParams(1, 1, 1), draft="target")
    gate, timed = _timed_run(stack, 1, 4, 48, verify_delay=0.0, per_seq_delay=0.03)
    rates = _rates(gate, 1)
    assert None not in rates.values(), rates
    assert gate.mode(1).startswith("ahead"), rates  # every outcome guessed: the two alike
    assert stack.scheduler.num_ahead_hits > 0
    assert timed.overlapping_drafts() > 0
    assert _gauges(1) in ((0, 1, 0, 0), (0, 0, 1, 0))


def test_gated_overlap_measures_draft_ahead_without_the_hint(models, smollm2_tokenizer) -> None:
    """With verify ahead (the default) the gate also measures draft-ahead that sends the
    verifier no hint ("ahead-unhinted": where the drafter is the slower service hints come late
    and cost their work). Its rounds send none (counted 'off'), the "ahead" rounds send theirs,
    and the output is the target's greedy output across the switches, with no KV left."""
    plain = make_stack(models["target"], "model", smollm2_tokenizer, CHAIN3, overlap="gated")
    default = plain.scheduler.overlap_gate
    assert default is not None
    assert default.modes == ("groups", "ahead", "ahead-unhinted", "serial")
    clients = (plain.scheduler.drafter, plain.scheduler.verifier)
    unhinted = Scheduler(
        *clients, smollm2_tokenizer, (2,), CHAIN3, overlap="gated", verify_ahead=False
    ).overlap_gate
    assert unhinted is not None and unhinted.modes == ("groups", "ahead", "serial")
    modes = ("ahead", "ahead-unhinted", "serial")
    stack = _gated_stack(
        models, smollm2_tokenizer, SpecParams(1, 1, 1), draft="target", modes=modes
    )
    requests = _requests(1, 7, 48)
    expected = target_only_ids(models["target"], smollm2_tokenizer, requests)
    before = {x: _hints(x) for x in ("sent", "late", "off")}
    flags: set[bool] = set()
    verify = stack.scheduler.verifier.verify

    async def recording(inputs: list[VerifyInput]) -> list[VerifyOutput]:
        flags.update(item.unhinted for item in inputs if item.tree)
        return await verify(inputs)

    stack.scheduler.verifier.verify = recording  # type: ignore[method-assign]
    out = generate_all(stack, requests)
    assert [generated_ids(c) for c in out] == expected
    gate = stack.scheduler.overlap_gate
    assert gate is not None and None not in _rates(gate, 1).values()
    assert _hints("off") > before["off"]  # the unhinted rounds
    # the unhinted rounds' Verify says so (the verifier counts their next rounds "off"); the
    # others' does not
    assert True in flags and False in flags
    assert _hints("sent") + _hints("late") > before["sent"] + before["late"]  # the others
    assert stack.scheduler.num_ahead_hits > 0


def test_gated_overlap_measures_groups_with_and_without_the_early_verify(
    models, smollm2_tokenizer
) -> None:
    """With early_verify (`up`'s default with two GPUs) the gate measures groups with the
    early Verify ("groups-early") and without it ("groups"): on two H100s it ran 1.25x / 1.38x
    groups at batch 8 / 32 with an 8B-shaped target, 0.65x / 0.73x with SmolLM2 and its head in
    one run (1.10x / 1.02x on SmolLM2-shaped random weights in the next).
    Both run, an early Verify goes out in the first, and the output is the target's greedy
    output across the switches, with no KV left."""
    early = make_stack(
        models["target"], "model", smollm2_tokenizer, CHAIN3, overlap="gated", early_verify=True
    )
    gate = early.scheduler.overlap_gate
    assert gate is not None
    assert gate.modes == ("groups-early", "groups", "ahead", "ahead-unhinted", "serial")
    modes = ("groups-early", "groups", "serial")
    stack = _gated_stack(models, smollm2_tokenizer, modes=modes)
    requests = _requests(4, 8, 48)
    expected = target_only_ids(models["target"], smollm2_tokenizer, requests)
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, verify_delay=0.05)
    stack.scheduler.drafter = timed.drafter_client()
    stack.scheduler.verifier = timed.verifier_client()
    out = generate_all(stack, requests)  # and no KV is left
    assert [generated_ids(c) for c in out] == expected
    gate = stack.scheduler.overlap_gate
    assert gate is not None
    rates = _rates(gate, 4)
    assert rates["groups-early"] is not None and rates["groups"] is not None, rates
    assert timed.early_verifies() > 0


@pytest.mark.parametrize("mode", ["groups", "groups-early"])
def test_gated_groups_send_the_early_verify_only_in_groups_early_rounds(
    models, smollm2_tokenizer, mode: str
) -> None:
    """A gate that stays on one groups mode (a window longer than the run): its rounds send
    the other group's Verify early only as "groups-early", whatever the scheduler's
    early_verify (which only adds the mode to the gate's)."""
    stack = _gated_stack(models, smollm2_tokenizer)
    stack.scheduler.early_verify = True
    stack.scheduler.overlap_gate = OverlapGate((mode, "serial"), window=10_000)
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, verify_delay=0.1)
    stack.scheduler.drafter = timed.drafter_client()
    stack.scheduler.verifier = timed.verifier_client()
    out = generate_all(stack, _requests(4, 3))
    assert all(len(generated_ids(c)) == MAX_NEW_TOKENS for c in out)
    assert timed.overlapping_drafts() > 0
    if mode == "groups":
        assert timed.early_verifies() == 0
    else:
        assert timed.early_verifies() >= len(timed.verifies) // 3


@pytest.mark.parametrize("mode", ["groups", "ahead"])
def test_a_batch_that_drafts_nothing_runs_serial_rounds_of_the_whole_batch(
    models, smollm2_tokenizer, mode: str
) -> None:
    """Target-only requests (their own spec of no draft steps) under a gate that would run
    every speculating round as `mode`: nothing to draft, nothing to overlap, so each round
    verifies the whole batch at once (groups would verify half of it a round), the tokens the
    target's, and the gate measures none of these rounds."""
    requests = _requests(4, 9)
    for request in requests:
        request.spec = SpecParams(0, 1, 0)
    expected = target_only_ids(models["target"], smollm2_tokenizer, requests)
    stack = _gated_stack(models, smollm2_tokenizer)
    gate = OverlapGate((mode, "serial"), window=10_000)
    stack.scheduler.overlap_gate = gate
    sizes: list[int] = []
    verify = stack.scheduler.verifier.verify

    async def counted(inputs: list[VerifyInput]) -> list[VerifyOutput]:
        sizes.append(len(inputs))
        return await verify(inputs)

    stack.scheduler.verifier.verify = counted  # type: ignore[method-assign]
    out = generate_all(stack, requests)
    assert [generated_ids(c) for c in out] == expected
    assert len(sizes) == MAX_NEW_TOKENS and all(size == 4 for size in sizes)
    assert gate.mode(4) == mode and gate._bucket(4).rounds_in_mode == 0


@pytest.mark.parametrize("mode", ["groups", "groups-early", "ahead"])
def test_groups_left_when_the_drafting_requests_finish_keep_the_target_tokens(
    models, smollm2_tokenizer, mode: str
) -> None:
    """Speculating requests finish early, target-only ones run on: the rounds leave `mode`
    for serial rounds mid-generation (a group's round in flight committed first), and every
    request's tokens are the target's, with no KV left."""
    requests = _requests(4, 12)
    for i, request in enumerate(requests):
        request.max_new_tokens = 6 if i % 2 else MAX_NEW_TOKENS
        request.spec = CHAIN3 if i % 2 else SpecParams(0, 1, 0)
    expected = target_only_ids(models["target"], smollm2_tokenizer, requests)
    stack = _gated_stack(models, smollm2_tokenizer)
    stack.scheduler.early_verify = mode == "groups-early"
    stack.scheduler.overlap_gate = OverlapGate((mode, "serial"), window=10_000)
    modes: list[str] = []
    round_mode = stack.scheduler._round_mode

    def recorded(speculate: bool) -> str:
        modes.append(round_mode(speculate))
        return modes[-1]

    stack.scheduler._round_mode = recorded  # type: ignore[method-assign]
    out = generate_all(stack, requests)
    assert [generated_ids(c) for c in out] == expected
    assert mode in modes and modes[-1] == "serial"  # left for serial rounds


def _hints(outcome: str) -> float:
    return REGISTRY.get_sample_value("specsplit_hints_total", {"outcome": outcome}) or 0.0


def test_gated_overlap_survives_a_verifier_restart_with_the_same_tokens(
    models, smollm2_tokenizer
) -> None:
    expected = target_only_ids(models["target"], smollm2_tokenizer, _requests(5, 6))
    stack = _gated_stack(models, smollm2_tokenizer)
    restarting = RestartingVerifier.installed(stack, 6)
    out = generate_all(stack, _requests(5, 6))
    assert [generated_ids(c) for c in out] == expected
    assert restarting.calls > 6


def _drive(
    gate: OverlapGate, rounds: int, costs: dict[str, tuple[int, float]], batch_size: int = 8
) -> list[str]:
    """`rounds` rounds at `batch_size`, each committing (tokens, seconds) of its mode; the
    modes the gate gave, in order."""
    modes = []
    for _ in range(rounds):
        mode = gate.mode(batch_size)
        gate.observe_mode(batch_size, mode, *costs[mode])
        modes.append(mode)
    return modes


def test_overlap_gate_explores_each_mode_in_order_then_keeps_the_fastest() -> None:
    """Unit: groups, then draft-ahead, then serial rounds, WINDOW measured rounds each (the
    round after a switch not measured), then the fastest; groups and draft-ahead must beat
    serial rounds by the margin."""
    gate = OverlapGate(THREE, window=3, probe_every=100)
    # a group's round: 8 tokens (half the batch) in 10 ms; draft-ahead 16 in 12.1 ms (1%
    # faster than serial rounds: within the margin); a serial round 16 in 12.2 ms
    costs = {"groups": (8, 10e-3), "ahead": (16, 12.1e-3), "serial": (16, 12.2e-3)}
    modes = _drive(gate, 3 + (SETTLE + 3) * 2 + 5, costs)
    assert modes[:3] == ["groups"] * 3
    assert modes[3 : 3 + SETTLE + 3] == ["ahead"] * (SETTLE + 3)
    assert modes[3 + SETTLE + 3 :] == ["serial"] * (SETTLE + 3 + 5)
    assert _gauges(8, THREE) == (0, 0, 1)


def test_overlap_gate_probes_the_other_modes_in_turn() -> None:
    """Chosen serial rounds, the gate probes groups, then draft-ahead, each after probe_every
    rounds (twice as many after a probe that confirmed the choice); a probe that finds its mode
    faster keeps it."""
    gate = OverlapGate(THREE, window=2, probe_every=4, probe_budget=1.0)  # rounds alone count
    costs = {"groups": (8, 10e-3), "ahead": (16, 14e-3), "serial": (16, 12e-3)}
    _drive(gate, 2 + (SETTLE + 2) * 2, costs)  # explored: serial chosen
    assert gate.mode(8) == "serial"
    probe = _drive(gate, 4 + SETTLE + 2, costs)
    assert probe == ["serial"] * 4 + ["groups"] * (SETTLE + 2)  # the first probe: groups
    assert gate.mode(8) == "serial"
    costs["ahead"] = (16, 6e-3)  # draft-ahead's guesses now hit: twice as fast
    probe = _drive(gate, 8 + SETTLE + 2, costs)  # backed off to 8 rounds, then ahead
    assert probe == ["serial"] * 8 + ["ahead"] * (SETTLE + 2)
    assert gate.mode(8) == "ahead"


def test_overlap_gate_explores_each_batch_size_apart() -> None:
    """Draft-ahead wins at batch 1 and groups at batch 8 (SmolLM2 on two H100s): batch 8, met
    after batch 1 chose, explores for itself instead of taking batch 1's choice, from batch
    1's mode (the likely one where a shrinking batch meets a new bucket in its last rounds),
    then the others in order."""
    gate = OverlapGate(THREE, window=2, probe_every=100)
    explore = 2 + (SETTLE + 2) * 2
    at_one = {"groups": (1, 10e-3), "ahead": (1, 6e-3), "serial": (1, 9e-3)}
    _drive(gate, explore, at_one, batch_size=1)
    assert gate.mode(1) == "ahead"
    at_eight = {"groups": (4, 5e-3), "ahead": (8, 14e-3), "serial": (8, 12e-3)}
    modes = _drive(gate, explore, at_eight)
    assert modes[:2] == ["ahead"] * 2
    assert modes[2:] == ["groups"] * (SETTLE + 2) + ["serial"] * (SETTLE + 2)
    assert gate.mode(8) == "groups" and gate.mode(1) == "ahead"
    assert _gauges(8, THREE) == (1, 0, 0)
    assert _drive(gate, 1, at_eight, batch_size=16) == ["groups"]  # batch 8's choice first


def test_overlap_gate_cuts_a_mode_far_slower_than_one_measured() -> None:
    """Groups explored first commit 16 tokens in 11 ms; draft-ahead's rounds 16 in 53 ms
    (overloaded batch 64 on two H200s, sampled) stop after CUT_ROUNDS measured rounds; serial
    rounds (16 in 20 ms: within CUT of groups) are measured whole; groups chosen."""
    gate = OverlapGate(THREE, window=8, probe_every=100)
    costs = {"groups": (16, 11e-3), "ahead": (16, 53e-3), "serial": (16, 20e-3)}
    modes = _drive(gate, 8 + (SETTLE + CUT_ROUNDS) + (SETTLE + 8) + 3, costs, batch_size=64)
    assert modes[:8] == ["groups"] * 8
    assert modes[8 : 8 + SETTLE + CUT_ROUNDS] == ["ahead"] * (SETTLE + CUT_ROUNDS)
    start = 8 + SETTLE + CUT_ROUNDS
    assert modes[start : start + SETTLE + 8] == ["serial"] * (SETTLE + 8)
    assert modes[start + SETTLE + 8 :] == ["groups"] * 3
    assert gate.rate(64, "ahead") is None and gate.rate(64, "serial") is not None
