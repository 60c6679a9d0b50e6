"""bench/grpc_write.py runs end to end: a client process reads both streams, and each kind of
write (paced, back to back) prints its median, p90 and CPU time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_kinds_of_write_are_timed() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "bench/grpc_write.py", "--chunks", "20", "--every-ms", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    assert [line.split(":")[0] for line in out] == ["one every 1 ms", "back to back"]
    assert all("write median" in line and "us a write" in line for line in out)
