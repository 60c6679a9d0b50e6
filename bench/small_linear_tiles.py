"""The small-linear kernels' tensor-core tiles swept on SmolLM2-135M's projections (bf16, one GPU):
each op at 8, 16 and 32 rows (decode at batch 8 / 16 / 32) with every tile of the sweep, timed
inside a CUDA graph (R calls a graph, the median replay of many, per call), against the op's
eager plain-torch reference (not the model's unfused layer, whose pointwise kernels are
compiled: no bar) and cuBLAS's GEMM alone (F.linear, the bar) in graphs the same way. The R
calls of a graph read R copies of the weights (70 MB for gate_up, more than an H200's 50 MB of
L2), so each reads its weights from HBM as a model step's layers do; --warm-weights reads one
copy R times (from L2 after the first: the fiftieth session's first sweep). Each tile's result
is checked against the reference first.

    PYTHONPATH=. python bench/small_linear_tiles.py [--rows 8 16 32] [--max-seconds 240]

Prints a table per op and row count, then the one tile with the least time summed over the ops
at each row class (BLOCK_M 16: rows 8 and 16; BLOCK_M 32: rows 32) and over all rows, as lines
`BEST_TILES rows<=16|rows<=32|all BLOCK_N,BLOCK_K,WARPS,STAGES` for
$SPECSPLIT_SMALL_LINEAR_DOT_TILES.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.attention_kernel import time_in_graph
from specsplit.kernels import small_linear as sl
from specsplit.kernels import small_linear_tiles

HIDDEN, INTER, EPS = 576, 1536, 1e-5
QKV = (9 + 2 * 3) * 64  # SmolLM2: 9 query heads, 3 KV heads of 64
DEFAULT = (16, 128, 4, 4)  # tiles_for's tensor-core tiles
CALLS_A_GRAPH = 20
Tile = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, WARPS, STAGES


def sweep_tiles() -> list[Tile]:
    tiles = [
        (block_n, block_k, warps, stages)
        for block_n in (16, 32)
        for block_k in (64, 128, 256)
        for warps, stages in ((4, 2), (4, 4), (8, 3))
    ]
    return tiles if DEFAULT in tiles else [DEFAULT, *tiles]


def make_inputs(
    num_rows: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_rows)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    return {
        "hidden": randn(num_rows, HIDDEN, scale=3.0),
        "norm_weight": 1 + randn(HIDDEN, scale=0.2),
        "qkv": randn(QKV, HIDDEN, scale=HIDDEN**-0.5),
        "attn": randn(num_rows, HIDDEN),
        "o": randn(HIDDEN, HIDDEN, scale=HIDDEN**-0.5),
        "gate_up": randn(2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
        "act": randn(num_rows, INTER),
        "down": randn(HIDDEN, INTER, scale=INTER**-0.5),
    }


# op -> (kernel, reference, its arguments, the GEMM's (x, weight))
Op = tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Any, Any]
OPS: dict[str, Op] = {
    "qkv norm_linear": (
        sl.norm_linear,
        sl.norm_linear_reference,
        lambda t: (t["hidden"], t["norm_weight"], EPS, t["qkv"], None),
        lambda t: (t["hidden"], t["qkv"]),
    ),
    "o linear_residual": (
        sl.linear_residual,
        sl.linear_residual_reference,
        lambda t: (t["attn"], t["o"], None, t["hidden"]),
        lambda t: (t["attn"], t["o"]),
    ),
    "gate_up norm_linear_silu_mul": (
        sl.norm_linear_silu_mul,
        sl.norm_linear_silu_mul_reference,
        lambda t: (t["hidden"], t["norm_weight"], EPS, t["gate_up"], None),
        lambda t: (t["hidden"], t["gate_up"]),
    ),
    "down linear_residual": (
        sl.linear_residual,
        sl.linear_residual_reference,
        lambda t: (t["act"], t["down"], None, t["hidden"]),
        lambda t: (t["act"], t["down"]),
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument(
        "--max-seconds", type=float, default=240.0, help="stop sweeping after this long"
    )
    parser.add_argument(
        "--warm-weights", action="store_true", help="every call of a graph reads one weight copy"
    )
    args = parser.parse_args()
    small_linear_tiles.BROADCAST_ROWS = 4  # the default row classes, whatever the env says
    small_linear_tiles.DOT_ROWS = 32  # BLOCK_M 32 for 17-32 rows (the bench's switch's value)
    deadline = time.monotonic() + args.max_seconds
    tiles = sweep_tiles()
    print(f"{torch.cuda.get_device_name()}, bf16, SmolLM2-135M projections, {len(tiles)} tiles")
    # (rows, op) -> {tile: us}; (rows, op) -> (eager reference us, GEMM us)
    timed: dict[tuple[int, str], dict[Tile, float]] = {}
    baselines: dict[tuple[int, str], tuple[float, float]] = {}
    for num_rows in args.rows:
        inputs = make_inputs(num_rows)
        # a graph's calls: each on its own copy of the inputs (its weights from HBM), or one
        copies = [inputs] * CALLS_A_GRAPH if args.warm_weights else [
            {key: value.clone() for key, value in inputs.items()} for _ in range(CALLS_A_GRAPH)
        ]  # fmt: skip
        for name, (kernel, reference, kernel_args, gemm_args) in OPS.items():
            bound = [kernel_args(copy) for copy in copies]
            want = reference(*bound[0])
            baselines[(num_rows, name)] = (
                time_in_graph([functools.partial(reference, *b) for b in bound], args.replays),
                time_in_graph(
                    [functools.partial(F.linear, *gemm_args(copy)) for copy in copies], args.replays
                ),
            )
            results = timed.setdefault((num_rows, name), {})
            for tile in tiles:
                if time.monotonic() > deadline:
                    break
                small_linear_tiles.DOT_TILES = tile
                try:
                    got = kernel(*bound[0])
                    torch.testing.assert_close(got, want, atol=2e-2, rtol=1.6e-2)
                    calls = [functools.partial(kernel, *b) for b in bound]
                    results[tile] = time_in_graph(calls, args.replays)
                except Exception as e:  # a tile that does not build or fit: reported, skipped
                    print(f"  {name}, {num_rows} rows, tile {tile}: {type(e).__name__}: {e}")
    small_linear_tiles.DOT_TILES = None
    report(timed, baselines, args.rows)


def report(
    timed: dict[tuple[int, str], dict[Tile, float]],
    baselines: dict[tuple[int, str], tuple[float, float]],
    rows: list[int],
) -> None:
    def fmt(tile: Tile) -> str:
        return ",".join(map(str, tile))

    print("\n| op | rows | eager reference us | cuBLAS GEMM alone us | default tile us |"
          " best tile | best us | best / GEMM |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for (num_rows, name), results in timed.items():
        eager, gemm = baselines[(num_rows, name)]
        if not results:
            print(f"| {name} | {num_rows} | {eager:.2f} | {gemm:.2f} | - | (none timed) | | |")
            continue
        best = min(results, key=results.__getitem__)
        default = results.get(DEFAULT, float("nan"))
        print(
            f"| {name} | {num_rows} | {eager:.2f} | {gemm:.2f} | {default:.2f} | {fmt(best)}"
            f" | {results[best]:.2f} | {results[best] / gemm:.2f} |"
        )
    for label, row_class in (("rows<=16", [r for r in rows if r <= 16]),
                             ("rows<=32", [r for r in rows if r > 16]), ("all", rows)):  # fmt: skip
        keys = [key for key in timed if key[0] in row_class]
        if not keys:
            continue
        common = set.intersection(*(set(timed[key]) for key in keys))
        if not common:
            continue
        total = {tile: sum(timed[key][tile] for key in keys) for tile in common}
        best = min(total, key=total.__getitem__)
        gemms = sum(baselines[key][1] for key in keys)
        default = total.get(DEFAULT, float("nan"))
        print(
            f"\n{label}: summed over the ops at rows {row_class}: cuBLAS GEMMs alone {gemms:.1f}"
            f" us, default tile {default:.1f} us, best tile {fmt(best)} {total[best]:.1f} us"
        )
        print(f"BEST_TILES {label} {fmt(best)}")


if __name__ == "__main__":
    main()
