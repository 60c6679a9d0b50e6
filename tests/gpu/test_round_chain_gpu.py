"""Hinted rounds chained on the device behind the round in flight, on a CUDA device: the
engine-level cases of tests/unit/test_round_chain.py with the engines on CUDA graphs (float32),
where the chained round's inputs are placed inside the forward's and the acceptance's graph
buffers while the round before it still runs. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_round_chain import (  # noqa: F401  (pytest collects them here)
    target_dir,
    test_an_outcome_not_among_the_hints_drops_only_its_share,
    test_chained_rounds_are_taken_and_give_the_same_tokens,
    test_synthetic_acceptance_bends_the_placed_tokens,
    test_the_devices_idle_time_before_a_round_comes_from_its_timestamps,
    test_the_last_chained_round_is_dropped_by_a_release,
    test_trees_of_different_shapes_are_launched_after_the_round,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
