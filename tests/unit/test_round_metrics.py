"""The gateway's round metrics: every round's wall time, and the part of it outside the
verifier's engine time (what the split and the drafting not hidden cost on the critical path);
a round's commits counted once per round by their totals."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from gateway.request import GenerationRequest
from specsplit import metrics
from specsplit.messages import SpecParams, VerifyOutput
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


def _rounds(kind: str) -> float:
    return REGISTRY.get_sample_value("specsplit_rounds_total", {"kind": kind}) or 0.0


@pytest.mark.parametrize("overlap", ["serial", "groups"])
def test_rounds_are_counted_by_kind(target: Path, smollm2_tokenizer, overlap: str) -> None:
    """Speculating rounds by the kind they ran as; target-only requests' rounds as plain. So a
    dashboard (and bench/serving.py) shows what the gates chose to run."""
    stack = make_stack(target, "model", smollm2_tokenizer, SpecParams(3, 1, 3), overlap=overlap)
    prompts = [[5, 9, 11, 3], [7, 7, 2, 8, 13, 21]]
    kinds = ("plain", "serial", "groups")
    before = {kind: _rounds(kind) for kind in kinds}
    generate_all(stack, [GenerationRequest(p, 10, ignore_eos=True) for p in prompts])
    middle = {kind: _rounds(kind) - before[kind] for kind in kinds}
    assert middle[overlap] > 0 and middle["plain"] == 0
    assert middle["groups" if overlap == "serial" else "serial"] == 0
    target_only = SpecParams(0, 1, 0)
    generate_all(
        stack, [GenerationRequest(p, 6, ignore_eos=True, spec=target_only) for p in prompts]
    )
    after = {kind: _rounds(kind) - before[kind] - middle[kind] for kind in kinds}
    assert after["plain"] > 0 and after[overlap] == 0


def test_a_rounds_time_outside_the_verifiers_device_is_its_wall_less_the_device_time() -> None:
    """observe_round: with the verifier's device time reported (a GPU), the round's wall less
    it goes to specsplit_round_outside_device_seconds (never below 0: the device time of a
    round run ahead may outlast the round's wall on the gateway); without, nothing does."""
    name = "specsplit_round_outside_device_seconds"

    def sample(kind: str) -> float:
        return REGISTRY.get_sample_value(f"{name}_{kind}") or 0.0

    count, total = sample("count"), sample("sum")
    metrics.observe_round("plain", 0.010, 0.0095, 0.0091)
    assert sample("count") == count + 1
    assert sample("sum") - total == pytest.approx(0.0009)
    metrics.observe_round("plain", 0.010, 0.002, 0.0)  # not measured: a CPU
    metrics.observe_round("plain", 0.010, 0.002, 0.012)  # ran before the round asked for it
    assert sample("count") == count + 2
    assert sample("sum") - total == pytest.approx(0.0009)


@dataclass
class _Seq:
    last_token_ns: int | None = None


@dataclass
class _Chunk:
    token_ids: list[int]
    elapsed_ns: int


def test_a_rounds_commits_move_each_counter_by_their_totals() -> None:
    """observe_commits: accepted drafts by depth, decoded and generated tokens, one TTFT per
    sequence's first tokens and one inter-token gap per later token, as per-sequence counting
    would give."""
    names = {
        "depth1": ("specsplit_accepted_drafts_total", {"depth": "1"}),
        "depth2": ("specsplit_accepted_drafts_total", {"depth": "2"}),
        "depth3": ("specsplit_accepted_drafts_total", {"depth": "3"}),
        "decoded": ("specsplit_decoded_tokens_total", {}),
        "generated": ("specsplit_generated_tokens_total", {}),
        "rounds": ("specsplit_accepted_tokens_per_round_count", {}),
        "ttft": ("specsplit_time_to_first_token_seconds_count", {}),
        "itl": ("specsplit_inter_token_latency_seconds_count", {}),
        "itl_sum": ("specsplit_inter_token_latency_seconds_sum", {}),
    }

    def samples() -> dict[str, float]:
        return {k: REGISTRY.get_sample_value(n, labels) or 0.0 for k, (n, labels) in names.items()}

    first, later = _Seq(), _Seq(last_token_ns=1_000_000)
    rounds = [
        (first, VerifyOutput("a", [4, 5], 6, 9), _Chunk([4, 5, 6], 2_000_000)),
        (later, VerifyOutput("b", [7, 8, 9], 1, 9), _Chunk([7, 8, 9, 1], 5_000_000)),
        (_Seq(), VerifyOutput("c", [], 3, 9, decoded_tokens=[2, 2]), _Chunk([], 1)),
    ]
    before = samples()
    metrics.observe_commits(rounds)
    moved = {k: v - before[k] for k, v in samples().items()}
    assert moved == pytest.approx(
        {
            "depth1": 2, "depth2": 2, "depth3": 1, "decoded": 2, "generated": 7, "rounds": 3,
            "ttft": 1, "itl": 4, "itl_sum": 4 * (4_000_000 / 1e9 / 4),
        }
    )  # fmt: skip
    assert (first.last_token_ns, later.last_token_ns) == (2_000_000, 5_000_000)
