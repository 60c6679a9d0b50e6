"""Overlap "gated" (gateway/gate.py OverlapGate): speculating rounds run as pipelined groups or
as serial rounds, whichever commits more tokens per second at the batch size. The gate keeps
serial rounds where a Verify of half the batch costs what one of the whole batch does (a large
memory-bound target), keeps groups where the draft and the verify grow with the batch, and the
output is the target's own greedy output across its switches, a verifier restart included,
with no KV left."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from gateway.gate import SETTLE, OverlapGate
from gateway.request import GenerationRequest
from inprocess.stack import LocalStack
from specsplit.messages import SpecParams
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


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("overlap_gate")
    return {
        "target": save_tiny_llama(root / "target", seed=0),
        "draft": save_tiny_llama(root / "draft", seed=1, num_layers=1),
    }


def _requests(batch_size: int, seed: int) -> list[GenerationRequest]:
    return mixed_requests(batch_size, seed, MAX_NEW_TOKENS)


def _gated_stack(
    models: dict[str, Path], tokenizer: object, spec: SpecParams, page_size: int = 16
) -> LocalStack:
    """A stack whose random draft model is accepted now and then (many rounds a request), its
    overlap gate choosing after WINDOW measured rounds of each mode."""
    stack = make_stack(
        models["target"],
        "model",
        tokenizer,
        spec,
        draft_dir=models["draft"],
        page_size=page_size,
        overlap="gated",
    )
    stack.scheduler.overlap_gate = OverlapGate(window=WINDOW, probe_every=1000)
    return stack


def _timed_run(
    models: dict[str, Path], tokenizer: object, seed: int, **delays: float
) -> tuple[OverlapGate, TimedClients]:
    """Four requests through a gated stack whose Draft and Verify take `delays` (TimedClients'
    verify_delay, per_seq_delay) more; each request generates its every token."""
    stack = _gated_stack(models, tokenizer, SpecParams(3, 1, 3))
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, **delays)
    stack.scheduler.drafter = timed.drafter_client()
    stack.scheduler.verifier = timed.verifier_client()
    out = generate_all(stack, _requests(4, seed))
    assert all(len(generated_ids(c)) == MAX_NEW_TOKENS for c in out)
    gate = stack.scheduler.overlap_gate
    assert gate is not None
    return gate, timed


def _gauge(batch_bucket: int) -> float | None:
    return REGISTRY.get_sample_value(
        "specsplit_pipelined_groups", {"batch_bucket": str(batch_bucket)}
    )


@pytest.mark.parametrize(
    ("spec", "batch_size", "page_size"),
    [(SpecParams(3, 1, 3), 4, 16), (SpecParams(3, 2, 6), 5, 1), (SpecParams(2, 1, 2), 6, 1)],
)
def test_gated_overlap_equals_target_greedy_across_its_switches(
    models, smollm2_tokenizer, spec: SpecParams, batch_size: int, page_size: int
) -> None:
    """Explored groups first, then serial rounds, then the choice: the switch from groups to
    serial commits the group left uncommitted and drops the trees drafted for the other."""
    expected = target_only_ids(models["target"], smollm2_tokenizer, _requests(batch_size, 1))
    stack = _gated_stack(models, smollm2_tokenizer, spec, page_size)
    out = generate_all(stack, _requests(batch_size, 1))  # checks that no KV is left
    assert [generated_ids(chunks) for chunks in out] == expected
    gate = stack.scheduler.overlap_gate
    assert gate is not None and gate.num_switches >= 1


def test_gated_overlap_keeps_serial_rounds_where_a_half_batch_verify_costs_a_whole_one(
    models, smollm2_tokenizer
) -> None:
    """Every Verify takes 40 ms whatever its batch (an 8B target at small batches), the draft
    nothing: a group's round commits half the tokens of a serial round in the same time."""
    gate, _ = _timed_run(models, smollm2_tokenizer, seed=2, verify_delay=0.04)
    groups_rate, serial_rate = gate.rates(4)
    assert groups_rate is not None and serial_rate is not None and serial_rate > groups_rate
    assert not gate.groups(4)
    assert _gauge(4) == 0


def test_gated_overlap_keeps_groups_where_draft_and_verify_grow_with_the_batch(
    models, smollm2_tokenizer
) -> None:
    """Draft and Verify each take 10 ms a sequence: a group's Verify hides the other group's
    draft, so groups commit about twice the tokens per second of serial rounds."""
    gate, timed = _timed_run(
        models, smollm2_tokenizer, seed=3, verify_delay=0.0, per_seq_delay=0.01
    )
    groups_rate, serial_rate = gate.rates(4)
    assert groups_rate is not None and serial_rate is not None and groups_rate > serial_rate
    assert gate.groups(4)
    assert gate.num_switches >= 2  # explored serial rounds, then back to groups
    assert timed.overlapping_drafts() > 0
    assert _gauge(4) == 1


def test_gated_overlap_survives_a_verifier_restart_with_the_same_tokens(
    models, smollm2_tokenizer
) -> None:
    expected = target_only_ids(models["target"], smollm2_tokenizer, _requests(5, 6))
    stack = _gated_stack(models, smollm2_tokenizer, SpecParams(3, 1, 3))
    restarting = RestartingVerifier(stack.scheduler.verifier, stack.verifier, fail_at=6)
    stack.scheduler.verifier = restarting
    out = generate_all(stack, _requests(5, 6))
    assert [generated_ids(c) for c in out] == expected
    assert restarting.calls > 6


def test_overlap_gate_explores_groups_first_then_keeps_the_faster() -> None:
    """Unit: groups (explored first) must beat serial rounds by the margin; rounds after a
    switch are not measured."""
    gate = OverlapGate(window=3, probe_every=100)
    modes = []
    for _ in range(3 + 3 + SETTLE + 5):
        groups = gate.groups(8)
        # a group's round: 8 tokens in 10 ms (half the batch); a serial round: 16 in 12 ms
        gate.observe(8, groups, *((8, 10e-3) if groups else (16, 12e-3)))
        modes.append(groups)
    assert modes[:3] == [True] * 3
    assert modes[3:] == [False] * (3 + SETTLE + 5)
    assert _gauge(8) == 0
