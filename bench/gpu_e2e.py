"""The whole system in one process on one GPU with random weights: target + draft model (or a
random EAGLE-3 head of the target's width, `--drafter eagle3`) through the real scheduler, drafter
engine and verifier engine, SYNTHETIC ACCEPTANCE (draft positions accepted at the given rates: the
output is not the target's; labelled in every line). Measures tokens/s of speculative rounds vs
target-only rounds through the same stack, serial and pipelined-groups scheduling, at several
batch sizes.

    PYTHONPATH=. python bench/gpu_e2e.py --target llama-8b --draft llama-1b --rates 0.8 0.7 0.6
    PYTHONPATH=. python bench/gpu_e2e.py --target llama-8b --drafter eagle3 --spec 3 5 \
        --modes serial --rates 0.8 0.7 0.6

The target-only row is the baseline `specsplit up` runs on a GPU: real acceptance (a round with
no drafts accepts nothing, synthetic or not), decode steps run ahead, rounds of
`--decode-steps` steps. `--drafter eagle3`: an EAGLE-3 head shaped like the public ones for
Llama-3.1-8B (one layer of the target's width, a 32,000-token draft vocabulary, three target
layers' features), its weights random, so only its time means anything.

What it leaves out: the RPCs of a real deployment (drafter and verifier share one process;
their engine calls run on two threads, as the in-process clients do). On one GPU they also share
it, so pipelined groups contend for it; `--device cuda:1 --drafter-device cuda:0` puts them on
two, as deployed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import os
import pstats
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench import trace_gaps
from bench.gpu_engine import SHAPES
from bench.profile_step import EngineTime
from bench.random_model import eagle3_head_config, random_eagle3_weights
from drafter.eagle import Eagle3Head
from drafter.eagle_checkpoint import Eagle3Config
from drafter.eagle_proposer import Eagle3Proposer
from drafter.engine import DrafterEngine
from drafter.model_proposer import ModelProposer
from drafter.tree_draft import CATCH_UP_LENS
from gateway.request import Chunk, GenerationRequest
from gateway.scheduler import Scheduler
from inprocess.clients import LocalDrafterClient, LocalVerifierClient
from inprocess.stack import token_ids
from specsplit.cli_flags import DECODE_AHEAD_MAX_BATCH
from specsplit.messages import SpecParams
from specsplit.model.config import ModelConfig
from specsplit.model.llama import LlamaModel, make_kv_cache, state_dict_from_hf
from verifier.engine import VerifierEngine

VOCAB = 49152  # SmolLM2's tokenizer detokenizes the stream (the only one that travels)


def random_model(shape: str, device: str, dtype: torch.dtype, seed: int) -> LlamaModel:
    torch.manual_seed(seed)
    sizes = SHAPES[shape] | {"vocab_size": VOCAB, "tie_word_embeddings": False}
    hf_config = LlamaConfig(**sizes, max_position_embeddings=8192, rms_norm_eps=1e-5)
    with torch.device(device):
        hf = LlamaForCausalLM(hf_config).to(dtype).eval()
    config = ModelConfig.from_hf(hf_config)
    model = LlamaModel.from_state_dict(
        config, state_dict_from_hf(config, hf.state_dict(), dtype, device), device
    )
    del hf
    return model


def random_eagle3_head(target: LlamaModel, draft_vocab: int, seed: int, device: str) -> Eagle3Head:
    """An EAGLE-3 head for `target` with random weights on `device`: one decoder layer of the
    target's width, heads and MLP (as the public heads for Llama-3.1-8B), `draft_vocab` tokens
    mapped to a random subset of the target's vocabulary, the target's embedding."""
    c = target.config
    raw = eagle3_head_config(c, VOCAB, draft_vocab)
    config = Eagle3Config.from_json(raw, c.num_layers)
    embed = target.embed_tokens.weight.detach().to(device)
    weights = random_eagle3_weights(config, seed, device, embed.dtype)
    return Eagle3Head(config, weights, embed)


def make_proposer(
    args: argparse.Namespace, target: LlamaModel, pages: int, device: str, dtype: torch.dtype
) -> Eagle3Proposer | ModelProposer:
    """The draft model (`--draft`) or a random EAGLE-3 head of the target's width."""
    if args.drafter == "eagle3":
        head = random_eagle3_head(target, args.draft_vocab, seed=1, device=device)
        return Eagle3Proposer(head, head.make_kv_cache(pages, 16))
    draft = random_model(args.draft, device, dtype, seed=1)
    return ModelProposer(draft, make_kv_cache(draft.config, pages, 16, dtype, device), VOCAB, 8192)


def engine_profilers(
    drafter: DrafterEngine, verifier: VerifierEngine
) -> dict[str, tuple[cProfile.Profile, Callable[[], None]]]:
    """A cProfile of every draft and verify call (each on its engine's thread), wrapped in
    place: name -> (profile, undo the wrapping)."""
    out: dict[str, tuple[cProfile.Profile, Callable[[], None]]] = {}
    for name, engine in (("draft", drafter), ("verify", verifier)):
        profiler, method = cProfile.Profile(), getattr(engine, name)

        def profiled(inputs: list[Any], p: cProfile.Profile = profiler, m: Any = method) -> Any:
            p.enable()
            try:
                return m(inputs)
            finally:
                p.disable()

        setattr(engine, name, profiled)
        out[name] = (profiler, functools.partial(setattr, engine, name, method))
    return out


class RoundTime(EngineTime):
    """Each Verify round's time from its launch to its finish (`VerifierEngine.launch` /
    `finish`, wrapped in place): for pipelined rounds (groups on a GPU) it includes the wait
    behind the round launched before it. Read as EngineTime's."""

    def __init__(self, verifier: VerifierEngine) -> None:
        self.seconds, self.calls = 0.0, 0
        started: dict[int, float] = {}
        launch, finish = verifier.launch, verifier.finish

        def timed_launch(inputs: list[Any]) -> Any:
            start = time.perf_counter()
            launched = launch(inputs)
            started[id(launched)] = start
            return launched

        def timed_finish(launched: Any) -> Any:
            try:
                return finish(launched)
            finally:
                self.seconds += time.perf_counter() - started.pop(id(launched))
                self.calls += 1

        verifier.launch, verifier.finish = timed_launch, timed_finish  # type: ignore[method-assign]


@contextlib.contextmanager
def traced(path: str | None) -> Iterator[None]:
    """torch.profiler over the block, every thread's ops and Python frames, exported to `path`
    (a chrome trace, .json.gz); nothing without a path."""
    if path is None:
        yield
        return
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=activities, with_stack=True, experimental_config=config) as prof:
        yield
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path)  # gzipped by torch for a path ending in .gz


def run(scheduler: Scheduler, requests: list[GenerationRequest]) -> tuple[int, float, float]:
    """(tokens, seconds, accepted tokens per round) for the requests run concurrently."""

    async def collect(request: GenerationRequest) -> list[Chunk]:
        return [chunk async for chunk in scheduler.generate(request)]

    async def go() -> tuple[int, float, float]:
        await scheduler.start()
        try:
            start = time.perf_counter()
            outs = await asyncio.gather(*(collect(r) for r in requests))
            seconds = time.perf_counter() - start
        finally:
            await scheduler.stop()
        stats = [o[-1].stats for o in outs if o[-1].stats]
        rounds = sum(s.rounds for s in stats)
        accepted = sum(s.num_accepted_tokens for s in stats) / max(rounds, 1)
        return sum(len(token_ids(o)) for o in outs), seconds, accepted

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--draft", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.8, 0.7, 0.6])
    parser.add_argument("--drafter", choices=("model", "eagle3"), default="model")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="the EAGLE-3 head's")
    parser.add_argument("--spec", type=int, nargs="+", default=[3], help="chain lengths")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("serial", "groups", "groups-early"),
        default=["serial", "groups"],
        help="groups-early: groups with the other group's Verify sent while one is in flight",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=4,
        help="the target-only rounds' (up's GPU base; `up` grows them as measured)",
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="enough that the prefill is a small share"
    )
    parser.add_argument("--tokenizer", default=".gpu/tokenizer")
    parser.add_argument("--device", default=None, help="the verifier's; default cuda (or cpu)")
    parser.add_argument("--drafter-device", default=None, help="default: --device")
    parser.add_argument("--eager-drafter", action="store_true", help="no drafter CUDA graphs")
    parser.add_argument(
        "--cprofile-all",
        action="store_true",
        help="cProfile the timed speculative runs as a whole, by own time (Python >= 3.12: "
        "every thread, the scheduler's included; not with --cprofile: one profiler at a time)",
    )
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="cProfile each engine's calls (on its thread) in the timed speculative runs: the "
        "top functions of the draft and verify calls after each row",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="torch.profiler (every thread, Python stacks) over each timed speculative run: "
        "DIR/trace_<mode>_<spec>_b<batch>.json.gz, and bench/trace_gaps.py's summary of what "
        "the host did while the GPU idled",
    )
    args = parser.parse_args()
    if args.cprofile and args.cprofile_all:
        parser.error("--cprofile and --cprofile-all: one profiler at a time (Python 3.12)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    draft_device = args.drafter_device or device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    target = random_model(args.target, device, dtype, seed=0)
    max_batch = max(args.batch)
    pages = max_batch * (-(-(args.prompt_len + args.max_new_tokens + 64) // 16)) + 64
    verifier = VerifierEngine(
        target,
        make_kv_cache(target.config, pages, 16, dtype, device),
        8192,
        VOCAB,
        graph_query_lens=(1, *(1 + n for n in args.spec)),
        max_batch_size=max_batch,
        synthetic_acceptance=tuple(args.rates),
        decode_ahead=True,
        decode_ahead_max_batch=DECODE_AHEAD_MAX_BATCH,  # `up`'s
    )
    verifier.warmup()
    proposer = make_proposer(args, target, pages, draft_device, dtype)
    drafter = DrafterEngine(
        proposer,
        graph_catch_up_lens=() if args.eager_drafter else CATCH_UP_LENS,
        max_batch_size=max_batch,
    )
    drafter.warmup()  # and its CUDA graphs
    label = f"SYNTHETIC acceptance {args.rates}"
    drafter_name = "EAGLE-3 head (random)" if args.drafter == "eagle3" else f"{args.draft} draft"
    print(
        f"{args.target} target on {device}, {drafter_name} on {draft_device}, {dtype}, "
        f"{label}, prompt {args.prompt_len}, {args.max_new_tokens} new tokens, chains "
        f"{args.spec}, drafter {'eager' if args.eager_drafter else 'CUDA graphs'}, target-only "
        f"rounds of {args.decode_steps} decode steps run ahead"
    )
    gen = torch.Generator().manual_seed(0)
    draft_time, verify_time = EngineTime(drafter, "draft"), RoundTime(verifier)
    # where an engine call's time goes: graph replays, eager forwards, acceptance
    parts: dict[str, EngineTime] = {}
    if verifier.graphs is not None:
        parts["verify graph"] = EngineTime(verifier.graphs, "forward")
    parts["verify eager"] = EngineTime(verifier.model, "forward")
    parts["accept"] = EngineTime(verifier, "_accept")
    draft_model = proposer.head if isinstance(proposer, Eagle3Proposer) else proposer.model
    parts["draft eager"] = EngineTime(draft_model, "forward")
    if proposer.graphs is not None:
        parts["draft graph"] = EngineTime(proposer.graphs, "forward")
    print(
        "| scheduling | spec | batch | tokens/s | accepted tokens/round | vs target-only "
        "| draft ms/call | verify ms/call |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        prompts = [
            torch.randint(3, VOCAB, (args.prompt_len,), generator=gen).tolist()
            for _ in range(batch)
        ]
        requests = [GenerationRequest(p, args.max_new_tokens, ignore_eos=True) for p in prompts]
        base = None
        runs = [("serial", 0)] + [(mode, n) for n in args.spec for mode in args.modes]
        for overlap, spec in runs:
            # target-only rounds accept nothing: real acceptance there (its graphs, decode ahead)
            verifier.synthetic_acceptance = None if spec == 0 else tuple(args.rates)
            scheduler = Scheduler(
                LocalDrafterClient(drafter),
                LocalVerifierClient(verifier, pipelined=overlap.endswith("-early")),
                tokenizer,
                eos_token_ids=(),
                default_spec=SpecParams(spec, 1, spec),
                max_batch_size=max_batch,
                overlap=overlap.removesuffix("-early"),
                early_verify=overlap.endswith("-early"),
                decode_steps=args.decode_steps if spec == 0 else 1,
            )
            # warm-up: the same batch once (the eager prefill's compiled kernels for its shapes,
            # the allocator), then the timed run
            run(scheduler, requests)
            for timer in (draft_time, verify_time, *parts.values()):
                timer.reset()
            profilers = engine_profilers(drafter, verifier) if args.cprofile and spec else {}
            trace = None
            if args.trace and spec:
                trace = f"{args.trace}/trace_{overlap}_{spec}_b{batch}.json.gz"
            whole = cProfile.Profile() if args.cprofile_all and spec else None
            with traced(trace), whole or contextlib.nullcontext():  # a Profile enables itself
                tokens, seconds, accepted = run(scheduler, requests)
            rate = tokens / seconds
            base = base or rate
            name = "target only" if spec == 0 else f"chain {spec}"
            print(
                f"| {overlap} | {name} | {batch} | {rate:.1f} | {accepted:.2f} | "
                f"{rate / base:.2f}x | {draft_time.ms_per_call:.2f} | "
                f"{verify_time.ms_per_call:.2f} |",
                flush=True,
            )
            details = ", ".join(
                f"{name} {t.calls} x {t.ms_per_call:.2f} ms" for name, t in parts.items()
            )
            print(f"|  | ({details}) | | | | | | |", flush=True)
            if trace is not None:
                print(trace_gaps.summarise(trace, top=40, min_gap_us=20, match="/"), flush=True)
            for name, (profiler, undo) in profilers.items():
                undo()
                print(f"\n{name} calls, cProfiled on the engine's thread:")
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            if whole is not None:
                print("\nthe whole run, cProfiled (every thread on Python >= 3.12):")
                pstats.Stats(whole).sort_stats("tottime").print_stats(50)
        assert verifier.num_pages_used == 0 and drafter.num_pages_used == 0


if __name__ == "__main__":
    main()
