"""Two Verify rounds in flight on a CUDA device: the cases of tests/unit/test_verify_pipelined.py
with the engines on CUDA graphs and the greedy acceptance graphs (float32), where the second
round's forward, acceptance and copies are queued behind the first's before it is waited for
(the graphs' shared buffers must not mix the two). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_verify_pipelined import (  # noqa: F401  (pytest collects them here)
    target_dir,
    test_two_groups_in_flight_verify_as_one_after_the_other,
    test_what_may_not_run_beside_a_round_in_flight_is_told,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
