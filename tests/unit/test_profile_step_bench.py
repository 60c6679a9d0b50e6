"""bench/profile_step.py's host phases: every one names what the engine calls today (a rename
in the engine broke the script once, unnoticed until a GPU run), each counts its calls through
a real round, and restoring them leaves the engine as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

import verifier.device_rounds as device_rounds_module
import verifier.round_accept as round_accept_module
from bench.profile_step import step_phases
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.support import save_tiny_llama
from tests.unit.test_decode_ahead import Driver, _engine, _release
from verifier.engine import VerifierEngine


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("phases") / "target", seed=31)


def test_each_phase_counts_the_engines_calls_and_restores(target_dir: Path) -> None:
    engine = _engine(target_dir, decode_ahead=True)
    originals = (device_rounds_module.build_forward_batch, round_accept_module._sampling_inputs)
    phases = step_phases(engine)
    try:
        driver = Driver(engine, layers=(1,))  # hidden-state rows, as an EAGLE drafter asks
        driver.begin("a")
        driver.round({"a": DraftTree([11, 12], [-1, 0])})
        driver.round({"a": DraftTree()}, sampling=SamplingParams(temperature=0.8, seed=3))
        driver.layers = ()
        driver.decode("a", rounds=2)  # decode rounds: the step run ahead
        for name in (
            "build batch",
            "eager forward",
            "accept (queued)",
            "commit",
            "validate",
            "sampling inputs",
            "hidden states out",
            "reserve",
            "launch ahead",
            "finish (+ wait)",
        ):
            assert phases[name].calls > 0, name
        _release(driver)
    finally:
        for timer in phases.values():
            timer.restore()
    assert (
        device_rounds_module.build_forward_batch,
        round_accept_module._sampling_inputs,
    ) == originals
    assert engine._accept.__func__ is VerifierEngine._accept  # the wrapper gone
