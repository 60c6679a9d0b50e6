"""bench/overlap.py's reading of `--ups`: an `up` whose target-only ran well under the others'
is named, since a raw ratio with it measures the machine."""

from __future__ import annotations

from bench.overlap import SLOW_UP, slow_ups


def test_an_up_whose_target_only_ran_slow_is_named_with_the_median() -> None:
    """The forty-fifth session's chain-auto run: the first `auto` `up` ran target-only at 763.7
    tokens/s against a median of 932.5 over all six `up`s (under SLOW_UP of it); no other did."""
    targets = {"serial": [1050.9, 924.1], "ahead-plain": [763.7, 873.4], "off": [940.8, 1034.2]}
    assert slow_ups(targets) == ["ahead-plain #1 (763.7 against 932.5)"]


def test_ups_within_the_share_of_the_median_are_not_named() -> None:
    median = 1000.0
    targets = {"serial": [median, SLOW_UP * median], "ahead-plain": [median, 1.2 * median]}
    assert slow_ups(targets) == []
