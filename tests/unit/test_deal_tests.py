"""scripts/deal_tests.py: the GPU test files dealt among tests-par's pytest processes by their
measured time (longest first, each to the process with the least so far), and the table of
times rewritten from pytest's --durations=0 output."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "deal_tests.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deal_tests", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


deal_tests = _load()


def test_longest_first_each_to_the_process_with_the_least_so_far() -> None:
    table = {"a": 100.0, "b": 90.0, "c": 60.0, "d": 50.0, "e": 40.0}
    groups = deal_tests.deal(["e", "d", "c", "b", "a"], 2, table)
    # a -> 0 (100); b -> 1 (90); c -> 1 (150); d -> 0 (150); e -> 0 by index among equals
    assert groups == [["a", "d", "e"], ["b", "c"]]


def test_round_robin_would_leave_one_process_far_behind_where_this_does_not() -> None:
    """The fifty-ninth session's measured table, four processes: every file once, and the
    slowest process within 2% of the mean (round-robin in name order: 335 s against 186)."""
    table = deal_tests.read_table(deal_tests.TABLE)
    files = sorted(table)
    groups = deal_tests.deal(files, 4, table)
    assert sorted(f for group in groups for f in group) == files
    totals = [sum(table[f] for f in group) for group in groups]
    assert max(totals) <= 1.02 * sum(totals) / 4, totals


def test_a_file_not_measured_counts_as_the_default() -> None:
    table = {"long": deal_tests.DEFAULT_SECONDS + 1, "short": deal_tests.DEFAULT_SECONDS - 1}
    groups = deal_tests.deal(["short", "new", "long"], 1, table)
    assert groups == [["long", "new", "short"]]


def test_more_processes_than_files_leaves_the_rest_empty() -> None:
    assert deal_tests.deal(["x"], 3, {}) == [["x"], [], []]


def test_the_table_names_only_gpu_test_files_that_exist() -> None:
    for name in deal_tests.read_table(deal_tests.TABLE):
        assert (ROOT / name).is_file(), f"{name}: rewrite tests/gpu/durations.txt"
        assert name.startswith("tests/gpu/test_"), name


def test_update_sums_each_files_setup_call_and_teardown(tmp_path: Path) -> None:
    output = tmp_path / "tests-par-0.txt"
    output.write_text(
        "============================== slowest durations ===============================\n"
        "12.50s call     tests/gpu/test_b.py::test_one[param-1]\n"
        "2.00s setup    tests/gpu/test_b.py::test_one[param-1]\n"
        "0.50s teardown tests/gpu/test_a.py::test_two\n"
        "1.00s call     tests/gpu/test_a.py::test_two\n"
        "(12 durations < 0.005s hidden.  Use -vv to show these durations.)\n"
        "4 passed in 20.00s\n"
    )
    table = tmp_path / "durations.txt"
    subprocess.run([sys.executable, str(SCRIPT), "--update", str(table), str(output)], check=True)
    assert deal_tests.read_table(table) == {"tests/gpu/test_a.py": 1.5, "tests/gpu/test_b.py": 14.5}
    printed = subprocess.run(
        [sys.executable, str(SCRIPT), "--jobs", "2", "--table", str(table), "x.py",
         "tests/gpu/test_a.py", "tests/gpu/test_b.py"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    # x.py (not measured: 30 s) first, then test_b (14.5) and test_a (1.5) to the other
    assert printed.splitlines() == ["x.py", "tests/gpu/test_b.py tests/gpu/test_a.py"]


def test_update_keeps_the_lines_of_files_the_outputs_do_not_time(tmp_path: Path) -> None:
    """A process cut short prints no durations: its files keep their measured lines, and the
    files the outputs time are measured anew."""
    table = tmp_path / "durations.txt"
    table.write_text("# seconds\n40.0 tests/gpu/test_a.py\n7.0 tests/gpu/test_c.py\n")
    output = tmp_path / "tests-par-1.txt"
    output.write_text("3.5s call     tests/gpu/test_a.py::test_two\n")
    subprocess.run([sys.executable, str(SCRIPT), "--update", str(table), str(output)], check=True)
    assert deal_tests.read_table(table) == {"tests/gpu/test_a.py": 3.5, "tests/gpu/test_c.py": 7.0}
