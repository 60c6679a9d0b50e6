"""The verifier's rounds run ahead on the gateway's hints, on a CUDA device: the engine-level cases
of tests/unit/test_round_ahead.py with the engines on CUDA graphs (float32), where the round run
ahead is still on the GPU when the next round arrives or is dropped. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_round_ahead import (  # noqa: F401  (pytest collects them here)
    target_dir,
    test_a_hint_after_its_round_finished_launches_the_next_round_if_none_started,
    test_a_hint_for_another_round_or_refused_runs_nothing,
    test_a_round_other_than_the_hinted_one_drops_it,
    test_a_round_taken_in_part_gives_each_sequence_its_own_hidden_states,
    test_each_round_with_none_run_ahead_after_it_is_counted_by_why,
    test_hinted_rounds_are_taken_and_give_the_same_tokens,
    test_hinted_sequences_run_no_decode_step_ahead_until_their_hints_stop,
    test_release_or_truncation_drops_the_round_run_ahead,
    test_rounds_launched_after_the_answer_are_taken_and_give_the_same_tokens,
    test_the_device_waits_between_rounds_only_where_nothing_ran_ahead,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
