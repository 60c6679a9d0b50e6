"""bench/serving.py: its arrivals (a Poisson process, reproducible by seed; all at once at an
infinite rate), its per-stream times and quantiles, its setups' parsing, and its load through the
gateway's real gRPC servicer over the in-process engines: each request sent at its arrival, every
stream the target's own tokens, no KV left behind."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import statistics
from collections import Counter
from pathlib import Path

import pytest

from bench.serving import (
    Stream,
    Summary,
    arrivals,
    forwards_note,
    gate_note,
    lengthened,
    parse_setup,
    progress,
    quantiles,
    report,
    requests_for,
    run_load,
    up_order,
)
from gateway.request import ModelInfo
from gateway.servicer import GatewayServicer
from specsplit.messages import SpecParams
from specsplit.v1 import gateway_pb2
from tests.support import TINY_VOCAB, check_no_leaks, gateway_stub, make_stack, save_tiny_llama


def test_arrivals_are_a_seeded_poisson_process_starting_at_zero() -> None:
    times = arrivals(4000, rate=50.0, seed=3)
    assert times == arrivals(4000, rate=50.0, seed=3) != arrivals(4000, rate=50.0, seed=4)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.05)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.1)


def test_an_infinite_rate_sends_everything_at_once() -> None:
    assert arrivals(5, rate=math.inf, seed=0) == [0.0] * 5


def test_quantiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1 .. 100
    assert quantiles(values) == (50.0, 90.0, 99.0)
    assert quantiles([7.0]) == (7.0, 7.0, 7.0)
    assert all(math.isnan(q) for q in quantiles([]))


def test_a_stream_times_its_first_token_tokens_after_it_and_chunk_gaps() -> None:
    stream = Stream(sent=10.0, chunks=[(10.5, 1), (10.7, 4), (11.0, 3)], token_ids=list(range(8)))
    assert stream.ttft == pytest.approx(0.5)
    assert stream.tpot == pytest.approx(0.5 / 7)  # 7 tokens in the 0.5 s after the first
    assert stream.gaps == pytest.approx([0.2, 0.3])
    assert Stream(sent=0.0, chunks=[(1.0, 1)], token_ids=[5]).tpot is None
    assert Stream(sent=0.0, chunks=[(1.0, 5)], token_ids=[1, 2, 3, 4, 5]).tpot is None
    # a first chunk of 3 tokens (a first round that drafted): the 2 after it took 0.4 s
    first_three = Stream(sent=0.0, chunks=[(1.0, 3), (1.4, 2)], token_ids=[1, 2, 3, 4, 5])
    assert first_three.tpot == pytest.approx(0.2)
    summary = Summary.of([stream], wall=2.0)
    assert summary.tokens_per_s == 4.0 and summary.requests_per_s == 0.5
    assert summary.tokens_per_chunk == pytest.approx(8 / 3)
    assert summary.ttft == pytest.approx((0.5, 0.5, 0.5))


def test_setups_take_turns_and_report_medians_over_their_ups(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert up_order(["a", "b"], 3) == ["a", "b", "a", "b", "a", "b"]

    def summary(tokens_per_s: float, ttft: float) -> Summary:
        return Summary(tokens_per_s, 1.0, (ttft, 2 * ttft, 3 * ttft), (1.0,) * 3, (2.0,) * 3, 4.0)

    ups = [summary(100.0, 0.010), summary(300.0, 0.030), summary(200.0, 0.020)]
    for up, (used, dropped_by) in zip(ups, [(90, {"unasked": 4.0}), (70, {}), (80, {
        "unasked": 2.0, "released": 6.0})], strict=True):  # fmt: skip
        up.ahead_used, up.ahead_dropped, up.dropped_by = used, sum(dropped_by.values()), dropped_by
    median = Summary.median(ups)
    assert median.tokens_per_s == 200.0 and median.ttft == pytest.approx((0.02, 0.04, 0.06))
    # the steps run ahead: medians each (a reason an `up` did not report counts 0 there)
    assert median.ahead() == "80 / 4 (unasked 2)"
    args = argparse.Namespace(
        ignore_eos=True, max_new_tokens=8, num_requests=1, seed=0, ups=3, temperature=0.0
    )
    tokens = [[1, 2]]
    report(args, "target", math.inf, {
        "a": [(u, tokens) for u in ups],
        "b": [(summary(400.0, 0.010), tokens)] * 3,
    })  # fmt: skip
    out = capsys.readouterr().out
    assert "medians over 3 `up`s a setup" in out
    assert "| a | 200 (1.00x) |" in out and "| 100, 300, 200 |" in out
    assert "| 80 / 4 (unasked 2) |" in out and "| 0 / 0 |" in out
    assert "| b | 400 (2.00x) |" in out and "20.0 / 40.0 / 60.0 (1.00x)" in out


def test_each_up_prints_a_line_as_it_ends() -> None:
    """So a run cut short by a time limit still shows the `up`s it finished."""
    first = Summary(2197.4, 17.2, (0.0079, 0.0102, 0.0131), (0.0009,) * 3, (0.003,) * 3, 3.9)
    second = Summary(8286.0, 64.7, (0.0117, 0.0144, 0.016), (0.0014,) * 3, (0.005,) * 3, 3.9)
    workloads = [("target", 20.0, None, None), ("target", math.inf, None, None)]
    line = progress("prefill1", 3, 41.6, workloads, [(first, None), (second, None)])
    assert line == (
        "`up` 3 (prefill1, 42 s): target rate 20: 2197 tok/s, TTFT p50 7.9 ms, TPOT p50 0.9 ms"
        "; target rate inf: 8286 tok/s, TTFT p50 11.7 ms, TPOT p50 1.4 ms"
    )


def test_a_run_notes_the_gates_rounds_by_kind_and_the_overlap_modes_chosen() -> None:
    """Where a setup's speculation ran slower, the note says which rounds the gates ran."""
    before = Counter({("gateway", "specsplit_gate_speculating_round_seconds_count"): 10.0})
    before[("gateway", "specsplit_gate_speculating_round_seconds_sum")] = 0.1
    after = Counter(before)
    after[("gateway", "specsplit_gate_speculating_round_seconds_count")] += 40
    after[("gateway", "specsplit_gate_speculating_round_seconds_sum")] += 0.4
    after[("gateway", "specsplit_gate_plain_round_seconds_count")] += 4
    after[("gateway", "specsplit_gate_plain_round_seconds_sum")] += 0.02
    after[("gateway", "specsplit_rounds_total:groups")] += 30
    after[("gateway", "specsplit_rounds_total:serial")] += 10
    after[("gateway", "specsplit_rounds_total:plain")] += 4
    assert gate_note(before, after, {8: "groups", 1: "serial"}) == (
        "ran groups 30, plain 4, serial 10; gate rounds speculating 40 (10.0 ms), plain 4 (5.0 ms)"
        "; overlap b1 serial b8 groups"
    )
    assert gate_note(before, before, {}) == ""
    summary = Summary(100.0, 1.0, (0.01,) * 3, (0.002,) * 3, (0.004,) * 3, 2.0, gates="x")
    line = progress("a", 1, 3.0, [("default", 20.0, None, None)], [(summary, None)])
    assert line.endswith("TPOT p50 2.0 ms [x]")
    summary.forwards = "eager 3, graph 40"  # the verifier's forwards by path
    line = progress("a", 1, 3.0, [("default", 20.0, None, None)], [(summary, None)])
    assert line.endswith("TPOT p50 2.0 ms [x] [verifier forwards eager 3, graph 40]")


def test_a_setup_is_a_name_and_up_flags() -> None:
    assert parse_setup("steps4=--decode-steps=4 --overlap serial") == (
        "steps4",
        ("--decode-steps=4", "--overlap", "serial"),
    )
    assert parse_setup("default=") == ("default", ())
    for bad in ("no-equals", "=--flag"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_setup(bad)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("serving") / "target", seed=23)


def test_the_load_sends_each_request_at_its_arrival_and_streams_the_targets_tokens(
    target_dir: Path, smollm2_tokenizer, one_torch_thread: None
) -> None:
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SpecParams(3, 1, 3), num_pages=512)
    model = ModelInfo(smollm2_tokenizer, TINY_VOCAB, 512, eos_token_ids=(2,))
    servicer = GatewayServicer(model, stack.scheduler)
    requests = [
        gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=[(13 * i + 5 * j) % 400 + 3 for j in range(3 + i)]),
            max_new_tokens=12,
            ignore_eos=True,
        )
        for i in range(6)
    ]
    delays = arrivals(len(requests), rate=40.0, seed=1)

    async def main() -> tuple[list[Stream], float, list[list[int]]]:
        async with gateway_stub(stack, servicer) as stub:
            alone = []
            for request in requests:  # one at a time: each prompt's tokens alone
                streams, _ = await run_load(stub, [request], [0.0])
                alone.append(streams[0].token_ids)
            streams, wall = await run_load(stub, requests, delays)
            return streams, wall, alone

    streams, wall, alone = asyncio.run(main())
    check_no_leaks(stack)
    assert [s.token_ids for s in streams] == alone
    assert all(len(s.token_ids) == 12 for s in streams)  # ignore_eos: every stream runs to 12
    first_sent = min(s.sent for s in streams)
    # the wall time runs from the load's start (the first send) to the last stream's end
    assert wall == pytest.approx(max(s.ended for s in streams) - first_sent, abs=0.05)
    assert Summary.of(streams, wall).tokens_per_s == pytest.approx(6 * 12 / wall)
    for stream, delay in zip(streams, delays, strict=True):
        assert stream.sent - first_sent == pytest.approx(delay, abs=0.05)
        assert 0 < stream.ttft <= stream.ended - stream.sent
        assert sum(n for _, n in stream.chunks) == 12 and len(stream.chunks) >= 2


def test_prompts_lengthened_from_their_own_tokens_then_the_others() -> None:
    prompts = [[1, 2, 3], [4, 5], [6]]
    assert lengthened(prompts, None) == prompts
    assert lengthened(prompts, 7) == [
        [1, 2, 3, 4, 5, 6, 1],
        [4, 5, 6, 1, 2, 3, 4],
        [6, 1, 2, 3, 4, 5, 6],
    ]
    assert lengthened(prompts, 2) == [[1, 2], [4, 5], [6, 1]]


def test_requests_are_greedy_or_sampled_seeded_by_their_index() -> None:
    """--temperature: every request sampled at it, seeded by its index (the same seeds in
    every setup and `up`); 0: greedy (no sampling params sent). --spec target: no drafts."""
    prompts = [[1, 2, 3], [4, 5]]
    args = argparse.Namespace(num_requests=3, max_new_tokens=8, ignore_eos=True, temperature=0.0)
    greedy = requests_for(prompts, args, "default")
    assert [list(r.token_ids.ids) for r in greedy] == [[1, 2, 3], [4, 5], [1, 2, 3]]
    assert not any(r.HasField("sampling") or r.HasField("spec") for r in greedy)
    args.temperature = 0.7
    sampled = requests_for(prompts, args, "target")
    assert [r.sampling.seed for r in sampled] == [0, 1, 2]
    assert all(r.sampling.temperature == pytest.approx(0.7) for r in sampled)
    assert all(r.spec.num_steps == 0 for r in sampled)


def test_the_verifiers_forwards_by_path_and_its_eager_ones_by_why() -> None:
    before = Counter({("verifier", "specsplit_verifier_forwards_total:graph"): 10.0})
    after = Counter(
        {
            ("verifier", "specsplit_verifier_forwards_total:graph"): 410.0,
            ("verifier", "specsplit_verifier_forwards_total:eager"): 12.0,
            ("verifier", "specsplit_verifier_eager_forwards_total:run"): 9.0,
            ("verifier", "specsplit_verifier_eager_forwards_total:batch"): 3.0,
            ("gateway", "specsplit_verifier_forwards_total:eager"): 99.0,  # not the verifier's
        }
    )
    assert forwards_note(before, after) == "eager 12 (batch 3, run 9), graph 400"
    assert forwards_note(before, before) == ""
