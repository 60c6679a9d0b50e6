"""Does a CUDA graph's replay wait on the host while the same graph's last launch is still on the
device? The engine replays its forward graph (and a rules graph) once a step while the step run
ahead of it still runs; under cProfile there `CUDAGraph.replay` averaged ~200 us a call against
~3 us bare (bench/RESULTS.md, eighty-sixth session). This times the host's `replay()` of a graph
whose body is a spin kernel of `--spin-us` plus a small op:

- idle: the device idle (synchronized before each replay);
- same: right after a replay of the same graph (its launch still running);
- other: right after a replay of a second graph of the same body (a different executable).

Median us over `--rounds` each. If "same" is far above "other", replays should alternate
between two captures of a graph. On an H200 (2026-12-03, bench/RESULTS.md) they were equal:
idle 5.3, same 5.3, other 5.4 us (a 500 us body); 5.8 / 5.6 / 5.7 (50 us).

    PYTHONPATH=. python bench/graph_relaunch.py [--spin-us 500] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _capture(spin_cycles: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(spin_cycles)
        x.add_(1)
        with torch.cuda.graph(graph, stream=stream):
            torch.cuda._sleep(spin_cycles)
            x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph


def _spin_cycles(spin_us: float) -> int:
    """Cycles of `torch.cuda._sleep` that take about `spin_us` on this device."""
    cycles = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return int(cycles * spin_us / 1e3 / start.elapsed_time(end))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spin-us", type=float, default=500.0)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    cycles = _spin_cycles(args.spin_us)
    x = torch.zeros(1024, device="cuda")
    first, second = _capture(cycles, x), _capture(cycles, x)
    times: dict[str, list[float]] = {"idle": [], "same": [], "other": []}
    for _ in range(args.rounds):
        for case in times:
            torch.cuda.synchronize()
            if case != "idle":
                first.replay()  # (its launch runs the spin)
            graph = second if case == "other" else first
            start = time.perf_counter()
            graph.replay()
            times[case].append(time.perf_counter() - start)
    torch.cuda.synchronize()
    line = ", ".join(f"{case} {1e6 * statistics.median(t):.1f}" for case, t in times.items())
    print(f"replay() host us (median of {args.rounds}, a {args.spin_us:.0f} us body): {line}")


if __name__ == "__main__":
    main()
