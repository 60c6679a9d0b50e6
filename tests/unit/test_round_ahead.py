"""The verifier's rounds run ahead on the gateway's hint (`VerifierEngine.hint_next`, draft-ahead's
trees for the outcomes of a round in flight): once that round commits, the round the gateway
will send next is launched before it is asked for, and kept only when the next round is exactly
it. Whatever the gateway sends next (that round, another tree, a release, a truncation), the
tokens and the committed KV are those of an engine without hints, and no page stays held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.messages import AheadTree, NextTrees, Truncation, VerifyInput
from specsplit.tree import DraftTree
from tests.support import save_tiny_llama
from tests.unit.test_decode_ahead import Driver, _chain, _engine, _release, _same
from verifier.device_waits import GAP_PHASES


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("round_ahead") / "target", seed=29)


@pytest.fixture(scope="module")
def device() -> str:
    return "cpu"


WRONG = AheadTree([1, 2], DraftTree([3], [-1]))  # an outcome that does not come


def _hinted_rounds(
    target_dir: Path, device: str, rounds: int, cut: bool = False, hint_b: bool = True
) -> tuple[Driver, Driver]:
    """`rounds` chain rounds of "a" and plain rounds of "b" on two engines; before each round
    of the second, a hint names the next round's tree for the outcome the first engine saw
    ("a": among a wrong outcome's; "b", if `hint_b`: none, misses plain). cut: the round sent
    next has a shorter tree for "a" than the hinted one."""
    plain, hinted = (
        Driver(_engine(target_dir, False, device)),
        Driver(_engine(target_dir, False, device)),
    )
    for driver in (plain, hinted):
        driver.begin("a", "b")
    tree = _chain(target_dir, device, plain, "a", 2)
    for r in range(rounds):
        bases = {s: len(plain.tokens[s]) for s in "ab"}  # committed + pending
        plain.round({"a": tree, "b": DraftTree()})
        outcome = plain.tokens["a"][bases["a"] :]
        following = _chain(target_dir, device, plain, "a", 1 + r % 3)
        hints = [NextTrees("a", bases["a"], [WRONG, AheadTree(outcome, following)])]
        if hint_b:
            hints.append(NextTrees("b", bases["b"], [WRONG], plain=True))
        hinted.engine.hint_next(hints)
        hinted.round({"a": tree, "b": DraftTree()})
        tree = DraftTree(following.tokens[:1], following.parents[:1]) if cut else following
    return plain, hinted


def test_hinted_rounds_are_taken_and_give_the_same_tokens(target_dir: Path, device: str) -> None:
    plain, hinted = _hinted_rounds(target_dir, device, rounds=6)
    _same(plain, hinted)
    engine = hinted.engine
    assert (engine.num_next_used, engine.num_next_dropped) == (5, 0)
    assert (engine.num_ahead_used, engine.num_ahead_dropped) == (0, 0)  # no decode step ahead
    assert not engine.hints.num_not_ahead  # every round had its next one run ahead
    _release(plain, hinted)


@pytest.mark.parametrize("hint_b", [False, True], ids=["dropped", "taken_in_part"])
def test_a_round_other_than_the_hinted_one_drops_it(
    target_dir: Path, device: str, hint_b: bool
) -> None:
    """A round whose tree for "a" is not the hinted one: the round run ahead is dropped, or
    taken for "b" alone (its plain step) while "a"'s share gives its room back."""
    plain, hinted = _hinted_rounds(target_dir, device, rounds=4, cut=True, hint_b=hint_b)
    _same(plain, hinted)
    want = (3, 0) if hint_b else (0, 3)
    assert (hinted.engine.num_next_used, hinted.engine.num_next_dropped) == want
    _release(plain, hinted)


def test_a_hint_for_another_round_or_refused_runs_nothing(target_dir: Path, device: str) -> None:
    driver = Driver(_engine(target_dir, False, device))
    driver.begin("a")
    base = len(driver.tokens["a"])
    engine = driver.engine
    bad = AheadTree([0], DraftTree([10**9], [-1]))  # a token outside the vocabulary
    for hint in (NextTrees("a", base + 1, [], plain=True), NextTrees("a", base, [], plain=False)):
        engine.hint_next([hint])
        driver.round({"a": DraftTree()})
        base = len(driver.tokens["a"])
        assert engine._ahead is None and not engine.hints.next
    engine.hint_next([NextTrees("a", base, [AheadTree([t], bad.tree) for t in range(300)])])
    driver.round({"a": DraftTree()})
    assert engine._ahead is None and engine.num_pages_used == len(engine.seqs["a"].kv.page_table)
    # both hints named the first round (the tuple was made before it), the last was refused
    assert engine.hints.num_not_ahead == {"stale": 2, "refused": 1}
    _release(driver)


@pytest.mark.parametrize("then", ["release", "truncate"])
def test_release_or_truncation_drops_the_round_run_ahead(
    target_dir: Path, device: str, then: str
) -> None:
    driver = Driver(_engine(target_dir, False, device))
    driver.begin("a", "b")
    base = len(driver.tokens["a"])
    engine = driver.engine
    engine.hint_next([NextTrees("a", base, [], plain=True)])
    driver.round({"a": DraftTree(), "b": DraftTree()})
    assert engine._ahead is not None
    if then == "release":
        engine.release(["a"])
        assert engine._ahead is None and engine.num_next_dropped == 1
    else:
        engine.truncate([Truncation("a", 3)])
        assert engine._ahead is None and engine.num_next_dropped == 1
        engine.hint_next([NextTrees("b", len(driver.tokens["b"]), [], plain=True)])
        engine.release(["b"])
        assert not engine.hints.next
    engine.check_integrity()
    engine.release(list(engine.seqs))
    assert engine.num_pages_used == 0


def test_a_round_taken_in_part_gives_each_sequence_its_own_hidden_states(
    target_dir: Path, device: str
) -> None:
    """Hinted rounds asking for hidden states (an EAGLE drafter's), the next round sent for
    "b" only ("a" finished): "b" takes its share, with its own rows from among the round's."""
    layers = (0, 1)
    engines = [_engine(target_dir, False, device) for _ in range(2)]
    committed = {"a": 0, "b": 0}
    tokens = {"a": [5, 17, 99, 3, 250, 41, 8], "b": [7, 7, 300, 12]}
    last = []
    for step in range(3):
        for n, engine in enumerate(engines):
            ids = "ab" if step < 2 else "b"
            if n == 1 and step == 1:  # before the second round: the hint for the third
                engine.hint_next([NextTrees(s, len(tokens[s]), [], plain=True) for s in "ab"])
            items = [
                VerifyInput(s, step == 0, committed[s], tokens[s][committed[s] :], DraftTree(),
                            hidden_state_layers=layers)
                for s in ids
            ]  # fmt: skip
            if step == 2:
                engine.release(["a"])
            outputs = engine.verify(items)
            if n == 1:
                for out in outputs:
                    tokens[out.seq_id] += out.new_tokens
                    committed[out.seq_id] = out.kv_committed_len
            last.append(outputs)
    plain, hinted = last[-2], last[-1]
    assert engines[1].num_next_used == 1
    assert [o.bonus_token for o in hinted] == [o.bonus_token for o in plain]
    assert hinted[0].hidden_states is not None and plain[0].hidden_states is not None
    # bit for bit on the CPU; on a GPU computed in a batch of two, as any round's across batches
    tolerance = 0 if device == "cpu" else 1e-5
    torch.testing.assert_close(
        hinted[0].hidden_states, plain[0].hidden_states, rtol=0, atol=tolerance
    )
    for engine in engines:
        engine.release(list(engine.seqs))
        assert engine.num_pages_used == 0


@pytest.mark.parametrize("launch_on_hint", [False, True])
def test_a_hint_after_its_round_finished_launches_the_next_round_if_none_started(
    target_dir: Path, device: str, launch_on_hint: bool
) -> None:
    """launch_on_hint (the service's, where its calls run on the event loop): a hint that comes
    after its round finished launches the next round then, if none has started since (the time
    since the finish reported as the gap phase "hint"), and the next round takes it; without it
    (the CPU's engine thread) the late hint runs nothing. A round started before the hint:
    nothing runs either."""
    plain, hinted = (
        Driver(_engine(target_dir, False, device)),
        Driver(_engine(target_dir, False, device)),
    )
    hinted.engine.launch_on_hint = launch_on_hint
    gaps: list[str] = []
    hinted.engine.on_gap = lambda phase, seconds: gaps.append(phase)
    for driver in (plain, hinted):
        driver.begin("a", "b")
    for late in (True, False):
        bases = {s: len(hinted.tokens[s]) for s in "ab"}
        for driver in (plain, hinted):
            driver.round({"a": DraftTree(), "b": DraftTree()})
        if not late:  # a round goes first
            for driver in (plain, hinted):
                driver.round({"a": DraftTree(), "b": DraftTree()})
        gaps.clear()
        hinted.engine.hint_next([NextTrees(s, bases[s], [], plain=True) for s in "ab"])
        launched = hinted.engine._ahead is not None
        assert launched == (launch_on_hint and late)
        # the launch waited for the hint since the finish (how late it came), then ran
        assert gaps == (["hint", "launch"] if launched else [])
        for driver in (plain, hinted):
            driver.round({"a": DraftTree(), "b": DraftTree()})
    _same(plain, hinted)
    used = 1 if launch_on_hint else 0
    assert (hinted.engine.num_next_used, hinted.engine.num_next_dropped) == (used, 0)
    # the rounds after which nothing ran ahead, once "b" and "a" sent hints: the one that took
    # the late launch, and the two before the hint that came after a round started (and is
    # dropped); without launch_on_hint a late hint is stale at the next round's finish
    want = {"late": 6} if launch_on_hint else {"late": 4, "stale": 4}
    assert hinted.engine.hints.num_not_ahead == want
    _release(plain, hinted)


def test_hinted_sequences_run_no_decode_step_ahead_until_their_hints_stop(
    target_dir: Path, device: str
) -> None:
    """With decode steps run ahead too: a sequence whose last round had a hint runs none (its
    next round is most often the hinted tree, which would drop the step); once its rounds come
    without hints, the steps run ahead again. Tokens and KV as without either."""
    plain, hinted = (
        Driver(_engine(target_dir, False, device)),
        Driver(_engine(target_dir, True, device)),
    )
    for driver in (plain, hinted):
        driver.begin("a", "b")
    for r in range(8):
        if r < 5:
            hinted.engine.hint_next(
                [NextTrees(s, len(hinted.tokens[s]), [], plain=True) for s in "ab"]
            )
        for driver in (plain, hinted):
            driver.round({"a": DraftTree(), "b": DraftTree()})
    _same(plain, hinted)
    engine = hinted.engine
    # rounds 0 and 1 take the steps the prefill and round 0 ran ahead (no hint seen yet at
    # their launch); rounds 2-5 take the rounds hinted in 1-4, with no step ahead; round 6,
    # after a round without a hint, runs a step ahead again, which round 7 takes
    assert engine.num_next_used == 4 and engine.num_next_dropped == 0
    assert engine.num_ahead_used == 3 and engine.num_ahead_dropped == 0
    _release(plain, hinted)


def test_the_device_waits_between_rounds_only_where_nothing_ran_ahead(
    target_dir: Path, device: str
) -> None:
    """`on_wait` (specsplit_verifier_wait_seconds): per round of the same sequences the time
    from the last finish to its launch, 0 where a round run ahead on a hint followed; a round
    of other sequences (a newcomer alone) reports nothing."""
    driver = Driver(_engine(target_dir, False, device))
    waits: list[float] = []
    driver.engine.on_wait = waits.append
    driver.begin("a")
    driver.round({"a": DraftTree()})  # no hint: the device waited for this request
    driver.engine.hint_next([NextTrees("a", len(driver.tokens["a"]), [], plain=True)])
    driver.round({"a": DraftTree()})  # waited too; at its finish the hinted round launches
    driver.round({"a": DraftTree()})  # that round: nothing waited
    assert len(waits) == 3 and waits[0] > 0 and waits[1] > 0 and waits[2] == 0.0
    assert driver.engine.num_next_used == 1
    driver.begin("b")  # another sequence: no wait of "a"'s counted for it
    assert len(waits) == 3
    _release(driver)


def test_each_round_with_none_run_ahead_after_it_is_counted_by_why(
    target_dir: Path, device: str
) -> None:
    """`on_not_ahead` (specsplit_round_not_ahead_total): a round of a sequence that sends hints
    with no round run ahead after it, by reason; a sequence that sent none counts nothing."""
    driver = Driver(_engine(target_dir, False, device))
    reasons: list[str] = []
    driver.engine.hints.on_not_ahead = reasons.append
    driver.begin("a", "b")
    both = {"a": DraftTree(), "b": DraftTree()}
    driver.round(both)
    assert reasons == []  # no hints yet
    driver.engine.hint_next([NextTrees("a", len(driver.tokens["a"]), [], plain=True)])
    driver.round(both, steps={"b": 2})  # "b"'s further step: the hint is dropped
    assert reasons == ["busy"] and not driver.engine.hints.next
    driver.round(both)  # no hint for this one
    assert reasons == ["busy", "late"]
    assert driver.engine.hints.num_not_ahead == {"busy": 1, "late": 1}
    _release(driver)


def test_rounds_launched_after_the_answer_are_taken_and_give_the_same_tokens(
    target_dir: Path, device: str
) -> None:
    """launch_on_hint (the service, where its calls run on the event loop): `finish` only
    parks its sequences, and `launch_parked`, once the answer went out, launches their hinted
    rounds; a round started before it leaves nothing to launch. The device's wait ends at that
    launch (`on_wait`), and its host parts are each reported (`on_gap`, GAP_PHASES): every
    finish, and before a hinted launch the time since that finish, then the launch."""
    plain, hinted = (
        Driver(_engine(target_dir, False, device)),
        Driver(_engine(target_dir, False, device)),
    )
    engine = hinted.engine
    engine.launch_on_hint = True
    waits: list[float] = []
    engine.on_wait = waits.append
    gaps: list[tuple[str, float]] = []
    engine.on_gap = lambda phase, seconds: gaps.append((phase, seconds))
    both = {"a": DraftTree(), "b": DraftTree()}
    for driver in (plain, hinted):
        driver.begin("a", "b")
    for _ in range(4):
        engine.hint_next([NextTrees(s, len(hinted.tokens[s]), [], plain=True) for s in "ab"])
        for driver in (plain, hinted):
            driver.round(both)
        assert engine._ahead is None  # parked: the answer goes first
        assert gaps[-1][0] == "finish"
        reported, phases = len(waits), len(gaps)
        engine.launch_parked()
        assert engine._ahead is not None and len(waits) == reported + 1 and waits[-1] > 0
        assert [phase for phase, _ in gaps[phases:]] == ["answer", "launch"]
    # ("chain", a round chained behind one in flight: tests/unit/test_round_chain.py; "hint",
    # a hint that came after its round finished: the test before this one)
    assert {phase for phase, _ in gaps} == set(GAP_PHASES) - {"chain", "hint"}
    assert all(seconds >= 0 for _, seconds in gaps)
    engine.hint_next([NextTrees(s, len(hinted.tokens[s]), [], plain=True) for s in "ab"])
    for _ in range(2):  # the second round starts before the first's hinted launch
        for driver in (plain, hinted):
            driver.round(both)
    engine.launch_parked()
    assert engine._ahead is None
    _same(plain, hinted)
    assert (engine.num_next_used, engine.num_next_dropped) == (4, 0)
    # "a" and "b" after their first round (hints came after it) and the first of those two
    assert engine.hints.num_not_ahead == {"late": 4}
    _release(plain, hinted)
