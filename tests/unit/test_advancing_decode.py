"""A round's further greedy decode steps queued at its launch as self-advancing steps
(verifier/advancing.py, specsplit/model/decode_graphs.py; the CPU runs their body eagerly,
tests/gpu/test_advancing_decode_gpu.py replays their CUDA graphs): the tokens, committed KV and
pages of one-step rounds, with and without a step run ahead before the round, over a round of
two parts and three sequences; the next round's step runs ahead behind them and is taken;
rounds that do not qualify (unequal steps, sampled, no room for every step, past the context)
or whose steps fail to launch run step by step with the same tokens; a round's pages come back
on release."""

from __future__ import annotations

from pathlib import Path

import pytest

import verifier.engine as engine_module
from specsplit.model.decode_graphs import AdvancingDecode
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.support import save_tiny_llama
from tests.unit.test_decode_ahead import Driver, _engine, _release, _same


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("advancing") / "target", seed=31)


@pytest.fixture(scope="module")
def device() -> str:
    """The engines' device (tests/gpu/test_advancing_decode_gpu.py runs these on CUDA)."""
    return "cpu"


@pytest.fixture
def advanced(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps of each round committed from self-advancing steps."""
    counts: list[int] = []
    commit = engine_module.commit_advanced

    def counted(advanced, outputs):  # type: ignore[no-untyped-def]
        counts.append(advanced.num_steps)
        return commit(advanced, outputs)

    monkeypatch.setattr(engine_module, "commit_advanced", counted)
    return counts


def _advancing(target_dir: Path, device: str, ahead: bool, num_pages: int = 64) -> Driver:
    engine = _engine(target_dir, ahead, device, num_pages=num_pages)
    engine.advancing = AdvancingDecode(engine.model, engine.kv, engine.max_context, 4)
    if device == "cuda":
        engine.advancing.capture()
    return Driver(engine)


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "decode-ahead"])
def test_advanced_rounds_give_the_tokens_and_kv_of_one_step_rounds(
    target_dir: Path, device: str, ahead: bool, advanced: list[int]
) -> None:
    """Rounds of 5 steps for "a" and "b" (the first taking the step run ahead after the
    prefill, with decode-ahead), a round of 3 for "b" alone, then a one-step round of both:
    each round of several steps advanced, the tokens and KV of one-step rounds."""
    single, steps = (
        Driver(_engine(target_dir, ahead, device)),
        _advancing(target_dir, device, ahead),
    )
    made: list[int] = []  # specsplit_advanced_decode_steps_total's increments
    steps.engine.on_advanced = made.append
    for driver in (single, steps):
        driver.begin("a", "b")
    for _ in range(2):
        outputs = steps.round(dict.fromkeys("ab", DraftTree()), steps={"a": 5, "b": 5})
        assert [len(o.decoded_tokens) for o in outputs] == [4, 4]
        single.decode("a", "b", rounds=5)
    steps.round({"b": DraftTree()}, steps={"b": 3})
    single.decode("b", rounds=3)
    steps.decode("a", "b", rounds=1)
    single.decode("a", "b", rounds=1)
    assert advanced == [4, 4, 2] and made == [8, 8, 2]
    _same(single, steps)
    assert steps.engine.num_pages_used <= single.engine.num_pages_used + 2
    _release(single, steps)


@pytest.mark.parametrize("case", ["unequal-steps", "sampled", "one-step"])
def test_rounds_that_do_not_qualify_run_step_by_step(
    target_dir: Path, device: str, case: str, advanced: list[int]
) -> None:
    sampling = SamplingParams(temperature=0.9, seed=5) if case == "sampled" else None
    each = {"unequal-steps": {"a": 4, "b": 2}, "sampled": {"a": 3, "b": 3}, "one-step": {}}[case]
    single, steps = Driver(_engine(target_dir, True, device)), _advancing(target_dir, device, True)
    for driver in (single, steps):
        driver.begin("a", "b")
    steps.round(dict.fromkeys("ab", DraftTree()), sampling=sampling, steps=each)
    for step in range(max(each.values(), default=1)):
        going_on = [s for s in "ab" if each.get(s, 1) > step]
        single.round(dict.fromkeys(going_on, DraftTree()), sampling=sampling)
    assert advanced == []
    _same(single, steps)
    _release(single, steps)


def test_no_room_for_every_step_runs_the_round_step_by_step(
    target_dir: Path, device: str, advanced: list[int]
) -> None:
    """Past the context: "a" may hold 3 more tokens, so its round of 6 steps runs step by step
    and makes 3; out of pages: 16 pages of 4 slots, 13 of them "a"'s, so "b" (4 tokens
    committed) has no room for a round of 16 steps (20 slots): it runs step by step and stops
    where the pool does (12 slots), with the tokens of one-step rounds."""
    driver = _advancing(target_dir, device, False)
    engine = driver.engine
    driver.begin("a")
    engine.max_context = driver.committed["a"] + 3
    [out] = driver.round({"a": DraftTree()}, steps={"a": 6})
    assert len(out.new_tokens) == 3 and out.kv_committed_len == engine.max_context
    assert advanced == []
    _release(driver)

    driver = _advancing(target_dir, device, False, num_pages=16)
    engine = driver.engine
    driver.begin("a")
    for steps in (16, 16, 10):  # advanced rounds, "a" to 49 tokens: 13 of the 16 pages
        driver.round({"a": DraftTree()}, steps={"a": steps})
    assert advanced == [15, 15, 9] and driver.committed["a"] == 49
    driver.begin("b")  # its 4 prompt tokens: 1 page, 2 left
    [out] = driver.round({"b": DraftTree()}, steps={"b": 16})  # would need 4 more
    assert advanced == [15, 15, 9] and out.kv_committed_len == 12
    assert engine.num_pages_free == 0
    reference = Driver(_engine(target_dir, False, device))
    reference.begin("b")
    reference.decode("b", rounds=12 - 4)
    assert driver.tokens["b"] == reference.tokens["b"]
    _release(driver, reference)


def test_the_next_rounds_step_runs_ahead_after_the_advanced_steps(
    target_dir: Path, device: str, advanced: list[int]
) -> None:
    """With decode-ahead, behind a round's advancing steps the gateway's next round's first step
    runs ahead (its input the last step's token), and the next round takes it."""
    single = Driver(_engine(target_dir, True, device))
    steps = _advancing(target_dir, device, True)
    for driver in (single, steps):
        driver.begin("a", "b")
    steps.round(dict.fromkeys("ab", DraftTree()), steps={"a": 4, "b": 4})
    assert advanced == [3] and steps.engine._ahead is not None
    used = steps.engine.num_ahead_used
    steps.decode("a", "b", rounds=2)
    assert steps.engine.num_ahead_used == used + 2 and steps.engine.num_ahead_dropped == 0
    single.decode("a", "b", rounds=6)
    _same(single, steps)
    _release(single, steps)


def test_a_round_of_two_parts_and_three_sequences_advances(
    target_dir: Path, device: str, advanced: list[int]
) -> None:
    """A round whose first step is a step run ahead for "a" and a launch of its own for "b" and
    "c" (two parts, three sequences: a bucket of 4 with a padding row on a GPU) advances over
    all three, with the tokens and KV of one-step rounds."""
    single = Driver(_engine(target_dir, True, device))
    steps = _advancing(target_dir, device, True)
    for driver in (single, steps):
        driver.begin("a")
        driver.begin("b", "c")
        driver.decode("a", rounds=1)  # "a"'s next step runs ahead, not "b"'s and "c"'s
    outputs = steps.round(dict.fromkeys("abc", DraftTree()), steps=dict.fromkeys("abc", 5))
    assert advanced == [4] and [len(o.decoded_tokens) for o in outputs] == [4, 4, 4]
    single.decode("a", "b", "c", rounds=5)
    _same(single, steps)
    _release(single, steps)


def test_a_failed_launch_of_the_steps_runs_the_round_step_by_step(
    target_dir: Path, device: str, advanced: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where queuing the advancing steps fails, the round runs step by step with the same
    tokens, and the room reserved for them goes back."""
    single, steps = (
        Driver(_engine(target_dir, False, device)),
        _advancing(target_dir, device, False),
    )
    assert steps.engine.advancing is not None

    def broken(*args: object) -> None:
        raise RuntimeError("a replay failed")

    monkeypatch.setattr(steps.engine.advancing, "start", broken)
    for driver in (single, steps):
        driver.begin("a", "b")
    steps.round(dict.fromkeys("ab", DraftTree()), steps={"a": 6, "b": 6})
    single.decode("a", "b", rounds=6)
    assert advanced == []
    _same(single, steps)
    _release(single, steps)
