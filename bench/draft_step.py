"""What one draft round costs the drafter engine: `DrafterEngine.draft` in process, an EAGLE-3
head (the shipped one) over a target checkpoint (random SmolLM2-shaped weights serve: only the
time counts), warmed up as the drafter service does (graphs captured, rounds rehearsed).

    PYTHONPATH=. python bench/draft_step.py --target DIR [--device cuda] [--batch 1 8 32] \
        [--shape 3x1x3 5x4x16] [--new 3] [--rounds 50] [--host-expansion] [--ahead 2]
    PYTHONPATH=. python bench/draft_step.py --random-target llama-8b --torch-profile ...

`--random-target SHAPE`: a random EAGLE-3 head of that target's width (8B: one 4096-wide layer,
a 32,000-token draft vocabulary), in place of the shipped head and a checkpoint.

Each round every sequence brings `--new` tokens (accepted drafts + bonus) with the target's
features of the tokens before them, and asks for a tree of shape STEPSxTOPKxNODES. Prints the
wall time of a round (median and p90 over `--rounds` after warm-up rounds) and the draft nodes
returned. `--ahead G` also times, after each round, the draft-ahead call the gateway sends
beside that round's Verify (`--overlap ahead`): the next round's trees for each accept length of
the chain just drafted and G guessed bonus tokens (chain shapes only). `--temperature T`: every
sequence samples (its chains, draft-ahead's outcomes' too, draw at its generator's uniforms and
come with their draft probabilities). `--host-expansion` runs
the tree expansion on the host, one step at a time (the path before the expansion graphs), for
comparison in the same run. `--rules`: each batch also with every sequence under a logit bias
and presence, frequency and repetition penalties (its first Draft carries them: the drafter bends
every step's logits, drafter/draft_rules.py), printed after the same batch without. `--guide`:
each batch also with every Draft carrying a guide's root mask (every other token allowed), the
root rows written by their kernel (`write_roots`) and, for an A/B in the same run, by its torch
reference ("guide, roots by torch").
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import itertools
import pstats
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import drafter.draft_rules as draft_rules
import drafter.eagle_proposer as eagle_proposer
import drafter.expansion as expansion
import drafter.tree_draft as tree_draft
import specsplit.kernels.draft_bend as draft_bend
import specsplit.kv_cache as kv_cache
import specsplit.model.cuda_graphs as cuda_graphs
import specsplit.model.graph_buffers as graph_buffers
import specsplit.model.transfer as transfer
import specsplit.step as step
from bench.gpu_e2e import random_eagle3_head, random_model
from bench.gpu_engine import SHAPES
from bench.host_phases import clock
from bench.profile_step import kernel_time
from drafter.eagle_proposer import Eagle3Proposer
from drafter.engine import DrafterEngine
from drafter.tree_draft import CATCH_UP_LENS
from specsplit.logit_rules import Penalties, pack_mask
from specsplit.messages import AheadTree, DraftInput, DraftOutput, DraftRules, SpecParams
from specsplit.sampling import SamplingParams


def parse_shape(text: str) -> SpecParams:
    steps, topk, nodes = (int(x) for x in text.split("x"))
    spec = SpecParams(steps, topk, nodes)
    spec.validate()
    return spec


# --rules: a bias, presence, frequency and repetition (bench/gpu_engine.py's kinds); `Rounds`
# starts each sequence's output past its context
RULES = DraftRules(
    Penalties(((13, 2.0), (99, -100.0)), presence=0.5, frequency=0.5, repetition=1.2), 0
)


class Rounds:
    """`batch` sequences of `context` random tokens, each round `new` more tokens each."""

    def __init__(
        self,
        engine: DrafterEngine,
        batch: int,
        context: int,
        width: int,
        sampling: SamplingParams,
        pinned: bool = False,
        rules: DraftRules | None = None,
        guide: bytes = b"",
    ) -> None:
        self.engine, self.width, self.sampling, self.pinned = engine, width, sampling, pinned
        # each sequence's, sent with its first Draft: the output starts past the context
        self.rules = None if rules is None else dataclasses.replace(rules, output_start=context)
        self.guide = guide  # a root mask every Draft carries (b"": none)
        gen = torch.Generator().manual_seed(batch)
        self.tokens = {
            f"s{b}": torch.randint(10, 40000, (context,), generator=gen).tolist()
            for b in range(batch)
        }
        self.held: dict[str, int] = {}
        self.outcomes: list[list[AheadTree]] = []  # the last draft-ahead call's, per sequence
        self.rows: dict[int, torch.Tensor] = {}  # random rows by count, drawn once

    def _random_rows(self, count: int) -> torch.Tensor:
        """[count, width] random bf16 rows, drawn once per count: a draw each round (CPU bf16
        randn, OpenMP) took up to ~40 ms on one GPU host and disturbed the timed rounds."""
        if count not in self.rows:
            self.rows[count] = torch.randn(count, self.width).to(torch.bfloat16)
        return self.rows[count]

    def run(self, spec: SpecParams, new: int) -> tuple[float, int]:
        inputs, counts = [], []
        for seq_id, tokens in self.tokens.items():
            if seq_id in self.held:
                tokens += [11 + i for i in range(new)]
            start = min(self.held.get(seq_id, 0), len(tokens) - 1)
            new_tokens = tokens[start:]
            counts.append(len(new_tokens) - 1)
            begin = seq_id not in self.held
            inputs.append(DraftInput(seq_id, begin, start, new_tokens, spec, self.sampling))
            if begin:
                inputs[-1].rules = self.rules
            inputs[-1].root_allowed = self.guide
            self.held[seq_id] = len(tokens) - 1
        self._attach_rows(inputs, counts)
        seconds, outputs = self._timed(inputs)
        self.trees = [out.tree for out in outputs]
        return seconds, sum(len(out.tree) for out in outputs)

    def _timed(self, inputs: list[DraftInput]) -> tuple[float, list[DraftOutput]]:
        """The engine's Draft of `inputs`: (seconds, its outputs)."""
        begin = time.perf_counter()
        outputs = self.engine.draft(inputs)
        return time.perf_counter() - begin, outputs

    def _attach_rows(self, inputs: list[DraftInput], counts: list[int]) -> None:
        """Each input's target features (random), `counts[i]` rows: back to back in one host
        buffer, as they come off the round lane (the drafter's on a GPU reads them into
        page-locked memory; --rows pageable: as before)."""
        flat = self._random_rows(sum(counts))
        if self.pinned:
            landed = transfer.pinned_bytes(
                flat.numel() * flat.element_size(), self.engine.proposer.device
            )
            flat = torch.frombuffer(landed, dtype=flat.dtype).reshape(flat.shape).copy_(flat)
        for item, rows in zip(inputs, flat.split(counts), strict=True):
            item.target_hidden_states = rows

    def ahead(self, spec: SpecParams, guesses: int) -> tuple[float, int]:
        """The draft-ahead call for the trees the last round drafted: (seconds, outcomes)."""
        inputs = []
        for (seq_id, tokens), tree in zip(self.tokens.items(), self.trees, strict=True):
            start = len(tokens) - 1  # the root again, as the gateway sends it
            inputs.append(
                DraftInput(seq_id, False, start, tokens[start:], spec, verifying=tree,
                           ahead_guesses=guesses)
            )  # fmt: skip
        seconds, outputs = self._timed(inputs)
        self.outcomes = [out.ahead for out in outputs]
        return seconds, sum(len(out.ahead) for out in outputs)

    def ahead_hit(self, spec: SpecParams, guesses: int, pick: int) -> tuple[float, int]:
        """A draft-ahead call as the gateway sends it after a hit, with no Draft in the round:
        each sequence takes one of the last call's outcomes (the `pick`-th, cycling: its
        accepted drafts and bonus), brings those tokens with the target's features of all but
        the new root (the catch-up), and the outcome's tree is the one being verified."""
        inputs, counts = [], []
        for (seq_id, tokens), outcomes in zip(self.tokens.items(), self.outcomes, strict=True):
            outcome = outcomes[pick % len(outcomes)]
            tokens += outcome.tokens
            start = self.held[seq_id]
            counts.append(len(tokens) - 1 - start)
            inputs.append(
                DraftInput(seq_id, False, start, tokens[start:], spec, self.sampling,
                           verifying=outcome.tree, ahead_guesses=guesses)
            )  # fmt: skip
            self.held[seq_id] = len(tokens) - 1
        self._attach_rows(inputs, counts)
        seconds, outputs = self._timed(inputs)
        self.outcomes = [out.ahead for out in outputs]
        return seconds, sum(len(out.ahead) for out in outputs)

    def release(self) -> None:
        self.engine.release(list(self.tokens))


class Phases:
    """Host time inside chosen functions (no syncs added), summed per round: where a round's
    host time goes without cProfile's cost per call. Nested phases count in each."""

    def __init__(self, engine: DrafterEngine) -> None:
        proposer = engine.proposer
        runner = proposer.device_expansion_runner  # type: ignore[attr-defined]
        self.seconds: dict[str, float] = {}
        targets = [
            (engine, "_validate"),
            (proposer, "propose"),
            (proposer, "_take_features"),
            (proposer, "_write_rows"),
            (proposer, "_root_steps"),
            (proposer, "_fused_ahead"),
            (proposer, "_forward_rows"),
            (proposer, "_expand"),
            (proposer.head, "fuse"),  # type: ignore[attr-defined]
            (proposer, "_tree_logits"),
            (cuda_graphs.CudaGraphRunner, "forward"),
            (graph_buffers.GraphBuffers, "fill"),
            (expansion.DeviceExpansion, "_run"),
            (expansion.DeviceExpansion, "_load"),
            (step, "build_forward_batch"),
            (step, "causal_step"),
            (transfer, "copy_rows"),
            (transfer.HostRows, "join"),
            (kv_cache.KVCache, "reserve"),
            (kv_cache.KVCache, "trim"),
            (proposer, "truncate"),
            (torch.cuda.Stream, "synchronize"),
            (proposer, "_take_rules"),  # (--rules: the rule tables' round update)
            (proposer, "_fused_key"),
            (draft_rules.RuleTables, "bend"),
        ]
        if runner is not None:
            targets.append((runner, "expand"))
        for owner, name in targets:
            self._wrap(owner, name)
        for module in (tree_draft, eagle_proposer):  # imported by name there
            for name in ("build_forward_batch", "causal_step"):
                if hasattr(module, name):
                    setattr(module, name, getattr(step, name))

    def _wrap(self, owner: object, name: str) -> None:
        label = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
        self.seconds[label] = 0.0
        clock(owner, name, functools.partial(self._add, label))

    def _add(self, label: str, seconds: float) -> None:
        self.seconds[label] += seconds

    def reset(self) -> None:
        for label in self.seconds:
            self.seconds[label] = 0.0

    def take(self, into: dict[str, float]) -> None:
        """Add the phases' sums since the last reset to `into`, then reset."""
        for label, seconds in self.seconds.items():
            into[label] = into.get(label, 0.0) + seconds
        self.reset()

    @staticmethod
    def report(sums: dict[str, float], calls: int, per: str = "round") -> None:
        for label, seconds in sums.items():
            print(f"  {label:40s} {1e3 * seconds / calls:7.3f} ms/{per}")


def torch_profile(
    run: Callable[[], object], count: int, per: str, sort_by: str
) -> dict[str, tuple[float, float]]:
    """`count` calls of `run` under torch.profiler: wall, GPU kernel time and kernels per call
    (the wall grows under the profiler; the kernel time does not), then the top ops by
    `sort_by`. Returns each GPU kernel's (launches, us) per call."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        begin = time.perf_counter()
        for _ in range(count):
            run()
        wall = (time.perf_counter() - begin) / count * 1e3
    events = prof.key_averages()
    gpu_ms, launches = kernel_time(events, count)
    print(
        f"torch.profiler: wall {wall:.3f} ms a {per} (profiled), GPU kernels {gpu_ms:.3f} "
        f"ms a {per}, {launches:.0f} kernels a {per}"
    )
    print(events.table(sort_by=sort_by, row_limit=15, max_name_column_width=60))
    kernels: dict[str, tuple[float, float]] = {}
    for event in events:
        if event.device_type.name == "CUDA" and event.device_time_total > 0:
            launches, us = kernels.get(event.key, (0.0, 0.0))
            kernels[event.key] = (
                launches + event.count / count,
                us + event.self_device_time_total / count,
            )
    return kernels


def print_kernel_difference(
    pair: dict[str, tuple[float, float]], alone: dict[str, tuple[float, float]], label: str
) -> None:
    """The GPU kernels of `pair` (per call) less those of `alone`: what the second call of a
    pair adds (a draft-ahead call beside its round), by time, the top 25."""
    diff = {
        name: (n - alone.get(name, (0.0, 0.0))[0], us - alone.get(name, (0.0, 0.0))[1])
        for name, (n, us) in pair.items()
    }
    launches, total = sum(n for n, _ in diff.values()), sum(us for _, us in diff.values())
    print(f"{label}: {launches:.0f} kernels, {total:.0f} us of GPU time a call; by time:")
    for name, (n, us) in sorted(diff.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {n:6.1f} x {us:7.1f} us  {name[:100]}")


def round_and_ahead(rounds: Rounds, spec: SpecParams, new: int, guesses: int) -> None:
    """A round, then its draft-ahead call."""
    rounds.run(spec, new)
    rounds.ahead(spec, guesses)


def first_draft(engine: DrafterEngine, length: int, width: int) -> Rounds:
    """A new sequence of a `length`-token prompt (page-locked rows on a GPU), before its first
    Draft."""
    pinned = engine.proposer.device.type == "cuda"
    return Rounds(engine, 1, length, width, SamplingParams(), pinned)


def time_prefills(
    engine: DrafterEngine, lengths: list[int], width: int, spec: SpecParams, new: int
) -> None:
    """A new sequence's first Draft (the catch-up over its prompt), then its second (a round's),
    at each prompt length; 3 sequences a length, one after another."""
    for length in lengths:
        firsts, seconds = [], []
        for i in range(3):
            rounds = first_draft(engine, length + i, width)
            firsts.append(1e3 * rounds.run(spec, new)[0])
            seconds.append(1e3 * rounds.run(spec, new)[0])
            rounds.release()
        print(
            f"prefill of {length}-{length + 2} tokens: first Draft "
            f"{' / '.join(f'{ms:.2f}' for ms in firsts)} ms, the next "
            f"{' / '.join(f'{ms:.2f}' for ms in seconds)} ms"
        )


def prefill_profile(
    engine: DrafterEngine, length: int, width: int, spec: SpecParams, new: int
) -> None:
    """Three more first Drafts of `length`-token prompts under torch.profiler (after
    time_prefills), the top ops by host time (a first Draft's catch-up runs eagerly)."""
    lengths = iter(range(length, length + 3))

    def run() -> None:
        rounds = first_draft(engine, next(lengths), width)
        rounds.run(spec, new)
        rounds.release()

    print(f"first Drafts of {length}-{length + 2}-token prompts:")
    torch_profile(run, 3, "first Draft", "self_cpu_time_total")


def idle(seconds: float, how: str) -> None:
    """The thread idles `seconds`: asleep, or polling the clock (a core kept busy)."""
    if how == "sleep":
        if seconds:
            time.sleep(seconds)
        return
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", help="the target checkpoint directory")
    parser.add_argument(
        "--random-target",
        choices=sorted(SHAPES),
        help="instead of --target: a random target of this shape and a random EAGLE-3 head of "
        "its width (bench/gpu_e2e.py; --draft-vocab tokens), built in memory",
    )
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--head", default="specsplit/data/eagle3-smollm2")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--shape", nargs="+", default=["3x1x3", "5x4x16"])
    parser.add_argument("--new", type=int, default=3, help="tokens each sequence gains a round")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--host-expansion", action="store_true")
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=["pinned", "pageable"],
        default=["pinned"],
        help="where each round's feature rows are on the host: page-locked (as the drafter's "
        "round lane reads them on a GPU) or pageable (before; over gRPC); each is timed",
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="the drafter idles this long before each timed round (as it waits for a Verify in "
        "the services: caches and clocks cool down); each is timed",
    )
    parser.add_argument(
        "--gap-how",
        nargs="+",
        choices=["sleep", "poll"],
        default=["sleep"],
        help="how the thread idles through --gap-ms: asleep (a service's event loop waiting in "
        "epoll) or polling the clock (its core kept busy); each is timed",
    )
    parser.add_argument(
        "--prefill",
        type=int,
        nargs="+",
        default=[],
        metavar="TOKENS",
        help="first time a new sequence's first Draft (its prompt's catch-up) at each of these "
        "prompt lengths, 3 sequences each, one at a time, and print each; with --torch-profile "
        "also the longest's under torch.profiler",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="sampled chains (0: greedy)")
    parser.add_argument("--rules", action="store_true", help="each batch under logit rules too")
    parser.add_argument("--guide", action="store_true", help="each batch under a root mask too")
    parser.add_argument("--ahead", type=int, default=0, help="time draft-ahead with G guesses")
    parser.add_argument(
        "--ahead-hits",
        action="store_true",
        help="with --ahead, then time draft-ahead calls as after hits: each brings an outcome of "
        "the last call (its tokens and features) and verifies that outcome's tree, no Draft",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="round",
        choices=["round", "ahead"],
        help="cProfile the timed rounds (or, `--profile ahead`, their draft-ahead calls only), "
        "top functions after",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="host time inside the round's main functions, ms a round (no syncs added)",
    )
    parser.add_argument(
        "--torch-profile",
        action="store_true",
        help="after the timed rounds, --rounds more under torch.profiler: GPU kernel time and "
        "kernels per round, top kernels (with --ahead-hits, then --rounds draft-ahead calls "
        "after hits, top ops by self CPU time)",
    )
    args = parser.parse_args()
    if args.random_target:
        target = random_model(args.random_target, args.device, torch.bfloat16, seed=0)
        head = random_eagle3_head(target, args.draft_vocab, seed=1, device=args.device)
        del target
        proposer = Eagle3Proposer(head, head.make_kv_cache(8192, 16))
        engine = DrafterEngine(proposer, graph_catch_up_lens=CATCH_UP_LENS)
    elif args.target:
        engine = DrafterEngine.load(
            "eagle3",
            args.head,
            target_path=args.target,
            device=args.device,
            dtype=torch.bfloat16 if args.device != "cpu" else torch.float32,  # as the service
            num_pages=8192,
        )
    else:
        parser.error("--target or --random-target")
    begin = time.perf_counter()
    engine.warmup()
    print(f"warm-up {time.perf_counter() - begin:.1f} s on {args.device}")
    proposer = engine.proposer  # type: ignore[assignment]
    if args.host_expansion:
        proposer.device_expansion = False  # type: ignore[attr-defined]
    width = proposer.feature_width  # type: ignore[attr-defined]
    label = "host expansion" if args.host_expansion else "default"
    time_prefills(engine, args.prefill, width, parse_shape(args.shape[0]), args.new)
    if args.prefill and args.torch_profile:
        prefill_profile(engine, args.prefill[-1], width, parse_shape(args.shape[0]), args.new)
    phases = Phases(engine) if args.phases else None
    for spec in map(parse_shape, args.shape):
        gaps = [(0.0, "sleep")] if 0 in args.gap_ms else []
        gaps += [(ms, how) for ms in args.gap_ms if ms for how in args.gap_how]
        variants: list[tuple[str, DraftRules | None, bytes, bool]] = [("", None, b"", False)]
        if args.rules:
            variants.append((", rules", RULES, b"", False))
        if args.guide:
            vocab = engine.proposer.vocab_size  # type: ignore[attr-defined]
            mask = pack_mask(np.arange(vocab) % 2 == 0).tobytes()
            variants.append((", guide", None, mask, False))
            variants.append((", guide, roots by torch", None, mask, True))
        for batch, rows_kind, (gap_ms, gap_how), variant in itertools.product(
            args.batch, args.rows, gaps, variants
        ):
            kind, rules, guide, by_torch = variant
            draft_rules.write_roots = (  # type: ignore[assignment]
                draft_bend.write_roots_reference if by_torch else draft_bend.write_roots
            )
            pinned = rows_kind == "pinned" and torch.device(args.device).type == "cuda"
            sampling = (
                SamplingParams(args.temperature, seed=1) if args.temperature else SamplingParams()
            )
            rounds = Rounds(engine, batch, args.context, width, sampling, pinned, rules, guide)
            rounds.run(spec, args.new)  # prefill
            for _ in range(5):
                rounds.run(spec, args.new)
            times, nodes, ahead_times, outcomes = [], 0, [], 0
            profiler = cProfile.Profile() if args.profile else None
            round_phases: dict[str, float] = {}  # the Draft's phases, then draft-ahead's
            ahead_phases: dict[str, float] = {}
            if phases is not None:
                phases.reset()
            for i in range(args.rounds + (3 if args.ahead else 0)):
                idle(gap_ms / 1e3, gap_how)
                if profiler is not None and args.profile == "round":
                    profiler.enable()
                seconds, nodes = rounds.run(spec, args.new)
                if phases is not None:
                    phases.take(round_phases)
                if args.ahead and spec.topk == 1:
                    if profiler is not None and args.profile == "ahead" and i >= 3:
                        profiler.enable()
                    ahead_seconds, outcomes = rounds.ahead(spec, args.ahead)
                    if i >= 3:  # the first ones capture its graphs
                        ahead_times.append(1e3 * ahead_seconds)
                    if phases is not None:
                        phases.take(ahead_phases)
                if profiler is not None:
                    profiler.disable()
                times.append(1e3 * seconds)
            if phases is not None:
                Phases.report(round_phases, len(times))
                if ahead_phases:
                    print("  draft-ahead calls:")
                    Phases.report(ahead_phases, len(times), "call")
            if args.torch_profile:
                alone = torch_profile(
                    functools.partial(rounds.run, spec, args.new),
                    args.rounds,
                    "round",
                    "self_device_time_total",
                )
                if args.ahead and spec.topk == 1:
                    # a round and its draft-ahead call: the pair's kernels less the round's
                    # above are the call's
                    pair = functools.partial(round_and_ahead, rounds, spec, args.new, args.ahead)
                    both = torch_profile(
                        pair, args.rounds, "round + draft-ahead", "self_cpu_time_total"
                    )
                    print_kernel_difference(both, alone, "the draft-ahead call")
            if args.ahead_hits and args.ahead and spec.topk == 1:
                hit_times, hit_phases = [], {}
                if phases is not None:
                    phases.reset()
                for i in range(args.rounds + 3):
                    idle(gap_ms / 1e3, gap_how)
                    hit_seconds, outcomes = rounds.ahead_hit(spec, args.ahead, i)
                    if phases is not None:
                        phases.take(hit_phases)
                    if i >= 3:
                        hit_times.append(1e3 * hit_seconds)
                if phases is not None:
                    print("  draft-ahead calls after a hit:")
                    Phases.report(hit_phases, len(hit_times) + 3, "call")
                print(
                    f"draft-ahead after a hit ({args.ahead} guesses, the outcome's tokens and "
                    f"features caught up): spec {spec.num_steps}x1 batch {batch:3d}: "
                    f"{statistics.median(hit_times):7.3f} ms/call median"
                )
                if args.torch_profile:  # its host ops (self CPU time), then its kernels
                    picks = itertools.count(args.rounds + 3)
                    torch_profile(
                        lambda r=rounds, s=spec, p=picks: r.ahead_hit(s, args.ahead, next(p)),
                        args.rounds,
                        "draft-ahead call after a hit",
                        "self_cpu_time_total",
                    )
            rounds.release()
            if ahead_times:
                print(
                    f"draft-ahead ({args.ahead} guesses): spec {spec.num_steps}x1 batch "
                    f"{batch:3d}: {statistics.median(ahead_times):7.3f} ms/call median, "
                    f"{outcomes / batch:.0f} trees/seq"
                )
            times.sort()
            p90 = times[int(0.9 * (len(times) - 1))]
            print(
                f"{label}{kind}, {rows_kind} rows, {gap_ms:g} ms idle"
                f"{f' ({gap_how})' if gap_ms else ''} before: spec "
                f"{spec.num_steps}x{spec.topk}x{spec.num_draft_tokens} "
                f"batch {batch:3d}: {statistics.median(times):7.3f} ms/round median, "
                f"p90 {p90:7.3f}, {nodes / batch:.1f} nodes/seq"
            )
            if profiler is not None:
                stats = pstats.Stats(profiler)
                stats.sort_stats("tottime").print_stats(15)
                stats.sort_stats("cumulative").print_stats(35)
    engine.check_integrity()


if __name__ == "__main__":
    main()
