"""The verifier's decode steps run ahead, on a CUDA device: the engine-level cases of
tests/unit/test_decode_ahead.py with the engines on CUDA graphs (float32), where the step run
ahead is still on the GPU when the next round arrives or is dropped. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_decode_ahead import (  # noqa: F401  (pytest collects them here)
    target_dir,
    test_a_tree_round_after_decode_drops_the_step_run_ahead,
    test_another_batch_drops_the_step_run_ahead,
    test_decode_rounds_take_the_step_run_ahead_and_give_the_same_tokens,
    test_sampled_rounds_run_nothing_ahead,
    test_truncation_and_refusals_leave_no_step_run_ahead,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
