"""Where a verifier step's time goes: torch.profiler over decode / verify steps of the engine.

    PYTHONPATH=. python bench/profile_step.py --shape smollm2-135m --batch 1 --n 0 4

Prints, per (batch, n): the wall time per step, the GPU kernel time per step and the number of
kernels, the host time spent in each phase (batch building, graph replay or eager forward,
acceptance, commit), and the top CPU-side ops.

`--cprofile`: the steps timed unprofiled first, then under cProfile (the host's Python, by
function) instead of torch.profiler.

Read the host times as shares: under the profiler (CUPTI) a CUDA graph's launch costs ~240 us
per call on an H100 host against 30-60 us unprofiled, and each step's wall time grows by ~0.8 ms;
`bench/graph_launch.py` times the step and the launch unprofiled.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

import verifier.device_rounds as device_rounds_module
import verifier.round_accept as round_accept_module
from bench.gpu_engine import SHAPES, EngineBench
from bench.host_phases import clock
from specsplit.kernels import paged_attention
from specsplit.messages import NO_LOGPROBS
from specsplit.model.config import ModelConfig
from verifier.engine import VerifierEngine


class EngineTime:
    """Wall time and calls of a method or function (`owner.name`), wrapped in place
    (`bench/host_phases.clock`); `restore` puts it back."""

    def __init__(self, owner: object, name: str) -> None:
        self.seconds, self.calls = 0.0, 0
        self.restore = clock(owner, name, self._add)

    def _add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    @property
    def ms_per_call(self) -> float:
        return 1e3 * self.seconds / max(self.calls, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--n", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--eager-accept",
        action="store_true",
        help="acceptance as eager ops, not its CUDA graphs (verifier/accept_graphs.py)",
    )
    parser.add_argument(
        "--hidden-states",
        action="store_true",
        help="every round asks for the default EAGLE-3 layers' hidden states",
    )
    parser.add_argument(
        "--cprofile", action="store_true", help="cProfile the steps, not torch.profiler"
    )
    parser.add_argument(
        "--decode-ahead", action="store_true", help="the engine runs decode steps ahead"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: sampled rounds (chains carry draft distributions cut as the drafter's)",
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        default=NO_LOGPROBS,
        help="every round asks for its tokens' log-probabilities and this many most likely "
        "tokens' (-1: none)",
    )
    parser.add_argument(
        "--guide",
        action="store_true",
        help="every round's sequences carry a guide's masks (bench/gpu_engine.py --guide)",
    )
    parser.add_argument(
        "--rules",
        action="store_true",
        help="every round's sequences carry logit rules (bench/gpu_engine.py --rules)",
    )
    parser.add_argument(
        "--rules-graphs-ab",
        action="store_true",
        help="with --rules: the steps' wall time with the rules graphs (verifier/rules_graphs.py) "
        "and without, alternating three times in this process, instead of a profile",
    )
    parser.add_argument(
        "--decode-stages",
        type=int,
        help="pipeline stages of paged attention's causal decode tile (DECODE_STAGES)",
    )
    args = parser.parse_args()
    args.verify_n = [n for n in args.n if n]
    if args.decode_stages:  # before the engine's warm-up builds and captures its kernels
        paged_attention.DECODE_STAGES = args.decode_stages
    torch.manual_seed(0)
    hf_config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=8192, rms_norm_eps=1e-5)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    bench = EngineBench(hf, ModelConfig.from_hf(hf_config), args, graphs=not args.eager)
    del hf
    engine = bench.engine
    if args.eager_accept:
        engine.accept_graphs = None
    phases = step_phases(engine)
    for batch in args.batch:
        state = bench.open(batch)
        for n in args.n:
            for _ in range(5):
                bench.step(state, n, 1, args.temperature)
            for timer in phases.values():
                timer.reset()
            torch.cuda.synchronize()
            if args.rules_graphs_ab:
                rules_graphs_ab(bench, state, n, args)
                continue
            if args.cprofile:
                cprofile_steps(bench, state, n, args, phases)
                continue
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                for _ in range(args.steps):
                    bench.step(state, n, 1, args.temperature)
                wall = (time.perf_counter() - start) / args.steps * 1e3
            events = prof.key_averages()
            gpu_ms, launches = kernel_time(events, args.steps)
            print(
                f"\n== {args.shape} batch {batch} n {n}"
                f"{' + hidden states' if args.hidden_states else ''}"
                f"{', eager acceptance' if args.eager_accept else ''}"
                f"{f', temperature {args.temperature}' if args.temperature else ''}: "
                f"wall {wall:.3f} ms/step (profiled), "
                f"GPU kernels {gpu_ms:.3f} ms/step, {launches:.0f} kernels/step"
            )
            print_phases(phases, args.steps)
            print(
                events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
            )
            print(
                events.table(
                    sort_by="self_device_time_total", row_limit=12, max_name_column_width=60
                )
            )
        bench.close(state)


def step_phases(engine: VerifierEngine) -> dict[str, EngineTime]:
    """The engine step's host phases, each timed in place where the engine looks it up (its
    methods on the engine, the functions it imports in its module, round_accept's own helpers
    there); `EngineTime.restore` each to undo."""
    phases = {"build batch": EngineTime(device_rounds_module, "build_forward_batch")}
    if engine.graphs is not None:
        phases["graph copy-in + replay"] = EngineTime(engine.graphs, "forward")
    phases["eager forward"] = EngineTime(engine.model, "forward")
    phases["accept (queued)"] = EngineTime(engine, "_accept")
    phases["logit rules (queued)"] = EngineTime(device_rounds_module, "bend_by_rules")
    phases["commit"] = EngineTime(engine, "_commit")
    phases["validate"] = EngineTime(engine, "_validate")
    phases["sampling inputs"] = EngineTime(round_accept_module, "_sampling_inputs")
    phases["accepted hidden rows"] = EngineTime(device_rounds_module, "accepted_hidden")
    phases["hidden states out"] = EngineTime(device_rounds_module, "hidden_states_out")
    phases["reserve"] = EngineTime(engine, "_reserve")
    phases["launch ahead"] = EngineTime(engine, "_launch_ahead")
    phases["finish (+ wait)"] = EngineTime(engine, "_finish")
    return phases


def kernel_time(events: Any, steps: int) -> tuple[float, float]:
    """A torch.profiler run's GPU kernel time (ms) and kernels, each per step of `steps`."""
    kernels = [e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    return gpu_ms, sum(e.count for e in kernels) / steps


def print_phases(phases: dict[str, EngineTime], steps: int, label: str = "") -> None:
    """The host phases' time per step, longest first."""
    for name, timer in sorted(phases.items(), key=lambda kv: -kv[1].seconds):
        print(f"   host {name}{label}: {timer.seconds / steps * 1e3:.3f} ms/step")


def rules_graphs_ab(
    bench: EngineBench, state: dict[str, tuple[int, int]], n: int, args: argparse.Namespace
) -> None:
    """The steps' wall time with the engine's rules graphs and without (eager bending), in
    turn three times (each pass after 5 untimed steps), and the medians."""
    engine = bench.engine
    graphs = engine.rules_graphs
    walls: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(3):
        for on in (True, False):
            engine.rules_graphs = graphs if on else None
            for _ in range(5):
                bench.step(state, n, 1, args.temperature)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                bench.step(state, n, 1, args.temperature)
            torch.cuda.synchronize()
            walls[on].append((time.perf_counter() - start) / args.steps * 1e3)
    engine.rules_graphs = graphs
    on, off = (statistics.median(walls[k]) for k in (True, False))
    passes = " / ".join(f"{a:.3f}-{b:.3f}" for a, b in zip(walls[True], walls[False], strict=True))
    print(f"== {args.shape} batch {len(state)} n {n}: rules graphs on {on:.3f}, off {off:.3f} "
          f"ms/step ({on / off:.2f}x; passes on-off {passes})")  # fmt: skip


def cprofile_steps(
    bench: EngineBench,
    state: dict[str, tuple[int, int]],
    n: int,
    args: argparse.Namespace,
    phases: dict[str, EngineTime],
) -> None:
    """The steps' wall time unprofiled, then the host's functions under cProfile."""
    start = time.perf_counter()
    for _ in range(args.steps):
        bench.step(state, n, 1, args.temperature)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps * 1e3
    hidden = " + hidden states" if args.hidden_states else ""
    print(f"\n== {args.shape} batch {len(state)} n {n}{hidden}: wall {wall:.3f} ms/step")
    engine = bench.engine
    dropped = dict(engine.num_ahead_dropped_by)
    print(f"   decode steps run ahead so far: used {engine.num_ahead_used}, dropped {dropped}")
    print_phases(phases, args.steps, " (unprofiled)")
    for timer in phases.values():
        timer.reset()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        bench.step(state, n, 1, args.temperature)
    profiler.disable()
    print_phases(phases, args.steps, " (cProfiled)")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
