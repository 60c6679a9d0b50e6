"""bench/attention_kernel.py's parts that run without a GPU: `launch_override` changes the
chosen path's key tile, stages and warps only (the other path keeps the wrapper's), turns
PAGES_AHEAD on for its block, and puts everything back after."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import specsplit.kernels.paged_attention as pa
from bench.attention_kernel import SINGLE_SWEEP, launch_override


def test_an_override_changes_its_own_path_only_and_is_undone() -> None:
    single, split = (
        pa._launch_config(128, 4, 1, False, False),
        pa._launch_config(128, 4, 1, True, False),
    )
    with launch_override(False, block_n=64, stages=3, ahead=True, warps=8):
        assert pa._launch_config(128, 4, 1, False, False) == (single[0], 64, 8, 3)
        assert pa._launch_config(128, 4, 1, True, False) == split
        assert pa.PAGES_AHEAD is True
    with launch_override(True, block_n=32):
        assert pa._launch_config(128, 4, 1, True, False) == (split[0], 32, split[2], split[3])
        assert pa._launch_config(128, 4, 1, False, False) == single
        assert pa.PAGES_AHEAD is False
    pa.PAGES_AHEAD = True  # (an A/B's setting left as it is unless the override names it)
    try:
        with launch_override(True, block_n=32):
            assert pa.PAGES_AHEAD is True
        with launch_override(True, ahead=False):
            assert pa.PAGES_AHEAD is False
        assert pa.PAGES_AHEAD is True
    finally:
        pa.PAGES_AHEAD = False
    assert pa._launch_config(128, 4, 1, False, False) == single and pa.PAGES_AHEAD is False


def test_the_sweep_names_say_their_settings() -> None:
    for name, (block_n, stages, ahead, warps) in SINGLE_SWEEP.items():
        assert name.startswith("1/")
        assert ("ahead" in name) == ahead
        assert (block_n is not None) == (f"bn{block_n}" in name)
        assert (warps is not None) == (f"w{warps}" in name)
        assert (stages is not None) == (f"st{stages}" in name)


def test_an_override_of_both_paths() -> None:
    with launch_override(None, stages=3, ahead=True):
        assert pa._launch_config(128, 4, 1, False, False)[3] == 3
        assert pa._launch_config(128, 4, 1, True, False)[3] == 3
        assert pa.PAGES_AHEAD is True
    assert pa.PAGES_AHEAD is False
