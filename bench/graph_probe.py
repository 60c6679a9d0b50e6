"""Which CUDA graphs take long to launch, and what is in them: runs another bench script (its
path and arguments after `--`) with every `torch.cuda.CUDAGraph` it makes in debug mode and the
host time of each `replay()` recorded. At the end, per graph (in capture order, named by the
code that captured it; graphs never replayed are left out): replays, median and p90 host us of
`replay()` (the replays after its first), and its nodes by type, edges, forks and joins (nodes
that wait for more than one), from the DOT file `cudaGraphDebugDotPrint` writes (kept in
--dot-dir).

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
        self.replays: list[int] = []
        _Probe.graphs.append(self)

    def replay(self) -> None:
        started = time.perf_counter_ns()
        super().replay()
        self.replays.append(time.perf_counter_ns() - started)


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
    print("  #  replays  median us  p90 us  captured by / nodes")
    for i, graph in replayed:
        times = sorted(graph.replays[1:])
        median = statistics.median(times) / 1e3 if times else float("nan")
        p90 = times[int(0.9 * (len(times) - 1))] / 1e3 if times else float("nan")
        path = os.path.join(dot_dir, f"graph_{i}.dot")
        try:
            graph.debug_dump(path)
            shape = dot_summary(path)
        except Exception as e:  # a graph reset or never captured
            shape = f"(no dump: {e})"
        print(f"{i:3d} {len(graph.replays):8d} {median:10.1f} {p90:7.1f}  {graph.where}")
        print(f"{'':33}{shape}")


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
