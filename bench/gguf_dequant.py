"""GGUF dequantization speed on this machine: the `gguf` package's numpy against
specsplit/model/gguf_dequant.py's torch ops at 1 and N threads (and on a GPU where there is
one), per format, M weights a second, best of --repeat; 2,048 x 4,096 random blocks
(tests/unit/test_gguf_dequant.py's `random_rows`). What `GGUFFile.tensor`'s routing rests on:
on the CPU gguf's numpy, off it the torch ops.

    PYTHONPATH=. python bench/gguf_dequant.py [--threads 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from specsplit.model import gguf_dequant
from tests.unit.test_gguf_dequant import SCALES, random_rows

ROWS, COLS = 2048, 4096


def best(run: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` runs, in seconds (a GPU's work waited for)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    columns = ["gguf (numpy)", "torch, 1 thread", f"torch, {args.threads} threads"]
    if torch.cuda.is_available():
        columns.append("torch, GPU")
    print("| format | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    weights = ROWS * COLS
    for qtype in SCALES:
        if qtype == GGMLQuantizationType.BF16:
            continue  # (a shift: nothing to weigh)
        raw = random_rows(qtype, ROWS, COLS // GGML_QUANT_SIZES[qtype][0], 0)
        stored = torch.from_numpy(raw)
        seconds = [best(partial(dequantize, raw, qtype), args.repeat)]
        for threads in (1, args.threads):
            torch.set_num_threads(threads)
            seconds.append(best(partial(gguf_dequant.dequantize, stored, qtype), args.repeat))
        if torch.cuda.is_available():
            on_gpu = stored.cuda()
            seconds.append(best(partial(gguf_dequant.dequantize, on_gpu, qtype), args.repeat))
        rates = " | ".join(f"{weights / s / 1e6:.0f}" for s in seconds)
        print(f"| {qtype.name} | {rates} |", flush=True)


if __name__ == "__main__":
    main()
