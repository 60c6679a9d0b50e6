"""A Verify round of several decode steps (`VerifyInput.decode_steps`): the verifier decodes the
next tokens itself, each step as the round the gateway would send next, so the tokens, the
committed KV and a seeded sampler's draws are those of one-step rounds, with its decode steps
run ahead or not; a step with no room (the context, the KV pool) ends the round early. Through
the scheduler: plain rounds decode several tokens, the stop rules cut what comes past a stop
(EOS, a stop string, max_new_tokens), sessions keep exactly their turns' tokens, and no page
stays held."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import verifier.engine as engine_module
from specsplit import convert
from specsplit.errors import Code, ServiceError
from specsplit.messages import MAX_DECODE_STEPS, MAX_LOOKUP, SpecParams, VerifyInput, VerifyOutput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.support import (
    check_no_leaks,
    generate_all,
    generated_ids,
    make_stack,
    mixed_requests,
    save_tiny_llama,
    target_only_ids,
)
from tests.unit.test_decode_ahead import Driver, _engine, _release, _same
from tests.unit.test_scheduler_preemption import _requests as _preemption_requests
from tests.unit.test_sessions import _run


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("steps") / "target", seed=29)


@pytest.fixture(scope="module")
def device() -> str:
    """The engines' device (tests/gpu/test_decode_steps_gpu.py runs these tests on CUDA)."""
    return "cpu"


def _pair(target_dir: Path, device: str, ahead: bool, **kwargs: int) -> tuple[Driver, Driver]:
    """One-step rounds (the reference) and rounds of several steps, on the same kind of engine."""
    return (
        Driver(_engine(target_dir, ahead, device, **kwargs)),
        Driver(_engine(target_dir, ahead, device, **kwargs)),
    )


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "decode-ahead"])
def test_a_round_of_steps_gives_the_tokens_and_kv_of_one_step_rounds(
    target_dir: Path, device: str, ahead: bool
) -> None:
    """ "a" asks for 4 steps a round and "b" for 2, twice; the reference sends 8 one-step
    rounds, "b" in the first 2 of each 4."""
    single, steps = _pair(target_dir, device, ahead)
    for driver in (single, steps):
        driver.begin("a", "b")
    for _ in range(2):
        outputs = steps.round(dict.fromkeys("ab", DraftTree()), steps={"a": 4, "b": 2})
        assert [len(o.decoded_tokens) for o in outputs] == [3, 1]
        assert all(not o.accepted_tokens for o in outputs)
        single.decode("a", "b", rounds=2)
        single.decode("a", rounds=2)
    _same(single, steps)  # the page run ahead aside, the same pages held
    assert steps.committed["a"] == len(steps.tokens["a"]) - 1
    if ahead:  # every step after the prefill's took the one run ahead but "b"'s first
        assert steps.engine.num_ahead_used >= 6
    _release(single, steps)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    ("steps", "used"),
    [({"a": 3, "b": 3}, 2), ({"a": 3, "b": 2}, 1)],
    ids=["all-go-on", "one-stops-first"],
)
def test_a_rounds_own_steps_run_ahead_past_the_batch_limit(
    target_dir: Path, device: str, steps: dict[str, int], used: int, sampled: bool
) -> None:
    """With decode_ahead_max_batch 0 (no round of the gateway's runs ahead), a round of 2
    sequences still runs its own further steps ahead while both take them ("all-go-on": steps
    2 and 3; "one-stops-first": step 2 only, then "a" alone), and nothing after its last
    step: that round is the gateway's. The tokens, KV and a seeded sampler's draws are those
    of one-step rounds."""
    sampling = SamplingParams(temperature=0.9, seed=11) if sampled else None
    single, several = _pair(target_dir, device, True)
    several.engine.decode_ahead_max_batch = 0
    for driver in (single, several):
        driver.begin("a", "b")
    for _ in range(2):
        before = several.engine.num_ahead_used
        several.round(dict.fromkeys("ab", DraftTree()), sampling=sampling, steps=steps)
        assert several.engine.num_ahead_used - before == used
        assert several.engine._ahead is None  # nothing launched past the round's last step
        for step in range(max(steps.values())):
            going_on = [s for s in "ab" if steps[s] > step]
            single.round(dict.fromkeys(going_on, DraftTree()), sampling=sampling)
    assert several.engine.num_ahead_dropped == 0
    _same(single, several)
    _release(single, several)


def test_the_wait_after_a_round_of_steps_starts_after_its_last_step(
    target_dir: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`on_wait` (specsplit_verifier_wait_seconds) after a round of several decode steps runs
    from its last step's results, not from the start of its `finish`: the steps are device
    work, not the device waiting for the next request. A clock that moves only while the
    further steps run: the next round's wait is 0, not their second."""
    clock = [0]
    monkeypatch.setattr(engine_module.time, "perf_counter_ns", lambda: clock[0])
    driver = Driver(_engine(target_dir, False, device))
    further = driver.engine._decode_further

    def slow_steps(*args: object) -> int:
        clock[0] += 10**9  # the further steps take a second
        return further(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(driver.engine, "_decode_further", slow_steps)
    waits: list[float] = []
    driver.engine.on_wait = waits.append
    driver.begin("a")
    driver.round({"a": DraftTree()}, steps={"a": 3})
    driver.round({"a": DraftTree()})  # launched at once after the round of steps: no wait
    assert waits[-1] == 0.0
    _release(driver)


def test_the_device_idle_time_before_a_rounds_further_steps_is_reported_apart(
    target_dir: Path, device: str
) -> None:
    """`on_step_idle` (specsplit_verifier_step_idle_seconds): on a GPU the further steps of a
    round of 4 launched within it report the device's idle time before them, from the CUDA
    events, besides `on_idle` (every round's); the step launched when the round's request came
    does not: before it the device waited through the trip between rounds (here a 50 ms pause
    of the gateway, while the next round's first step, run ahead, had long finished). On the
    CPU there are no device timestamps and nothing is reported."""
    driver = Driver(_engine(target_dir, True, device))
    idles: list[float] = []
    step_idles: list[float] = []
    driver.engine.on_idle = idles.append
    driver.engine.on_step_idle = step_idles.append
    driver.begin("a", "b")
    driver.round(dict.fromkeys("ab", DraftTree()), steps={"a": 4, "b": 4})
    time.sleep(0.05)
    driver.round(dict.fromkeys("ab", DraftTree()), steps={"a": 4, "b": 4})
    if device == "cpu":
        assert idles == step_idles == []
    else:  # per round: its first step, the step launched with it, two further steps
        assert len(idles) == 8 and len(step_idles) == 4
        assert step_idles == idles[2:4] + idles[6:8], (idles, step_idles)
        assert idles[5] >= 0.03, idles  # the pause, before the second round's second step
        assert all(0.0 <= seconds < idles[5] / 2 for seconds in step_idles), step_idles
    _release(driver)


def test_sampled_steps_draw_as_one_step_rounds(target_dir: Path, device: str) -> None:
    single, steps = _pair(target_dir, device, True)
    sampling = SamplingParams(temperature=0.9, seed=11)
    for driver in (single, steps):
        driver.begin("a", "b")
    for _ in range(3):
        steps.round(dict.fromkeys("ab", DraftTree()), sampling=sampling, steps={"a": 3, "b": 3})
        for _ in range(3):
            single.round(dict.fromkeys("ab", DraftTree()), sampling=sampling)
    _same(single, steps)
    _release(single, steps)


def test_a_step_with_no_room_ends_the_round_where_it_is(target_dir: Path, device: str) -> None:
    """The context: "a" may hold 3 more tokens' KV, so a round of 6 steps makes 3 tokens (the
    last one pending). The KV pool: 16 pages of 4 slots (a GPU warm-up's rehearsal needs
    several), 13 of them "a"'s (49 tokens), so "b" (4 prompt tokens) runs out after its 12th
    slot: a round of 16 steps stops there, commits what it made and holds nothing more."""
    engine = _engine(target_dir, False, device)
    driver = Driver(engine)
    driver.begin("a")
    engine.max_context = driver.committed["a"] + 3
    [out] = driver.round({"a": DraftTree()}, steps={"a": 6})
    assert len(out.new_tokens) == 3 and out.kv_committed_len == engine.max_context
    engine.check_integrity()
    _release(driver)

    engine = _engine(target_dir, True, device, num_pages=16)
    driver = Driver(engine)
    driver.begin("a")
    for steps in (16, 16, 10):
        driver.round({"a": DraftTree()}, steps={"a": steps})
    driver.begin("b")  # drops "a"'s step run ahead: "a" holds its 49 tokens' 13 pages
    # "b" holds 2: its prompt's, and its step run ahead's for its 5th slot
    assert driver.committed["a"] == 49 and engine.num_pages_free == 16 - 13 - 2
    [out] = driver.round({"b": DraftTree()}, steps={"b": MAX_DECODE_STEPS})
    assert out.kv_committed_len == 12 and engine.num_pages_free == 0
    assert len(out.new_tokens) == 12 - 4
    reference = Driver(_engine(target_dir, False, device))
    reference.begin("b")
    reference.decode("b", rounds=8)
    assert driver.tokens["b"] == reference.tokens["b"]
    _release(driver, reference)


@pytest.mark.parametrize(
    ("steps", "tree", "layers", "lookup"),
    [
        (0, False, False, 0),
        (MAX_DECODE_STEPS + 1, False, False, 0),
        (2, True, False, 0),
        (2, False, True, 0),
        (3, False, False, -1),
        (3, False, False, MAX_LOOKUP + 1),
    ],
    ids=["zero", "too-many", "with-a-tree", "with-hidden-states", "lookup-below-0", "lookup-above"],
)
def test_bad_decode_steps_are_refused_and_change_nothing(
    target_dir: Path, device: str, steps: int, tree: bool, layers: bool, lookup: int
) -> None:
    """And a bad VerifyInput.lookup (the prompt-lookup chains of further steps)."""
    engine = _engine(target_dir, False, device)
    driver = Driver(engine)
    driver.begin("a")
    item = VerifyInput(
        "a", False, driver.committed["a"], driver.tokens["a"][-1:],
        DraftTree([4], [-1]) if tree else DraftTree(), hidden_state_layers=(0,) if layers else (),
        decode_steps=steps, lookup=lookup,
    )  # fmt: skip
    before = (engine.seqs["a"].kv.kv_committed_len, engine.num_pages_used)
    with pytest.raises(ServiceError) as refused:
        engine.verify([item])
    named = "lookup" if lookup else "decode_steps"
    assert refused.value.code == Code.INVALID_ARGUMENT and named in refused.value.message
    assert (engine.seqs["a"].kv.kv_committed_len, engine.num_pages_used) == before
    _release(driver)


def test_decode_steps_and_decoded_tokens_cross_the_wire() -> None:
    item = VerifyInput("s", False, 9, [5], DraftTree(), decode_steps=4)
    plain = VerifyInput("t", False, 9, [5], DraftTree())
    msg = convert.verify_request_to_proto([item, plain])
    assert list(msg.decode_steps) == [4, 1] and not msg.tree_tokens
    assert convert.verify_request_from_proto(msg) == [item, plain]
    assert not convert.verify_request_to_proto([plain]).decode_steps  # all 1: left empty
    out = VerifyOutput("s", [], 7, 12, decoded_tokens=[5, 6, 8])
    msg = convert.verify_response_to_proto([out, VerifyOutput("t", [2], 3, 11)], verify_ns=1)
    assert list(msg.num_decoded_tokens) == [3, 0]
    back, other = convert.verify_response_from_proto(msg)
    assert back.new_tokens == [5, 6, 8, 7] and back.kv_committed_len == 12
    assert other.new_tokens == [2, 3]


@pytest.mark.parametrize(
    ("mixed", "ahead", "overlap"),
    [
        (False, False, "serial"),
        (False, True, "serial"),
        (True, False, "serial"),
        (True, True, "serial"),
        (True, True, "groups"),
        (True, False, "both"),
    ],
    ids=["target-only", "target-only-ahead", "mixed", "mixed-ahead", "mixed-groups", "mixed-both"],
)
def test_the_gateway_gets_the_target_tokens_with_rounds_of_steps(
    target_dir: Path, smollm2_tokenizer: object, mixed: bool, ahead: bool, overlap: str
) -> None:
    """max_new_tokens not a multiple of the steps (the last round is cut to what is allowed),
    and with some requests speculating (their rounds one step, the others' several), in each
    overlap mode (decode-ahead: the verifier's steps run ahead)."""
    requests = mixed_requests(5, seed=4, max_new_tokens=6)
    for i, request in enumerate(requests):
        request.max_new_tokens = 5 + 3 * i
        request.spec = SpecParams(2, 1, 2) if mixed and i % 2 else SpecParams(0, 1, 0)
    expected = target_only_ids(target_dir, smollm2_tokenizer, requests)
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0),
                       decode_ahead=ahead, decode_steps=4, overlap=overlap)  # fmt: skip
    decoded = REGISTRY.get_sample_value("specsplit_decoded_tokens_total") or 0.0
    results = generate_all(stack, requests)
    assert [generated_ids(c) for c in results] == expected
    # /metrics: the tokens of further decode steps (plain rounds, and a speculating request's
    # rounds the n-gram drafter found nothing for), fewer than all
    decoded = (REGISTRY.get_sample_value("specsplit_decoded_tokens_total") or 0.0) - decoded
    assert 0 < decoded < sum(r.max_new_tokens for r in requests)
    for request, chunks in zip(requests, results, strict=True):
        stats = chunks[-1].stats
        assert stats is not None and chunks[-1].finish_reason == "length"
        if request.spec == SpecParams(0, 1, 0):  # each step counts as a round of one token
            assert stats.rounds == request.max_new_tokens
            assert stats.num_accepted_tokens == request.max_new_tokens
    # fewer rounds than tokens: the longest request alone decodes 4 a round
    assert stack.scheduler.num_rounds < max(r.max_new_tokens for r in requests)
    check_no_leaks(stack)


@pytest.mark.parametrize("seed", [None, 3], ids=["greedy", "seeded"])
def test_session_turns_with_rounds_of_steps_equal_fresh_requests(
    target_dir: Path, smollm2_tokenizer: object, seed: int | None
) -> None:
    """Turns ending by length, by EOS and by a stop string inside a round of 4 steps: the tokens
    past the stop leave both services, and each turn equals a fresh request."""
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0),
                       decode_steps=4)  # fmt: skip
    _run(stack, SamplingParams() if seed is None else SamplingParams(temperature=0.8, seed=seed))


def test_rounds_of_steps_with_eos_end_at_the_eos(
    target_dir: Path, smollm2_tokenizer: object
) -> None:
    """A request that stops at EOS mid-round streams nothing past it."""
    [request] = mixed_requests(1, seed=8, max_new_tokens=12)
    [probe] = target_only_ids(target_dir, smollm2_tokenizer, [request])
    # the first token from the fourth on that did not come before: inside a round of 4 steps
    at = next(i for i in range(3, len(probe)) if probe[i] not in probe[:i])
    request.ignore_eos = False
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0),
                       decode_steps=4)  # fmt: skip
    stack.scheduler.eos_token_ids = (probe[at],)
    [chunks] = generate_all(stack, [request])
    assert generated_ids(chunks) == probe[: at + 1] and chunks[-1].finish_reason == "stop"
    check_no_leaks(stack)


def test_decode_steps_out_of_range_are_refused_by_the_scheduler(
    target_dir: Path, smollm2_tokenizer: object
) -> None:
    for steps in (0, MAX_DECODE_STEPS + 1):
        with pytest.raises(ValueError, match="decode_steps"):
            make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0),
                       decode_steps=steps)  # fmt: skip


@pytest.mark.parametrize("overlap", ["serial", "groups"])
def test_a_full_kv_pool_preempts_rounds_of_steps_with_the_same_tokens(
    target_dir: Path, smollm2_tokenizer: object, overlap: str
) -> None:
    """4 requests of 10 + 40 tokens need ~52 pages of 4; 30 hold about two. A round's further
    steps end early where the pool runs out (its answer says how far), the next round is
    refused and the gateway preempts, as with one-step rounds: the tokens of a roomy pool."""
    requests = _preemption_requests(4, max_new_tokens=40)
    expected = target_only_ids(target_dir, smollm2_tokenizer, requests)
    tight = make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0), page_size=4,
                       num_pages=30, overlap=overlap, decode_steps=4)  # fmt: skip
    out = generate_all(tight, requests)  # checks no KV is left in either service
    assert [generated_ids(c) for c in out] == expected
    assert all(c[-1].finish_reason == "length" for c in out)
    assert tight.scheduler.num_preemptions > 0
