"""Rounds of several decode steps on a CUDA device: the engine-level cases of
tests/unit/test_decode_steps.py with the engines on CUDA graphs (float32), the steps run ahead
still on the GPU when the next step of the round takes them. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_decode_steps import (  # noqa: F401  (pytest collects them here)
    target_dir,
    test_a_round_of_steps_gives_the_tokens_and_kv_of_one_step_rounds,
    test_a_rounds_own_steps_run_ahead_past_the_batch_limit,
    test_a_step_with_no_room_ends_the_round_where_it_is,
    test_bad_decode_steps_are_refused_and_change_nothing,
    test_sampled_steps_draw_as_one_step_rounds,
    test_the_device_idle_time_before_a_rounds_further_steps_is_reported_apart,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
