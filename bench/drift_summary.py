"""What one `up` of `scripts/gpu_suite.sh drift` ran on in its last seconds: each GPU's SM clock
and utilization (nvidia-smi samples) and the cores of each service's main thread (ps samples),
from the samples in the window before the run's end.

    python3 bench/drift_summary.py SMI_CSV PS_TXT END_EPOCH_SECONDS [--window 6]

SMI_CSV: `nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,
utilization.gpu --format=csv,noheader -lms 100`; PS_TXT: blocks of an epoch-seconds line, then
`ps -Lo pid,tid,psr,pcpu,comm --no-headers` of the services' processes.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from datetime import datetime


def gpu_lines(path: str, start: float, end: float) -> dict[str, list[tuple[float, float]]]:
    """Per GPU index, (SM MHz, utilization %) of the samples within [start, end]."""
    per_gpu: dict[str, list[tuple[float, float]]] = {}
    with open(path) as f:
        for line in f:
            fields = [x.strip() for x in line.split(",")]
            if len(fields) < 6:
                continue
            try:
                when = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                sm, util = float(fields[2].split()[0]), float(fields[5].split()[0])
            except ValueError:
                continue
            if start <= when <= end:
                per_gpu.setdefault(fields[1], []).append((sm, util))
    return per_gpu


def main_threads(path: str, start: float, end: float) -> list[tuple[float, dict[int, int]]]:
    """Per ps sample within [start, end]: each process's main thread's core."""
    samples: list[tuple[float, dict[int, int]]] = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) == 1:
                with contextlib.suppress(ValueError):
                    samples.append((float(fields[0]), {}))
            elif len(fields) >= 5 and samples and fields[0] == fields[1]:
                samples[-1][1][int(fields[0])] = int(fields[2])
    return [(t, mains) for t, mains in samples if start <= t <= end]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("smi")
    parser.add_argument("ps")
    parser.add_argument("end", type=float)
    parser.add_argument("--window", type=float, default=6.0)
    args = parser.parse_args()
    start = args.end - args.window
    for gpu, samples in sorted(gpu_lines(args.smi, start, args.end).items()):
        busy = [sm for sm, util in samples if util > 0] or [sm for sm, _ in samples]
        print(
            f"GPU {gpu}: SM clock median {statistics.median(busy):.0f} MHz (min {min(busy):.0f},"
            f" max {max(busy):.0f}) over {len(busy)} busy samples, utilization max"
            f" {max(util for _, util in samples):.0f}%"
        )
    for when, mains in main_threads(args.ps, start, args.end):
        print(f"{when - args.end:+.1f} s: main threads' cores {mains}")


if __name__ == "__main__":
    main()
