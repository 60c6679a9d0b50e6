"""Self-advancing decode steps on a CUDA device: the engine-level cases of
tests/unit/test_advancing_decode.py with the engines on CUDA graphs (float32), a round's further
steps replayed from AdvancingDecode's graphs. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import verifier.engine as engine_module
from tests.unit.test_advancing_decode import (  # noqa: F401  (pytest collects them here)
    advanced,
    target_dir,
    test_a_failed_launch_of_the_steps_runs_the_round_step_by_step,
    test_a_round_of_two_parts_and_three_sequences_advances,
    test_advanced_rounds_give_the_tokens_and_kv_of_one_step_rounds,
    test_no_room_for_every_step_runs_the_round_step_by_step,
    test_rounds_that_do_not_qualify_run_step_by_step,
    test_the_next_rounds_step_runs_ahead_after_the_advanced_steps,
)
from tests.unit.test_decode_ahead import _engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"


def test_the_switch_builds_captures_and_rehearses_advancing_steps(
    target_dir: Path,  # noqa: F811  (the fixtures imported above)
    monkeypatch: pytest.MonkeyPatch,
    advanced: list[int],  # noqa: F811
) -> None:
    """$SPECSPLIT_ADVANCING_DECODE=1 as the service reads it: the engine makes its advancing
    steps, the warm-up captures a graph per batch bucket and its rehearsal's round of 3 decode
    steps commits 2 from them (bf16, pages of 16, as served)."""
    monkeypatch.setattr(engine_module, "ADVANCING_DECODE", True)
    engine = _engine(target_dir, True, "cuda", dtype=torch.bfloat16, page_size=16)
    assert engine.advancing is not None
    assert sorted(engine.advancing.graphs) == engine.advancing.batch_sizes == [1, 2, 4]
    assert advanced == [2]
    assert engine.num_pages_used == 0 and not engine.seqs
