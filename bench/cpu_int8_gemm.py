"""The CPU's two routes for a GGUF's 4-bit matrices, over the embedded default's 30 layers of
projections (random Q4_1 blocks at its shapes, ~80 MB: more than the caches hold, as in a
step): the packed float32 route (cpu_gemm.c's `quant_gemm`, kind 1) against the 8-bit panels
(kind 5, x as two 8-bit parts) on AMX's tiles (`int8_gemm`) and on AVX-512 VNNI (`vnni_gemm`,
the same bits), and on VNNI with float16 scales (kind 7, the same bits, 0.83x the bytes), each
pass's median ms in turn in one process, and each / the float32 route's.
Needs a CPU with either.

    PYTHONPATH=. python bench/cpu_int8_gemm.py [--rows 1 4 16] [--turns 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gguf import GGMLQuantizationType

from specsplit.model import cpu_gemm, cpu_quant

HIDDEN, INTERMEDIATE, KV, LAYERS = 576, 1536, 192, 30  # the embedded SmolLM2-135M's
# each layer's matrices [out, in]: q, k, v, o, gate, up, down
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
SHAPES += [(INTERMEDIATE, HIDDEN)] * 2 + [(HIDDEN, INTERMEDIATE)]


def q4_1(rows: int, cols: int, gen: torch.Generator) -> cpu_quant.Packed:
    """Random Q4_1 blocks (small positive d, negative m, any nibbles), packed (kind 1)."""
    blocks = cols // cpu_quant.BLOCK
    raw = torch.randint(0, 256, (rows, blocks, 20), dtype=torch.uint8, generator=gen)
    d = torch.rand(rows, blocks, generator=gen) * 0.01 + 0.001
    m = -torch.rand(rows, blocks, generator=gen) * 0.05
    raw[..., 0:2] = d.half().view(torch.uint8).reshape(rows, blocks, 2)
    raw[..., 2:4] = m.half().view(torch.uint8).reshape(rows, blocks, 2)
    return cpu_quant.pack(GGMLQuantizationType.Q4_1, raw.reshape(rows, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--turns", type=int, default=20, help="timed passes of each route")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_gemm.library()
    if lib is None or not lib.int8_ready:
        raise SystemExit("this CPU has neither AMX's 8-bit tiles nor AVX-512 VNNI (or no compiler)")
    # (name, which matrix of a triple, rows from which AMX takes the panels' products)
    routes = [("float32 route (kind 1)", 0, 0)]
    routes += [("AMX tiles (kind 5)", 1, 1)] if lib.amx else []
    routes += [("VNNI (kind 5)", 1, 1 << 40)] if lib.vnni else []
    routes += [("VNNI, float16 scales (kind 7)", 2, 1 << 40)] if lib.vnni else []
    gen = torch.Generator().manual_seed(0)
    mats = []
    for _ in range(LAYERS):
        for rows, cols in SHAPES:
            packed = q4_1(rows, cols, gen)
            mats.append((packed, cpu_quant.panels(packed), cpu_quant.panels(packed, half=True)))
    sizes = " / ".join(f"{sum(m[i].data.numel() for m in mats) / 1e6:.1f}" for i in range(3))
    print(f"{len(mats)} matrices, {sizes} MB (kinds 1 / 5 / 7), {args.threads} threads; median "
          "ms a pass")  # fmt: skip
    names = [name for name, _, _ in routes]
    ratios = [f"{n} / float32" for n in names[1:]]
    print("| rows | " + " | ".join(names + ratios) + " |")
    print("|---:|" + "---:|" * (2 * len(routes) - 1))
    default_rows = lib.int8_kernel_rows(1)
    for num_rows in args.rows:
        xs = {k: torch.randn(num_rows, k, generator=gen) for k in (HIDDEN, INTERMEDIATE)}
        outs = {n: torch.empty(num_rows, n) for n in (KV, HIDDEN, INTERMEDIATE)}

        times: list[list[float]] = [[] for _ in routes]
        for turn in range(args.turns + 1):  # the first untimed
            for times_of, (_, which, amx_from) in zip(times, routes, strict=True):
                lib.int8_kernel_rows(amx_from)
                start = time.perf_counter()
                for mat in mats:
                    packed = mat[which]
                    lib.quant(xs[packed.cols], packed, outs[packed.rows], lib.lanes)
                if turn:
                    times_of.append((time.perf_counter() - start) * 1e3)
        ms = [statistics.median(t) for t in times]
        cells = [f"{m:.3f}" for m in ms] + [f"{m / ms[0]:.3f}" for m in ms[1:]]
        print(f"| {num_rows} | " + " | ".join(cells) + " |")
    lib.int8_kernel_rows(default_rows)


if __name__ == "__main__":
    main()
