"""The verifier's decode steps run ahead, on a CUDA device: the engine-level cases of
tests/unit/test_decode_ahead.py with the engines on CUDA graphs (float32), where the step run
ahead is still on the GPU when the next round arrives or is dropped. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from tests.unit.test_decode_ahead import (  # noqa: F401  (pytest collects them here)
    Driver,
    _release,
    target_dir,
    test_a_tree_round_after_decode_drops_the_step_run_ahead,
    test_another_batch_drops_the_step_run_ahead_unless_sequences_only_left,
    test_decode_rounds_take_the_step_run_ahead_and_give_the_same_tokens,
    test_each_step_run_ahead_is_reported_once_and_warm_up_is_not,
    test_releasing_or_truncating_another_sequence_keeps_the_step_run_ahead,
    test_sampled_rounds_run_ahead_and_a_dropped_step_gives_its_draws_back,
    test_truncation_and_refusals_leave_no_step_run_ahead,
)
from verifier.engine import VerifierEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"


def test_bf16_decode_rounds_give_the_same_tokens_and_kv(target_dir) -> None:  # noqa: F811
    """In bfloat16 (as served) too: the step run ahead is the same graph on the same inputs,
    so tokens and the committed KV are bit for bit those of rounds without it."""
    drivers = []
    for ahead in (False, True):
        model, config = load_model(str(target_dir), dtype=torch.bfloat16, device="cuda")
        kv = make_kv_cache(config, 64, 16, torch.bfloat16, "cuda")
        engine = VerifierEngine(
            model,
            kv,
            config.max_position_embeddings,
            config.vocab_size,
            graph_query_lens=(1, 4),
            max_batch_size=4,
            decode_ahead=ahead,
        )
        engine.warmup()  # fmt: skip
        driver = Driver(engine)
        driver.begin("a", "b")
        driver.decode("a", "b", rounds=40)
        drivers.append(driver)
    plain, ahead = drivers
    assert ahead.engine.num_ahead_used >= 40
    assert ahead.tokens == plain.tokens
    for seq_id in ("a", "b"):
        assert torch.equal(ahead.kv_rows(seq_id), plain.kv_rows(seq_id))
    _release(plain, ahead)
