"""The rules graphs' fixed layout (verifier/rules_graphs.py) under the Triton interpreter: steady
rounds repacked into it (rule rows, sequences, deltas and paths padded to powers of two, the
padding inert) bend every row as the one-row reference does, bit for bit, through fifteen
rounds of commits and through steps run ahead; the logits' rows past a round's in their buffer
are left as they were; a greedy round's argmax comes from the bent rows; rounds that refill a
slot or hold stop tokens back do not qualify and bend eagerly; a guide's masks ride along. (The
graphs themselves: tests/gpu/test_rules_graphs_gpu.py.)"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from specsplit.logit_rules import NO_MASK, Allowed, LogitRules, Penalties, mask_words
from specsplit.messages import VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.rules_reference import rules_for
from tests.unit import test_rule_rows
from tests.unit.test_verify_rules import reference_bend
from verifier import rules_graphs
from verifier.kept_rules import keep_rules
from verifier.round_rules import bend_by_rules
from verifier.rounds import VerifierSeq
from verifier.rule_rows import RuleRows
from verifier.rules_graphs import RulesGraphs

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py

VOCAB = 64
PENALTIES = Penalties(bias=((3, 2.0),), presence=0.5, frequency=1.25, repetition=1.4, min_p=0.1)


def test_steady_rounds_through_the_fixed_layout_bend_as_the_reference() -> None:
    graphs = RulesGraphs("cpu", capture=False)
    test_rule_rows.test_rounds_count_only_what_their_commits_appended("cpu", True, graphs)
    # (a round with a first-round sequence or a held stop token bends eagerly: not all 15)
    assert 5 <= graphs.replays < 15


def test_steps_run_ahead_through_the_fixed_layout_bend_as_the_reference() -> None:
    graphs = RulesGraphs("cpu", capture=False)
    test_rule_rows.test_a_step_run_ahead_counts_its_pending_token_and_its_commit_follows(
        "cpu", True, graphs
    )
    assert graphs.replays >= 6  # (all but the first round of each)


def round_of(
    seqs: list[VerifierSeq],
    outputs: list[list[int]],
    penalties: Penalties,
    trees: list[DraftTree],
    sampling: SamplingParams = SamplingParams(),  # noqa: B008  (frozen)
) -> list[VerifyInput]:
    """A round of each sequence's tree (in turn) under `penalties` over its output so far."""
    rules = [rules_for(penalties, (7, 30), Counter(output)) for output in outputs[: len(seqs)]]
    return [
        VerifyInput(seq.seq_id, False, 10, [4], trees[i % len(trees)], sampling, rules=rules[i])
        for i, seq in enumerate(seqs)
    ]


def test_padding_rows_stay_and_a_greedy_rounds_argmax_is_the_bent_rows() -> None:
    """Three sequences' rows in a buffer of eight (the forward graph's): the graphs bend rows
    0-4 (padded to eight rule rows over the buffer's eight), rows 5-7 stay; the argmax returned
    is the reference-bent rows'."""
    torch.manual_seed(0)
    graphs, kept = RulesGraphs("cpu", capture=False), RuleRows(VOCAB, "cpu")
    seqs = [VerifierSeq(f"s{i}", None) for i in range(3)]  # type: ignore[arg-type]
    outputs = [[3, 9], [5], [3, 3, 40]]
    trees = [DraftTree([3, 5], [-1, 0]), DraftTree(), DraftTree([9], [-1])]
    for round_number in range(2):  # (the first fills the slots: eager)
        items = round_of(seqs, outputs, PENALTIES, trees)
        rows = [range(0, 3), range(3, 4), range(4, 6)][: len(items)]
        buffer = torch.randn(8, VOCAB) * 4
        before = buffer.clone()
        logits = buffer[:6]
        want = reference_bend(items, rows, before[:6])
        bent = bend_by_rules(items, logits, rows, None, (kept, seqs), True, graphs)
        assert bent is not None and graphs.replays == round_number
        assert bent.eager == (None if round_number else "refill")
        assert torch.equal(logits, want) and torch.equal(buffer[6:], before[6:])
        if round_number:
            assert bent.argmax is not None and torch.equal(bent.argmax, want.argmax(dim=-1))
        for item, seq, output in zip(items, seqs, outputs, strict=True):
            keep_rules(item, seq, [4])
            output.append(4)


@pytest.mark.parametrize("what", ["stops", "new-context"])
def test_rounds_that_do_not_fit_the_fixed_layout_bend_eagerly(what: str) -> None:
    """A sequence's second round (its slot filled by its first): under min_tokens with stop
    tokens held back, or under other penalties (its slot refilled)."""
    base = Penalties(presence=0.5, min_tokens=9 if what == "stops" else 0, stop_ids=(2,))
    graphs, kept = RulesGraphs("cpu", capture=False), RuleRows(VOCAB, "cpu")
    seqs = [VerifierSeq("s0", None)]  # type: ignore[arg-type]
    first = round_of(seqs, [[3]], base, [DraftTree()])
    bend_by_rules(first, torch.randn(1, VOCAB), [range(1)], None, (kept, seqs), True, graphs)
    keep_rules(first[0], seqs[0], [4])
    second = base if what != "new-context" else Penalties(presence=0.7)
    item = round_of(seqs, [[3, 4]], second, [DraftTree()])[0]
    logits = torch.randn(1, VOCAB) * 4
    want = reference_bend([item], [range(1)], logits)
    bent = bend_by_rules([item], logits, [range(1)], None, (kept, seqs), True, graphs)
    assert bent is not None and bent.eager == "refill"
    assert graphs.replays == 0 and torch.equal(logits, want)
    alone = bend_by_rules([item], logits.clone(), [range(1)], None, (kept, seqs), True)
    assert alone is not None and alone.eager == "no graphs"
    # the engine has graphs but the forward's rows were gathered (its logits not static)
    gathered = bend_by_rules(
        [item], logits.clone(), [range(1)], None, (kept, seqs), True, no_graphs="logits"
    )
    assert gathered is not None and gathered.eager == "logits"


def _mask(allowed: np.ndarray, vocab: int) -> bytes:
    bits = np.zeros(mask_words(vocab) * 32, dtype=bool)
    bits[allowed] = True
    return np.packbits(bits, bitorder="little").tobytes()


def test_a_guides_masks_ride_the_fixed_layout(
    on: str = "cpu", vocab: int = VOCAB, replayed: bool = True
) -> None:
    """Three sequences over four rounds, two under a guide (three distinct masks a round, a row
    without one among them; one guided sequence with penalties, one without any), their rows
    in a buffer of eight: every round after the first replays and bends every row as the
    reference does, masks included (on a GPU: `on`, the graphs captured)."""
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    graphs, kept = RulesGraphs(on, capture=on != "cpu"), RuleRows(vocab, on)
    buffer = torch.zeros(8, vocab, device=on)
    seqs = [VerifierSeq(f"s{i}", None) for i in range(3)]  # type: ignore[arg-type]
    outputs = [[3, 9], [5], [3, 3, 40]]
    trees = [DraftTree([3, 5], [-1, 0]), DraftTree([7], [-1]), DraftTree([9], [-1])]
    kinds = [PENALTIES, Penalties(), Penalties(frequency=0.5)]
    for round_number in range(4):
        masks = [_mask(rng.choice(vocab, size=20, replace=False), vocab) for _ in range(3)]
        items = []
        for i in range(3):
            item = round_of(seqs[i : i + 1], [outputs[i]], kinds[i], [trees[i]])[0]
            if i < 2:  # (the first: masks 0, none, 1; the second: masks 2, 0)
                rows = (0, NO_MASK, 1) if i == 0 else (1, 0)
                words = masks[0] + masks[1] if i == 0 else masks[1] + masks[2]
                rules = item.rules or LogitRules(Penalties())  # (the second: the guide alone)
                item.rules = rules.with_allowed(Allowed(words, rows))
            items.append(item)
        rows_of = [range(0, 3), range(3, 5), range(5, 7)]
        logits = torch.randn(7, vocab) * 4
        want = reference_bend(items, rows_of, logits)
        assert torch.isinf(want[[0, 2, 3, 4]]).all(dim=1).tolist() == [False] * 4
        assert torch.isinf(want[[0, 2, 3, 4]]).sum() == 4 * (vocab - 20)  # (each row's mask)
        buffer[:7] = logits.to(on)
        kernel = True if on == "cpu" else None
        bent = bend_by_rules(items, buffer[:7], rows_of, None, (kept, seqs), kernel, graphs)
        assert bent is not None and torch.equal(buffer[:7].cpu(), want)
        steady = None if replayed else "masks"  # (past the masks' cap: eager)
        assert bent.eager == (steady if round_number else "refill")
        assert graphs.replays == (round_number if replayed else 0)  # (the first fills slots)
        for item, seq, output in zip(items, seqs, outputs, strict=True):
            keep_rules(item, seq, [4])
            output.append(4)


def test_rounds_of_more_masks_than_a_graph_holds_bend_eagerly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_MASK_BYTES of (padded) masks' words a round bends eagerly, as the reference
    (three masks a round, padded to four, against room for three)."""
    monkeypatch.setattr(rules_graphs, "MAX_MASK_BYTES", 4 * 3 * mask_words(VOCAB))
    test_a_guides_masks_ride_the_fixed_layout(replayed=False)
