"""A first round's prompt log-probabilities on a CUDA device:
tests/unit/test_verify_prompt_logprobs.py's engine cases with the verifier on CUDA graphs
(float32). Not run on a GPU yet (written in the eightieth session, its GPU time spent). Skipped
without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_verify_logprobs import reference, target_dir  # noqa: F401  (fixtures)
from tests.unit.test_verify_prompt_logprobs import (  # noqa: F401  (pytest collects them here)
    test_a_one_token_prompt_has_no_entries,
    test_prompt_logprobs_are_the_full_forwards,
    test_prompt_logprobs_out_of_range_or_past_the_first_round_refused,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
