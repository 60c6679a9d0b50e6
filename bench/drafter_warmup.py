"""What the drafter's warm-up costs on a GPU, by phase, in one process (an EAGLE-3 head over its
target, as `up` serves it): the first draft, the attention kernels' variants, the CUDA graphs
(the steps', then each expansion key's at every batch bucket: seconds, graphs, memory reserved)
and the rehearsal; then the whole of it again on the same engine's caches (`DrafterEngine.warmup`
on a second engine in the process: what a restart with the compile caches kept costs).

    PYTHONPATH=. python bench/drafter_warmup.py --target DIR [--head specsplit/data/eagle3-smollm2]
        [--max-batch 64]

Each key's row: its graphs at every batch bucket (`DeviceExpansion.capture_all`), grouped as
chains, chains under logit rules (`rules`), draft-ahead (`Ahead`) and those with the catch-up
fused in (`catch_up`). On a GPU only.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from drafter.engine import DrafterEngine
from drafter.expansion import DeviceExpansion
from drafter.expansion_inputs import Ahead, Shape

MIB = 2**20


def group(key: Shape | Ahead) -> str:
    """A key's row in the table: what kind of expansion it is."""
    shape = key.shape if isinstance(key, Ahead) else key
    kind = "draft-ahead" if isinstance(key, Ahead) else "chain" if shape.topk == 1 else "tree"
    kind += ", sampled" if shape.sampled else ", greedy"
    if shape.rules:
        kind += ", rules"
    if key.catch_up:
        kind += ", catch-up fused"
    return kind


def timed_captures() -> dict[str, list[float]]:
    """Wrap `DeviceExpansion.capture_all`: per group, [seconds, graphs, MiB reserved]."""
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    capture_all = DeviceExpansion.capture_all

    def timed(self: DeviceExpansion, key: Shape | Ahead) -> None:
        torch.cuda.synchronize()
        graphs, reserved = len(self.captured), torch.cuda.memory_reserved()
        start = time.perf_counter()
        capture_all(self, key)
        torch.cuda.synchronize()
        row = table[group(key)]
        row[0] += time.perf_counter() - start
        row[1] += len(self.captured) - graphs
        row[2] += (torch.cuda.memory_reserved() - reserved) / MIB

    DeviceExpansion.capture_all = timed  # type: ignore[method-assign]
    return table


def phase(name: str, run: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"| {name} | {seconds:.2f} |", flush=True)
    return seconds


def by_phase(engine: DrafterEngine) -> None:
    """`DrafterEngine.warmup`'s phases, each timed."""
    proposer = engine.proposer
    print("| phase | seconds |")
    print("|---|---:|")
    total = phase("first draft (the eager path's first run)", engine.first_draft)
    total += phase("attention kernels' variants", proposer.warm_up_kernels)
    total += phase(
        "CUDA graphs: steps and expansions",
        lambda: proposer.capture_cuda_graphs(engine.graph_catch_up_lens, engine.max_batch_size),
    )
    total += phase("rehearsal", engine.rehearse)
    print(f"| whole | {total:.2f} |")
    print(f"\nreserved {torch.cuda.memory_reserved() / MIB:.0f} MiB after the warm-up\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="the head's target checkpoint directory")
    parser.add_argument("--head", default="specsplit/data/eagle3-smollm2")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--num-pages", type=int, default=4096)
    args = parser.parse_args()

    def load() -> DrafterEngine:
        return DrafterEngine.load(
            "eagle3",
            args.head,
            target_path=args.target,
            device="cuda",
            dtype=torch.bfloat16,
            num_pages=args.num_pages,
            max_batch_size=args.max_batch,
        )

    table = timed_captures()
    by_phase(load())
    print("| expansion keys | seconds | graphs | reserved |")
    print("|---|---:|---:|---:|")
    for kind, (seconds, graphs, reserved) in sorted(table.items()):
        print(f"| {kind} | {seconds:.2f} | {graphs:.0f} | +{reserved:.0f} MiB |")
    torch.cuda.empty_cache()
    again = load()
    start = time.perf_counter()
    again.warmup()
    torch.cuda.synchronize()
    print(f"\na second engine's whole warm-up (caches warm): {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
