"""The verifier's hidden rows for the drafter, gathered on the GPU (`accepted_rows`, one Triton
launch, then one copy of the gathered rows to pinned host memory) against the path it replaced
(every row copied to the host, the accepted ones picked there by numpy: `take_rows`, in
`accepted_rows_reference`). Wall time from the launch until the rows are on the host,
median of --repeats after a warm-up, per shape: decode rounds of a chain (1 pending + 3 nodes,
about 60% of the nodes accepted) at batch 1 / 8 / 32 / 64, and a long prompt's prefill beside
such rounds; rows of an 8B head's features (3 x 4096 bf16) unless --width says otherwise.

    PYTHONPATH=. python bench/accepted_rows.py [--width 12288] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specsplit.kernels.accepted_rows import accepted_rows, accepted_rows_reference
from tests.unit.test_accepted_rows import make_round, meta_of

SHAPES = {
    "chain 3, batch 1": ([1], [3]),
    "chain 3, batch 8": ([1] * 8, [3] * 8),
    "chain 3, batch 32": ([1] * 32, [3] * 32),
    "chain 3, batch 64": ([1] * 64, [3] * 64),
    "prefill 1024 + 31 x chain 3": ([1024] + [1] * 31, [0] + [3] * 31),
}


def median_us(fn: Callable[[], None], repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def time_shape(pending: list[int], nodes: list[int], width: int, repeats: int) -> str:
    """One table row: rows out, the GPU path's and the host path's median us, their ratio."""
    device = torch.device("cuda")
    asks = [True] * len(pending)
    hidden, packed, starts = make_round(pending, nodes, asks, width, seed=0)
    hidden = hidden.to(device, torch.bfloat16)
    packed_d, meta = packed.to(device), meta_of(starts, pending, asks).to(device)
    host = torch.empty(hidden.shape, dtype=torch.bfloat16, pin_memory=True)
    num_out = sum(p + int(packed[b, 0]) for b, p in enumerate(pending))

    def on_gpu() -> None:
        host.copy_(accepted_rows(hidden, packed_d, meta), non_blocking=True)
        torch.cuda.current_stream().synchronize()

    def on_host() -> None:
        host.copy_(hidden, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        accepted_rows_reference(host, packed, starts, pending, asks)

    gpu, cpu = median_us(on_gpu, repeats), median_us(on_host, repeats)
    return f"{num_out} | {gpu:.1f} | {cpu:.1f} | {cpu / gpu:.1f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=3 * 4096)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, rows of {args.width} bf16, median us of {args.repeats}")
    print("| shape | rows out | on the GPU + copy | host copy + numpy pick | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, (pending, nodes) in SHAPES.items():
        print(f"| {name} | {time_shape(pending, nodes, args.width, args.repeats)} |", flush=True)


if __name__ == "__main__":
    main()
