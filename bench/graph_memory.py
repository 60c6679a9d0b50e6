"""What the verifier's CUDA graphs hold on the GPU and how long they take to capture, at the
services' graphs (query lengths GRAPH_QUERY_LENS, batches up to --max-batch), in one process:

1. the whole warm-up (`VerifierEngine.for_model(...).warmup()`: forward, prefill and acceptance
   graphs, the rehearsal): its seconds, and the memory reserved after `torch.cuda.empty_cache`
   beyond the weights and the KV pool (what the graphs' pools keep);
2. the acceptance graphs alone, in a second engine over the same weights: every layout's graph
   captured per kind (greedy, sampled, sampled with top-k / top-p), each kind timed, with the
   growth of `torch.cuda.memory_reserved` / `memory_allocated`.

A pool caches its blocks per stream: graphs captured on a fresh stream each cannot reuse what
earlier captures freed (`specsplit.model.graph_buffers.CaptureStream`). On a GPU only.

    PYTHONPATH=. python bench/graph_memory.py --model DIR [--max-batch 64] [--num-pages 4096]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model
from verifier.engine import VerifierEngine
from verifier.warmup import GRAPH_QUERY_LENS

MIB = 2**20


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def whole_warm_up(model: LlamaModel, max_batch: int, num_pages: int) -> None:
    """Part 1: the warm-up's seconds and what it keeps reserved beyond weights and KV."""
    engine = VerifierEngine.for_model(
        model, num_pages=num_pages, graph_query_lens=GRAPH_QUERY_LENS, max_batch_size=max_batch
    )
    start = time.perf_counter()
    engine.warmup()
    torch.cuda.synchronize()
    warmed = time.perf_counter() - start
    torch.cuda.empty_cache()
    weights = sum(nbytes(p) for p in model.parameters())
    kv = nbytes(engine.kv.data)
    reserved = torch.cuda.memory_reserved()
    print(
        f"warm-up: {warmed:.1f} s; reserved after empty_cache {reserved / MIB:.0f} MiB: weights "
        f"{weights / MIB:.0f}, KV {kv / MIB:.0f}, the rest {(reserved - weights - kv) / MIB:.0f} "
        f"MiB (allocated {torch.cuda.memory_allocated() / MIB:.0f} MiB)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a target checkpoint directory")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--num-pages", type=int, default=4096)
    args = parser.parse_args()
    model, config = load_model(args.model, torch.bfloat16, "cuda")
    whole_warm_up(model, args.max_batch, args.num_pages)
    gc.collect()  # part 1's engine, its KV pool and graphs, before part 2's
    torch.cuda.empty_cache()
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
        f"{nbytes(kv.data) / MIB:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
