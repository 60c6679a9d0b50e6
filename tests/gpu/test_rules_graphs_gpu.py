"""The rules graphs (verifier/rules_graphs.py) on a CUDA device: a steady round replays its graph
without a host sync behind queued device work and bends every row as the one-row reference does
(bit for bit), a greedy round's argmax with it, the buffer's rows past the round's untouched;
the graphs are dropped and captured again when the kept rows' tables grow, and past MAX_GRAPHS
the least recently replayed goes for a new key; a guide's masks ride
in the captured table; the verifier engine serves decode steps run ahead, speculative rounds
and sampled rounds under rules through them (tests/unit/test_verify_rules.py's cases: the
target's greedy tokens under the rules, the bent distribution); after the warm-up's rehearsal
of rules, rounds mixing requests' rules build no bending kernel. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specsplit.kernels.bend_rules import jitted_kernels
from specsplit.logit_rules import Allowed, Penalties, pack_mask, round_rules, start_context
from specsplit.messages import VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.unit import test_rules_graphs, test_verify_rules
from tests.unit.test_rules_graphs import round_of
from tests.unit.test_verify_logprobs import _engine
from tests.unit.test_verify_rules import (  # noqa: F401  (fixtures)
    reference,
    reference_bend,
    target_dir,
    truth,
)
from verifier import rules_graphs
from verifier.kept_rules import keep_rules
from verifier.round_rules import bend_by_rules
from verifier.rounds import VerifierSeq
from verifier.rule_rows import MIN_SLOTS, RuleRows
from verifier.rules_graphs import RulesGraphs
from verifier.warmup import REHEARSED_RULES, rehearse_rules

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


def _round_logits(
    items: list[VerifyInput],
) -> tuple[list[range], int, torch.Tensor, torch.Tensor]:
    """Each item's logit rows in turn, their count, a 32-row buffer's random logits, and the
    reference's bent rows."""
    rows, start = [], 0
    for item in items:
        rows.append(range(start, start + len(item.tree) + 1))
        start += len(item.tree) + 1
    logits = torch.randn(32, VOCAB) * 4
    return rows, start, logits, reference_bend(items, rows, logits[:start])


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
        rows, start, logits, want = _round_logits(items)
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


def test_past_max_graphs_the_least_recently_replayed_graph_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With room for two graphs, steady rounds over three logits buffers (three keys) in turn:
    each new key drops the least recently replayed graph and captures its own, every round
    still bent as the reference bends it; a key replayed in between stays."""
    monkeypatch.setattr(rules_graphs, "MAX_GRAPHS", 2)
    torch.manual_seed(5)
    graphs, kept = RulesGraphs("cuda"), RuleRows(VOCAB, "cuda")
    seqs = [VerifierSeq(f"s{i}", None) for i in range(3)]  # type: ignore[arg-type]
    outputs = [[i % 4, 40] for i in range(len(seqs))]
    buffers = [torch.empty(32, VOCAB, device="cuda") for _ in range(3)]
    order = [0, 0, 1, 2, 0, 2, 1, 2]  # (the first round fills the slots: eager)
    for round_number, which in enumerate(order):
        items = _items(seqs, outputs, greedy=True)
        rows, start, logits, want = _round_logits(items)
        buffer = buffers[which]
        buffer.copy_(logits)
        keys = [key.logits[0] for key in graphs.graphs]
        bent = bend_by_rules(items, buffer[:start], rows, None, (kept, seqs), graphs=graphs)
        assert bent is not None
        assert torch.equal(buffer[:start].cpu(), want)
        if round_number:
            assert len(graphs.graphs) <= 2
            assert [key.logits[0] for key in graphs.graphs][-1] == buffer.data_ptr()
            if buffer.data_ptr() in keys or len(keys) < 2:  # a hit or room: nothing dropped
                assert set(keys) <= {key.logits[0] for key in graphs.graphs}
        for i, item in enumerate(items):
            keep_rules(item, seqs[i], [i % 7, 12])
            outputs[i] += [i % 7, 12]
    # captured: 0 (round 1), 1, 2 (0 dropped), 0 (1 dropped), 1 (0 dropped; 2 replayed last)
    assert graphs.evicted == 3


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


def _kernels_built() -> int:
    """The bending kernels' variants compiled in this process (every device)."""
    return sum(
        len(caches[0])
        for kernel in jitted_kernels(False)
        for caches in kernel.device_caches.values()
    )


def test_after_the_rules_rehearsal_mixed_rules_build_no_kernel(target_dir: Path) -> None:  # noqa: F811
    """`rehearse_rules` (the warm-up's) builds a variant per kind of rules, and a round's rules
    are the union of its sequences': rounds of four requests with different rules (a bias;
    presence and repetition; min_tokens and min_p; a guide), greedy and sampled, a prefill,
    chains, a tree and decode steps, then the same requests alone, build none more."""
    engine = _engine(target_dir, "cuda")
    rehearse_rules(engine)
    built = _kernels_built()
    assert built >= len(REHEARSED_RULES)
    mixed = (
        Penalties(bias=((5, -1.5),)),
        Penalties(presence=0.3, repetition=1.3),
        Penalties(min_tokens=12, stop_ids=(4,), min_p=0.1),
        Penalties(),  # guided: every token but 6 allowed
    )
    allowed = np.ones(engine.vocab_size, dtype=bool)
    allowed[6] = False
    mask = pack_mask(allowed).tobytes()
    chain, tree = DraftTree([7, 8, 9], [-1, 0, 1]), DraftTree([3, 9, 4], [-1, -1, 0])
    shapes = ((chain, 1), (DraftTree(), 2), (tree, 1), (chain, 1), (DraftTree(), 1))
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=3)):
        for together in (mixed, *((p,) for p in mixed)):
            seq_ids = [f"m{i}" for i in range(len(together))]
            tokens = {s: list(range(3 + i, 13 + i)) for i, s in enumerate(seq_ids)}
            contexts = {
                s: start_context(p, tokens[s]) for s, p in zip(seq_ids, together, strict=True)
            }
            committed = dict.fromkeys(seq_ids, 0)
            for draft, steps in shapes:
                items = []
                for s, penalties in zip(seq_ids, together, strict=True):
                    guide = None if penalties.active else Allowed(mask, (0,) * (len(draft) + 1))
                    item = VerifyInput(
                        s,
                        committed[s] == 0,
                        committed[s],
                        tokens[s][committed[s] :],
                        draft,
                        sampling=sampling,
                        rules=round_rules(contexts[s], guide, kept=committed[s] > 0),
                    )
                    item.decode_steps = 1 if guide else steps
                    items.append(item)
                for out in engine.verify(items):
                    tokens[out.seq_id] += out.new_tokens
                    committed[out.seq_id] = out.kv_committed_len
                    context = contexts[out.seq_id]
                    assert context is not None
                    contexts[out.seq_id] = context.after(out.new_tokens)
            engine.release(seq_ids)
    assert _kernels_built() == built
    engine.check_integrity()
    assert engine.num_pages_used == 0
