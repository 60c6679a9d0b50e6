"""What the verifier's CUDA graphs hold on the GPU and how long they take to capture, at the
services' graphs (query lengths GRAPH_QUERY_LENS, batches up to --max-batch), in one process:

1. the whole warm-up (`VerifierEngine.load(...).warmup()`: forward, prefill and acceptance
   graphs, the rehearsal): its seconds, and the memory reserved after `torch.cuda.empty_cache`
   beyond the weights and the KV pool (what the graphs' pools keep);
2. the acceptance graphs alone, in a second engine: every layout's graph captured per kind
   (greedy, sampled, sampled with top-k / top-p), each kind timed, with the growth of
   `torch.cuda.memory_reserved` / `memory_allocated`.

A pool caches its blocks per stream: graphs captured on a fresh stream each cannot reuse what
earlier captures freed (`specsplit.model.graph_buffers.CaptureStream`). On a GPU only.

    PYTHONPATH=. python bench/graph_memory.py --model DIR [--max-batch 64] [--num-pages 4096]
"""

from __future__ import annotations

import argparse
import time

import torch

from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from verifier.engine import VerifierEngine
from verifier.warmup import GRAPH_QUERY_LENS

MIB = 2**20


def whole_warm_up(model_path: str, max_batch: int, num_pages: int) -> None:
    """Part 1: the warm-up's seconds and what it keeps reserved beyond weights and KV."""
    start = time.perf_counter()
    engine = VerifierEngine.load(
        model_path,
        device="cuda",
        dtype=torch.bfloat16,
        num_pages=num_pages,
        graph_query_lens=GRAPH_QUERY_LENS,
        max_batch_size=max_batch,
    )
    loaded = time.perf_counter()
    engine.warmup()
    torch.cuda.synchronize()
    warmed = time.perf_counter()
    torch.cuda.empty_cache()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = engine.kv.data.numel() * engine.kv.data.element_size()
    reserved = torch.cuda.memory_reserved()
    print(
        f"warm-up: loaded in {loaded - start:.1f} s, warmed up in {warmed - loaded:.1f} s; "
        f"reserved after empty_cache {reserved / MIB:.0f} MiB: weights {weights / MIB:.0f}, "
        f"KV {kv / MIB:.0f}, the rest {(reserved - weights - kv) / MIB:.0f} MiB "
        f"(allocated {torch.cuda.memory_allocated() / MIB:.0f} MiB)",
        flush=True,
    )
    del engine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a target checkpoint directory")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--num-pages", type=int, default=4096)
    args = parser.parse_args()
    whole_warm_up(args.model, args.max_batch, args.num_pages)
    torch.cuda.empty_cache()
    model, config = load_model(args.model, torch.bfloat16, "cuda")
    kv = make_kv_cache(config, args.num_pages, 16, torch.bfloat16, "cuda")
    engine = VerifierEngine(
        model,
        kv,
        2048,
        config.vocab_size,
        graph_query_lens=GRAPH_QUERY_LENS,
        max_batch_size=args.max_batch,
    )
    graphs = engine.accept_graphs
    assert graphs is not None
    layouts = graphs.layouts(max(GRAPH_QUERY_LENS) - 1)
    print("| kind | graphs | seconds | reserved | allocated |")
    print("|---|---:|---:|---:|---:|")
    for kind, filters in (("greedy", None), ("sampled", False), ("sampled, top-k / top-p", True)):
        torch.cuda.synchronize()
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        start = time.perf_counter()
        for layout in layouts:
            sampling = None if filters is None else graphs.sampling(layout, 0, filters)
            graphs.host_arrays(layout, sampling)  # captures the graph it takes
        torch.cuda.synchronize()
        print(
            f"| {kind} | {len(layouts)} | {time.perf_counter() - start:.2f} "
            f"| +{(torch.cuda.memory_reserved() - reserved) / MIB:.0f} MiB "
            f"| +{(torch.cuda.memory_allocated() - allocated) / MIB:.0f} MiB |",
            flush=True,
        )
    torch.cuda.empty_cache()
    print(
        f"after empty_cache: reserved {torch.cuda.memory_reserved() / MIB:.0f} MiB, allocated "
        f"{torch.cuda.memory_allocated() / MIB:.0f} MiB (KV "
        f"{kv.data.numel() * kv.data.element_size() / MIB:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
