"""What a cold GPU warm-up spends building our Triton kernels, one after another (today's
default) and side by side (`building_ahead`, specsplit/kernels/triton_jit.py:
$SPECSPLIT_BUILD_AHEAD=1).

One service's engine warmed up as `up` warms it (`--service verifier`: `VerifierEngine.load`
with decode-ahead; `drafter`: an EAGLE-3 head over its target, `DrafterEngine.load`), each run in
a fresh process with its own Triton and inductor cache directories:

- `cold, off`: empty caches, $SPECSPLIT_BUILD_AHEAD=0 (the builds one after another, as they
  come);
- `cold, on, N threads`: empty caches, $SPECSPLIT_BUILD_AHEAD=1, N build threads (default: the
  process's cores);
- `warm, on`: the previous run's caches kept.

Each run: the warm-up's seconds, its phases' (each with the Triton builds that ended in it:
triton's post-compile hook; with warm caches a build is a load from triton's cache), and
torch.compile's seconds (dynamo's counters).

    PYTHONPATH=. python bench/kernel_builds.py --model DIR [--service verifier|drafter]...
        [--threads 16] [--head specsplit/data/eagle3-smollm2] [--runs cold-off warm-off]

--runs: which of the runs, in that order (default cold-off cold-on warm-on; warm-off keeps
cold-off's caches). $SPECSPLIT_TRITON_POINTWISE and the other switches pass to every run.

On a GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PHASES: dict[str, list[float]] = {}  # phase -> [seconds, builds]
_current = ["load"]


def count_builds() -> None:
    """Triton's post-compile hook: each build counted in the phase it ends in (once a variant:
    built ahead, when the block waits for it)."""
    from triton import knobs

    def built(**_: Any) -> None:
        PHASES.setdefault(_current[0], [0.0, 0.0])[1] += 1

    knobs.runtime.jit_post_compile_hook = built


@contextmanager
def in_phase(phase: str) -> Iterator[None]:
    """The block's seconds and builds counted as `phase` (inside the warm-up, outermost only)."""
    if _current[0] != "warm-up":
        yield
        return
    _current[0] = phase
    start = time.perf_counter()
    try:
        yield
    finally:
        sync()
        PHASES.setdefault(phase, [0.0, 0.0])[0] += time.perf_counter() - start
        _current[0] = "warm-up"


def timed(owner: Any, name: str, phase: str) -> None:
    """`owner.name` timed as `phase`."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with in_phase(phase):
            return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def timed_block(module: Any) -> None:
    """`module.building_ahead` timed as the phase "building ahead"."""
    original = module.building_ahead

    @contextmanager
    def block(*args: Any, **kwargs: Any) -> Iterator[None]:
        with in_phase("building ahead"), original(*args, **kwargs):
            yield

    module.building_ahead = block


def phases(service: str) -> None:
    """The service's warm-up phases timed."""
    if service == "verifier":
        import verifier.warmup as warmup
        from specsplit.model.cuda_graphs import CudaGraphRunner
        from verifier.accept_graphs import AcceptGraphs

        timed_block(warmup)
        timed(CudaGraphRunner, "capture", "step graphs")
        timed(AcceptGraphs, "capture_all", "acceptance graphs")
        for name in ("warm_up_chain", "rehearse", "rehearse_rules", "time_rounds"):
            timed(warmup, name, name)
    else:
        import drafter.tree_draft as tree_draft
        from drafter.engine import DrafterEngine
        from drafter.expansion import DeviceExpansion
        from specsplit.model.cuda_graphs import CudaGraphRunner

        timed_block(tree_draft)
        timed(tree_draft.TreeProposer, "warm_up_kernels", "attention variants")
        timed(CudaGraphRunner, "capture", "step graphs")
        timed(DeviceExpansion, "capture_all", "expansion graphs")
        timed(DrafterEngine, "first_draft", "first draft")
        timed(DrafterEngine, "rehearse", "rehearse")


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm_up(args: argparse.Namespace) -> float:
    """The service's engine loaded and warmed up; returns the warm-up's seconds."""
    import torch

    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32

    if args.service == "verifier":
        from verifier.engine import VerifierEngine

        engine: Any = VerifierEngine.load(
            args.model, device=args.device, dtype=dtype, decode_ahead=True
        )
    else:
        from drafter.engine import DrafterEngine

        engine = DrafterEngine.load(
            "eagle3", args.head, target_path=args.model, device=args.device, dtype=dtype
        )
    sync()
    _current[0] = "warm-up"
    start = time.perf_counter()
    engine.warmup()
    sync()
    return time.perf_counter() - start


def child(args: argparse.Namespace) -> None:
    """One run in this process: prints one JSON line of its figures."""
    count_builds()
    phases(args.service)
    seconds = warm_up(args)
    from torch._dynamo.utils import compile_times

    dynamo = compile_times(repr="csv", aggregate=True)
    compiled_s = dict(zip(dynamo[0], dynamo[1], strict=True)).get("_compile.compile_inner", 0.0)
    print(
        json.dumps(
            {
                "warm_up_s": seconds,
                "builds": sum(builds for _, builds in PHASES.values()),
                "torch_compile_s": float(compiled_s),
                "phases": PHASES,
            }
        ),
        flush=True,
    )


def run(args: argparse.Namespace, service: str, cache: str, ahead: bool) -> dict[str, Any]:
    """One child run of `service` with its caches under `cache`, building ahead or not."""
    env = dict(os.environ, TRITON_CACHE_DIR=f"{cache}/triton")
    env["TORCHINDUCTOR_CACHE_DIR"] = f"{cache}/inductor"
    env["SPECSPLIT_BUILD_AHEAD"] = "1" if ahead else "0"
    env["SPECSPLIT_BUILD_THREADS"] = str(args.threads)
    command = [sys.executable, __file__, "--child", "--service", service, "--model", args.model]
    command += ["--head", args.head, "--device", args.device]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.exit(f"{service}: rc {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


# --runs: name, cache directory (a: built as they come, b: built ahead), building ahead; a warm
# run reuses the cold run's caches before it in the list
RUNS = {
    "cold-off": ("cold, off", "a", False),
    "cold-on": ("cold, on, N threads", "b", True),
    "warm-on": ("warm, on", "b", True),
    "warm-off": ("warm, off", "a", False),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="the target checkpoint directory")
    parser.add_argument("--service", nargs="+", default=["verifier", "drafter"])
    parser.add_argument("--head", default="specsplit/data/eagle3-smollm2")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--device", default="cuda", help="cpu: a check of this script alone")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS)[:3])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.service = args.service[0]
        child(args)
        return
    print("| service | run | warm-up s | Triton builds | torch.compile s | phases: s (builds) |")
    print("|---|---|---:|---:|---:|---|")
    for service in args.service:
        with tempfile.TemporaryDirectory() as root:
            for key in args.runs:
                name, cache, ahead = RUNS[key]
                name = name.replace("N threads", f"{args.threads} threads")
                got = run(args, service, f"{root}/{cache}", ahead)
                parts = sorted(got["phases"].items(), key=lambda item: -item[1][0])
                by_phase = "; ".join(f"{p} {s:.1f} ({b:.0f})" for p, (s, b) in parts)
                print(
                    f"| {service} | {name} | {got['warm_up_s']:.1f} | {got['builds']:.0f} "
                    f"| {got['torch_compile_s']:.1f} | {by_phase} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
