"""Which path and tiles a small-linear projection (specsplit/kernels/small_linear.py) of N rows
takes, and the benches' environment switches for them.

Rows are padded to BLOCK_M, a power of two: up to 4 rows the product is a broadcast multiply
(CUDA cores), above that BLOCK_M = 16 rows on tensor cores (tl.dot; 32 rows as one block with the
bench's switch $SPECSPLIT_SMALL_LINEAR_DOT_ROWS=32, its tiles from
$SPECSPLIT_SMALL_LINEAR_DOT_TILES: bench/small_linear_tiles.py sweeps them). A bench's switch,
$SPECSPLIT_SMALL_LINEAR_BROADCAST_ROWS, keeps up to 8, 16 or 32 rows on the broadcast path (and
lets the model's small path take that many: MAX_ROWS, specsplit/model/llama.py). With
programmatic dependent launch, $SPECSPLIT_SMALL_LINEAR_PREFETCH, _PREFETCH_LINES, _PDL_DOT and
_PDL_LATE choose the weights' L2 prefetch (how much of each row) and which launches take it.

Each switch is read from the environment once, at import, into a module global here;
small_linear.py reads those globals at each launch, so a bench (bench/step_ab.py,
bench/small_linear_tiles.py) or a test sets them here at run time.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from specsplit.kernels.triton_jit import next_power_of_2


class Tiles(NamedTuple):
    """A launch's tiling: rows, output columns and K per step of a program; the path."""

    block_m: int
    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int
    num_stages: int


def _rows_switch(name: str, default: str, allowed: tuple[str, ...]) -> int:
    """$name's row count, one of `allowed` (default `default`); anything else stops the
    process."""
    value = os.environ.get(name, default)
    if value not in allowed:
        raise SystemExit(f"{name}={value!r}: one of {', '.join(allowed)}")
    return int(value)


def _broadcast_rows() -> int:
    """$SPECSPLIT_SMALL_LINEAR_BROADCAST_ROWS (a developer's switch, for benches: 1, 2, 4, 8, 16
    or 32; default 4). Up to 4 rows the broadcast path beat the unfused layer on an H100; 5-16
    rows on tensor cores were slower than it there (small_linear.py's docstring), and are
    0.91-0.94x the unfused step on an H200 with RoPE fused in (the default since: `_dot_rows`).
    Above 4 rows the broadcast path loses to the unfused layer (H200, SmolLM2 decode step
    in process: 1.17 / 2.62 / 8.12 ms at batch 8 / 16 / 32 against 1.02 / 1.08 / 1.15 ms;
    bench/RESULTS.md, fiftieth session), so 4 stays the default."""
    return _rows_switch(
        "SPECSPLIT_SMALL_LINEAR_BROADCAST_ROWS", "4", ("1", "2", "4", "8", "16", "32")
    )


BROADCAST_ROWS = _broadcast_rows()  # above this many rows, tensor cores (BLOCK_M 16 or 32)


def _dot_rows() -> int:
    """$SPECSPLIT_SMALL_LINEAR_DOT_ROWS (a developer's switch, for benches: 16 or 32; default
    16): the most rows on the tensor-core path, 17-32 rows as one 32-row block (decode at batch
    17-32). The model's steps take the path up to 16 rows by default (specsplit/model/llama.py:
    0.91-0.94x the unfused decode step at batch 8 on an H200, alternating in one process); at
    32 rows it measured within the spread (bench/step_ab.py, bench/RESULTS.md)."""
    return _rows_switch("SPECSPLIT_SMALL_LINEAR_DOT_ROWS", "16", ("16", "32"))


DOT_ROWS = _dot_rows()  # the tensor-core path's largest row block (BLOCK_M)


def max_rows() -> int:
    """Rows (tokens) a launch takes: decode and verify steps of a small batch (the tensor-core
    path's largest row block, or the broadcast path's limit when that is larger)."""
    return max(DOT_ROWS, BROADCAST_ROWS)


MAX_ROWS = max_rows()  # as the paths are at import


def tiles_for(num_rows: int, n: int, k: int, itemsize: int, interpret: bool) -> Tiles:
    """How a launch of `num_rows` rows x `n` output columns x `k` is cut. On a GPU: narrow
    column tiles, so that there are a few programs per SM (SmolLM2: 144-384) and every weight
    is read in parallel; the broadcast path's K step is one 16-byte load per thread of a tile
    and at most a warp's span (its sums over K stay in the warp); the tensor-core path's K loop
    pipelined 4 deep."""
    use_dot = num_rows > BROADCAST_ROWS
    block_m = max(16, next_power_of_2(num_rows)) if use_dot else next_power_of_2(num_rows)
    if interpret:  # small tiles: the tests cross tile edges with small shapes
        return Tiles(block_m, 16 if use_dot else 8, 32, use_dot, 1, 1)
    if use_dot:
        if DOT_TILES is not None:
            return Tiles(block_m, *DOT_TILES[:2], True, *DOT_TILES[2:])
        return Tiles(block_m, 16, 128, True, 4, 4)
    warp_span = 32 * (16 // itemsize)  # K lanes of one warp's 16-byte loads
    block_n = 8 if n > 1024 and block_m == 1 else 4
    block_k = min(warp_span, 4 * warp_span // (block_m * block_n), next_power_of_2(k))
    return Tiles(block_m, block_n, max(block_k, 32), False, 4, 1)


def _dot_tiles() -> tuple[int, int, int, int] | None:
    """$SPECSPLIT_SMALL_LINEAR_DOT_TILES=BLOCK_N,BLOCK_K,WARPS,STAGES (a developer's switch, for
    benches: the tensor-core path's tiles, powers of two, BLOCK_N and BLOCK_K at least 16, at
    most 256; default unset: 16,128,4,4)."""
    value = os.environ.get("SPECSPLIT_SMALL_LINEAR_DOT_TILES")
    if not value:
        return None
    try:
        block_n, block_k, warps, stages = (int(v) for v in value.split(","))
    except ValueError:
        block_n = block_k = warps = stages = 0  # refused below
    powers = all(v & (v - 1) == 0 for v in (block_n, block_k, warps))
    if not (16 <= block_n <= 256 and 16 <= block_k <= 256 and 1 <= warps <= 16 and powers
            and 1 <= stages <= 8):  # fmt: skip
        raise SystemExit(
            f"SPECSPLIT_SMALL_LINEAR_DOT_TILES={value!r}: BLOCK_N,BLOCK_K,WARPS,STAGES (powers of"
            " two, BLOCK_N and BLOCK_K in 16..256, WARPS in 1..16; STAGES in 1..8)"
        )
    return block_n, block_k, warps, stages


DOT_TILES = _dot_tiles()
# with programmatic dependent launch (triton_jit.pdl): prefetch each program's weight rows to L2
# before waiting for the kernel before ($SPECSPLIT_SMALL_LINEAR_PREFETCH=0: wait first, a bench's
# switch)
PREFETCH = os.environ.get("SPECSPLIT_SMALL_LINEAR_PREFETCH", "1") != "0"


def _prefetch_max_lines() -> int | None:
    """$SPECSPLIT_SMALL_LINEAR_PREFETCH_LINES (a developer's switch, for benches: a power of two;
    unset: whole rows): the prefetch's 128-byte lines a weight row at most, its first ones. A
    whole row is the prefetch of a small model (SmolLM2: 9-24 lines); an 8B's rows are 64-224
    lines, more than L2 holds for all the programs at once."""
    value = os.environ.get("SPECSPLIT_SMALL_LINEAR_PREFETCH_LINES")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1 or int(value) & (int(value) - 1):
        raise SystemExit(f"SPECSPLIT_SMALL_LINEAR_PREFETCH_LINES={value!r}: a power of two")
    return int(value)


PREFETCH_MAX_LINES = _prefetch_max_lines()
# the tensor-core path launches without PDL: with it (and the prefetch) a SmolLM2 decode step at
# batch 8 took 1.15x the step without (H200, bench/step_ab.py, fifty-first session), where the
# broadcast path's took 0.75x at batch 1; $SPECSPLIT_SMALL_LINEAR_PDL_DOT=1 (a bench's switch)
# launches it with PDL too
PDL_ON_TENSOR_CORES = os.environ.get("SPECSPLIT_SMALL_LINEAR_PDL_DOT", "0") == "1"
# with it, $SPECSPLIT_SMALL_LINEAR_PDL_LATE=1 (a bench's switch) lets the kernel after a
# tensor-core launch start only once that launch's K loop is done, not at once (one kernel ahead
# at most, not a cascade of waiting programs: a guess at the slowdown above, not measured)
PDL_TRIGGER_LATE = os.environ.get("SPECSPLIT_SMALL_LINEAR_PDL_LATE", "0") == "1"
