"""Two Verify rounds in flight on a CUDA device: the cases of tests/unit/test_verify_pipelined.py
with the engines on CUDA graphs and the greedy acceptance graphs (float32), where the second
round's forward, acceptance and copies are queued behind the first's before it is waited for
(the graphs' shared buffers must not mix the two); and a round's device time. Skipped without a
GPU."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.tree import DraftTree
from tests.unit.test_decode_ahead import _engine
from tests.unit.test_verify_pipelined import (  # noqa: F401  (pytest collects them here)
    target_dir,
    test_two_groups_in_flight_verify_as_one_after_the_other,
    test_what_may_not_run_beside_a_round_in_flight_is_told,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"


def test_a_rounds_device_time_is_its_gpu_work_and_its_further_steps_add_theirs(
    target_dir: Path,  # noqa: F811
) -> None:
    """VerifyRound.device_ns on CUDA (CUDA events, the part of the gateway's round the
    verifier's GPU took): > 0 and within the round's launch-to-finish wall; a round of four
    decode steps counts each step's, more than a one-step round's."""
    engine = _engine(target_dir, decode_ahead=False, device="cuda")
    prompt = [5, 9, 11, 3, 7, 2]

    def timed(inputs: list[VerifyInput]) -> tuple[list[VerifyOutput], int, int]:
        start = time.perf_counter_ns()
        launched = engine.launch(inputs)
        outputs = engine.finish(launched)
        return outputs, launched.device_ns, time.perf_counter_ns() - start

    (out,), device_ns, wall_ns = timed([VerifyInput("a", True, 0, prompt, DraftTree())])
    assert 0 < device_ns <= wall_ns
    one = []
    for _ in range(3):
        step = VerifyInput("a", False, out.kv_committed_len, [out.bonus_token], DraftTree())
        (out,), device_ns, wall_ns = timed([step])
        assert 0 < device_ns <= wall_ns
        one.append(device_ns)
    step = VerifyInput("a", False, out.kv_committed_len, [out.bonus_token], DraftTree())
    step.decode_steps = 4
    (out,), four, wall_ns = timed([step])
    assert len(out.decoded_tokens) == 3
    assert min(one) < four <= wall_ns
    engine.release(["a"])
