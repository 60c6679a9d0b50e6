"""bench/profile_services.py --repeat: each unprofiled run's rate in order and their median
(an A/B through the services compares medians of several runs of one `up`); the decode steps
run ahead, used of all and the dropped ones by why."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.profile_services import print_round_means, runs_line


def test_runs_line_gives_each_runs_rate_in_order_and_their_median() -> None:
    line = runs_line([100, 300, 200], [1.0, 1.0, 2.0])
    assert line == "unprofiled runs: 100.0, 300.0, 100.0 tok/s; median 100.0"


def test_runs_line_median_of_an_even_count_is_the_middle_two_averaged() -> None:
    assert runs_line([10, 40], [1.0, 1.0]).endswith("; median 25.0")


def test_the_decode_steps_dropped_are_named_by_why(capsys: pytest.CaptureFixture[str]) -> None:
    totals: Counter[tuple[str, str]] = Counter()
    for key, n in [("total:used", 10), ("total:dropped", 3), ("dropped_total:unasked", 2),
                   ("dropped_total:joined", 1)]:  # fmt: skip
        totals[("verifier", f"specsplit_decode_ahead_{key}")] = n
    print_round_means(100, 1.0, totals)
    out = capsys.readouterr().out
    assert "decode steps run ahead used 10 / 13 (dropped: unasked 2, joined 1)" in out
