"""A round launched in parts on a CUDA device (`graph_parts`): six prefills at once replay two
prefill graphs, six sequences' trees and a newcomer's prefill two graphs, a prompt longer than
the largest prefill graph leads in by its replays (verifier/lead_in.py), none of it eagerly,
and every round answers as an engine without graphs does (tokens, committed KV lengths,
hidden-state rows). Skipped without a GPU."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.tree import DraftTree
from tests.support import TINY_VOCAB
from tests.unit.test_graph_parts import _rounds, target_dir, truths  # noqa: F401 (fixtures)
from verifier.engine import VerifierEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
JOINING = {0: "abcdef", 3: "g"}  # round 3: six trees and a prefill


class CountingModel:
    """The engine's model, counting its eager forwards (a graph's replay calls none)."""

    def __init__(self, model: Any) -> None:
        self.model, self.calls = model, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _engine(path: Path, graphs: bool, num_pages: int = 128) -> tuple[VerifierEngine, CountingModel]:
    model, config = load_model(str(path), dtype=torch.float32, device="cuda")
    kv = make_kv_cache(config, num_pages, 4, torch.float32, "cuda")
    engine = VerifierEngine(
        model,
        kv,
        config.max_position_embeddings,
        config.vocab_size,
        graph_query_lens=(1, 4, 5) if graphs else (),
        max_batch_size=8,
    )
    if graphs:
        engine.warmup()
        # Replaying parts or not is timed at warm-up; tests here ask for parts whatever the
        # timings (beside other test processes they vary), so the answers are what they check.
        assert engine.graphs is not None
        engine.graphs.eager_round_ms = None
    counting = CountingModel(engine.model)
    engine.model = counting  # type: ignore[assignment]
    return engine, counting


@pytest.mark.parametrize("layers", [(), (0, 1)], ids=["", "hidden"])
def test_trees_beside_a_prefill_replay_two_graphs_and_answer_as_eager(
    target_dir: Path,  # noqa: F811
    truths: dict[str, list[int]],  # noqa: F811
    layers: tuple[int, ...],
) -> None:
    eager, _ = _engine(target_dir, graphs=False)
    expected = _rounds(eager, truths, layers, sampled=False, joining=JOINING)
    engine, counting = _engine(target_dir, graphs=True)
    calls = []
    launch = engine.launch

    def counted(inputs: Any) -> Any:
        before = counting.calls
        launched = launch(inputs)
        calls.append((len(inputs), sum(i.begin for i in inputs), counting.calls - before))
        return launched

    engine.launch = counted  # type: ignore[method-assign]
    got = _rounds(engine, truths, layers, sampled=False, joining=JOINING)
    assert [(o.accepted_tokens, o.bonus_token, o.kv_committed_len) for o in got] == [
        (o.accepted_tokens, o.bonus_token, o.kv_committed_len) for o in expected
    ]
    for a, b in zip(expected, got, strict=True):
        if layers:
            assert a.hidden_states is not None and b.hidden_states is not None
            # float32: the graphs' padded steps reduce in another order (2.4e-4 on an H200)
            torch.testing.assert_close(a.hidden_states, b.hidden_states, atol=1e-3, rtol=1e-3)
    # round 0: six prefills at once, past the prefill graphs' 4: two parts of them (4 + 2);
    # round 3: the trees and the newcomer, two parts; no round eager
    assert calls[0] == (6, 6, 0) and calls[3] == (7, 1, 0), calls
    assert all(eager == 0 for _, _, eager in calls), calls


LONG = [random.Random(7).randrange(3, TINY_VOCAB) for _ in range(300)]  # past a prefill graph


def _long_rounds(engine: VerifierEngine, layers: tuple[int, ...]) -> list[VerifyOutput]:
    """ "a" begins (20 tokens), then "b" with a 300-token prompt beside "a"'s decode step, then
    three rounds of both; every round's outputs."""
    tokens = {"a": LONG[:20]}
    committed = {"a": 0}
    outputs = []
    for r in range(5):
        if r == 1:
            tokens["b"], committed["b"] = list(LONG), 0
        inputs = [
            VerifyInput(s, committed[s] == 0, committed[s], ids[committed[s] :], DraftTree())
            for s, ids in tokens.items()
        ]
        for item in inputs:
            item.hidden_state_layers = layers
        for out in engine.verify(inputs):
            tokens[out.seq_id] += [*out.accepted_tokens, out.bonus_token]
            committed[out.seq_id] = out.kv_committed_len
            outputs.append(out)
    engine.release(list(tokens))
    engine.check_integrity()
    return outputs


@pytest.mark.parametrize("layers", [(), (0, 1)], ids=["", "hidden"])
def test_a_long_prompt_leads_in_by_prefill_graphs_and_answers_as_eager(
    target_dir: Path,  # noqa: F811
    layers: tuple[int, ...],
) -> None:
    """A 300-token prompt beside a running sequence: 256 of its tokens lead in (two replays of
    the 128-token prefill graph), the round takes the rest; no forward runs eagerly, and every
    round answers as an engine without graphs (tokens, lengths, hidden-state rows)."""
    eager, _ = _engine(target_dir, graphs=False, num_pages=256)
    expected = _long_rounds(eager, layers)
    engine, counting = _engine(target_dir, graphs=True, num_pages=256)
    leads: list[int] = []
    lead_in = engine._lead_in

    def counted(items, seqs, lens):  # type: ignore[no-untyped-def]
        leads.extend(m for m in lens if m)
        return lead_in(items, seqs, lens)

    engine._lead_in = counted  # type: ignore[method-assign]
    got = _long_rounds(engine, layers)
    assert leads == [256]
    assert counting.calls == 0
    assert [(o.seq_id, o.bonus_token, o.kv_committed_len) for o in got] == [
        (o.seq_id, o.bonus_token, o.kv_committed_len) for o in expected
    ]
    for a, b in zip(expected, got, strict=True):
        assert (a.hidden_states is None) == (b.hidden_states is None) == (not layers)
        if a.hidden_states is not None and b.hidden_states is not None:
            assert b.hidden_states.shape[0] == a.hidden_states.shape[0]
            torch.testing.assert_close(a.hidden_states, b.hidden_states, atol=2e-2, rtol=2e-2)
