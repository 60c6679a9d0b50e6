"""bench/trace_gaps.py: the GPU's idle spans in a chrome trace and the Python frames charged."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from bench import trace_gaps


def _event(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


# GPU busy 0-10 and 40-50 (two kernels overlapping) and 100-110: idle 10-40 and 50-100
EVENTS = [
    _event("kernel", "a", 0, 10),
    _event("kernel", "b", 40, 8),
    _event("gpu_memcpy", "c", 45, 5),
    _event("kernel", "d", 100, 10),
    # thread 1: outer 0-110 calls inner 20-60 (idle 20-40 and 50-60 inside it)
    _event("python_function", "x.py(1): outer", 0, 110),
    _event("python_function", "x.py(2): inner at 0x7f00", 20, 40),
    # thread 2: one frame across the second gap only
    _event("python_function", "y.py(3): other", 60, 30, tid=2),
]


def test_busy_spans_merge_overlaps_and_gaps_skip_short_ones() -> None:
    busy = trace_gaps.busy_spans(EVENTS)  # type: ignore[arg-type]
    assert busy == [(0, 10), (40, 50), (100, 110)]
    assert trace_gaps.gaps(busy, 20) == [(10, 40), (50, 100)]
    assert trace_gaps.gaps(busy, 31) == [(50, 100)]


def test_idle_time_charged_inclusive_and_self() -> None:
    idle = [(10.0, 40.0), (50.0, 100.0)]
    inclusive, own = trace_gaps.charge(EVENTS, idle)  # type: ignore[arg-type]
    assert inclusive["x.py(1): outer"] == 80  # every idle us
    assert inclusive["x.py(2): inner"] == 30  # 20-40 and 50-60; the address is dropped
    assert own["x.py(2): inner"] == 30
    assert own["x.py(1): outer"] == 50  # 10-20 and 60-100
    assert inclusive["y.py(3): other"] == own["y.py(3): other"] == 30


def test_summary_reads_a_gzipped_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    text = trace_gaps.summarise(str(path), top=5, min_gap_us=20, match="x.py")
    assert "GPU busy 0.0 ms (27%)" in text  # 30 of 110 us
    assert "2 idle spans" in text
    assert "y.py" not in text and "x.py(1): outer" in text
