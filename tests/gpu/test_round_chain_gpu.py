"""Hinted rounds chained on the device behind the round in flight, on a CUDA device: the
engine-level cases of tests/unit/test_round_chain.py with the engines on CUDA graphs (float32),
where the chained round's inputs are placed inside the forward's and the acceptance's graph
buffers while the round before it still runs. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_decode_ahead import _engine, _release
from tests.unit.test_round_chain import (  # noqa: F401  (pytest collects them here)
    _run,
    target_dir,
    test_a_hint_for_a_round_the_gpu_is_done_with_launches_after_the_answer,
    test_a_miss_run_plain_is_placed_as_the_plain_round_and_taken,
    test_a_round_accepting_more_than_the_hints_longest_outcome_stays_in_its_room,
    test_a_round_placed_plain_frees_its_reference_trees_room,
    test_an_outcome_not_among_the_hints_drops_only_its_share,
    test_auto_chains_only_where_a_round_outlasts_the_chains_host_work,
    test_chained_rounds_are_taken_and_give_the_same_tokens,
    test_rounds_with_hidden_states_chain_and_give_the_same_rows,
    test_synthetic_acceptance_bends_the_placed_tokens,
    test_the_devices_idle_time_before_a_round_comes_from_its_timestamps,
    test_the_last_chained_round_is_dropped_by_a_release,
    test_trees_of_different_shapes_are_launched_after_the_round,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"


def _variants() -> int:
    """The placement kernels' compiled variants on every device."""
    from specsplit.kernels import place_chain

    kernels = [place_chain._jitted(name, False) for name in ("forward", "accept")]
    return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())


def test_chained_rounds_compile_nothing_after_the_warm_up(target_dir: Path) -> None:  # noqa: F811
    """The engine's warm-up compiles the placement kernels (one variant each, whatever their
    arguments' values and alignments); chained rounds of another page size and tree shape
    compile nothing more (a compile stalls the round for hundreds of ms)."""
    _engine(target_dir, False, "cuda")  # warmed up
    assert _variants() == 2
    # page size 16, two sequences of one-token-shorter trees (eager forward, another layout)
    plain, chained, was_chained = _run(target_dir, "cuda", 2, 16, nodes=2)
    _release(plain, chained)
    assert was_chained == [True, True]
    assert _variants() == 2
