"""What the first rounds at a new batch size cost after the services' warm-up: the whole
system in one process (the real scheduler, the verifier engine with its CUDA graphs, the
drafter engine with an EAGLE-3 head and its graphs), each engine warmed up as its service does;
then, batch size by batch size, the same requests twice: cold (the first time at that batch)
and warm. For each run: wall seconds, the Triton kernels compiled (cubins written to a fresh
Triton / inductor cache, so every build counts), the graphs torch.compile traced and the CUDA
graphs captured (any: the forwards', acceptance's, logit rules', the drafter's).

    PYTHONPATH=. python bench/cold_shapes.py --model DIR --head specsplit/data/eagle3-smollm2 \
        [--device cuda] [--batch 1 2 3 5 8 13 21 32] [--max-new-tokens 16] [--spec 3]
        [--temperature 0.7 --top-p 0.95 [--top-k 50]] [--decode-steps 4 --decode-ahead]
        [--presence 0.5 --frequency 0.5 --repetition 1.1]

--spec 0: plain rounds (no drafts: what the speculation gate runs on a GPU for the embedded
model). --temperature: sampled requests (seeded), with --top-p / --top-k their filters.
--decode-steps / --decode-ahead: a plain round's steps and the step run ahead, as `up` has them on
a GPU. --presence / --frequency / --repetition: logit rules (penalties) on every request, whose
steady rounds replay the verifier's rules graphs (verifier/rules_graphs.py, captured on first
use).

Cold rounds that build kernels are what a user's first requests at a new batch size wait for;
the bench says which runs build them and how long they take.
"""

from __future__ import annotations

import os
import tempfile

_CACHE = tempfile.mkdtemp(prefix="specsplit-cold-")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_CACHE, "triton")  # before triton is imported
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_CACHE, "inductor")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.acceptance import bundled_prompts  # noqa: E402
from drafter.tree_draft import CATCH_UP_LENS  # noqa: E402
from gateway.request import GenerationRequest  # noqa: E402
from inprocess.stack import build_local_stack  # noqa: E402
from specsplit import metrics  # noqa: E402
from specsplit.logit_rules import Penalties  # noqa: E402
from specsplit.messages import SpecParams  # noqa: E402
from specsplit.model.loader import load_tokenizer  # noqa: E402
from specsplit.prompt import apply_chat_template  # noqa: E402
from specsplit.sampling import SamplingParams  # noqa: E402
from verifier.warmup import GRAPH_QUERY_LENS  # noqa: E402


def kernels_built() -> set[str]:
    return {str(path.relative_to(_CACHE)) for path in Path(_CACHE).rglob("*.cubin")}


def specialised(cubin: str) -> str:
    """What Triton specialised a built kernel on (its cache entry's metadata beside the cubin:
    constants and the arguments' attributes, e.g. 16-byte alignment or a value of 1)."""
    path = Path(_CACHE, cubin).with_suffix(".json")
    if not path.exists():
        return "(no metadata)"
    meta = json.loads(path.read_text())
    return json.dumps({k: v for k, v in meta.items() if len(json.dumps(v)) < 600})


_captured: list[str] = []  # each capture's site: the innermost of the project's frames


def count_captures() -> None:
    """Count every CUDA graph capture from here on (`captures`), with where it was made."""
    begin = torch.cuda.CUDAGraph.capture_begin
    me = Path(__file__).resolve()
    root = str(me.parent.parent)

    def counted(self: torch.cuda.CUDAGraph, *args: object, **kwargs: object) -> None:
        ours = [
            f
            for f in traceback.extract_stack()
            if f.filename.startswith(root) and Path(f.filename).resolve() != me
        ]
        site = ours[-1] if ours else None
        where = "?" if site is None else f"{Path(site.filename).relative_to(root)}:{site.name}"
        _captured.append(where)
        begin(self, *args, **kwargs)  # type: ignore[arg-type]

    torch.cuda.CUDAGraph.capture_begin = counted  # type: ignore[method-assign]


def captures() -> int:
    return len(_captured)


def eager_drafter_forwards() -> Counter[str]:
    """The drafter's eager forwards so far, by why no graph ran them."""
    return Counter(
        {
            sample.labels["why"]: int(sample.value)
            for family in metrics.DRAFTER_EAGER_FORWARDS.collect()
            for sample in family.samples
            if sample.name.endswith("_total")
        }
    )


def num_graphs_traced() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a target checkpoint directory")
    parser.add_argument("--head", default="specsplit/data/eagle3-smollm2")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 3, 5, 8, 13, 21, 32])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--spec", type=int, default=3, help="chain depth (0: plain rounds)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--decode-steps", type=int, default=1)
    parser.add_argument("--decode-ahead", action="store_true")
    parser.add_argument("--presence", type=float, default=0.0)
    parser.add_argument("--frequency", type=float, default=0.0)
    parser.add_argument("--repetition", type=float, default=1.0)
    args = parser.parse_args()
    count_captures()
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, seed=1)
    rules = Penalties(presence=args.presence, frequency=args.frequency, repetition=args.repetition)
    penalties = rules if rules.active else None
    tokenizer = load_tokenizer(args.model)
    chats = [apply_chat_template(tokenizer, m) for m in bundled_prompts()]
    start = time.perf_counter()
    stack = build_local_stack(
        args.model,
        "eagle3",
        tokenizer,
        SpecParams(args.spec, 1, args.spec),
        draft_path=args.head,
        dtype=torch.bfloat16,
        device=args.device,
        graph_query_lens=GRAPH_QUERY_LENS,
        draft_graph_lens=CATCH_UP_LENS,
        num_pages=4096,
        decode_steps=args.decode_steps,
        decode_ahead=args.decode_ahead,
    )
    print(
        f"loaded and warmed up in {time.perf_counter() - start:.1f} s: "
        f"{len(kernels_built())} kernels built, {num_graphs_traced()} graphs traced, "
        f"{captures()} CUDA graphs captured; requests {sampling}, {penalties}, spec {args.spec}"
    )
    # from here on: what torch.compile traces, and why it traces again
    torch._logging.set_logs(dynamo=logging.INFO, recompiles=True)
    built: dict[int, list[str]] = {}
    print("| batch | run | seconds | kernels built | graphs traced | CUDA graphs captured |")
    print("|---:|---|---:|---:|---:|---:|")
    for batch in args.batch:
        requests = [
            GenerationRequest(
                chats[i % len(chats)],
                args.max_new_tokens,
                ignore_eos=True,
                sampling=sampling,
                penalties=penalties,
            )
            for i in range(batch)
        ]
        for run in ("cold", "warm"):
            kernels, graphs, captured = kernels_built(), num_graphs_traced(), captures()
            eager = eager_drafter_forwards()
            begin = time.perf_counter()
            stack.generate_all(requests)
            seconds = time.perf_counter() - begin
            new = sorted(kernels_built() - kernels)
            built.setdefault(batch, []).extend(new)
            print(
                f"| {batch} | {run} | {seconds:.2f} | {len(new)} "
                f"| {num_graphs_traced() - graphs} | {captures() - captured} |",
                flush=True,
            )
            sites = Counter(_captured[captured:])
            if sites:
                print(f"captured at batch {batch} ({run}): {dict(sites)}")
            eager = eager_drafter_forwards() - eager
            if eager:
                print(f"eager drafter forwards ({run}): {dict(eager)}")
    warmed = kernels_built() - {name for names in built.values() for name in names}
    for batch, names in built.items():
        for name in names:
            print(f"built at batch {batch}: {name}\n  {specialised(name)}")
            # the same kernel's variants the warm-up built: what the new one's key differs in
            stem = Path(name).name
            for other in sorted(n for n in warmed if Path(n).name == stem):
                print(f"  warm-up's: {specialised(other)}")


if __name__ == "__main__":
    main()
