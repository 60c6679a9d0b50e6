"""Where the three processes' Python time goes at a given batch: `specsplit up` with each
service's main thread under cProfile ($SPECSPLIT_PROFILE_DIR, specsplit/cli.py), --batch
concurrent streams of --max-new-tokens each (bundled chat prompts, greedy) after a warm-up at
that batch: unprofiled (--repeat times: each run's tok/s and their median; exact means per round
from the services' histograms over them all), then once profiled from start to end of that run
only (a SIGUSR2 to the services at each end), then the top functions of each process by own
time.

On a GPU the engine calls run on the services' main threads (--engine-calls auto), so their
host work is in the verifier's and drafter's profiles; on the CPU they run on an engine thread
that cProfile does not see. cProfile slows Python code down (about 2x): read the shares, not the
absolute times.

    PYTHONPATH=. python bench/profile_services.py --batch 32 --max-new-tokens 64 [--model PATH]
        [--device cuda:1 --drafter-device cuda:0] [--drafter KIND --draft-model PATH]
        [--target-only] [--top 25] [--sort tottime cumulative] [--keep DIR]
        [--overlap ahead [--verify-ahead off]] [--synthetic-acceptance 0.8,0.7,0.6]

Several --batch values: each measured unprofiled in turn, the last one profiled (none with
--top 0). --synthetic-acceptance (BENCHMARKS ONLY, labelled): the verifier's, so that random
weights run rounds of a realistic accepted length (an 8B-shaped target with a random EAGLE-3
head: its feature rows per round as a real head's); the streams then ignore EOS.
"""

from __future__ import annotations

import argparse
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.acceptance import bundled_prompts
from bench.e2e import (
    Buckets,
    cumulative_counts,
    quantile,
    scrape_buckets,
    scrape_totals,
    services,
    wait_for_drafter,
)
from bench.overlap import TARGET_ONLY, run_batch
from specsplit.metrics import RPC_STAGES
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.loader import load_tokenizer
from specsplit.prompt import apply_chat_template
from verifier.device_waits import GAP_PHASES
from verifier.hints import NOT_AHEAD_REASONS
from verifier.run_ahead import DROP_REASONS


def service_pids(directory: Path) -> list[int]:
    """The `specsplit serve-*` processes started with SPECSPLIT_PROFILE_DIR=directory."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        mine = f"SPECSPLIT_PROFILE_DIR={directory}".encode() in environ
        if mine and any(arg.startswith(b"serve-") for arg in cmdline):
            pids.append(int(proc.name))
    assert len(pids) == 3, f"expected the three services, found {pids}"
    return pids


def observed(buckets: Buckets, key: tuple[str, str, tuple[tuple[str, str], ...]]) -> bool:
    """Whether the histogram `key` has any sample (a GPU's only: none on the CPU)."""
    counts = cumulative_counts(buckets, key)
    return bool(counts) and counts[-1][1] > 0


def print_critical_path(buckets: Buckets) -> None:
    """p50 / p99 (bucket upper bounds) of the round's critical path outside the verifier's
    engine (the gateway's `specsplit_round_outside_verify_seconds`: both RPCs' overhead, a
    Draft not hidden, its own work; the overlap issue's goal is 0.4 ms p50), outside its device
    on a GPU (`specsplit_round_outside_device_seconds`: the round's wall less the verifier GPU's
    time for it, however early that ran), and of the time
    the verifier's device waits between rounds of the same sequences (its
    `specsplit_verifier_wait_seconds`: 0 where a round run ahead followed)."""
    key = ("gateway", "specsplit_round_outside_verify_seconds", ())
    print_p50_p99(buckets, key, "gateway round outside the verifier's engine")
    key = ("gateway", "specsplit_round_outside_device_seconds", ())
    if observed(buckets, key):  # the verifier on a GPU
        print_p50_p99(buckets, key, "gateway round outside the verifier's device (CUDA events)")
    key = ("verifier", "specsplit_verifier_wait_seconds", ())
    counts = cumulative_counts(buckets, key)
    none = f", none {counts[0][1]:.0f} of {counts[-1][1]:.0f}" if counts else ""
    print_p50_p99(buckets, key, "verifier's device waiting between rounds", none)
    key = ("verifier", "specsplit_verifier_idle_seconds", ())
    if observed(buckets, key):
        print_p50_p99(buckets, key, "verifier GPU idle before a round (CUDA events)")


def print_p50_p99(
    buckets: Buckets, key: tuple[str, str, tuple[tuple[str, str], ...]], label: str, tail: str = ""
) -> None:
    """The histogram `key`'s p50 and p99 (bucket upper bounds, ms) on one line."""
    p50, p99 = (1e3 * quantile(buckets, key, q) for q in (0.5, 0.99))
    print(f"  {label}: p50 <= {p50:g} ms, p99 <= {p99:g} ms{tail}")


def print_call_spread(buckets: Buckets) -> None:
    """How the engines' calls of the run spread over their histograms' buckets (a mean above
    the in-process median: every call a little slower, or a few much slower?)."""
    for process, name in (
        ("verifier", "specsplit_verify_seconds"),
        ("drafter", "specsplit_draft_seconds"),
    ):
        counts, below = [], 0
        for le, n in cumulative_counts(buckets, (process, name, ())):
            if n > below:
                counts.append(f"<= {1e3 * le:g} ms: {n - below:.0f}")
            below = n
        print(f"  {process} {name} calls by bucket: {', '.join(counts) or '-'}")


def print_gpu_processes() -> None:
    """Which processes hold a context on which GPU (nvidia-smi, when there is one): a service
    with a context on another's GPU shares its time slices."""
    if shutil.which("nvidia-smi") is None:
        return
    query = "--query-compute-apps=pid,gpu_bus_id,used_memory"
    lines = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    for line in lines:
        pid = line.split(",")[0].strip()
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            cmdline = []
        command = next((a.decode() for a in cmdline if a.startswith(b"serve-")), "?")
        print(f"  GPU context: {command} {line}")


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        os.kill(pid, signum)


def runs_line(tokens: list[int], walls: list[float]) -> str:
    """Each unprofiled run's tokens/s in order and their median (--repeat): one `up`'s runs
    spread less than runs of separate `up`s, so an A/B compares medians of several."""
    rates = [n / wall for n, wall in zip(tokens, walls, strict=True)]
    each = ", ".join(f"{rate:.1f}" for rate in rates)
    return f"unprofiled runs: {each} tok/s; median {statistics.median(rates):.1f}"


def print_round_means(tokens: int, wall: float, totals: Counter) -> None:
    """The same run unprofiled: exact means per round from the services' histogram sums (the
    gateway's round wall, the part of it outside the verifier's engine, the verify and draft
    engine calls, each service's own time per call beyond its engine, and each RPC's on the
    gateway beyond the engine time its service reports)."""
    rounds = totals[("gateway", "specsplit_round_seconds_count")]
    print(f"unprofiled: {tokens / wall:.1f} tok/s, {rounds:.0f} rounds in {wall:.2f} s")
    for process, name, label in (
        ("gateway", "specsplit_round_seconds", ""),
        ("gateway", "specsplit_round_outside_verify_seconds", ""),
        ("gateway", "specsplit_round_outside_device_seconds", ""),
        ("verifier", "specsplit_verify_seconds", ""),
        ("drafter", "specsplit_draft_seconds", ""),
        ("verifier", "specsplit_service_overhead_seconds", ""),
        ("drafter", "specsplit_service_overhead_seconds", ""),
        ("gateway", "specsplit_rpc_overhead_seconds", ":verifier"),
        ("gateway", "specsplit_rpc_overhead_seconds", ":drafter"),
    ):
        calls = totals[(process, f"{name}_count{label}")]
        seconds = totals[(process, f"{name}_sum{label}")]
        mean = f"{1e3 * seconds / calls:.3f} ms" if calls else "-"
        print(f"  {process} {name}{label}: {calls:.0f} x {mean}")
    outside = totals[("gateway", "specsplit_round_outside_device_seconds_sum")]
    if totals[("gateway", "specsplit_round_outside_device_seconds_count")]:  # a GPU verifier's
        busy = 1 - outside / max(totals[("gateway", "specsplit_round_seconds_sum")], 1e-12)
        print(  # issue 9's "of the verify bound", the device's time as the verify time
            f"  verifier GPU busy in the rounds: {busy:.2f} (1 - outside the device / round)"
        )
    accepted = totals[("gateway", "specsplit_accepted_tokens_per_round_sum")]
    counted = totals[("gateway", "specsplit_accepted_tokens_per_round_count")]
    hits, misses = (
        totals[("gateway", f"specsplit_draft_ahead_total:{x}")] for x in ("hit", "miss")
    )
    ahead = f", draft-ahead hits {hits:.0f} / {hits + misses:.0f}" if hits + misses else ""
    used, dropped = (
        totals[("verifier", f"specsplit_round_ahead_total:{x}")] for x in ("used", "dropped")
    )
    if used + dropped:
        ahead += f", rounds run ahead on hints used {used:.0f} / {used + dropped:.0f}"
    used, dropped = (
        totals[("verifier", f"specsplit_decode_ahead_total:{x}")] for x in ("used", "dropped")
    )
    if used + dropped:  # (a dropped one: a step of device time thrown away)
        ahead += f", decode steps run ahead used {used:.0f} / {used + dropped:.0f}"
        if dropped:  # by why
            why = [
                (x, totals[("verifier", f"specsplit_decode_ahead_dropped_total:{x}")])
                for x in DROP_REASONS
            ]
            ahead += " (dropped: " + ", ".join(f"{x} {n:.0f}" for x, n in why if n) + ")"
    print(f"  accepted tokens per sequence round: {accepted / max(counted, 1):.2f}{ahead}")
    asked = totals[("gateway", "specsplit_decode_steps_count")]
    if asked:  # --decode-steps-adaptive
        steps = totals[("gateway", "specsplit_decode_steps_sum")] / asked
        print(f"  decode steps a plain round asked for (adaptive), mean: {steps:.2f}")
    hints = {x: totals[("gateway", f"specsplit_hints_total:{x}")] for x in ("sent", "late", "off")}
    reasons = {
        x: totals[("verifier", f"specsplit_round_not_ahead_total:{x}")] for x in NOT_AHEAD_REASONS
    }
    if sum(hints.values()) or sum(reasons.values()):
        print(
            "  hints sent {sent:.0f}, not sent (the Verify answered first) {late:.0f}, off (the"
            " overlap gate's ahead-unhinted) {off:.0f}; ".format(**hints)
            + "sequence rounds with none run ahead: "
            + ", ".join(f"{x} {n:.0f}" for x, n in reasons.items())
        )
    waits = totals[("verifier", "specsplit_verifier_wait_seconds_count")]
    if waits:
        mean = 1e3 * totals[("verifier", "specsplit_verifier_wait_seconds_sum")] / waits
        print(f"  verifier's device waiting between rounds: {waits:.0f} x {mean:.3f} ms")
    idles = totals[("verifier", "specsplit_verifier_idle_seconds_count")]
    if idles:  # the device's own timestamps (a GPU)
        mean = 1e3 * totals[("verifier", "specsplit_verifier_idle_seconds_sum")] / idles
        print(f"  verifier GPU idle before a round (CUDA events): {idles:.0f} x {mean:.3f} ms")
    step_idles = totals[("verifier", "specsplit_verifier_step_idle_seconds_count")]
    if step_idles:  # of them, those before a round's further decode steps
        mean = 1e3 * totals[("verifier", "specsplit_verifier_step_idle_seconds_sum")] / step_idles
        label = "of them before a round's further decode steps"
        print(f"    {label}: {step_idles:.0f} x {mean:.3f} ms")
    gaps = []
    for phase in GAP_PHASES:
        calls = totals[("verifier", f"specsplit_verifier_gap_seconds_count:{phase}")]
        if calls:
            seconds = totals[("verifier", f"specsplit_verifier_gap_seconds_sum:{phase}")]
            gaps.append(f"{phase} {calls:.0f} x {1e3 * seconds / calls:.3f}")
    if gaps:  # the host work in that wait
        print(f"  verifier's host work between rounds, mean ms: {', '.join(gaps)}")
    for service in ("verifier", "drafter"):
        means = []
        for stage in RPC_STAGES:
            key = f"specsplit_rpc_stage_seconds_{{}}:{service}:{stage}"
            calls = totals[("gateway", key.format("count"))]
            if calls:
                means.append(f"{stage} {1e3 * totals[('gateway', key.format('sum'))] / calls:.3f}")
        if means:  # the round lane's RPCs only
            print(f"  gateway {service} RPC stages, mean ms: {', '.join(means)}")
    for process in ("gateway", "verifier", "drafter"):
        pauses = []
        for generation in "012":
            key = f"specsplit_gc_pause_seconds_{{}}:{generation}"
            count, seconds = (totals[(process, key.format(part))] for part in ("count", "sum"))
            pauses.append(f"gen {generation} {count:.0f} x {1e3 * seconds / max(count, 1):.3f}")
        print(f"  {process} garbage collections (count x mean ms): {', '.join(pauses)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[32], help="the last one is profiled"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="unprofiled runs at each batch, one after another (each's tok/s and the median;"
        " the round means over them all)",
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--drafter-device", default=None)
    parser.add_argument("--drafter", default=None, help="specsplit up --drafter (default: its own)")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--target-only", action="store_true", help="num_steps 0 per request")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampled streams, seeded (0: greedy)"
    )
    parser.add_argument("--top", type=int, default=25, help="0: no profiled run")
    parser.add_argument(
        "--sort",
        nargs="+",
        default=["tottime"],
        choices=["tottime", "cumulative"],
        help="each process's top functions by these keys, in turn",
    )
    parser.add_argument("--keep", default=None, help="copy the .prof files into this directory")
    parser.add_argument(
        "--services-log", default=None, help="append the services' output to this file"
    )
    parser.add_argument(
        "--overlap",
        default=None,
        choices=("serial", "groups", "gated", "ahead", "both"),
        help="`up --overlap` (default: its own, auto); the round's critical path outside the "
        "verifier's engine is printed as p50 / p99 either way",
    )
    parser.add_argument(
        "--verify-ahead",
        default=None,
        choices=("on", "off"),
        help="`up --verify-ahead` (default: its own, on): draft-ahead's hints to the verifier",
    )
    parser.add_argument(
        "--chain-rounds",
        default=None,
        choices=("auto", "on", "off"),
        help="`up --chain-rounds` (default: its own): hinted rounds chained on the device",
    )
    parser.add_argument(
        "--early-verify",
        default=None,
        choices=("on", "off"),
        help="`up --early-verify` (default: its own, auto: on with two GPUs): groups send the"
        " other group's Verify as soon as its trees are drafted",
    )
    parser.add_argument(
        "--synthetic-acceptance",
        default=None,
        metavar="RATES",
        help="BENCHMARKS ONLY, NOT LOSSLESS: the verifier's `--synthetic-acceptance`",
    )
    parser.add_argument(
        "--up-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more `up` argument, repeatable (e.g. --up-arg=--ahead-guesses=1)",
    )
    args = parser.parse_args()
    synthetic = args.synthetic_acceptance is not None
    extra: tuple[str, ...] = (
        ("--synthetic-acceptance", args.synthetic_acceptance) if synthetic else ()
    )
    if args.overlap:
        extra += ("--overlap", args.overlap)
    if args.verify_ahead:
        extra += ("--verify-ahead", args.verify_ahead)
    if args.chain_rounds:
        extra += ("--chain-rounds", args.chain_rounds)
    if args.early_verify:
        extra += ("--early-verify" if args.early_verify == "on" else "--no-early-verify",)
    extra += tuple(args.up_arg)
    path = args.model or embedded_default_model_path()
    tokenizer = load_tokenizer(path)
    chats = [apply_chat_template(tokenizer, m) for m in bundled_prompts()]
    spec = TARGET_ONLY if args.target_only else None
    kind = "target only" if args.target_only else "speculative"
    if args.temperature:
        kind += f", temperature {args.temperature}"
    if synthetic:
        kind += f", SYNTHETIC ACCEPTANCE {args.synthetic_acceptance} (not the target's output)"
    directory = Path(tempfile.mkdtemp(prefix="specsplit-profile-"))
    os.environ["SPECSPLIT_PROFILE_DIR"] = str(directory)  # `up` and its children inherit it
    try:
        with services(args, extra) as stub:
            # target-only runs too: the drafter's warm-up (its graphs, its kernels' builds, a
            # full garbage collection) shares the host, and a GPU it shares, with runs timed
            # before it ends (a 343 ms collection of the drafter's fell inside a timed target-only
            # run, and first runs ran slower, in the forty-ninth session)
            wait_for_drafter(stub, chats[0])
            for batch in args.batch:
                prompts = [chats[i % len(chats)] for i in range(batch)]
                run_batch(stub, prompts, 16, spec, args.temperature, synthetic)  # warm-up
                before, before_buckets = scrape_totals(), scrape_buckets()
                counts: list[int] = []
                walls: list[float] = []
                for _ in range(args.repeat):  # the histograms' sums cover every run
                    plain, wall = run_batch(
                        stub, prompts, args.max_new_tokens, spec, args.temperature, synthetic
                    )
                    counts.append(sum(map(len, plain)))
                    walls.append(wall)
                totals = Counter(scrape_totals())
                totals.subtract(before)
                spread = Counter(scrape_buckets())
                spread.subtract(before_buckets)
                print(f"== {batch} streams x {args.max_new_tokens} tokens, {kind}")
                if args.repeat > 1:
                    print(runs_line(counts, walls))
                print_round_means(sum(counts), sum(walls), totals)
                print_critical_path(spread)
                print_call_spread(spread)
                print_gpu_processes()
            if not args.top:
                return
            pids = service_pids(directory)
            signal_all(pids, signal.SIGUSR2)  # profiles start
            outputs, wall = run_batch(
                stub, prompts, args.max_new_tokens, spec, args.temperature, synthetic
            )
            signal_all(pids, signal.SIGUSR2)  # and stop, written
            time.sleep(1.0)
    finally:
        del os.environ["SPECSPLIT_PROFILE_DIR"]
    tokens = sum(map(len, outputs))
    print(
        f"{batch} streams x {args.max_new_tokens} tokens, {kind}: {tokens / wall:.1f} tok/s "
        f"(profiled, so slower than unprofiled; the profiles cover this run only)"
    )
    for file in sorted(directory.glob("*.prof")):
        if file.name.startswith("up-"):
            continue
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(file, Path(args.keep) / file.name)
        try:
            stats = pstats.Stats(str(file))
        except TypeError:  # pstats refuses a profile without calls: an idle main thread
            error = file.with_suffix(".error")  # written when the profile could not start
            print(f"\n== {file.stem}:", error.read_text().strip() if error.exists() else "no calls")
            continue
        for key in args.sort:
            print(f"\n== {file.stem}: top {args.top} by {key} time")
            stats.sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
