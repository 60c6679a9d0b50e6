"""Logit rules on a CUDA device: tests/unit/test_verify_rules.py's engine cases with the verifier
on CUDA graphs (float32; the forward's argmax is taken again on the bent rows), decode steps run
ahead where a round allows it (under rules too: their bending counts the token drawn on the
device). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_verify_rules import (  # noqa: F401  (pytest collects them here)
    reference,
    target_dir,
    test_bent_rows_are_the_reference_rows,
    test_decode_steps_under_rules_are_the_targets_greedy_tokens,
    test_each_sequence_is_bent_by_its_own_rules_alone,
    test_logprobs_under_rules_are_the_raw_distribution,
    test_malformed_rules_are_refused,
    test_min_p_draws_only_tokens_likely_enough,
    test_sampled_rounds_draw_from_the_bent_distribution,
    test_speculative_rounds_commit_the_targets_greedy_tokens_under_the_rules,
    test_steps_run_ahead_hold_stop_tokens_back_until_min_tokens,
    truth,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
