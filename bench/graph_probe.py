"""Which CUDA graphs take long to launch, and what is in them: runs another bench script (its
path and arguments after `--`) with every `torch.cuda.CUDAGraph` it makes in debug mode and the
host time of each `replay()` recorded. At the end, per graph (in capture order, named by the
code that captured it; graphs never replayed are left out): replays, median and p90 host us of
`replay()` (the replays after its first), median and p90 us on the GPU (CUDA events around each
replay), and its nodes by type, edges, forks and joins (nodes that wait for more than one), from
the DOT file `cudaGraphDebugDotPrint` writes (kept in --dot-dir).

    PYTHONPATH=. python bench/graph_probe.py --dot-dir /tmp/dots -- bench/draft_step.py \
        --target /tmp/smollm2_random --batch 1 --shape 3x1x3 --ahead 2 --ahead-hits

A straight line of kernel nodes launches in constant time on recent drivers (CUDA 12.6+);
other node types or branches may cost per node. The probe tells which graphs launch slowly and
whether their shape is why.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import runpy
import statistics
import sys
import time
import traceback
from typing import Any, ClassVar

import torch

_KINDS = (
    "KERNEL|MEMCPY|MEMSET|HOST|EVENT_RECORD|WAIT_EVENT|EMPTY|MEM_ALLOC|MEM_FREE|CONDITIONAL|GRAPH"
)
_NODE = re.compile(rf'^\s*"?(\w+)"?\s*\[.*?\b({_KINDS})\b', re.MULTILINE)
_EDGE = re.compile(r'^\s*"?(\w+)"?\s*->\s*"?(\w+)"?', re.MULTILINE)
_OURS = ("drafter/", "verifier/", "specsplit/")


class _Probe:
    graphs: ClassVar[list[Any]] = []


def _caller() -> str:
    """The innermost frame of our code that is capturing (file:line function)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if any(part in frame.filename for part in _OURS):
            name = frame.filename.split("/")[-2:]
            return f"{'/'.join(name)}:{frame.lineno} {frame.name}"
    return "?"


class ProbedGraph(torch.cuda.CUDAGraph):
    def __init__(self, keep_graph: bool = False) -> None:
        # kept (instantiated on its first replay, which the figures leave out): without it the
        # cudaGraph_t is gone after capture and debug_dump writes nothing (torch 2.11)
        super().__init__(True)  # type: ignore[call-arg]
        self.enable_debug_mode()
        self.where = _caller()
        self.replays: list[int] = []  # host ns of each replay()
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # around each on the GPU
        _Probe.graphs.append(self)

    def replay(self) -> None:
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()  # the current stream: replay() launches there
        started = time.perf_counter_ns()
        super().replay()
        self.replays.append(time.perf_counter_ns() - started)
        after.record()
        self.events.append((before, after))

    def device_us(self) -> list[float]:
        """Each replay's time on the GPU (us, between events recorded around it; a replay
        queued behind other work counts from when the GPU reached it), after its first."""
        torch.cuda.synchronize()
        return sorted(1e3 * before.elapsed_time(after) for before, after in self.events[1:])


def dot_summary(path: str) -> str:
    """Node types (counts), edges, joins (nodes with > 1 incoming edge) of a DOT graph."""
    with open(path) as f:
        text = f.read()
    kinds = collections.Counter(kind for _, kind in _NODE.findall(text))
    edges = _EDGE.findall(text)
    incoming = collections.Counter(dst for _, dst in edges)
    outgoing = collections.Counter(src for src, _ in edges)
    joins = sum(1 for n in incoming.values() if n > 1)
    forks = sum(1 for n in outgoing.values() if n > 1)
    kind_text = " ".join(f"{k}:{n}" for k, n in kinds.most_common())
    nodes = sum(kinds.values())
    return f"{nodes} nodes ({kind_text}), {len(edges)} edges, {forks} forks, {joins} joins"


def report(dot_dir: str) -> None:
    os.makedirs(dot_dir, exist_ok=True)
    replayed = [(i, g) for i, g in enumerate(_Probe.graphs) if g.replays]
    print(f"\n== graph probe: {len(_Probe.graphs)} graphs captured, {len(replayed)} replayed")
    print("  #  replays  host us: median  p90  GPU us: median  p90  captured by / nodes")
    for i, graph in replayed:
        host = _median_p90([ns / 1e3 for ns in sorted(graph.replays[1:])])
        gpu = _median_p90(graph.device_us())
        path = os.path.join(dot_dir, f"graph_{i}.dot")
        try:
            graph.debug_dump(path)
            shape = dot_summary(path)
        except Exception as e:  # a graph reset or never captured
            shape = f"(no dump: {e})"
        print(f"{i:3d} {len(graph.replays):8d} {host}  {gpu}  {graph.where}")
        print(f"{'':13}{shape}")


def _median_p90(values: list[float]) -> str:
    """'median p90' of sorted values (nan where there are none)."""
    if not values:
        return f"{'nan':>7} {'nan':>6}"
    return f"{statistics.median(values):7.1f} {values[int(0.9 * (len(values) - 1))]:6.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dot-dir", default="/tmp/graph_probe")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [its args]")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("the bench script to run goes after --")
    torch.cuda.CUDAGraph = ProbedGraph  # type: ignore[misc]
    sys.argv = script
    try:
        runpy.run_path(script[0], run_name="__main__")
    finally:
        report(args.dot_dir)


if __name__ == "__main__":
    main()
