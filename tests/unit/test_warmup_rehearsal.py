"""The services' warm-up on a GPU builds what traffic would otherwise build on its first
requests (bench/cold_shapes.py): every paged-attention variant of the KV layout, and a rehearsal
of rounds as traffic runs them in each engine. On the CPU both run here as written (the kernel
under the Triton interpreter): they must leave no sequence and no page behind and keep the
engines' invariants."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drafter.engine import DrafterEngine
from specsplit.kernels.paged_attention import warm_up
from specsplit.messages import DraftInput, DraftOutput, VerifyInput, VerifyOutput
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from tests.eagle_random import save_target_and_drafters
from tests.unit.test_verify_rules import _rules_counts
from verifier.engine import VerifierEngine
from verifier.warmup import REHEARSED_RULES, graphs_reserve_bytes, rehearse, rehearse_rules


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_target_and_drafters(tmp_path_factory.mktemp("rehearsal"))


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "page_size"), [(4, 2, 16), (9, 3, 1)])
def test_attention_warm_up_launches_every_variant(
    triton_interpreter, num_heads: int, num_kv_heads: int, page_size: int
) -> None:
    k = torch.randn(64, num_kv_heads, 16)
    v = torch.randn(64, num_kv_heads, 16)
    before = k.clone(), v.clone()
    # three BLOCK_M classes x causal / tree x single pass / split
    assert warm_up(k, v, num_heads, page_size, torch.float32) == 12
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])  # the cache is only read


def test_verifier_rehearsal_leaves_nothing(models, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its rounds, the last of 3 decode steps (its 2 further steps run step by step), leave no
    sequence or page."""
    model, config = load_model(str(models["target"]), dtype=torch.float32, device="cpu")
    engine = VerifierEngine(
        model, make_kv_cache(config, 64, 16, torch.float32, "cpu"), 256, config.vocab_size
    )
    verify, rounds = engine.verify, []

    def recorded(inputs: list[VerifyInput]) -> list[VerifyOutput]:
        outputs = verify(inputs)
        rounds.append(outputs)
        return outputs

    monkeypatch.setattr(engine, "verify", recorded)
    rehearse(engine)
    assert rounds and all(len(out.decoded_tokens) == 2 for out in rounds[-1])
    engine.check_integrity()
    assert engine.num_pages_used == 0 and not engine.seqs


def test_verifier_rules_rehearsal_bends_every_round_and_leaves_nothing(models) -> None:
    """Each rehearsed kind of rules, greedy and sampled, without and with a guide, 4 rounds:
    every round and decode step bent by the rules; no sequence, page or rules slot left."""

    def bent() -> float:
        counts = _rules_counts()
        return counts["graph"] + counts["eager"]

    model, config = load_model(str(models["target"]), dtype=torch.float32, device="cpu")
    engine = VerifierEngine(
        model, make_kv_cache(config, 64, 16, torch.float32, "cpu"), 256, config.vocab_size
    )
    before = bent()
    assert rehearse_rules(engine) == 4 * 2 * 2 * len(REHEARSED_RULES)
    # (4 rounds a kind, sampling and guide, the third of 3 decode steps without a guide: 6 steps
    # and 4 steps, each bent)
    assert bent() - before == (6 + 4) * 2 * len(REHEARSED_RULES)
    engine.check_integrity()
    assert engine.num_pages_used == 0 and not engine.seqs and engine.rule_rows.num_used == 0


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_drafter_rehearsal_leaves_nothing(
    models, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its rounds draft (EAGLE: from the features), a sequence's under logit rules and a guided
    one's among them; they leave no sequence or page."""
    path = models[kind]
    engine = DrafterEngine.load(
        kind, str(path), target_path=str(models["target"]), num_pages=64, graph_catch_up_lens=()
    )
    draft, drafted = engine.draft, []

    def recorded(inputs: list[DraftInput]) -> list[DraftOutput]:
        outputs = draft(inputs)
        drafted.extend(zip(inputs, outputs, strict=True))
        return outputs

    monkeypatch.setattr(engine, "draft", recorded)
    assert engine.rehearse() >= 10
    assert all(len(out.tree) for _, out in drafted)
    assert any(item.rules is not None and item.rules.penalties.active for item, _ in drafted)
    assert any(item.root_allowed for item, _ in drafted)
    engine.check_integrity()
    assert engine.num_pages_used == 0 and not engine.seqs


def test_the_kv_pool_keeps_room_for_the_graphs_only_when_there_are_graphs() -> None:
    assert graphs_reserve_bytes(49152, (), 64) == 0  # eager: every byte to the KV pool
    # SmolLM2's vocabulary, the default shapes: float32 logits of 64 x 17 rows, twice per step
    # graph (5) and 7 more for the sampled acceptance, plus 4 prefills of 32 + 64 + 128 rows, twice
    logits = 64 * 17 * 49152 * 4
    expected = 2 * logits * 5 + 7 * logits + 2 * 4 * 224 * 49152 * 4
    assert graphs_reserve_bytes(49152, (1, 4, 5, 9, 17), 64) == expected
