"""The rules graphs (verifier/rules_graphs.py) on a CUDA device: a steady round replays its graph
without a host sync behind queued device work and bends every row as the one-row reference does
(bit for bit), a greedy round's argmax with it, the buffer's rows past the round's untouched;
the graphs are dropped and captured again when the kept rows' tables grow; a guide's masks ride
in the captured table; the verifier engine serves decode steps run ahead, speculative rounds
and sampled rounds under rules through them (tests/unit/test_verify_rules.py's cases: the
target's greedy tokens under the rules, the bent distribution). Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.logit_rules import Penalties
from specsplit.messages import VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.unit import test_rules_graphs, test_verify_rules
from tests.unit.test_rules_graphs import round_of
from tests.unit.test_verify_rules import (  # noqa: F401  (fixtures)
    reference,
    reference_bend,
    target_dir,
    truth,
)
from verifier.kept_rules import keep_rules
from verifier.round_rules import bend_by_rules
from verifier.rounds import VerifierSeq
from verifier.rule_rows import MIN_SLOTS, RuleRows
from verifier.rules_graphs import RulesGraphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 49152
PENALTIES = Penalties(bias=((3, 2.0),), presence=0.5, frequency=1.25, repetition=1.4, min_p=0.05)


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"


def _items(seqs: list[VerifierSeq], outputs: list[list[int]], greedy: bool) -> list[VerifyInput]:
    sampling = SamplingParams() if greedy else SamplingParams(temperature=0.8)
    trees = [DraftTree([3, 5, 3], [-1, 0, 1]), DraftTree(), DraftTree([9, 9], [-1, -1])]
    return round_of(seqs, outputs, PENALTIES, trees, sampling)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_steady_rounds_replay_their_graph_as_the_reference_without_a_sync(greedy: bool) -> None:
    """Six rounds of three sequences (then nine: the kept tables grow past their slots) in a
    32-row logits buffer, as the forward graph's: the first round fills the slots (eager), the
    second captures, the rest replay under sync debug mode "error" behind queued device work."""
    torch.manual_seed(3)
    graphs, kept = RulesGraphs("cuda"), RuleRows(VOCAB, "cuda")
    seqs = [VerifierSeq(f"s{i}", None) for i in range(MIN_SLOTS + 1)]  # type: ignore[arg-type]
    outputs = [[i % 4, 40] for i in range(len(seqs))]
    buffer = torch.empty(32, VOCAB, device="cuda")
    for round_number in range(9):
        num = 3 if round_number < 6 else len(seqs)  # (round 6 fills 6 more: the tables grow)
        items = _items(seqs[:num], outputs, greedy)
        rows, start = [], 0
        for item in items:
            rows.append(range(start, start + len(item.tree) + 1))
            start += len(item.tree) + 1
        logits = torch.randn(32, VOCAB) * 4
        want = reference_bend(items, rows, logits[:start])
        buffer.copy_(logits)
        torch.cuda.synchronize()
        steady = round_number not in (0, 1, 6, 7)  # (filled or captured: eager or a sync)
        if steady:
            torch.cuda._sleep(10**7)  # (device work queued before it, as a step run ahead)
            torch.cuda.set_sync_debug_mode("error")
        replays = graphs.replays
        try:
            bent = bend_by_rules(
                items, buffer[:start], rows, None, (kept, seqs[:num]), graphs=graphs
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert bent is not None
        assert graphs.replays == replays + (round_number not in (0, 6))
        assert torch.equal(buffer[:start].cpu(), want)
        assert torch.equal(buffer[start:].cpu(), logits[start:])
        if greedy and round_number not in (0, 6):
            assert bent.argmax is not None
            assert torch.equal(bent.argmax.cpu(), want.argmax(dim=-1))
        for i, item in enumerate(items):
            keep_rules(item, seqs[i], [i % 7, 12])
            outputs[i] += [i % 7, 12]
    assert len(kept.bias) > MIN_SLOTS and graphs.tables == tuple(
        t.data_ptr() for t in (kept.bias, kept.counts, kept.seen)
    )


def test_the_engine_serves_rules_rounds_through_the_graphs(
    target_dir: Path,  # noqa: F811
    reference: object,  # noqa: F811
    truth: list[int],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode steps run ahead, speculative rounds of trees and sampled rounds under rules on the
    verifier engine (CUDA graphs on): the target's greedy tokens under the rules, the bent
    distribution's draws, and rounds bent by the rules graphs among them."""
    replayed: list[int] = []
    bend = RulesGraphs.bend

    def counting(self: RulesGraphs, *args: object, **kwargs: object) -> object:
        out = bend(self, *args, **kwargs)  # type: ignore[arg-type]
        replayed.append(out is not None)
        return out

    monkeypatch.setattr(RulesGraphs, "bend", counting)
    test_verify_rules.test_decode_steps_under_rules_are_the_targets_greedy_tokens(
        target_dir, "cuda", truth
    )
    decode = sum(replayed)
    test_verify_rules.test_speculative_rounds_commit_the_targets_greedy_tokens_under_the_rules(
        target_dir,
        reference,
        "cuda",
        truth,  # type: ignore[arg-type]
    )
    speculative = sum(replayed) - decode
    test_verify_rules.test_sampled_rounds_draw_from_the_bent_distribution(target_dir, "cuda")
    sampled = sum(replayed) - decode - speculative
    # (a tree of 4 and its pending token pass the 1 + 3 graph: the forward runs eagerly, its
    # logits no graph's buffer, and so does the bending; the last round's smaller tree fits)
    assert decode >= 5 and speculative >= 1 and sampled >= 1, (decode, speculative, sampled)


def test_a_guides_masks_ride_the_graphs() -> None:
    """tests/unit/test_rules_graphs.py's guided rounds on the GPU at SmolLM2's vocabulary: the
    masks' words in the captured table, every row the reference's."""
    test_rules_graphs.test_a_guides_masks_ride_the_fixed_layout("cuda", VOCAB)
