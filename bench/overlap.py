"""Serial rounds vs pipelined groups vs draft-ahead vs the target alone through `specsplit up`
(three processes), the same prompts at several batch sizes (that many streams at once; the bundled
prompts repeated when the batch is larger), in one run; greedy, so every mode must give the same
tokens. "target only" is the serial services with speculation off per request (num_steps 0).

    PYTHONPATH=. python bench/overlap.py [--batch 1 4 8] [--max-new-tokens 48] [--device cpu]
        [--drafter-device DEVICE] [--model PATH] [--drafter KIND] [--draft-model PATH]
        [--spec 5x4x16 | --speculation-gate on] [--modes serial groups ahead both]
        [--services-log FILE] [--synthetic-acceptance 0.8,0.7,0.6] [--repeat 3]
        [--prompt-groups 4] [--ups 2] [--variant "--ahead-guesses=4"]

Prints tokens/s per (mode, batch), the ratios to target-only and to serial, draft-ahead's hit
rate (rounds whose tree was drafted ahead, of those with trees drafted ahead), and each mode's
round parts from the services' histograms (round wall, verify and draft engine time,
the part outside the verifier's engine), p50 as bucket upper bounds.

--synthetic-acceptance (timing only, labelled in every output): the verifier accepts each
tree's first children at these rates (`serve-verifier --synthetic-acceptance`), so random-weight
checkpoints (`bench/random_model.py --shape llama-8b` / `llama-1b` with `--drafter model`) run the
whole system at a realistic accepted length; every stream runs to --max-new-tokens (EOS ignored)
and outputs are not the target's, so the same-tokens column compares nothing.

--repeat N: each (mode, batch) timed N times in its `up`; the tokens/s tables give the median
run, the time-spent table all N together, and a line per run lists each run's tokens/s (the
spread between `up` starts was ~+-25% at 64 tokens a stream, thirty-sixth session).

--prompt-groups G: each timed run streams G batches one after another, each of the next
`batch` bundled prompts (16 of them, reused past the last), so a run covers several prompts'
acceptance and lasts G times as long: at batch 1 one stream of 128 tokens took ~0.25 s and runs
scattered by +-30% (thirty-ninth session).

--ups N: the modes' `up`s N times in turn (serial, ahead-plain, serial, ahead-plain, ...), each
mode's runs pooled over its `up`s; every `up` also times target-only, the yardstick of its own
`up`. Runs within one `up` agree to a few percent while `up` starts on one machine differed by
+-15-25% (forty-fourth session), so one `up` per mode measures the `up` as much as the mode: the
ratios are printed per pair of `up`s, as is, and with each mode's tokens/s over the target-only
of its own `up`.

--variant ARGS: each mode but serial also run with these `up` arguments (after every other),
as a mode of its own named "MODE ARGS": a knob A/B'd in the same run, against the same serial
and target-only (with --ups, in turn with the others).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.acceptance import bundled_prompts
from bench.e2e import (
    ROUND_PARTS,
    Buckets,
    Totals,
    gated_round_cells,
    quantile,
    scrape_buckets,
    scrape_overlap_modes,
    scrape_totals,
    services,
    wait_for_drafter,
)
from gateway.adaptive import parse_ladder
from specsplit import convert
from specsplit.metrics import GATE_ROUND_KINDS
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.loader import load_tokenizer
from specsplit.prompt import apply_chat_template
from specsplit.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

# "groups-early": groups with the other group's Verify sent while one is in flight ("groups":
# without it; the other modes take `up`'s default, --early-verify auto)
# "ahead": draft-ahead whose misses are drafted before their Verify (`--ahead-miss draft`);
# "ahead-plain": misses verified with no tree (`--ahead-miss plain`, `up`'s default)
MODES = ("serial", "groups", "groups-early", "gated", "ahead", "ahead-plain", "both")
TARGET_ONLY = common_pb2.SpecParams(num_steps=0, topk=1)
WARMUP_TOKENS = 16  # each batch runs once this long before its timed run
# ... and in "gated" mode this long: the overlap gate explores its modes per batch size (five
# on two GPUs: groups with the early Verify and without, draft-ahead with hints and without,
# serial; WINDOW measured rounds each after a settling one, gateway/gate.py) before the timed
# run sees its choice, as a long-running gateway does (exploring is a one-time cost per batch
# size). 128 tokens were ~51 rounds of a stream at 2.5 tokens a round against the 45 that
# exploring takes: a mode whose misses commit one token a round pushed it into the timed run
GATED_WARMUP_TOKENS = 256
PARTS = ("round (gateway)", "verify engine", "draft engine", "round outside verify engine")


def run_batch(
    stub: gateway_pb2_grpc.GatewayStub,
    prompts: list[list[int]],
    max_new_tokens: int,
    spec: common_pb2.SpecParams | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = False,
) -> tuple[list[list[int]], float]:
    """Every prompt as its own stream, all at once; (tokens of each, wall seconds). spec: the
    requests' draft shape (None: the gateway's default). temperature > 0: stream i samples
    with seed i. ignore_eos: every stream runs to max_new_tokens (random weights)."""

    def one(i: int) -> list[int]:
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompts[i]),
            max_new_tokens=max_new_tokens,
            spec=spec,
            sampling=common_pb2.SamplingParams(temperature=temperature, seed=i),
            ignore_eos=ignore_eos,
        )
        return [t for r in stub.Generate(request) for t in r.token_ids]

    with ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        outputs = list(pool.map(one, range(len(prompts))))
        return outputs, time.perf_counter() - start


def run_groups(
    stub: gateway_pb2_grpc.GatewayStub,
    groups: list[list[list[int]]],
    max_new_tokens: int,
    spec: common_pb2.SpecParams | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = False,
) -> tuple[list[list[int]], float]:
    """`run_batch` of each group of prompts, one after another: every stream's tokens (the
    groups' in order) and the wall seconds of them all."""
    outputs: list[list[int]] = []
    wall = 0.0
    for prompts in groups:
        out, seconds = run_batch(stub, prompts, max_new_tokens, spec, temperature, ignore_eos)
        outputs += out
        wall += seconds
    return outputs, wall


def print_time_spent(
    runs: dict[tuple[str, int], list[tuple[int, float]]],
    totals: dict[tuple[str, int], Totals],
    batches: list[int],
    modes: tuple[str, ...],
) -> None:
    """Per run, exact means from the services' histogram sums: engine time per call, each
    engine's busy fraction (engine-call time / wall: an upper bound of its GPU's), the
    verifier GPU's own (its rounds' device time from CUDA events / wall; "-" off a GPU), accepted
    tokens per sequence-round (of a round's first step), and tokens/s against what the verify
    time alone allows (every token over the verifier's engine time: the overlap issue's goal is
    >= 0.9). The
    hit rate: draft-ahead's; on target-only rows the share of the verifier's decode steps run
    ahead that the next round took. Over every timed run of a (mode, batch) (`runs`: tokens and
    wall seconds of each)."""
    print(
        "| run | batch | tok/s | verify ms/call | draft ms/call | verifier busy | verifier GPU "
        "busy | drafter busy | accepted/round | verify-bound tok/s | of the bound "
        "| ahead hit rate |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in ("target", *modes):
        for batch in batches:
            tokens = sum(n for n, _ in runs[(mode, batch)])
            wall = sum(w for _, w in runs[(mode, batch)])
            t = totals[(mode, batch)]
            rate = tokens / wall
            verify_s = t[("verifier", "specsplit_verify_seconds_sum")]
            draft_s = t[("drafter", "specsplit_draft_seconds_sum")]
            device_s = t[("verifier", "specsplit_verify_device_seconds_sum")]
            device_busy = f"{device_s / wall:.2f}" if device_s else "-"
            accepted = t[("gateway", "specsplit_accepted_tokens_per_round_sum")]
            seq_rounds = t[("gateway", "specsplit_accepted_tokens_per_round_count")]
            # every token over the verifier's time (a round of several decode steps included)
            bound = tokens / verify_s if verify_s else math.nan
            name = "target only" if mode == "target" else mode
            hits = t[("gateway", "specsplit_draft_ahead_total:hit")]
            misses = t[("gateway", "specsplit_draft_ahead_total:miss")]
            if mode == "target":  # the verifier's decode steps run ahead, kept / all
                hits = t[("verifier", "specsplit_decode_ahead_total:used")]
                misses = t[("verifier", "specsplit_decode_ahead_total:dropped")]
            hit_rate = f"{hits / (hits + misses):.2f}" if hits + misses else "-"
            print(
                f"| {name} | {batch} | {rate:.1f} "
                f"| {_per_call(verify_s, t[('verifier', 'specsplit_verify_seconds_count')])} "
                f"| {_per_call(draft_s, t[('drafter', 'specsplit_draft_seconds_count')])} "
                f"| {verify_s / wall:.2f} | {device_busy} | {draft_s / wall:.2f} "
                f"| {accepted / max(seq_rounds, 1):.2f} | {bound:.1f} | {rate / bound:.2f} "
                f"| {hit_rate} |"
            )


def print_divergence(
    results: dict[tuple[str, int], tuple[list[list[int]], float]],
    batches: list[int],
    modes: tuple[str, ...],
) -> None:
    """Streams whose tokens differ from target-only's, per mode: where they part (bf16 logits
    of a token computed in rounds of other shapes can tip a near tie; float32 tests are exact)."""
    for mode in modes:
        for batch in batches:
            target, outputs = results[("target", batch)][0], results[(mode, batch)][0]
            parts = [
                next((i for i, (a, b) in enumerate(zip(t, o, strict=False)) if a != b), None)
                for t, o in zip(target, outputs, strict=True)
            ]
            differ = [(s, i) for s, i in enumerate(parts) if i is not None]
            if differ:
                where = ", ".join(f"stream {s} at token {i}" for s, i in differ[:8])
                print(f"{mode} batch {batch}: {len(differ)} differ from target-only ({where})")


def print_gated_rounds(
    totals: dict[tuple[str, int], Totals], batches: list[int], modes: tuple[str, ...]
) -> None:
    """With the speculation gate on: per run, its rounds by kind (count, mean ms) from the
    gateway's gate histograms (specsplit/metrics.py GATE_ROUND_KINDS)."""
    print("| run | batch | " + " | ".join(f"{kind} rounds, mean ms" for kind in GATE_ROUND_KINDS))
    print("|---|---:|" + "---:|" * len(GATE_ROUND_KINDS))
    for mode in modes:
        for batch in batches:
            cells = gated_round_cells(totals[(mode, batch)])
            print(f"| {mode} | {batch} | " + " | ".join(cells) + " |")


def print_ups(
    up_rates: dict[tuple[str, int], list[float]],
    up_target: dict[tuple[str, int], list[float]],
    batches: list[int],
    others: list[str],
) -> None:
    """--ups: each `up`'s median tokens/s of a mode and of target-only in that `up`; each mode's
    ratio to serial per pair of `up`s (the i-th of each), as is and with each over its own `up`'s
    target-only (an `up` that ran slow ran its target-only slow too), and their medians."""
    print("by `up` (tokens/s, the `up`'s median run; target-only in the same `up` after '/'):")
    for batch in batches:
        for mode in ("serial", *others):
            cells = ", ".join(
                f"{r:.1f} / {t:.1f}"
                for r, t in zip(up_rates[(mode, batch)], up_target[(mode, batch)], strict=True)
            )
            print(f"  {mode} batch {batch}: {cells}")
        slow = slow_ups({mode: up_target[(mode, batch)] for mode in ("serial", *others)})
        if slow:
            print(f"  slow `up`s at batch {batch} (target-only under {SLOW_UP:.2f}x the median"
                  f" of every `up`'s; their raw pairs mislead): {', '.join(slow)}")  # fmt: skip
        serial = up_rates[("serial", batch)]
        serial_norm = [r / t for r, t in zip(serial, up_target[("serial", batch)], strict=True)]
        for mode in others:
            rates = up_rates[(mode, batch)]
            norm = [r / t for r, t in zip(rates, up_target[(mode, batch)], strict=True)]
            plain = [r / s for r, s in zip(rates, serial, strict=True)]
            yardstick = [n / s for n, s in zip(norm, serial_norm, strict=True)]
            print(
                f"  {mode} / serial batch {batch} by pair of `up`s: "
                f"{', '.join(f'{x:.2f}' for x in plain)} (median {statistics.median(plain):.2f}x); "
                f"each over its `up`'s target-only: {', '.join(f'{x:.2f}' for x in yardstick)} "
                f"(median {statistics.median(yardstick):.2f}x)"
            )


SLOW_UP = 0.85  # an `up` whose target-only ran under this share of the median `up`'s


def slow_ups(targets: dict[str, list[float]]) -> list[str]:
    """The `up`s (mode #i, 1-based) whose target-only tokens/s fell under SLOW_UP times the
    median of every `up`'s: the machine ran slow through them, so a raw ratio with one of them
    says more about the machine than about the mode."""
    median = statistics.median(t for ups in targets.values() for t in ups)
    return [
        f"{mode} #{i + 1} ({t:.1f} against {median:.1f})"
        for mode, ups in targets.items()
        for i, t in enumerate(ups)
        if t < SLOW_UP * median
    ]


# a timed run: each stream's tokens and the wall seconds of them all
Run = tuple[list[list[int]], float]


def _tokens(run: Run) -> int:
    return sum(map(len, run[0]))


def _rate(run: Run) -> float:
    return _tokens(run) / run[1]


def _median_run(runs: list[Run]) -> Run:
    """The median run by tokens/s (the upper of the middle two: a run that happened)."""
    return sorted(runs, key=_rate)[len(runs) // 2]


def _per_call(seconds: float, calls: float) -> str:
    return f"{1e3 * seconds / calls:.2f}" if calls else "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampled streams, stream i seeded i (0: greedy); their tokens then differ from "
        "target-only's (the same law)",
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--drafter-device", default=None)
    parser.add_argument("--drafter", default=None, help="specsplit up --drafter (default: its own)")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument(
        "--spec", default=None, help="the speculative modes' draft shape STEPS[xTOPK[xNODES]]"
    )
    parser.add_argument(
        "--speculation-gate",
        choices=("on", "off"),
        default="off",
        help="the gateway's --speculation-gate: serial and groups runs gated (not with --spec:"
        " requests naming their spec are never gated)",
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--decode-ahead",
        choices=("auto", "on", "off"),
        default="auto",
        help="`up --decode-ahead` (the verifier runs decode steps ahead)",
    )
    parser.add_argument(
        "--chain-rounds",
        choices=("auto", "on", "off"),
        default=None,
        help="`up --chain-rounds` (default: its own): hinted rounds chained on the device",
    )
    parser.add_argument(
        "--decode-steps",
        default=None,
        help="`up --decode-steps` (tokens a plain round decodes; default: its own)",
    )
    parser.add_argument(
        "--decode-ahead-max-batch",
        default=None,
        help="`up --decode-ahead-max-batch` (default: its own)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="timed runs of each (mode, batch); the median's"
    )
    parser.add_argument(
        "--ups",
        type=int,
        default=1,
        help="each mode's `up` this many times, the modes in turn; target-only timed in each",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="each mode but serial also with these `up` arguments, as a mode of its own;"
        " repeatable (e.g. --variant=--ahead-guesses=4)",
    )
    parser.add_argument(
        "--services-log", default=None, help="append the services' output (logs) to this file"
    )
    parser.add_argument(
        "--prompt-groups",
        type=int,
        default=1,
        help="each timed run streams this many batches one after another, each of the next "
        "bundled prompts",
    )
    parser.add_argument(
        "--synthetic-acceptance",
        default=None,
        metavar="RATES",
        help="BENCHMARKS ONLY, NOT LOSSLESS: the verifier's `--synthetic-acceptance` (e.g. "
        "0.8,0.7,0.6); outputs are then not the target's",
    )
    parser.add_argument(
        "--up-arg",
        action="append",
        default=[],
        help="one more `up` argument for every mode, repeatable (e.g. --up-arg=--cpu-affinity=off)",
    )
    args = parser.parse_args()
    if args.spec and args.speculation_gate == "on":
        parser.error("--speculation-gate on gates the gateway's default spec: leave out --spec")
    spec = None  # the gateway's default
    if args.spec:
        (shape,) = parse_ladder(args.spec)
        spec = convert.spec_to_proto(shape)
    path = args.model or embedded_default_model_path()
    tokenizer = load_tokenizer(path)
    chats = [apply_chat_template(tokenizer, m) for m in bundled_prompts()]
    # (mode, batch): every timed run's (tokens of each stream, wall), over all its `up`s
    every_run: dict[tuple[str, int], list[Run]] = {}
    totals: dict[tuple[str, int], Totals] = {}  # the services' histogram sums over its runs
    parts: dict[str, Buckets] = {}
    # (mode, batch): each `up`'s median tokens/s, and target-only's in that `up`
    up_rates: dict[tuple[str, int], list[float]] = {}
    up_target: dict[tuple[str, int], list[float]] = {}

    def timed(
        stub: gateway_pb2_grpc.GatewayStub,
        key: tuple[str, int],
        groups: list[list[list[int]]],
        spec: Any = None,
    ) -> float:
        """key's runs in this `up`, kept with its earlier `up`s' (`every_run`); this `up`'s
        median run's tokens/s."""
        # kernels first built (and the overlap gate's choice made)
        warmup = GATED_WARMUP_TOKENS if key[0].partition(" ")[0] == "gated" else WARMUP_TOKENS
        run_batch(stub, groups[0], warmup, spec, args.temperature, synthetic)
        before = scrape_totals()
        timed_runs = [
            run_groups(stub, groups, args.max_new_tokens, spec, args.temperature, synthetic)
            for _ in range(args.repeat)
        ]
        after: Totals = Counter(scrape_totals())
        after.subtract(before)
        totals.setdefault(key, Counter()).update(after)
        every_run.setdefault(key, []).extend(timed_runs)
        return _rate(_median_run(timed_runs))

    synthetic = args.synthetic_acceptance is not None
    if synthetic:
        print(f"SYNTHETIC ACCEPTANCE {args.synthetic_acceptance}: outputs are not the target's")
    gate_choices = ""
    modes = tuple(args.modes)
    if "serial" not in modes:
        parser.error("--modes needs serial (target-only runs with it, and every ratio is to it)")
    modes += tuple(f"{m} {v}" for v in args.variant for m in args.modes if m != "serial")
    for mode in [m for _ in range(args.ups) for m in modes]:
        base, _, variant = mode.partition(" ")  # a --variant's mode: "MODE ARGS"
        flags: tuple[str, ...] = ("--overlap", base.removesuffix("-early").removesuffix("-plain"))
        if base.startswith("groups"):  # (other modes: `up`'s default, on with two GPUs)
            flags += ("--early-verify" if base.endswith("-early") else "--no-early-verify",)
        flags += ("--ahead-miss", "plain" if base.endswith("-plain") else "draft")
        flags += ("--decode-ahead", args.decode_ahead)
        if args.decode_ahead_max_batch is not None:
            flags += ("--decode-ahead-max-batch", args.decode_ahead_max_batch)
        if args.decode_steps is not None:
            flags += ("--decode-steps", args.decode_steps)
        if args.chain_rounds is not None:
            flags += ("--chain-rounds", args.chain_rounds)
        if synthetic:
            flags += ("--synthetic-acceptance", args.synthetic_acceptance)
        flags += tuple(args.up_arg) + tuple(variant.split())
        with services(args, flags) as stub:
            run_batch(stub, chats[:2], 8)  # warm-up
            wait_for_drafter(stub, chats[0])
            before = scrape_buckets()
            for batch in args.batch:
                groups = [
                    [chats[(g * batch + i) % len(chats)] for i in range(batch)]
                    for g in range(args.prompt_groups)
                ]
                up_rates.setdefault((mode, batch), []).append(
                    timed(stub, (mode, batch), groups, spec)
                )
                if mode == "serial" or args.ups > 1:  # target-only's own key: serial `up`s'
                    target_key = ("target" if mode == "serial" else f"target in {mode}", batch)
                    up_target.setdefault((mode, batch), []).append(
                        timed(stub, target_key, groups, TARGET_ONLY)
                    )
            spent: Buckets = Counter(scrape_buckets())
            spent.subtract(before)
            parts.setdefault(mode, Counter()).update(spent)
            if base == "gated":
                chosen = sorted(scrape_overlap_modes().items())
                gate_choices = ", ".join(f"batch <= {b}: {m}" for b, m in chosen) or "none yet"
    # each (mode, batch)'s median run over all its `up`s, and every run's (tokens, wall)
    results = {key: _median_run(each) for key, each in every_run.items()}
    runs = {key: [(_tokens(r), r[1]) for r in each] for key, each in every_run.items()}
    print(
        f"model {path}, device {args.device}, drafter {args.drafter or 'default'}, "
        f"spec {args.spec or 'the default'}, {args.max_new_tokens} new tokens per stream, "
        f"{f'temperature {args.temperature} (seeded)' if args.temperature else 'greedy'}, "
        f"decode ahead {args.decode_ahead} (max batch {args.decode_ahead_max_batch or 'default'}), "
        f"decode steps {args.decode_steps or 'default'}"
        f"{', speculation gate on' if args.speculation_gate == 'on' else ''}"
        + (f", SYNTHETIC ACCEPTANCE {args.synthetic_acceptance}" if synthetic else "")
    )
    others = [m for m in modes if m != "serial"]
    print(
        "| batch | target-only tok/s | serial tok/s | "
        + "".join(f"{m} tok/s | " for m in others)
        + "serial / target | "
        + "".join(f"{m} / target | {m} / serial | " for m in others)
        + "streams with the same tokens (greedy: all) |"
    )
    print("|---:|" + "---:|" * (2 + len(others) + 1 + 2 * len(others)) + "---|")
    for batch in args.batch:
        outputs = {m: results[(m, batch)][0] for m in ("target", *modes)}
        rate = {m: sum(map(len, outputs[m])) / results[(m, batch)][1] for m in outputs}
        streams = zip(*outputs.values(), strict=True)
        same = sum(len(set(map(tuple, per_mode))) == 1 for per_mode in streams)
        cells = [f"{rate['target']:.1f}", f"{rate['serial']:.1f}"]
        cells += [f"{rate[m]:.1f}" for m in others]
        cells.append(f"{rate['serial'] / rate['target']:.2f}x")
        for m in others:
            cells += [f"{rate[m] / rate['target']:.2f}x", f"{rate[m] / rate['serial']:.2f}x"]
        print(f"| {batch} | " + " | ".join(cells) + f" | {same}/{len(outputs['target'])} |")
    if not synthetic:  # synthetic outputs are not the target's: nothing to compare
        print_divergence(results, args.batch, modes)
    if "gated" in modes:
        print(f"the overlap gate's choices (gated): {gate_choices}")
    if args.repeat > 1:
        for key, each in runs.items():
            listed = ", ".join(f"{n / w:.1f}" for n, w in each)
            print(
                f"{'target only' if key[0] == 'target' else key[0]} batch {key[1]} runs: {listed}"
            )
    if args.ups > 1:
        print_ups(up_rates, up_target, args.batch, others)
    print_time_spent(runs, totals, args.batch, modes)
    if args.speculation_gate == "on":
        print_gated_rounds(totals, args.batch, modes)
    print("round parts over all batches, p50 ms (bucket upper bounds):")
    for mode in modes:
        cells = [
            f"{part} {1e3 * quantile(parts[mode], ROUND_PARTS[part], 0.5):.2f}" for part in PARTS
        ]
        print(f"  {mode}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
