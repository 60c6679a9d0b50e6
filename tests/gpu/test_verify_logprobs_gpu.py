"""Log-probabilities of a round's new tokens on a CUDA device: tests/unit/test_verify_logprobs.py's
engine cases with the verifier on CUDA graphs (float32), decode steps run ahead where a round
allows it. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_verify_logprobs import (  # noqa: F401  (pytest collects them here)
    reference,
    target_dir,
    test_asking_changes_no_token_and_only_askers_get_them,
    test_decode_steps_round_has_every_steps_logprobs,
    test_decode_steps_run_ahead_carry_the_askers_logprobs,
    test_logprobs_out_of_range_refused,
    test_sampled_round_logprobs_are_the_raw_distribution,
    test_tree_round_logprobs_are_the_full_forwards,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
