"""The CPU attention path, one layer's call: `paged_attention_with_plan` (one SDPA a KV head with
its query heads as rows, no mask where every key is visible) against the same SDPA with each KV
head's keys repeated for its query heads and a dense mask always passed (the path before the
seventy-third session). SmolLM2's heads (9 query, 3 KV, 64 wide), page 16, float32; decode,
verify 1 + 3 and a short prefill, batch 1 / 8 / 32. The two calls alternate, so a shared
machine's drift hits both alike; prints the median us of each and their ratio, and the largest
difference between their outputs.

    PYTHONPATH=. python bench/cpu_attention.py [--reps 400] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specsplit.kernels.paged_attention_reference import (
    PlanEntry,
    paged_attention_with_plan,
    reference_plan,
)

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
# (batch, queries a sequence, keys a sequence)
SHAPES = [(1, 1, 128), (1, 1, 512), (1, 1, 2048), (1, 4, 512), (8, 1, 512), (8, 4, 512),
          (32, 1, 512), (2, 64, 64)]  # fmt: skip


def keys_repeated(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: list[PlanEntry], scale: float
) -> torch.Tensor:
    """SDPA per sequence over [heads, kv_len, D] keys (each KV head's repeated), mask always."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for q_start, q_end, slots, mask in plan:
        dense = torch.ones(q_end - q_start, slots.shape[0], dtype=torch.bool)
        k_b, v_b = (x[slots].transpose(0, 1).repeat_interleave(groups, 0) for x in (k, v))
        o_b = F.scaled_dot_product_attention(
            q[q_start:q_end].transpose(0, 1), k_b, v_b, attn_mask=dense if mask is None else mask,
            scale=scale,
        )  # fmt: skip
        out[q_start:q_end] = o_b.transpose(0, 1)
    return out


def alternate(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median us of a and of b, called in turn `reps` times after a warm-up."""
    for _ in range(10):
        a(), b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for call, kept in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            call()
            kept.append(time.perf_counter() - start)
    return tuple(sorted(t)[len(t) // 2] * 1e6 for t in times)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=400, help="calls of each at batch 1")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: its)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"CPU, {torch.get_num_threads()} threads, float32, us a layer's call (medians)")
    print("| batch | queries | keys | keys repeated | one SDPA a KV head | ratio | max diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch, q_len, kv_len in SHAPES:
        pages = -(-kv_len // PAGE)
        k = torch.randn((batch * pages + 1) * PAGE, KV_HEADS, HEAD_DIM)
        v = torch.randn_like(k)
        plan = reference_plan(
            torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32),
            torch.full((batch,), kv_len, dtype=torch.int32),
            torch.full((batch,), kv_len - q_len, dtype=torch.int32),
            torch.randperm(batch * pages).view(batch, pages).to(torch.int32),
            PAGE,
            None,
        )
        q = torch.randn(batch * q_len, HEADS, HEAD_DIM)
        scale = HEAD_DIM**-0.5
        call_args = (q, k, v, plan, scale)
        old = functools.partial(keys_repeated, *call_args)
        new = functools.partial(paged_attention_with_plan, *call_args)
        diff = (old() - new()).abs().max().item()
        t_old, t_new = alternate(old, new, max(50, args.reps // batch))
        print(f"| {batch} | {q_len} | {kv_len} | {t_old:.1f} | {t_new:.1f} | "
              f"{t_old / t_new:.2f}x | {diff:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
