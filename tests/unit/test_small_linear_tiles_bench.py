"""bench/small_linear_tiles.py's parts that run without a GPU: its ops' arguments bind to the
kernels and their references (which agree, float32 under the Triton interpreter), its sweep's
tiles are ones $SPECSPLIT_SMALL_LINEAR_DOT_TILES accepts, and its report names the best tile per
row class from the timings."""

from __future__ import annotations

import pytest
import torch

from bench import small_linear_tiles as bench
from specsplit.kernels import small_linear_tiles

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


@pytest.mark.parametrize("num_rows", [9])
@pytest.mark.parametrize("op", list(bench.OPS))
def test_each_op_binds_and_matches_its_reference(op: str, num_rows: int) -> None:
    kernel, reference, kernel_args, gemm_args = bench.OPS[op]
    inputs = bench.make_inputs(num_rows, device="cpu", dtype=torch.float32)
    want = reference(*kernel_args(inputs))
    torch.testing.assert_close(kernel(*kernel_args(inputs)), want, atol=1e-4, rtol=1e-4)
    x, weight = gemm_args(inputs)
    assert x.shape == (num_rows, weight.shape[1])


def test_the_sweep_holds_the_default_and_only_tiles_the_switch_accepts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiles = bench.sweep_tiles()
    assert bench.DEFAULT in tiles and len(set(tiles)) == len(tiles)
    for tile in tiles:
        monkeypatch.setenv("SPECSPLIT_SMALL_LINEAR_DOT_TILES", ",".join(map(str, tile)))
        assert small_linear_tiles._dot_tiles() == tile


def test_the_report_names_the_best_tile_per_row_class(capsys: pytest.CaptureFixture[str]) -> None:
    fast, slow = (32, 64, 4, 2), bench.DEFAULT
    timed = {
        (8, "o"): {fast: 2.0, slow: 3.0},
        (16, "o"): {fast: 2.5, slow: 3.0},
        (32, "o"): {fast: 5.0, slow: 4.0},  # the default wins at 32 rows
    }
    baselines = {key: (6.0, 3.5) for key in timed}
    bench.report(timed, baselines, [8, 16, 32])
    lines = capsys.readouterr().out.splitlines()
    best = {line.split()[1]: line.split()[2] for line in lines if line.startswith("BEST_TILES")}
    # all: 9.5 us against 10.0
    assert best == {"rows<=16": "32,64,4,2", "rows<=32": "16,128,4,4", "all": "32,64,4,2"}
