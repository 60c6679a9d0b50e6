"""Two Verify rounds in flight on one verifier engine (`VerifierEngine.launch` / `finish`): a
round launched while another is not finished (disjoint sequences, one decode step) gives exactly
the tokens, KV and lengths of the same rounds run one after the other, trees, hidden states and
sampling included; rounds that may not run beside one in flight are told so (`can_launch`), and
releasing or truncating a sequence whose round is in flight is refused. On the CPU a launch
computes everything; tests/gpu/test_verify_pipelined_gpu.py runs these on CUDA graphs, where the
second round is queued behind the first."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from specsplit.messages import Truncation, VerifyInput, VerifyOutput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.support import TINY_VOCAB, save_tiny_llama
from tests.unit.test_decode_ahead import _engine
from verifier.engine import VerifierEngine

LAYERS = (0, 1)  # hidden states of these layers for the "h" sequences


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("pipelined") / "target", seed=31)


@pytest.fixture(scope="module")
def device() -> str:
    """The engines' device (tests/gpu/test_verify_pipelined_gpu.py runs these on CUDA)."""
    return "cpu"


def _greedy(oracle: VerifierEngine, tokens: list[int], n: int) -> list[int]:
    """The target's next n greedy tokens after `tokens` (a throwaway sequence)."""
    out = oracle.verify([VerifyInput("oracle", True, 0, tokens, DraftTree())])[0]
    greedy = [out.bonus_token]
    while len(greedy) < n:
        out = oracle.verify(
            [VerifyInput("oracle", False, out.kv_committed_len, greedy[-1:], DraftTree())]
        )[0]
        greedy.append(out.bonus_token)
    oracle.release(["oracle"])
    return greedy


class Group:
    """Sequences verified together, each round with a random chain or tree of drafts; with an
    `oracle`, the greedy ones' chains start with a few of the target's own next tokens."""

    def __init__(self, names: list[str], seed: int, oracle: VerifierEngine | None = None) -> None:
        self.rng = random.Random(seed)
        self.oracle = oracle
        self.tokens = {n: [self.rng.randrange(3, TINY_VOCAB) for _ in range(5)] for n in names}
        self.committed = dict.fromkeys(names, 0)

    def inputs(self) -> list[VerifyInput]:
        out = []
        for name, tokens in self.tokens.items():
            n = self.rng.randint(0, 3)
            drafts = [self.rng.randrange(3, TINY_VOCAB) for _ in range(n)]
            if self.oracle is not None and name[0] != "s" and self.committed[name] and n:
                right = _greedy(self.oracle, tokens, n)
                k = self.rng.randint(1, n)
                drafts[:k] = right[:k]
            parents = [-1 if i == 0 or self.rng.random() < 0.3 else i - 1 for i in range(n)]
            sampling = SamplingParams(temperature=0.8, seed=7) if name.startswith("s") else None
            out.append(
                VerifyInput(
                    name,
                    self.committed[name] == 0,
                    self.committed[name],
                    tokens[self.committed[name] :],
                    DraftTree(drafts, parents),
                    sampling or SamplingParams(),
                    hidden_state_layers=LAYERS if name.startswith("h") else (),
                )
            )
        return out

    def take(self, outputs: list[VerifyOutput]) -> None:
        for out in outputs:
            self.tokens[out.seq_id][out.kv_committed_len :] = [
                *out.accepted_tokens,
                out.bonus_token,
            ]
            self.committed[out.seq_id] = out.kv_committed_len


def _same(got: list[VerifyOutput], want: list[VerifyOutput]) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g.seq_id, g.accepted_tokens, g.bonus_token, g.kv_committed_len) == (
            w.seq_id,
            w.accepted_tokens,
            w.bonus_token,
            w.kv_committed_len,
        )
        assert (g.hidden_states is None) == (w.hidden_states is None)
        if g.hidden_states is not None and w.hidden_states is not None:
            torch.testing.assert_close(g.hidden_states, w.hidden_states)


def _kv(engine: VerifierEngine, seq_id: str) -> torch.Tensor:
    seq = engine.seqs[seq_id].kv
    slots = seq.slots(0, seq.kv_committed_len)
    return engine.kv.data[:, :, slots]


def test_two_groups_in_flight_verify_as_one_after_the_other(target_dir: Path, device: str) -> None:
    """Group b is launched before group a's round is finished, round after round, a then b
    alternating which goes first; the reference engine runs every round alone."""
    piped, alone = _engine(target_dir, False, device), _engine(target_dir, False, device)
    oracle = _engine(target_dir, False, device)
    groups = [(Group(["a0", "ha1", "sa2"], 1, oracle), Group(["a0", "ha1", "sa2"], 1, oracle)),
              (Group(["b0", "hb1"], 2, oracle), Group(["b0", "hb1"], 2, oracle))]  # fmt: skip
    accepted = 0
    for round_number in range(8):
        first, second = groups if round_number % 2 == 0 else groups[::-1]
        inputs = [first[0].inputs(), second[0].inputs()]
        assert [first[1].inputs(), second[1].inputs()] == inputs  # the same rngs
        launched = piped.launch(inputs[0])
        assert piped.can_launch(inputs[1])
        launched_too = piped.launch(inputs[1])
        got = [piped.finish(launched), piped.finish(launched_too)]
        want = [alone.verify(inputs[0]), alone.verify(inputs[1])]
        for g, w, (group, ref) in zip(got, want, (first, second), strict=True):
            _same(g, w)
            accepted += sum(len(out.accepted_tokens) for out in g)
            group.take(g)
            ref.take(w)
        piped.check_integrity()
    assert accepted > 0  # accepted paths were compacted in both
    for name in ["a0", "ha1", "sa2", "b0", "hb1"]:
        torch.testing.assert_close(_kv(piped, name), _kv(alone, name))
    for engine in (piped, alone):
        engine.release(["a0", "ha1", "sa2", "b0", "hb1"])
        engine.check_integrity()
        assert engine.num_pages_used == 0


def test_what_may_not_run_beside_a_round_in_flight_is_told(target_dir: Path, device: str) -> None:
    """A round sharing a sequence with the round in flight, or of several decode steps, may not
    launch beside it (launch refuses it, changing nothing); nor may anything beside a round
    that ran a decode step ahead. Release and Truncate of a sequence in flight are refused."""
    engine = _engine(target_dir, True, device)
    a, b = Group(["a"], 3), Group(["b"], 4)
    a.take(engine.verify(a.inputs()))
    b.take(engine.verify(b.inputs()))
    launched = engine.launch(a.inputs())
    again = a.inputs()
    assert not engine.can_launch(again)
    with pytest.raises(RuntimeError):
        engine.launch(again)
    steps = b.inputs()
    steps[0].tree, steps[0].decode_steps = DraftTree(), 2
    assert not engine.can_launch(steps)
    with pytest.raises(RuntimeError):
        engine.release(["a"])
    with pytest.raises(RuntimeError):
        engine.truncate([Truncation("a", 1)])
    assert engine.can_launch(b.inputs())
    assert engine.in_flight(["a"]) and not engine.in_flight(["b"])
    a.take(engine.finish(launched))
    assert engine.can_launch(steps) and not engine.in_flight(["a"])
    # a plain decode round runs its next step ahead (decode_ahead): nothing launches beside it
    plain = a.inputs()
    plain[0].tree = DraftTree()
    launched = engine.launch(plain)
    if launched.ahead is not None:
        assert not engine.can_launch(b.inputs())
    a.take(engine.finish(launched))
    engine.release(["a", "b"])
    engine.check_integrity()
    assert engine.num_pages_used == 0
