"""bench/profile_services.py --repeat: each unprofiled run's rate in order and their median
(an A/B through the services compares medians of several runs of one `up`)."""

from __future__ import annotations

from bench.profile_services import runs_line


def test_runs_line_gives_each_runs_rate_in_order_and_their_median() -> None:
    line = runs_line([100, 300, 200], [1.0, 1.0, 2.0])
    assert line == "unprofiled runs: 100.0, 300.0, 100.0 tok/s; median 100.0"


def test_runs_line_median_of_an_even_count_is_the_middle_two_averaged() -> None:
    assert runs_line([10, 40], [1.0, 1.0]).endswith("; median 25.0")
