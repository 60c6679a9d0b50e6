"""Self-advancing decode steps on a CUDA device: the engine-level cases of
tests/unit/test_advancing_decode.py with the engines on CUDA graphs (float32), a round's further
steps replayed from AdvancingDecode's graphs. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_advancing_decode import (  # noqa: F401  (pytest collects them here)
    advanced,
    target_dir,
    test_advanced_rounds_give_the_tokens_and_kv_of_one_step_rounds,
    test_no_room_for_every_step_runs_the_round_step_by_step,
    test_rounds_that_do_not_qualify_run_step_by_step,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
