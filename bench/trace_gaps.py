"""What the host does while the GPU idles: read a torch.profiler chrome trace (CPU + CUDA
activities, `with_stack=True`), find the spans where no kernel, copy or memset runs on the GPU,
and charge each span's time to the Python functions running on any thread across it
(inclusive: a caller is charged its callees' share too).

    python3 bench/trace_gaps.py TRACE.json[.gz] [--top 50] [--min-gap-us 20] [--match /work/]

`bench/gpu_e2e.py --trace DIR` writes such traces of whole-system rounds.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
import re
from collections import defaultdict
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events: list[dict[str, Any]] = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def busy_spans(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The union of the GPU's activity, sorted (start, end) in us."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATEGORIES)
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def gaps(busy: list[tuple[float, float]], min_gap: float) -> list[tuple[float, float]]:
    return [
        (a_end, b_start)
        for (_, a_end), (b_start, _) in itertools.pairwise(busy)
        if b_start - a_end >= min_gap
    ]


def overlap(
    idle: list[tuple[float, float]], starts: list[float], begin: float, end: float
) -> float:
    """us of the idle spans (sorted; `starts` their starts) within [begin, end)."""
    total, i = 0.0, max(bisect.bisect_right(starts, begin) - 1, 0)
    while i < len(idle) and idle[i][0] < end:
        total += max(0.0, min(end, idle[i][1]) - max(begin, idle[i][0]))
        i += 1
    return total


Frame = tuple[dict[str, Any], float]  # a trace event, and where its self time resumes


def _close(
    stack: list[Frame],
    until: float,
    own: dict[str, float],
    idle: list[tuple[float, float]],
    starts: list[float],
) -> None:
    """Pop the frames that end before `until`, charging their last stretch of self time."""
    while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= until:
        frame, resume = stack.pop()
        end = frame["ts"] + frame["dur"]
        own[_name(frame)] += overlap(idle, starts, resume, end)
        if stack:
            stack[-1] = (stack[-1][0], end)


def _name(event: dict[str, Any]) -> str:
    """The event's name without object addresses (one name per built-in method)."""
    return re.sub(r" (object )?at 0x[0-9a-f]+", "", event["name"])


def charge(
    events: list[dict[str, Any]], idle: list[tuple[float, float]]
) -> tuple[dict[str, float], dict[str, float]]:
    """us of idle GPU time each Python function spans, (inclusive, self): inclusive counts
    its callees' time too, self only the time it is the innermost frame of its thread."""
    starts = [g[0] for g in idle]
    inclusive: dict[str, float] = defaultdict(float)
    own: dict[str, float] = defaultdict(float)
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function":
            by_thread[e.get("tid")].append(e)
    for frames in by_thread.values():
        frames.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[Frame] = []

        for e in frames:
            begin, end = e["ts"], e["ts"] + e["dur"]
            inclusive[_name(e)] += overlap(idle, starts, begin, end)
            _close(stack, begin, own, idle, starts)
            if stack:  # the caller's self time pauses
                parent, resume = stack[-1]
                own[_name(parent)] += overlap(idle, starts, resume, begin)
                stack[-1] = (parent, begin)
            stack.append((e, begin))
        _close(stack, float("inf"), own, idle, starts)
    return inclusive, own


def summarise(path: str, top: int, min_gap_us: float, match: str) -> str:
    events = load(path)
    busy = busy_spans(events)
    if not busy:
        return f"{path}: no GPU activity recorded"
    window = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)
    idle = gaps(busy, min_gap_us)
    idle_us = sum(end - start for start, end in idle)
    lines = [
        f"{path}: {window / 1e3:.1f} ms from the first kernel to the last, GPU busy "
        f"{busy_us / 1e3:.1f} ms ({busy_us / window:.0%}); {len(idle)} idle spans of >= "
        f"{min_gap_us:.0f} us, {idle_us / 1e3:.1f} ms",
        "idle us: inclusive | self | function (by inclusive; then by self)",
    ]
    inclusive, own = charge(events, idle)
    names = [name for name in inclusive if match in name]
    for key in (inclusive, own):
        lines += [
            f"{inclusive[name]:9.0f} | {own[name]:9.0f} | {name}"
            for name in sorted(names, key=lambda n: -key[n])[:top]
        ]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=50)
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    parser.add_argument("--match", default="", help="only functions whose name has this")
    args = parser.parse_args()
    for path in args.traces:
        print(summarise(path, args.top, args.min_gap_us, args.match))


if __name__ == "__main__":
    main()
