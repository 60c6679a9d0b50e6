"""The gateway's round metrics: every round's wall time, and the part of it outside the
verifier's engine time (what the split and the drafting not hidden cost on the critical path)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from gateway.request import GenerationRequest
from specsplit.messages import SpecParams
from tests.support import TINY_VOCAB, generate_all, make_stack, save_tiny_llama

NAMES = ("specsplit_round_seconds", "specsplit_round_outside_verify_seconds")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("round_metrics") / "target", seed=8)


def _samples() -> dict[str, float]:
    return {
        f"{name}_{kind}": REGISTRY.get_sample_value(f"{name}_{kind}") or 0.0
        for name in NAMES
        for kind in ("count", "sum")
    }


@pytest.mark.parametrize("overlap", ["serial", "groups"])
def test_every_round_is_timed_and_its_verify_engine_time_taken_out(
    target: Path, smollm2_tokenizer, overlap: str
) -> None:
    stack = make_stack(target, "model", smollm2_tokenizer, SpecParams(3, 1, 3), overlap=overlap)
    before = _samples()
    prompts = [[5, 9, 11, 3], [7, 7, 2, 8, 13, 21]]
    assert all(t < TINY_VOCAB for p in prompts for t in p)
    generate_all(stack, [GenerationRequest(p, 10, ignore_eos=True) for p in prompts])
    after = _samples()
    delta = {key: after[key] - before[key] for key in after}
    rounds = stack.scheduler.num_rounds
    assert rounds > 0
    assert delta["specsplit_round_seconds_count"] >= rounds  # groups: a round may only draft
    count = delta["specsplit_round_outside_verify_seconds_count"]
    assert count == delta["specsplit_round_seconds_count"]
    outside, total = (delta[f"{n}_sum"] for n in NAMES[::-1])
    assert 0 < outside < total  # the verifier's engine took part of every verifying round
    assert stack.scheduler.verifier.last_engine_seconds > 0
