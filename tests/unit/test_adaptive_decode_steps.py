"""--decode-steps-adaptive (gateway/decode_steps.py): plain rounds stay at the base until a batch
size's rounds were measured, then grow to the fewest steps that hold the verifier's device idle
time between rounds to a tenth of its busy time, up to 16, once no request arrived for the quiet
time; no device time (a CPU) leaves them at the base. Through the scheduler the tokens stay the
target's, in fewer rounds."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from gateway.decode_steps import MIN_ROUNDS, QUIET_SECONDS, DecodeSteps, is_plain
from gateway.request import GenerationRequest
from gateway.scheduler import Scheduler
from specsplit import cli, cli_flags, up
from specsplit.errors import ServiceError
from specsplit.messages import SpecParams, VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.support import (
    generate_all,
    generated_ids,
    make_stack,
    mixed_requests,
    save_tiny_llama,
    target_only_ids,
)

MS = 1e-3


def _measured(
    policy: DecodeSteps, batch: int, rounds: int, steps: int, step: float, idle: float
) -> None:
    for _ in range(rounds):
        policy.observe(batch, steps, steps * step + idle, steps * step)


def test_rounds_stay_at_the_base_until_a_batch_size_was_measured() -> None:
    policy = DecodeSteps(4)
    _measured(policy, 32, MIN_ROUNDS - 1, steps=4, step=1.2 * MS, idle=1.75 * MS)
    assert policy.steps(32) == 4
    _measured(policy, 32, 1, steps=4, step=1.2 * MS, idle=1.75 * MS)
    assert policy.steps(32) == 15  # 1.75 / (0.1 * 1.2) = 14.6


def test_batch_sizes_share_a_power_of_two_bucket_and_learn_apart() -> None:
    policy = DecodeSteps(4)
    _measured(policy, 17, MIN_ROUNDS, steps=4, step=1.0 * MS, idle=0.75 * MS)
    assert policy.steps(32) == policy.steps(17) == 8
    assert policy.steps(33) == policy.steps(16) == 4  # not measured


@pytest.mark.parametrize(
    ("batch", "step_ms", "idle_ms", "want"),
    [
        pytest.param(1, 0.7, 0.05, 4, id="a_trip_the_step_run_ahead_covers_keeps_the_base"),
        # 1.8 / (0.1 * 1.2) = 15 (15.000000000000002 in floats)
        pytest.param(32, 1.2, 1.8, 15, id="a_whole_number_of_tenths_asks_for_that_many_steps"),
        pytest.param(8, 0.5, 10, 16, id="rounds_grow_to_sixteen_steps_at_most"),
    ],
)
def test_measured_rounds_ask_for_the_steps_that_cover_the_idle_time(
    batch: int, step_ms: float, idle_ms: float, want: int
) -> None:
    policy = DecodeSteps(4)
    _measured(policy, batch, MIN_ROUNDS, steps=4, step=step_ms * MS, idle=idle_ms * MS)
    assert policy.steps(batch) == want


def test_rounds_shrink_back_when_the_idle_time_falls() -> None:
    """A running mean: the rounds follow the device's idle time down again."""
    policy = DecodeSteps(4)
    _measured(policy, 32, MIN_ROUNDS, steps=4, step=1.0 * MS, idle=1.6 * MS)
    assert policy.steps(32) == 16
    _measured(policy, 32, 40, steps=16, step=1.0 * MS, idle=0.45 * MS)
    assert policy.steps(32) == 5


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rounds_keep_the_base_while_requests_arrive() -> None:
    """A request arriving during a round waits for its end: rounds grow only once none arrived
    for quiet_seconds, and fall back to the base at the next arrival."""
    clock = _Clock()
    policy = DecodeSteps(4, quiet_seconds=0.1, clock=clock)
    _measured(policy, 32, MIN_ROUNDS, steps=4, step=1.2 * MS, idle=1.8 * MS)
    assert policy.steps(32) == 15  # nothing arrived yet
    policy.arrived()
    assert policy.steps(32) == 4
    clock.now += 0.099
    assert policy.steps(32) == 4
    clock.now += 0.002
    assert policy.steps(32) == 15
    policy.arrived()
    assert policy.steps(32) == 4


def test_a_quiet_time_of_zero_grows_rounds_regardless_of_arrivals() -> None:
    policy = DecodeSteps(4, quiet_seconds=0.0, clock=_Clock())
    _measured(policy, 32, MIN_ROUNDS, steps=4, step=1.2 * MS, idle=1.8 * MS)
    policy.arrived()
    assert policy.steps(32) == 15
    with pytest.raises(ValueError, match="quiet_seconds"):
        DecodeSteps(4, quiet_seconds=-1.0)


def test_no_device_time_learns_nothing() -> None:
    """A CPU verifier reports no device time: its rounds stay at the base."""
    policy = DecodeSteps(2)
    for _ in range(10):
        policy.observe(4, 2, 0.05, 0.0)
    assert policy.steps(4) == 2


@pytest.mark.parametrize("base,most", [(0, 16), (5, 4), (4, 17)])
def test_bases_outside_one_to_sixteen_are_refused(base: int, most: int) -> None:
    with pytest.raises(ValueError, match="decode steps"):
        DecodeSteps(base, most)


def test_a_plain_item_has_no_tree_no_features_and_is_not_the_first_round() -> None:
    greedy = SamplingParams()
    assert is_plain(VerifyInput("a", False, 5, [1], DraftTree(), greedy))
    assert not is_plain(VerifyInput("a", True, 0, [1, 2], DraftTree(), greedy))
    assert not is_plain(VerifyInput("a", False, 5, [1], DraftTree([3], [-1]), greedy))
    assert not is_plain(VerifyInput("a", False, 5, [1], DraftTree(), greedy, (1, 2)))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("adaptive") / "target", seed=31)


def _device_seconds(stack: Any, seconds: float) -> None:
    """The in-process verifier's rounds report `seconds` of device time (a CPU's is 0)."""
    client = stack.scheduler.verifier
    verify: Callable[..., Any] = client.verify

    async def reported(inputs: list[VerifyInput]) -> Any:
        outputs = await verify(inputs)
        client.last_device_seconds = seconds
        return outputs

    client.verify = reported


@pytest.mark.parametrize(
    ("device", "quiet"),
    [(1e-6, 0.0), (0.0, 0.0), (1e-6, 3600.0)],
    ids=["device-idles", "no-device-time", "requests-arrived-just-now"],
)
def test_the_scheduler_grows_plain_rounds_with_the_same_tokens(
    target_dir: Path, smollm2_tokenizer: object, device: float, quiet: float
) -> None:
    """Target-only requests through the in-process stack, whose verifier reports almost no
    device time (the device idles nearly the whole round): after MIN_ROUNDS rounds of 4 steps
    the rounds ask for 16, the tokens stay the target's and take fewer rounds; with no device
    time reported, or while the requests' arrival is more recent than the quiet time (an
    hour), they stay at 4."""
    requests = mixed_requests(3, seed=5, max_new_tokens=60)
    for request in requests:
        request.spec = SpecParams(0, 1, 0)
    expected = target_only_ids(target_dir, smollm2_tokenizer, requests)
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0),
                       decode_steps=4)  # fmt: skip
    stack.scheduler.steps_policy = DecodeSteps(4, quiet_seconds=quiet)
    _device_seconds(stack, device)
    before = REGISTRY.get_sample_value("specsplit_decode_steps_bucket", {"le": "12.0"}) or 0.0
    total = REGISTRY.get_sample_value("specsplit_decode_steps_count") or 0.0
    results = generate_all(stack, requests)
    assert [generated_ids(c) for c in results] == expected
    up_to_12 = REGISTRY.get_sample_value("specsplit_decode_steps_bucket", {"le": "12.0"}) or 0.0
    rounds = (REGISTRY.get_sample_value("specsplit_decode_steps_count") or 0.0) - total
    grown = rounds - (up_to_12 - before)  # rounds that asked for more than 12 steps
    if device and not quiet:
        assert grown > 0 and stack.scheduler.num_rounds < 1 + MIN_ROUNDS + 60 // 16 + 2
    else:
        assert grown == 0 and stack.scheduler.num_rounds >= 1 + 60 // 4


@pytest.mark.parametrize(
    "argv,on",
    [
        (["up", "--device", "cpu"], False),
        (["up", "--decode-steps-adaptive"], True),
        (["up", "--device", "cuda:0"], True),
        (["up", "--device", "cuda:0", "--decode-steps", "4"], False),  # fixed rounds, as asked
        (["up", "--device", "cuda:0", "--decode-steps", "4", "--decode-steps-adaptive"], True),
        (["up", "--device", "cuda:0", "--no-decode-steps-adaptive"], False),
    ],
)
def test_up_passes_the_adaptive_rounds_to_the_gateway(argv: list[str], on: bool) -> None:
    """auto: on when the verifier runs on a GPU and --decode-steps is not given (rounds grown
    as measured ran 1.5x rounds of 4 steps at 32 streams on two H200s); off on a CPU."""
    gateway = up.child_commands(cli.parse_args(argv))["gateway"]
    assert gateway[:3] == [sys.executable, "-m", "specsplit.cli"]
    assert cli.parse_args(gateway[3:]).decode_steps_adaptive is on


def test_the_flags_default_quiet_time_is_the_policys() -> None:
    assert cli_flags.DECODE_STEPS_QUIET_MS == 1e3 * QUIET_SECONDS


@pytest.mark.parametrize(("value", "ms"), [(None, 100.0), ("0", 0.0), ("250", 250.0)])
def test_up_passes_the_quiet_time_to_the_gateway(value: str | None, ms: float) -> None:
    flags = [] if value is None else [f"--decode-steps-quiet-ms={value}"]
    argv = ["up", "--device", "cuda:0", *flags]
    gateway = up.child_commands(cli.parse_args(argv))["gateway"]
    assert cli.parse_args(gateway[3:]).decode_steps_quiet_ms == ms


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e400", "soon"])
def test_a_quiet_time_below_zero_or_not_a_number_is_refused(value: str) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["up", f"--decode-steps-quiet-ms={value}"])


@pytest.mark.parametrize(("value", "parsed"), [("auto", None), ("on", True), ("off", False)])
def test_the_adaptive_switch_reads_auto_from_the_environment(
    value: str, parsed: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$SPECSPLIT_DECODE_STEPS_ADAPTIVE=auto is the default spelled out (`up` decides; a
    serve-gateway takes it as off), as the help says."""
    monkeypatch.setenv("SPECSPLIT_DECODE_STEPS_ADAPTIVE", value)
    assert cli.parse_args(["up"]).decode_steps_adaptive is parsed
    assert cli.parse_args(["serve-gateway"]).decode_steps_adaptive is parsed


def test_the_scheduler_counts_admitted_requests_and_session_turns_as_arrivals(
    smollm2_tokenizer: object,
) -> None:
    """An unstarted scheduler (nothing leaves its queue): a request it queues and a session's
    turn each hold the rounds at the base for the quiet time; a request refused at once (past
    --max-waiting) does not."""
    scheduler = Scheduler(
        None, None, smollm2_tokenizer, (), SpecParams(), max_waiting=2,  # type: ignore[arg-type]
        decode_steps=4, adaptive_decode_steps=True,
    )  # fmt: skip
    clock = _Clock()
    policy = scheduler.steps_policy = DecodeSteps(4, quiet_seconds=0.1, clock=clock)
    _measured(policy, 8, MIN_ROUNDS, steps=4, step=1.0 * MS, idle=1.6 * MS)
    assert policy.steps(8) == 16

    async def main() -> None:
        waits = []

        async def queue(request: GenerationRequest) -> None:
            stream = scheduler.generate(request)
            queued = len(scheduler.waiting)
            waits.append(asyncio.ensure_future(anext(stream)))  # type: ignore[arg-type]
            for _ in range(100):  # a session's turn takes a few steps of the loop to its queue
                await asyncio.sleep(0)
                if len(scheduler.waiting) > queued:
                    return
            raise AssertionError("the request was not queued")

        await queue(GenerationRequest([1, 2], 4))
        assert len(scheduler.waiting) == 1 and policy.steps(8) == 4
        clock.now += 0.2
        assert policy.steps(8) == 16
        session = scheduler.sessions.open()
        await queue(GenerationRequest([3, 4], 4, session_id=session.session_id))
        assert len(scheduler.waiting) == 2 and policy.steps(8) == 4
        clock.now += 0.2
        with pytest.raises(ServiceError, match="waiting"):  # a third: refused, not queued
            scheduler.generate(GenerationRequest([5, 6], 4))
        assert policy.steps(8) == 16
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)

    asyncio.run(main())
