"""A guide's masks on a CUDA device: tests/unit/test_verify_guide.py's cases with the verifier on
CUDA graphs (float32; the masked rows bit for bit the reference's, the forward's argmax taken
again on them). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_verify_guide import (  # noqa: F401  (pytest collects them here)
    reference,
    target_dir,
    test_a_guided_round_takes_one_decode_step,
    test_guided_rounds_commit_the_targets_greedy_tokens_under_the_masks,
    test_malformed_masks_are_refused,
    test_masked_rows_are_the_reference_rows,
    test_sampled_guided_rounds_draw_only_allowed_tokens,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
