"""Prompt lookup in a round's steps on a CUDA device: the engine-level cases of
tests/unit/test_decode_lookup.py with the engines on CUDA graphs (float32). Skipped without a
GPU."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_decode_lookup import (  # noqa: F401  (pytest collects them here)
    target_dir,
    test_lookup_rounds_give_the_tokens_and_kv_of_one_step_rounds,
    test_the_history_holds_the_committed_tokens,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"
