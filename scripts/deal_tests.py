"""Deal test files among N pytest processes by their measured time, so that the processes of
`scripts/gpu_suite.sh tests-par` end together: the longest file first, each to the process with
the least time so far (a file not in the table counts as DEFAULT_SECONDS). Dealt round-robin
(until the fifty-ninth session) the four processes on two H200s took 186 / 264 / 249 / 335 s:
the slowest decides the call's device time.

    python3 scripts/deal_tests.py --jobs 4 tests/gpu/test_*.py
        one line a process, its files space-separated (the table: tests/gpu/durations.txt)
    python3 scripts/deal_tests.py --update tests/gpu/durations.txt OUT/tests-par-*.txt
        the table rewritten from tests-par's outputs (pytest --durations=0: each test's setup,
        call and teardown, summed by file); a file the outputs do not time keeps its line (a
        process that did not finish prints no durations: the outputs of a later call that ran
        its files can be given beside it)
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

DEFAULT_SECONDS = 30.0  # a file not measured yet: about a median GPU test file's time
TABLE = Path(__file__).resolve().parents[1] / "tests" / "gpu" / "durations.txt"
# a line of pytest --durations=0: "12.34s call     tests/gpu/test_x.py::test_y[param]"
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s\s+(?:setup|call|teardown)\s+([^:\s]+)::")


def read_table(path: Path) -> dict[str, float]:
    """file -> seconds, from lines "SECONDS FILE" ('#' starts a comment)."""
    table = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            seconds, name = line.split()
            table[name] = float(seconds)
    return table


def measured(outputs: list[str]) -> dict[str, float]:
    """file -> seconds summed over its tests' setup, call and teardown in pytest outputs."""
    seconds: dict[str, float] = defaultdict(float)
    for text in outputs:
        for line in text.splitlines():
            match = DURATION.match(line)
            if match:
                seconds[match.group(2)] += float(match.group(1))
    return dict(seconds)


def deal(files: list[str], jobs: int, table: dict[str, float]) -> list[list[str]]:
    """`files` in `jobs` groups: longest first (ties by name), each to the group with the least
    time so far (the lowest index among equals); each group in the order it was dealt."""
    assert jobs >= 1, jobs
    groups: list[list[str]] = [[] for _ in range(jobs)]
    totals = [0.0] * jobs
    for name in sorted(set(files), key=lambda f: (-table.get(f, DEFAULT_SECONDS), f)):
        j = min(range(jobs), key=lambda i: (totals[i], i))
        groups[j].append(name)
        totals[j] += table.get(name, DEFAULT_SECONDS)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--table", type=Path, default=TABLE)
    parser.add_argument("--update", type=Path, default=None, help="rewrite this table")
    parser.add_argument("paths", nargs="*", help="test files, or with --update pytest outputs")
    args = parser.parse_args()
    if args.update is not None:
        seconds = read_table(args.update) if args.update.exists() else {}
        seconds.update(measured([Path(p).read_text() for p in args.paths]))
        lines = [f"{seconds[name]:.1f} {name}\n" for name in sorted(seconds)]
        header = "# seconds a file in scripts/gpu_suite.sh tests-par (scripts/deal_tests.py)\n"
        args.update.write_text(header + "".join(lines))
        return
    table = read_table(args.table) if args.table.exists() else {}
    for group in deal(args.paths, args.jobs, table):
        print(" ".join(group))


if __name__ == "__main__":
    main()
