"""Where a verifier step's time goes: torch.profiler over decode / verify steps of the engine.

    PYTHONPATH=. python bench/profile_step.py --shape smollm2-135m --batch 1 --n 0 4

Prints, per (batch, n): the wall time per step, the GPU kernel time per step and the number of
kernels, the host time spent in each phase (batch building, graph replay or eager forward,
acceptance, commit), and the top CPU-side ops.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

import verifier.engine as engine_module
from bench.gpu_engine import SHAPES, EngineBench
from specsplit.model.config import ModelConfig


def timed(phases: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--n", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    args = parser.parse_args()
    args.verify_n = [n for n in args.n if n]
    torch.manual_seed(0)
    hf_config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=8192, rms_norm_eps=1e-5)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    bench = EngineBench(hf, ModelConfig.from_hf(hf_config), args, graphs=not args.eager)
    del hf
    engine = bench.engine
    phases: dict[str, float] = defaultdict(float)
    engine_module.build_forward_batch = timed(  # type: ignore[assignment]
        phases, "build batch", engine_module.build_forward_batch
    )
    if engine.graphs is not None:
        engine.graphs.forward = timed(phases, "graph copy-in + replay", engine.graphs.forward)  # type: ignore[method-assign]
    engine.model.forward = timed(phases, "eager forward", engine.model.forward)  # type: ignore[method-assign]
    engine._accept = timed(phases, "accept (+ sync)", engine._accept)  # type: ignore[method-assign]
    engine._commit = timed(phases, "commit", engine._commit)  # type: ignore[method-assign]
    engine._validate = timed(phases, "validate", engine._validate)  # type: ignore[method-assign]
    engine._reserve = timed(phases, "reserve", engine._reserve)  # type: ignore[method-assign]
    for batch in args.batch:
        state = bench.open(batch)
        for n in args.n:
            for _ in range(5):
                bench.step(state, n)
            phases.clear()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                for _ in range(args.steps):
                    bench.step(state, n)
                wall = (time.perf_counter() - start) / args.steps * 1e3
            events = prof.key_averages()
            kernels = [
                e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"
            ]
            gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
            launches = sum(e.count for e in kernels) / args.steps
            print(
                f"\n== {args.shape} batch {batch} n {n}: wall {wall:.3f} ms/step (profiled), "
                f"GPU kernels {gpu_ms:.3f} ms/step, {launches:.0f} kernels/step"
            )
            for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
                print(f"   host {name}: {seconds / args.steps * 1e3:.3f} ms/step")
            print(
                events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
            )
            print(
                events.table(
                    sort_by="self_device_time_total", row_limit=12, max_name_column_width=60
                )
            )
        bench.close(state)


if __name__ == "__main__":
    main()
