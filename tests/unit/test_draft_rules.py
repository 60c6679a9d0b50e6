"""The drafter bends its drafts' logits by a request's bias and penalties (drafter/draft_rules.py).
Named invariants:
- the device tables bend a row exactly as the verifier's reference `bend_row` does with the same
  rules (output through the root, no tree path), each rule alone and all together, over the
  target's vocabulary and over a head's own columns; slot 0 leaves a row as it is;
- the rows follow the sequence's tokens through appends, a rejected tail sent again, a
  truncation and a change of rules, and min_tokens' stop tokens are -inf until the output
  reaches it; the count changes counted in by a run (crossing with its metadata, zero-padded)
  equal those counted in at the call's end, and more than a run carries are counted in before
  it;
- a sequence past the tables' slots drafts unbent until a slot is free; a release gives it back;
- the device expansion (graphs' path) drafts the host expansion's trees under rules (chains,
  trees, sampled chains, draft models and EAGLE heads, draft-ahead too; the count changes
  crossing with its runs, or counted in before one that cannot carry them all), and they are
  not the unbent trees;
- a guide's root mask bends the roots' rows alone (as bend_row bends a guided root row), with or
  without penalties, and the first drafts keep to it;
- a bias of -100 keeps its tokens out of every draft;
- a drafter that is the target, under a bias alone, has every draft accepted (as few rounds as
  without rules) and the output is the target's under the bias.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from drafter.draft_rules import RuleTables
from drafter.eagle import load_eagle3
from drafter.eagle_proposer import Eagle3Proposer
from drafter.engine import DrafterEngine
from drafter.model_proposer import ModelProposer
from drafter.tree_draft import TreeProposer
from drafter.types import DraftJob, DraftSeq
from specsplit.errors import Code, ServiceError
from specsplit.logit_rules import Allowed, LogitRules, Penalties, bend_row, distinct, pack_mask
from specsplit.messages import DraftInput, DraftOutput, DraftRules, SpecParams
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from tests.eagle_random import save_random_eagle3
from tests.rules_reference import rules_for
from tests.support import TINY_VOCAB, save_tiny_llama

VOCAB = 64
PROMPT = [5, 9, 9, 12, 30, 41]
EACH_RULE = {
    "bias": Penalties(bias=((3, 2.5), (9, -1.25), (40, -100.0))),
    "presence-frequency": Penalties(presence=0.75, frequency=0.5),
    "negative-frequency": Penalties(frequency=-0.5),
    "repetition": Penalties(repetition=1.3),
    "min-tokens": Penalties(min_tokens=8, stop_ids=(2, 7, 63)),
    "all": Penalties(
        bias=((7, 1.5), (12, -3.0)),
        presence=0.5,
        frequency=0.25,
        repetition=0.8,
        min_tokens=5,
        stop_ids=(7, 11),
    ),
}


def _seq(
    tokens: list[int], penalties: Penalties | None, output_start: int = len(PROMPT)
) -> DraftSeq:
    seq = DraftSeq("s", list(tokens))
    seq.rules = None if penalties is None else DraftRules(penalties, output_start)
    return seq


def _job(seq: DraftSeq, start: int = 0) -> DraftJob:
    return DraftJob(seq, SpecParams(3, 1, 3), SamplingParams(), start)


def _reference(seq: DraftSeq, row: torch.Tensor) -> torch.Tensor:
    """`row` [VOCAB] bent by the verifier's reference with the rules made afresh from the tokens
    (tests/rules_reference.py), the output through the root."""
    assert seq.rules is not None
    start = seq.rules.output_start
    rules = rules_for(
        seq.rules.penalties, distinct(seq.tokens[:start]), Counter(seq.tokens[start:])
    )
    return row if rules is None else bend_row(row, rules, [])


def _bent(tables: RuleTables, slot: int, row: torch.Tensor, columns: np.ndarray) -> torch.Tensor:
    return tables.bend(row[None, columns], torch.tensor([slot]))[0]


def _take(tables: RuleTables, jobs: list[DraftJob], how: str = "flush") -> None:
    """The round's `take`, its count changes counted in as a call's end does ("flush") or as a
    run does ("run": handed out for a run of capacity 4, zero-padded as its crossing is)."""
    tables.take(jobs)
    if how == "flush":
        tables.flush()
        return
    capacity = 4
    deltas = tables.deltas(capacity)
    crossing = np.zeros((2, capacity), dtype=np.int32)
    crossing[:, : deltas.shape[1]] = deltas
    tables.count_in(torch.from_numpy(crossing))
    tables.flush()  # (nothing left: the run took them, or they were counted in before it)


@pytest.mark.parametrize("columns", ["target", "head"])
@pytest.mark.parametrize("rule", list(EACH_RULE))
def test_the_tables_bend_a_row_as_bend_row(rule: str, columns: str) -> None:
    scored = np.arange(VOCAB) if columns == "target" else np.arange(1, VOCAB, 2)  # (a head's)
    ids = None if columns == "target" else torch.from_numpy(scored)
    tables = RuleTables(VOCAB, ids, torch.device("cpu"), slots=4)
    output = [9, 40, 3, 3, 17, 2]
    seq = _seq(PROMPT + output, EACH_RULE[rule])
    job = _job(seq)
    _take(tables, [job])
    assert job.rule_slot == 1 and job.bent
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        row = torch.randn(VOCAB, generator=gen) * 4
        want = _reference(seq, row)[scored]
        got = _bent(tables, job.rule_slot, row, scored)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert torch.equal(_bent(tables, 0, row, scored), row[scored])  # (slot 0: unbent)
    assert not torch.equal(want, row[scored])  # (each rule changes the row)


@pytest.mark.parametrize("how", ["flush", "run"])
def test_the_rows_follow_the_sequences_tokens(how: str) -> None:
    """Appends (the root sent again), a rejected tail replaced, a truncation, other rules: after
    each round the rows bend as the rules made afresh from the tokens; the stop tokens are -inf
    until the output holds min_tokens tokens, then their own bias. "run": the changes cross
    with a run of capacity 4 (the first round's 8 and the replaced tail's 6 do not fit)."""
    tables = RuleTables(VOCAB, None, torch.device("cpu"), slots=2)
    every = np.arange(VOCAB)
    penalties = Penalties(((7, 2.0),), 0.5, 0.75, 1.2, min_tokens=5, stop_ids=(7, 8))
    seq = _seq(PROMPT + [3], penalties)
    gen = torch.Generator().manual_seed(5)

    def check(start: int) -> None:
        job = _job(seq, start)
        _take(tables, [job], how)
        row = torch.randn(VOCAB, generator=gen) * 3
        torch.testing.assert_close(
            _bent(tables, job.rule_slot, row, every), _reference(seq, row), rtol=0, atol=0
        )

    check(0)
    for new in ([4, 3], [9, 9, 12], [7]):  # the root goes again, then the new tokens
        start = len(seq.tokens) - 1
        seq.tokens += new
        check(start)
    stops = tables.bias[1, [7, 8]].tolist()
    assert stops == [2.0, 0.0]  # (the output holds 7 tokens now, past min_tokens)
    start = len(seq.tokens) - 4  # a tail the drafter held, replaced
    seq.tokens[start:] = [30, 30, 31]
    check(start)
    del seq.tokens[len(PROMPT) + 2 :]  # truncated (a session's turn boundary)
    check(len(seq.tokens) - 1)
    assert tables.bias[1, 7] == -np.inf  # (back under min_tokens)
    seq.rules = DraftRules(Penalties(repetition=2.0), len(PROMPT) + 1)  # other rules
    check(len(seq.tokens) - 1)
    assert torch.equal(tables.bias[1], torch.zeros(VOCAB))
    seq.rules = None
    job = _job(seq, len(seq.tokens) - 1)
    _take(tables, [job])
    assert (job.rule_slot, job.bent, tables.num_used) == (0, False, 0)


def _mask(allowed: np.ndarray) -> bytes:
    return pack_mask(allowed).tobytes()


@pytest.mark.parametrize("columns", ["target", "head"])
@pytest.mark.parametrize("rule", ["none", "all"])
def test_a_guides_root_mask_bends_the_roots_rows_alone(rule: str, columns: str) -> None:
    scored = np.arange(VOCAB) if columns == "target" else np.arange(1, VOCAB, 2)
    ids = None if columns == "target" else torch.from_numpy(scored)
    tables = RuleTables(VOCAB, ids, torch.device("cpu"), slots=4)
    seq = _seq(PROMPT + [9, 40, 3], EACH_RULE["all"] if rule == "all" else None)
    allowed = np.random.default_rng(4).random(VOCAB) < 0.4
    job = _job(seq)
    job.root_allowed = _mask(allowed)
    _take(tables, [job])
    assert job.rule_slot == 1
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(6)) * 4
    plain = row if seq.rules is None else _reference(seq, row)
    guided = bend_row(plain, LogitRules(Penalties(), allowed=Allowed(job.root_allowed, (0,))), [])
    slots = torch.tensor([job.rule_slot])
    root = tables.bend(row[None, scored], slots, root=True)[0]
    torch.testing.assert_close(root, guided[scored], rtol=0, atol=0)
    torch.testing.assert_close(_bent(tables, 1, row, scored), plain[scored], rtol=0, atol=0)
    assert torch.isinf(root[torch.from_numpy(~allowed[scored])]).all()
    job = _job(seq, len(seq.tokens) - 1)  # a round without a mask (the guide ended, or none)
    tables.take([job])
    assert (job.rule_slot > 0) == (seq.rules is not None)
    if job.rule_slot:
        assert torch.equal(tables.bend(row[None, scored], slots, root=True)[0], plain[scored])
    tables.release(seq)
    assert tables.num_used == 0


def test_a_sequence_past_the_slots_drafts_unbent_until_one_is_free() -> None:
    tables = RuleTables(VOCAB, None, torch.device("cpu"), slots=2)
    seqs = [_seq(PROMPT + [b], Penalties(presence=1.0)) for b in range(3)]
    jobs = [_job(seq) for seq in seqs]
    tables.take(jobs)
    assert [job.rule_slot for job in jobs] == [1, 2, 0]
    assert all(job.bent for job in jobs)  # (the round bends: slot 0 rows pass unbent)
    tables.release(seqs[0])
    jobs = [_job(seq, len(seq.tokens) - 1) for seq in seqs[1:]]
    tables.take(jobs)
    assert [job.rule_slot for job in jobs] == [2, 1]
    for seq in seqs:
        tables.release(seq)
    assert tables.num_used == 0


GREEDY = SamplingParams()

# -- through the drafter ---------------------------------------------------------------------

# a rule of each kind the drafter reads, a sequence each (the third without rules)
# (strong: a random head's logits spread ~8 apart, the bias's +20 fades as its token counts)
RULES = [
    Penalties(((5, -3.0), (17, 20.0), *((t, -100.0) for t in range(30, 60))), 2.0, 2.0),
    Penalties(repetition=6.0, min_tokens=30, stop_ids=(2, 11)),
    None,
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-rules")
    target = save_tiny_llama(root / "target", seed=5, num_layers=2)
    _, config = load_model(str(target), dtype=torch.float64, device="cpu")
    head = save_random_eagle3(root / "head", config, seed=9, draft_vocab_size=300)
    return {"target": target, "head": head, "draft": save_tiny_llama(root / "draft", seed=21)}


def _engine(models: dict[str, Path], kind: str, on_device: bool) -> DrafterEngine:
    proposer: TreeProposer
    if kind == "model":
        model, config = load_model(str(models["draft"]), dtype=torch.float64, device="cpu")
        kv = make_kv_cache(config, 512, 4, torch.float64, "cpu")
        proposer = ModelProposer(model, kv, config.vocab_size, config.max_position_embeddings)
    else:
        head = load_eagle3(str(models["head"]), str(models["target"]), torch.float64, "cpu")
        proposer = Eagle3Proposer(head, head.make_kv_cache(512, 4))
    proposer.device_expansion = on_device
    return DrafterEngine(proposer)


def _rounds(
    engine: DrafterEngine,
    spec: SpecParams,
    rules: list[Penalties | None],
    sampling: SamplingParams = GREEDY,
    ahead: bool = False,
    guided: bool = False,
) -> list[list[DraftOutput]]:
    """A sequence per entry of `rules`, five rounds, each appending the first two drafts of the
    last (and a token of its own; the first sequence 30 more in round 2: more count changes than
    the round's run carries, DELTAS_PER_ROW a row, so they are counted in before it); with
    `ahead`, then a draft-ahead call for each (the chain its
    last round drafted); `guided`: every Draft with a random root mask (ROOT_MASKS' for its
    round and sequence)."""
    width = getattr(engine.proposer, "feature_width", None)
    gen = torch.Generator().manual_seed(7)
    jump = torch.Generator().manual_seed(11)  # (its own: the other inputs stay as they were)
    tokens = [
        torch.randint(3, TINY_VOCAB, (9 + b,), generator=gen).tolist() for b in range(len(rules))
    ]
    prompt_lens = [len(t) for t in tokens]
    held = [0] * len(rules)
    outs: list[list[DraftOutput]] = []
    for r in range(5):
        inputs = []
        for b, penalties in enumerate(rules):
            if r:
                tokens[b] += outs[-1][b].tree.tokens[:2] + [3 + (r * 7 + b) % 50]
            extra = 30 if (r, b) == (2, 0) else 0
            tokens[b] += torch.randint(3, TINY_VOCAB, (extra,), generator=jump).tolist()
            start = min(held[b], len(tokens[b]) - 1)
            rows = (
                None
                if width is None
                else torch.cat([
                    torch.randn(len(tokens[b]) - start - 1 - extra, width, generator=gen),
                    torch.randn(extra, width, generator=jump),
                ])
            )  # fmt: skip
            item = DraftInput(f"s{b}", r == 0, start, tokens[b][start:], spec, sampling=sampling,
                              target_hidden_states=rows)  # fmt: skip
            if r == 0 and penalties is not None:
                item.rules = DraftRules(penalties, prompt_lens[b])
            if guided:
                item.root_allowed = _mask(ROOT_MASKS[r, b])
            inputs.append(item)
            held[b] = len(tokens[b]) - (1 if width is not None else 0)
        outs.append(engine.draft(inputs))
        engine.check_integrity()
    if ahead:
        inputs = [
            DraftInput(
                f"s{b}",
                False,
                len(tokens[b]) - 1,
                tokens[b][-1:],
                spec,
                sampling=sampling,
                verifying=outs[-1][b].tree,
                ahead_guesses=2,
                root_allowed=_mask(ROOT_MASKS[5, b]) if guided else b"",
            )
            for b in range(len(rules))
        ]
        outs.append(engine.draft(inputs))
    engine.release([f"s{b}" for b in range(len(rules))])
    assert engine.num_pages_used == 0
    tables = getattr(engine.proposer, "rule_tables", None)
    assert tables is None or tables.num_used == 0  # (the slots given back)
    return outs


def _found(outs: list[list[DraftOutput]]) -> list[object]:
    return [
        [(o.tree.tokens, o.tree.parents, [(a.tokens, a.tree.tokens) for a in o.ahead]) for o in out]
        for out in outs
    ]


SAMPLED = SamplingParams(temperature=0.8, seed=3)
CASES = {
    "chain": (SpecParams(3, 1, 3), GREEDY, False),
    "tree": (SpecParams(3, 2, 5), GREEDY, False),
    "sampled-chain": (SpecParams(3, 1, 3), SAMPLED, False),
    "chain-ahead": (SpecParams(3, 1, 3), GREEDY, True),
}
# [round, sequence, token]: the tokens a guide allows at each root (a third of them)
ROOT_MASKS = np.random.default_rng(8).random((6, len(RULES), TINY_VOCAB)) < 0.33


@pytest.mark.parametrize("guided", [False, True], ids=["rules", "rules-guided"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_the_device_expansion_bends_as_the_host_expansion(
    models: dict[str, Path], kind: str, case: str, guided: bool
) -> None:
    spec, sampling, ahead = CASES[case]
    device = _rounds(_engine(models, kind, True), spec, RULES, sampling, ahead, guided)
    host = _rounds(_engine(models, kind, False), spec, RULES, sampling, ahead, guided)
    assert _found(device) == _found(host)
    if guided:  # (the first drafts keep to the root's mask; the ahead call's k = 0 guesses too)
        for r, out in enumerate(device):
            for b, o in enumerate(out):
                firsts = [t for t, p in zip(o.tree.tokens, o.tree.parents, strict=True) if p < 0]
                firsts += [a.tokens[0] for a in o.ahead if len(a.tokens) == 1]
                assert all(ROOT_MASKS[r, b, t] for t in firsts), (r, b, firsts)
        return
    for want, got in zip(host, device, strict=True):
        for a, b in zip(want, got, strict=True):
            if a.tree.draft_probs is not None:
                assert b.tree.draft_probs is not None
                torch.testing.assert_close(b.tree.draft_probs.dense(), a.tree.draft_probs.dense())
    unbent = _rounds(_engine(models, kind, True), spec, [None] * len(RULES), sampling, ahead)
    bent_seqs = [[out[b] for out in device] for b in range(2)]
    plain_seqs = [[out[b] for out in unbent] for b in range(2)]
    assert _found([bent_seqs[0]]) != _found([plain_seqs[0]])
    assert _found([bent_seqs[1]]) != _found([plain_seqs[1]])
    assert _found([[out[2] for out in device]]) == _found([[out[2] for out in unbent]])


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_a_bias_of_minus_100_keeps_its_tokens_out_of_every_draft(
    models: dict[str, Path], kind: str
) -> None:
    spec = SpecParams(3, 2, 6)
    plain = _rounds(_engine(models, kind, True), spec, [None])
    drafted = sorted({t for out in plain for t in out[0].tree.tokens})
    banned = Penalties(tuple((t, -100.0) for t in drafted))
    bent = _rounds(_engine(models, kind, True), spec, [banned])
    assert all(len(out[0].tree) == spec.num_draft_tokens for out in bent)
    assert not {t for out in bent for t in out[0].tree.tokens} & set(drafted)


def test_the_engine_takes_checks_and_clears_rules(models: dict[str, Path]) -> None:
    engine = _engine(models, "model", True)
    proposer = engine.proposer
    assert isinstance(proposer, TreeProposer)
    bad = [
        DraftRules(Penalties(presence=3.0), 2),
        DraftRules(Penalties(bias=((TINY_VOCAB, 1.0),)), 2),
        DraftRules(Penalties(presence=1.0), -1),
    ]
    for rules in bad:
        with pytest.raises(ServiceError) as e:
            engine.draft([DraftInput("s", True, 0, [4, 5, 6], SpecParams(2, 1, 2), rules=rules)])
        assert e.value.code is Code.INVALID_ARGUMENT
    with pytest.raises(ServiceError) as e:  # (a mask's words: a bit a token of the vocabulary)
        engine.draft([DraftInput("s", True, 0, [4, 5], SpecParams(2, 1, 2), root_allowed=b"\0")])
    assert e.value.code is Code.INVALID_ARGUMENT and "root_allowed" in str(e.value)
    rules = DraftRules(Penalties(presence=1.0), 2)
    engine.draft([DraftInput("s", True, 0, [4, 5, 6], SpecParams(2, 1, 2), rules=rules)])
    assert engine.seqs["s"].rules == rules and proposer.rule_tables is not None
    assert proposer.rule_tables.num_used == 1
    engine.draft([DraftInput("s", False, 2, [6, 7], SpecParams(2, 1, 2))])  # (kept)
    assert engine.seqs["s"].rules == rules and proposer.rule_tables.num_used == 1
    off = DraftRules(Penalties(min_p=0.2), 2)  # (rules that change no draft: none)
    engine.draft([DraftInput("s", False, 3, [7, 8], SpecParams(2, 1, 2), rules=off)])
    assert engine.seqs["s"].rules is None and proposer.rule_tables.num_used == 0
    engine.release(["s"])
