"""Serving under arrivals: requests arrive as a Poisson process at --rate requests a second
(`inf`: all at once), each a stream through `specsplit up`, as a server's users send them.
Per stream: time to first token (TTFT: the request sent to its first chunk with tokens), time a
token after the first chunk (TPOT: its last chunk's arrival less its first's, over the tokens
after the first chunk) and the gaps between its chunks (a round's tokens stream as one chunk:
rounds of N decode steps stream N tokens at once). Per run: output tokens a second over the
run's wall time (its first request sent to its last stream's end), p50 / p90 / p99 of each.
Below saturation the tokens a second follow the arrivals (the offered load, requests a second x
tokens a request, is printed beside them): only a rate the server cannot keep up with, or
`inf`, compares throughput.

Each --setup is one `up` with more flags (`NAME=FLAGS`, the flags space-separated; default: `up`'s
defaults, and rounds of 4 fixed decode steps beside them), all run on one schedule of arrivals
(--seed) with the same prompts (the bundled chat prompts, cycled; --prompt-tokens N: each made
N tokens long from them), so the rows compare the
setups. Before its timed runs each `up` serves the first rate's schedule once untimed (its
adaptive policies measure their batch sizes then, as a long-running server's have). --ups N runs
each setup's `up` N times, the setups in turn (A B A B ...), and reports each figure's median
over them, each `up`'s tokens a second beside it: one `up` can run tens of percent faster than
the next on a shared machine. --spec:
each request's draft shape, `target` (target only, no drafts) or `default` (the gateway's).

    PYTHONPATH=. python bench/serving.py [--model PATH] [--device cuda:0] [--drafter-device ...]
        [--rate 4 16 inf] [--num-requests 64] [--max-new-tokens 128] [--ignore-eos]
        [--spec target default] [--setup default= --setup steps4=--decode-steps=4] [--ups 3]
        [--temperature 1.0]

Every stream must end with its tokens (a failed stream fails the run); how many streams gave
the first setup's tokens is printed beside each row (greedy: a batch's makeup may part tokens
at near-ties on a GPU, so it is shown, not asserted; sampled, --temperature: the target's
distribution, not its draws, so few match).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import shlex
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from bench.acceptance import bundled_prompts
from bench.e2e import Totals, scrape_overlap_modes, scrape_totals, services, wait_for_drafter
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.loader import load_tokenizer
from specsplit.prompt import apply_chat_template
from specsplit.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

GATEWAY = "127.0.0.1:50151"  # bench.e2e.services' gateway
TARGET_ONLY = common_pb2.SpecParams(num_steps=0, topk=1)
DEFAULT_SETUPS = ("default=", "steps4=--decode-steps=4")
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Stream:
    """One request's times (seconds on the client's perf_counter) and tokens."""

    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrived, tokens in it)
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.sent

    @property
    def tpot(self) -> float | None:
        """Seconds a token after the first chunk's: the later chunks' tokens over the time
        they took; None for a stream of one chunk."""
        if len(self.chunks) < 2:
            return None
        later = len(self.token_ids) - self.chunks[0][1]
        return (self.chunks[-1][0] - self.chunks[0][0]) / later

    @property
    def gaps(self) -> list[float]:
        return [b[0] - a[0] for a, b in itertools.pairwise(self.chunks)]

    @property
    def ended(self) -> float:
        return self.chunks[-1][0]


def arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds after the run's start at which each request is sent: a Poisson process of `rate`
    requests a second (exponential gaps, the first at 0), all at 0 when `rate` is inf."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def one_stream(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest, delay: float,
    start: float,
) -> Stream:  # fmt: skip
    """`request` sent `delay` seconds after `start` (perf_counter), its chunks timed."""
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    stream = Stream(sent=time.perf_counter())
    async for response in stub.Generate(request):
        if response.token_ids:
            stream.chunks.append((time.perf_counter(), len(response.token_ids)))
            stream.token_ids.extend(response.token_ids)
    if not stream.chunks:
        raise RuntimeError("a stream ended without tokens")
    return stream


async def run_load(
    stub: gateway_pb2_grpc.GatewayStub,
    requests: Sequence[gateway_pb2.GenerateRequest],
    delays: Sequence[float],
) -> tuple[list[Stream], float]:
    """Every request at its delay, all at once in flight as they arrive; (the streams in
    request order, the run's wall seconds: its start to its last stream's end)."""
    start = time.perf_counter()
    streams = await asyncio.gather(
        *(one_stream(stub, r, d, start) for r, d in zip(requests, delays, strict=True))
    )
    return list(streams), max(s.ended for s in streams) - start


def quantiles(values: Sequence[float]) -> tuple[float, ...]:
    """QUANTILES of `values` (nearest rank); nan each when there are none."""
    ordered = sorted(values)
    if not ordered:
        return tuple(math.nan for _ in QUANTILES)
    return tuple(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] for q in QUANTILES)


@dataclass
class Summary:
    tokens_per_s: float
    requests_per_s: float
    ttft: tuple[float, ...]  # QUANTILES, seconds
    tpot: tuple[float, ...]
    gap: tuple[float, ...]
    tokens_per_chunk: float
    # the verifier's decode steps run ahead during the run, taken and dropped
    # (`specsplit_decode_ahead_total`): a dropped one is a step of device time thrown away
    ahead_used: float = 0.0
    ahead_dropped: float = 0.0
    # ... those dropped by why (`specsplit_decode_ahead_dropped_total`, verifier/run_ahead.py
    # DROP_REASONS)
    dropped_by: dict[str, float] = field(default_factory=dict)
    # the gateway's rounds by kind and its gates during the run (`gate_note`; "" for none)
    gates: str = ""
    # the verifier's and the drafter's forwards during the run by path (graph, eager: why),
    # `forwards_note`'s
    forwards: str = ""
    drafter_forwards: str = ""

    @classmethod
    def median(cls, summaries: Sequence[Summary]) -> Summary:
        """Each figure's median over `summaries` (several `up`s of one setup)."""

        def each(values: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
            return tuple(statistics.median(column) for column in zip(*values, strict=True))

        return cls(
            tokens_per_s=statistics.median(s.tokens_per_s for s in summaries),
            requests_per_s=statistics.median(s.requests_per_s for s in summaries),
            ttft=each([s.ttft for s in summaries]),
            tpot=each([s.tpot for s in summaries]),
            gap=each([s.gap for s in summaries]),
            tokens_per_chunk=statistics.median(s.tokens_per_chunk for s in summaries),
            ahead_used=statistics.median(s.ahead_used for s in summaries),
            ahead_dropped=statistics.median(s.ahead_dropped for s in summaries),
            dropped_by={
                reason: statistics.median(s.dropped_by.get(reason, 0.0) for s in summaries)
                for reason in {r for s in summaries for r in s.dropped_by}
            },
        )

    def ahead(self) -> str:
        """The steps run ahead: "used / dropped (reason n, ...)"."""
        reasons = ", ".join(
            f"{reason} {n:.0f}" for reason, n in sorted(self.dropped_by.items()) if n
        )
        return f"{self.ahead_used:.0f} / {self.ahead_dropped:.0f}" + (
            f" ({reasons})" if reasons else ""
        )

    @classmethod
    def of(cls, streams: Sequence[Stream], wall: float) -> Summary:
        num_tokens = sum(len(s.token_ids) for s in streams)
        tpots = [t for s in streams if (t := s.tpot) is not None]
        return cls(
            tokens_per_s=num_tokens / wall,
            requests_per_s=len(streams) / wall,
            ttft=quantiles([s.ttft for s in streams]),
            tpot=quantiles(tpots),
            gap=quantiles([g for s in streams for g in s.gaps]),
            tokens_per_chunk=num_tokens / sum(len(s.chunks) for s in streams),
        )


def by_label(before: Totals, after: Totals, process: str, prefix: str) -> dict[str, float]:
    """A labelled counter's growth during a run by its label (`scrape_totals`' keys "<name>:<label>"
    under `prefix`), for `process`."""
    return {
        key.removeprefix(prefix): after[(who, key)] - before[(who, key)]
        for who, key in after
        if who == process and key.startswith(prefix)
    }


def forwards_note(before: Totals, after: Totals, service: str = "verifier") -> str:
    """A service's forwards during a run by path (the verifier's, or the drafter's catch-up and
    root steps), its eager ones by why no graph ran them: "eager 12 (run 9, batch 3), graph
    400"."""
    paths = by_label(before, after, service, f"specsplit_{service}_forwards_total:")
    whys = by_label(before, after, service, f"specsplit_{service}_eager_forwards_total:")
    why = ", ".join(f"{w} {n:.0f}" for w, n in sorted(whys.items()) if n)
    notes = [
        f"{p} {n:.0f}" + (f" ({why})" if p == "eager" and why else "")
        for p, n in sorted(paths.items())
        if n
    ]
    return ", ".join(notes)


def gate_note(before: Totals, after: Totals, modes: dict[int, str]) -> str:
    """What the gateway's gates did during a run: its rounds by kind (plain, or the kind a
    speculating round ran as), the speculation gate's rounds by kind (speculating, plain,
    resuming) with their mean wall time, and the overlap gate's round kind per batch bucket at
    its end. Why a setup speculated slower or faster than another."""
    ran = by_label(before, after, "gateway", "specsplit_rounds_total:")
    run = (
        "ran " + ", ".join(f"{k} {n:.0f}" for k, n in sorted(ran.items()) if n)
        if any(ran.values())
        else ""
    )
    kinds = []
    for kind in ("speculating", "plain", "resuming"):
        count, total = (
            after[("gateway", f"specsplit_gate_{kind}_round_seconds_{part}")]
            - before[("gateway", f"specsplit_gate_{kind}_round_seconds_{part}")]
            for part in ("count", "sum")
        )
        if count:
            kinds.append(f"{kind} {count:.0f} ({total / count * 1e3:.1f} ms)")
    rounds = "gate rounds " + ", ".join(kinds) if kinds else ""
    chosen = " ".join(f"b{bucket} {mode}" for bucket, mode in sorted(modes.items()))
    overlap = f"overlap {chosen}" if chosen else ""
    return "; ".join(part for part in (run, rounds, overlap) if part)


def parse_setup(text: str) -> tuple[str, tuple[str, ...]]:
    """`NAME=FLAGS` -> (NAME, the flags split as a shell would)."""
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--setup {text!r}: want NAME=FLAGS (FLAGS may be empty)")
    return name, tuple(shlex.split(flags))


def lengthened(prompts: Sequence[list[int]], tokens: int | None) -> list[list[int]]:
    """Each prompt made `tokens` long (None: as it is): its own tokens, then the other prompts'
    in turn, cut there (long prompts for timing: a prompt past the verifier's prefill graphs
    leads in by chunks; the words are the bundled prompts', not one text)."""
    if tokens is None:
        return [list(p) for p in prompts]
    out = []
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        for other in itertools.cycle(prompts[i + 1 :] + prompts[: i + 1]):
            if len(ids) >= tokens:
                break
            ids += other
        out.append(ids[:tokens])
    return out


def requests_for(
    prompts: Sequence[list[int]], args: argparse.Namespace, spec: str
) -> list[gateway_pb2.GenerateRequest]:
    return [
        gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompts[i % len(prompts)]),
            max_new_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos,
            spec=TARGET_ONLY if spec == "target" else None,
            # sampled: seeded by the request's index, the same seeds in every setup and `up`
            sampling=common_pb2.SamplingParams(temperature=args.temperature, seed=i)
            if args.temperature
            else None,
        )
        for i in range(args.num_requests)
    ]


def ms(values: tuple[float, ...]) -> str:
    return " / ".join(f"{v * 1e3:.1f}" for v in values)


def up_order(names: Sequence[str], ups: int) -> list[str]:
    """The setups' `up`s in turn, `ups` rounds of them (A B A B ...): a machine's drift between
    `up`s falls on every setup alike."""
    return [name for _ in range(ups) for name in names]


def report(
    args: argparse.Namespace,
    spec: str,
    rate: float,
    per_up: dict[str, list[tuple[Summary, list[list[int]]]]],
) -> None:
    """One workload's table: each setup's median over its `up`s (each `up`'s tokens/s beside it
    when there were several), its streams' tokens against the first setup's first `up`."""
    rows = {
        name: (Summary.median([s for s, _ in results]), results[0][1])
        for name, results in per_up.items()
    }
    first_name = next(iter(rows))
    base, reference = rows[first_name]
    flags = " ".join(f"--{k.replace('_', '-')}={v}" for k, v in (("spec", spec), ("rate", rate)))
    eos = ", --ignore-eos" if args.ignore_eos else ""
    eos += f", sampled at temperature {args.temperature:g}" if args.temperature else ""
    offered = (
        "all at once"
        if math.isinf(rate)
        else f"offered load {rate * args.max_new_tokens:.0f} tokens/s at most"
    )
    print(
        f"\n{flags}: {args.num_requests} requests, {args.max_new_tokens} new tokens at most{eos}"
        f", arrivals seed {args.seed}, {offered}; vs = against {first_name}"
        + (f"; medians over {args.ups} `up`s a setup, in turn" if args.ups > 1 else "")
    )
    print(
        "| setup | tok/s (vs) | req/s | TTFT p50 / p90 / p99 ms (p50 vs) | TPOT p50 / p90 / p99 ms"
        " | chunk gap p50 / p90 / p99 ms | tokens a chunk | steps ahead used / dropped (why)"
        " | streams as the first setup's | tok/s each up |"
    )
    print("|---|---:|---:|---|---|---|---:|---|---:|---|")
    for name, (s, outputs) in rows.items():
        same = sum(a == b for a, b in zip(outputs, reference, strict=True))
        each_up = ", ".join(f"{u.tokens_per_s:.0f}" for u, _ in per_up[name])
        print(
            f"| {name} | {s.tokens_per_s:.0f} ({s.tokens_per_s / base.tokens_per_s:.2f}x)"
            f" | {s.requests_per_s:.2f} | {ms(s.ttft)} ({s.ttft[0] / base.ttft[0]:.2f}x)"
            f" | {ms(s.tpot)} | {ms(s.gap)} | {s.tokens_per_chunk:.1f}"
            f" | {s.ahead()} | {same}/{len(outputs)}"
            f" | {each_up} |"
        )


def progress(
    name: str,
    number: int,
    seconds: float,
    workloads: Sequence[tuple[str, float, object, object]],
    results: Sequence[tuple[Summary, object]],
) -> str:
    """One line as an `up` ends (printed at once, so a run cut short by a time limit still
    shows the `up`s it finished): its setup, how long it took, each workload's tokens a
    second and TTFT / TPOT p50, what the gateway's gates did (`gate_note`) and the verifier's
    and the drafter's forwards by path (an eager one is host-bound on a GPU)."""
    runs = "; ".join(
        f"{spec} rate {rate:g}: {s.tokens_per_s:.0f} tok/s, TTFT p50 {s.ttft[0] * 1e3:.1f} ms"
        f", TPOT p50 {s.tpot[0] * 1e3:.1f} ms"
        + (f" [{s.gates}]" if s.gates else "")
        + (f" [verifier forwards {s.forwards}]" if s.forwards else "")
        + (f" [drafter forwards {s.drafter_forwards}]" if s.drafter_forwards else "")
        for (spec, rate, _, _), (s, _) in zip(workloads, results, strict=True)
    )
    return f"`up` {number} ({name}, {seconds:.0f} s): {runs}"


async def serve_setup(
    args: argparse.Namespace,
    workloads: list[tuple[str, float, list[gateway_pb2.GenerateRequest], list[float]]],
) -> list[tuple[Summary, list[list[int]]]]:
    """One `up`'s runs: the first workload untimed, then each timed, in order."""
    async with grpc.aio.insecure_channel(GATEWAY) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        _, _, requests, delays = workloads[0]
        await run_load(stub, requests, delays)  # warm-up
        results = []
        for _, _, requests, delays in workloads:
            before = scrape_totals()
            streams, wall = await run_load(stub, requests, delays)
            after = scrape_totals()
            summary = Summary.of(streams, wall)
            used, dropped = (
                ("verifier", f"specsplit_decode_ahead_total:{outcome}")
                for outcome in ("used", "dropped")
            )
            summary.ahead_used = after[used] - before[used]
            summary.ahead_dropped = after[dropped] - before[dropped]
            summary.dropped_by = by_label(
                before, after, "verifier", "specsplit_decode_ahead_dropped_total:"
            )
            summary.gates = gate_note(before, after, scrape_overlap_modes())
            summary.forwards = forwards_note(before, after)
            summary.drafter_forwards = forwards_note(before, after, "drafter")
            results.append((summary, [s.token_ids for s in streams]))
        return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="target checkpoint (default: embedded)")
    parser.add_argument("--device", default="cpu", help="the verifier's device")
    parser.add_argument("--drafter-device", default=None, help="default: --device")
    parser.add_argument("--dtype", default=None, help="specsplit up --dtype (default: its own)")
    parser.add_argument("--drafter", default=None, help="specsplit up --drafter")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument(
        "--rate", type=float, nargs="+", default=[4.0, 16.0, math.inf], help="requests a second"
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="each prompt made N tokens long from the bundled ones (default: as they are)",
    )
    parser.add_argument(
        "--long-every",
        type=int,
        default=1,
        help="with --prompt-tokens: only every K-th prompt made that long, the others as they "
        "are (streams decoding while long prompts come in: --prefill-chunk)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true", help="every stream runs to the end")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampled requests at this temperature, seeded by their index (default 0: greedy)",
    )
    parser.add_argument("--spec", nargs="+", choices=("target", "default"), default=["target"])
    parser.add_argument("--seed", type=int, default=0, help="the arrivals' schedule")
    parser.add_argument(
        "--setup",
        action="append",
        type=parse_setup,
        default=None,
        help="NAME=FLAGS: one `up` with more flags, repeatable (default: "
        + " ".join(DEFAULT_SETUPS)
        + ")",
    )
    parser.add_argument(
        "--ups", type=int, default=1, help="`up`s a setup, in turn (medians reported)"
    )
    parser.add_argument("--services-log", default=None, help="append the services' output here")
    args = parser.parse_args()
    args.speculation_gate = "off"
    setups = args.setup or [parse_setup(s) for s in DEFAULT_SETUPS]
    path = args.model or embedded_default_model_path()
    tokenizer = load_tokenizer(path)
    chats = [apply_chat_template(tokenizer, m) for m in bundled_prompts()]
    long = lengthened(chats, args.prompt_tokens)
    pairs = enumerate(zip(long, chats, strict=True))
    prompts = [p if i % args.long_every == 0 else c for i, (p, c) in pairs]
    workloads = [
        (spec, rate, requests_for(prompts, args, spec), delays)
        for spec in args.spec
        for rate in args.rate
        for delays in [arrivals(args.num_requests, rate, args.seed)]
    ]
    flags_of = dict(setups)
    # setup -> per `up`: per workload (Summary, tokens)
    by_setup: dict[str, list[list[tuple[Summary, list[list[int]]]]]] = {n: [] for n in flags_of}
    for number, name in enumerate(up_order(list(flags_of), args.ups), start=1):
        started = time.perf_counter()
        with services(args, flags_of[name]) as sync_stub:
            wait_for_drafter(sync_stub, prompts[0])
            by_setup[name].append(asyncio.run(serve_setup(args, workloads)))
        seconds = time.perf_counter() - started
        print(progress(name, number, seconds, workloads, by_setup[name][-1]), flush=True)
    for i, (spec, rate, _, _) in enumerate(workloads):
        per_up = {name: [up[i] for up in ups] for name, ups in by_setup.items()}
        report(args, spec, rate, per_up)


if __name__ == "__main__":
    main()
