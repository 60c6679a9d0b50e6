"""The verifier's host work for a round launched on the gateway's hint, in process: chained on
the device behind the round in flight as the hint comes (`chain`: `HintedRounds._chain`, the
service's gap phase "chain"), or launched when the hint comes after the round finished
(`after`: `_launch_next`, the phase "launch"), against the same round launched on its request
(`plain`: `VerifierEngine.launch`). What the services' critical path at batch 1 waits on when a
chain is late, and what a hinted launch at batch 8 / 32 costs while the GPU idles.

Random weights (bench/gpu_engine.py's shapes; bf16 with CUDA graphs on a GPU, float32 eager on
the CPU), every sequence at --context tokens, each round a chain of --nodes random drafts under
SYNTHETIC ACCEPTANCE 0.8 / 0.7 / 0.6 (timing only). A `chain` hint names, per sequence, every
accept length with --guesses random bonus tokens (a chain of --nodes each): its bonus tokens are
not the target's, so the chained round is dropped when the next round comes (its undoing is in
that launch's time) and the chaining's own host work is what is timed. An `after` hint names the
outcome that came, so the next round takes the round launched on it.

--hidden-states: every round asks for the EAGLE-3 layers' hidden states, as an EAGLE drafter's
rounds do through the services; --no-synthetic: the random target's own acceptance (no logits
bent on the host, work the services' launch does not have).

Per batch: the median host ms of each call over --rounds rounds (each --staging setting's in
two halves, A B B A; no device sync around them: a call that waits for the device shows it),
and on a GPU each round's device time for scale.
--profile: those calls again, profiled: `cprofile` (the Python functions by own and cumulative
time) or `torch` (torch.profiler's CPU ops by self time, each call profiled alone).
--phases: those calls again with the launch's steps timed (`Phases`: each one's host time a
call, inclusive, and the time from a launch's start to its first CUDA graph replay, while the
device idles), no profiler's overhead beyond a clock read around each step.

    PYTHONPATH=. python bench/hinted_launch.py --shape llama-8b --batch 1 8 32 --profile torch
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from bench.gpu_engine import SHAPES, EngineBench
from bench.host_phases import clock
from specsplit.messages import AheadTree, NextTrees, VerifyInput, VerifyOutput
from specsplit.model import transfer
from specsplit.model.config import ModelConfig
from specsplit.model.transfer import STAGE_BYTES
from specsplit.tree import DraftTree
from verifier.engine import VerifierEngine

RATES = (0.8, 0.7, 0.6)
MODES = ("plain", "chain", "after")


class CallProfile:
    """Profiles of the timed calls alone, added up (`--profile`)."""

    def __init__(self, kind: str | None) -> None:
        self.kind = kind
        self.cprofile = cProfile.Profile() if kind == "cprofile" else None
        self.ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # self us, count
        self.calls = 0

    def run(self, fn: Callable[[], Any]) -> Any:
        self.calls += 1
        if self.cprofile is not None:
            self.cprofile.enable()
            try:
                return fn()
            finally:
                self.cprofile.disable()
        if self.kind == "torch":
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                result = fn()
            for event in prof.key_averages():
                entry = self.ops[event.key]
                entry[0] += event.self_cpu_time_total
                entry[1] += event.count
            return result
        return fn()

    def print(self, label: str, top: int) -> None:
        if self.cprofile is not None:
            print(f"  -- {label}: cProfile of {self.calls} calls, by own time, then cumulative")
            stats = pstats.Stats(self.cprofile)
            stats.sort_stats("tottime").print_stats(top)
            stats.sort_stats("cumulative").print_stats(top)
        elif self.kind == "torch":
            print(f"  -- {label}: CPU ops by self time, us a call ({self.calls} calls)")
            ranked = sorted(self.ops.items(), key=lambda kv: -kv[1][0])[:top]
            for key, (self_us, count) in ranked:
                print(f"    {self_us / self.calls:9.1f}  {count / self.calls:6.1f} x  {key}")


# the launch's steps --phases times: (owner, attribute name, label)
PHASE_TARGETS = (
    ("verifier.engine:VerifierEngine", "_validate", "validate"),
    ("verifier.engine:VerifierEngine", "_take_ahead", "take ahead"),
    ("verifier.engine:VerifierEngine", "_reserve", "reserve"),
    ("verifier.device_rounds", "verify_step", "verify_step"),
    ("verifier.device_rounds", "build_forward_batch", "build_forward_batch"),
    ("specsplit.model.cuda_graphs:CudaGraphRunner", "plan", "graphs.plan"),
    ("specsplit.model.graph_buffers:GraphBuffers", "fill", "graphs fill"),
    ("specsplit.model.cuda_graphs:CudaGraphRunner", "forward", "graphs.forward"),
    ("torch.cuda:CUDAGraph", "replay", "CUDAGraph.replay"),
    ("verifier.engine:VerifierEngine", "_accept", "_accept"),
    ("verifier.accept_graphs:AcceptGraphs", "host_arrays", "accept host_arrays"),
    ("verifier.accept_graphs:AcceptGraphs", "run", "accept run"),
    ("verifier.device_rounds", "accepted_hidden", "accepted_hidden"),
    ("verifier.device_rounds", "to_host", "to_host"),
    ("verifier.hinted_rounds", "chain_inputs", "chain_inputs"),
    ("verifier.hinted_rounds", "joined_results", "joined_results"),
    ("verifier.hinted_rounds", "page_tables", "page_tables"),
    ("verifier.engine:VerifierEngine", "_launch", "_launch"),
)


class Phases:
    """--phases: the launch's steps (PHASE_TARGETS) wrapped with a clock each, host ms summed
    per timed call; and from the timed call's start to its first CUDA graph replay."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.per_call: dict[str, list[float]] = defaultdict(list)
        self.start_ns: int | None = None
        self.restores: list[Callable[[], None]] = []
        for owner_path, name, label in PHASE_TARGETS:
            module_name, _, cls = owner_path.partition(":")
            owner: Any = importlib.import_module(module_name)
            if cls:
                owner = getattr(owner, cls)
            on_start = self._first_replay if label == "CUDAGraph.replay" else None
            adding = functools.partial(self._add, label)
            self.restores.append(clock(owner, name, adding, on_start=on_start))

    def _first_replay(self) -> None:
        """The time from the timed call's start to its first CUDA graph replay."""
        if self.start_ns is not None:
            self.sums["(to the first replay)"] += (time.perf_counter_ns() - self.start_ns) / 1e6
            self.start_ns = None

    def _add(self, label: str, seconds: float) -> None:
        self.sums[label] += seconds * 1e3

    def run(self, fn: Callable[[], Any]) -> Any:
        self.sums.clear()
        self.start_ns = time.perf_counter_ns()
        try:
            return fn()
        finally:
            self.start_ns = None
            for label, ms in self.sums.items():
                self.per_call[label].append(ms)

    def print(self, label: str) -> None:
        print(f"  -- {label}: host ms a call, inclusive (median over calls that had it)")
        for name, ms in sorted(self.per_call.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"    {statistics.median(ms):7.3f}  {name} ({len(ms)})")
        self.per_call.clear()

    def close(self) -> None:
        for restore in self.restores:
            restore()


class Rounds:
    """Rounds of one batch of sequences on the engine, in one of MODES."""

    def __init__(self, bench: EngineBench, batch: int, nodes: int, guesses: int) -> None:
        self.bench, self.engine = bench, bench.engine
        self.nodes, self.guesses = nodes, guesses
        self.state = bench.open(batch)  # seq id -> (kv_committed_len, pending token)
        self.trees = {seq_id: self._chain() for seq_id in self.state}

    def _chain(self) -> DraftTree:
        return DraftTree(self.bench._tokens(self.nodes), list(range(-1, self.nodes - 1)))

    def inputs(self) -> list[VerifyInput]:
        return [
            VerifyInput(
                seq_id,
                False,
                committed,
                [pending],
                self.trees[seq_id],
                hidden_state_layers=self.bench.hidden_state_layers,
            )
            for seq_id, (committed, pending) in self.state.items()
        ]

    def commit(self, outputs: list[VerifyOutput], trees: dict[str, DraftTree]) -> None:
        for out in outputs:
            self.state[out.seq_id] = (out.kv_committed_len, out.bonus_token)
        self.trees = trees

    def guessed_hints(self, inputs: list[VerifyInput]) -> list[NextTrees]:
        """Each sequence's hint for its round in flight: every accept length, each with
        `guesses` random bonus tokens, the same chain for each (`chain`)."""
        hints = []
        for item in inputs:
            nxt = self._chain()
            outcomes = [
                AheadTree([*item.tree.tokens[:k], guess], nxt)
                for k in range(len(item.tree) + 1)
                for guess in self.bench._tokens(self.guesses)
            ]
            hints.append(NextTrees(item.seq_id, item.kv_committed_len + 1, outcomes))
        return hints

    def outcome_hints(
        self, inputs: list[VerifyInput], outputs: list[VerifyOutput]
    ) -> tuple[list[NextTrees], dict[str, DraftTree]]:
        """Each sequence's hint naming the outcome that came (`after`), and the trees so
        hinted (its next round's)."""
        hints, trees = [], {}
        for item, out in zip(inputs, outputs, strict=True):
            trees[item.seq_id] = self._chain()
            outcome = AheadTree([*out.accepted_tokens, out.bonus_token], trees[item.seq_id])
            hints.append(NextTrees(item.seq_id, item.kv_committed_len + 1, [outcome]))
        return hints, trees

    def close(self) -> None:
        self.bench.close(self.state)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, 1e3 * (time.perf_counter() - start)


def run_mode(
    rounds: Rounds, mode: str, count: int, profiler: CallProfile | Phases | None
) -> dict[str, list[float]]:
    """`count` rounds in `mode`; each timed call's host ms by name (and the engine's gap
    phases'). With `profiler`, the hinted calls (plain: the launch) run under it."""
    engine = rounds.engine
    engine.launch_on_hint = mode != "plain"
    engine.chain_rounds = mode == "chain"
    engine.chain_max_batch = 1 << 20
    engine.chain_min_guess_rate = 0.0  # its hints' guesses are random: chain all the same
    times: dict[str, list[float]] = defaultdict(list)
    engine.on_gap = lambda phase, seconds: times[f"gap {phase}"].append(1e3 * seconds)

    def run(name: str, fn: Callable[[], Any], profiled: bool) -> Any:
        if profiled and profiler is not None:
            result, ms = timed(lambda: profiler.run(fn))
        else:
            result, ms = timed(fn)
        times[name].append(ms)
        return result

    for _ in range(count):
        inputs = rounds.inputs()
        launched = run("launch", lambda i=inputs: engine.launch(i), mode == "plain")
        if mode == "chain":
            hints = rounds.guessed_hints(inputs)
            run("hint (chain)", lambda h=hints: engine.hint_next(h), True)
        outputs = engine.finish(launched)
        if launched.device_ns:  # a GPU's: the round's own device time, for scale
            times["round on the device"].append(launched.device_ns / 1e6)
        trees = {seq_id: rounds._chain() for seq_id in rounds.state}
        if mode == "after":
            hints, trees = rounds.outcome_hints(inputs, outputs)
            run("hint (launch after)", lambda h=hints: engine.hint_next(h), True)
        rounds.commit(outputs, trees)
    engine.on_gap = None
    _settle(engine)
    return times


def _settle(engine: VerifierEngine) -> None:
    """Nothing left ahead (a round launched on the last hint): dropped, its room freed."""
    if engine._ahead is not None:
        engine._drop_ahead("released")
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--nodes", type=int, default=3, help="drafts in each round's chain")
    parser.add_argument("--guesses", type=int, default=2, help="bonus guesses an accept length")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--staging",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="to_device's staging buffers (specsplit/model/transfer.py) on, off (pin_memory each "
        "copy, as before them), or both in turn",
    )
    parser.add_argument(
        "--hidden-states",
        action="store_true",
        help="every round asks for the default EAGLE-3 layers' hidden states (as an EAGLE "
        "drafter's rounds do through the services)",
    )
    parser.add_argument(
        "--no-synthetic",
        action="store_true",
        help="the random target's own acceptance (next to nothing accepted) instead of the "
        "synthetic rates: no logits bent on the host (the services' launch has no such work)",
    )
    parser.add_argument("--profile", choices=("cprofile", "torch"), default=None)
    parser.add_argument("--phases", action="store_true", help="the launch's steps timed")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    # EngineBench's: its KV pool holds --steps rounds of each sequence, graphs of 1 + nodes
    args.steps = 3 * args.rounds * (len(args.modes) * len(args.staging) + 1)
    args.verify_n = [args.nodes]
    torch.manual_seed(0)
    gpu = args.device.startswith("cuda")
    hf_config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=8192, rms_norm_eps=1e-5)
    with torch.device(args.device):
        hf = LlamaForCausalLM(hf_config).to(torch.bfloat16 if gpu else torch.float32).eval()
    bench = EngineBench(hf, ModelConfig.from_hf(hf_config), args, graphs=gpu)
    del hf
    acceptance = "the random target's own acceptance"
    if not args.no_synthetic:
        bench.engine.synthetic_acceptance = RATES
        acceptance = f"SYNTHETIC ACCEPTANCE {RATES} (timing only)"
    hidden = f", hidden states of layers {bench.hidden_state_layers}" if args.hidden_states else ""
    print(
        f"== {args.shape} on {args.device}, context {args.context}, chains of {args.nodes}"
        f"{hidden}, {acceptance}; host ms a call, median of {args.rounds}"
    )
    for batch in args.batch:
        rounds = Rounds(bench, batch, args.nodes, args.guesses)
        for mode in args.modes:
            # each staging setting in two halves, in the order A B B A: neither always runs
            # first (host times drift between passes)
            times: dict[str, dict[str, list[float]]] = {s: defaultdict(list) for s in args.staging}
            for staging in [*args.staging, *reversed(args.staging)]:
                _stage(staging)
                run_mode(rounds, mode, 5, None)  # warm-up
                for name, ms in run_mode(rounds, mode, max(1, args.rounds // 2), None).items():
                    times[staging][name] += ms
            for staging in args.staging:
                label = f"batch {batch} {mode}" + (", staging off" if staging == "off" else "")
                cells = ", ".join(
                    f"{name} {statistics.median(ms):.3f} ({len(ms)})"
                    for name, ms in times[staging].items()
                )
                print(f"{label}: {cells}", flush=True)
                if args.profile:
                    _stage(staging)
                    profiler = CallProfile(args.profile)
                    run_mode(rounds, mode, args.rounds, profiler)
                    profiler.print(label, args.top)
                if args.phases:
                    _stage(staging)
                    phases = Phases()
                    try:
                        run_mode(rounds, mode, args.rounds, phases)
                    finally:
                        phases.close()
                    phases.print(label)
        _stage("on")
        rounds.close()


def _stage(staging: str) -> None:
    """to_device's staging buffers on (the default) or off (every copy through pin_memory)."""
    transfer.STAGE_BYTES = STAGE_BYTES if staging == "on" else -1


if __name__ == "__main__":
    main()
