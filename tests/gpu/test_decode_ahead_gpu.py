"""The verifier's decode steps run ahead, on a CUDA device: the engine-level cases of
tests/unit/test_decode_ahead.py with the engines on CUDA graphs (float32), where the step run
ahead is still on the GPU when the next round arrives or is dropped. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_decode_ahead import (  # noqa: F401  (pytest collects them here)
    Driver,
    _engine,
    _release,
    target_dir,
    test_a_draft_ahead_round_without_a_hint_runs_no_step_ahead,
    test_a_newcomer_in_a_round_of_several_steps_joins_past_the_batch_cap,
    test_a_newcomer_writes_the_pages_the_dropped_steps_gave_back,
    test_a_round_whose_sequences_stop_at_different_steps_keeps_the_steps_queued,
    test_a_sequence_joining_takes_the_step_for_the_others,
    test_a_sequence_sitting_out_gets_back_the_draws_of_the_steps_queued_for_it,
    test_a_tree_round_takes_the_step_for_the_sequences_without_a_tree,
    test_another_batch_takes_the_step_unless_none_of_it_is_that_step,
    test_decode_rounds_take_the_step_run_ahead_and_give_the_same_tokens,
    test_each_step_run_ahead_is_reported_once_and_warm_up_is_not,
    test_releasing_or_truncating_another_sequence_keeps_the_step_run_ahead,
    test_sampled_rounds_run_ahead_and_a_dropped_step_gives_its_draws_back,
    test_the_steps_behind_a_rounds_last_step_are_queued_and_taken_in_turn,
    test_truncation_and_refusals_leave_no_step_run_ahead,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"


@pytest.fixture(params=[1, 3], ids=lambda d: f"depth{d}")
def depth(request: pytest.FixtureRequest) -> int:
    """Steps run ahead after a round's last step: one, and the most (each behind the one
    before on the GPU, on the bonus tokens the one before left there)."""
    return int(request.param)


def test_bf16_decode_rounds_give_the_same_tokens_and_kv(target_dir) -> None:  # noqa: F811
    """In bfloat16 (as served) too: the step run ahead is the same graph on the same inputs,
    so tokens and the committed KV are bit for bit those of rounds without it."""
    drivers = []
    for ahead in (False, True):
        engine = _engine(target_dir, ahead, "cuda", dtype=torch.bfloat16, page_size=16)
        driver = Driver(engine)
        driver.begin("a", "b")
        driver.decode("a", "b", rounds=40)
        drivers.append(driver)
    plain, ahead = drivers
    assert ahead.engine.num_ahead_used >= 40
    assert ahead.tokens == plain.tokens
    for seq_id in ("a", "b"):
        assert torch.equal(ahead.kv_rows(seq_id), plain.kv_rows(seq_id))
    _release(plain, ahead)
