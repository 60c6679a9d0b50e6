"""A CPU decode / verify step of the embedded default (or --model) in process, with the decoder
layers in one C call (specsplit/model/cpu_layer.c) and with the torch layer it replaced, in
turn in one process (so a shared machine's drift hits both alike): the median ms of each.

    PYTHONPATH=. python bench/cpu_step.py [--context 200] [--rows 1 4] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specsplit.model import cpu_layer
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.step import build_forward_batch, causal_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="tokens a step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps a turn")
    parser.add_argument("--turns", type=int, default=3, help="alternations of the two layers")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or embedded_default_model_path()
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    page_size = 16
    kv = make_kv_cache(config, -(-(args.context + max(args.rows)) // page_size) + 1, page_size,
                       torch.float32, "cpu")  # fmt: skip
    seq = kv.new_seq()
    kv.reserve(seq, args.context + max(args.rows))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, config.vocab_size, (args.context,), generator=gen).tolist()
    model(build_forward_batch([causal_step(seq, prompt, [args.context - 1])], page_size)[0], kv)
    seq.kv_committed_len = args.context
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.turns):
        for layer in ("C layer", "torch layer"):
            os.environ["SPECSPLIT_CPU_LAYER"] = "1" if layer == "C layer" else "0"
            cpu_layer.switch.cache_clear()  # (it reads the variable once)
            for rows in args.rows:
                tokens = torch.randint(3, config.vocab_size, (rows,), generator=gen).tolist()
                step = causal_step(seq, tokens, list(range(rows)))
                for index in range(args.steps + 3):
                    start = time.perf_counter()
                    model(build_forward_batch([step], page_size)[0], kv)
                    if index >= 3:  # after warm-up
                        times.setdefault((layer, rows), []).append(time.perf_counter() - start)
    print(f"{path}, float32, {args.threads} threads, {args.context} tokens of context")
    print("| rows | C layer ms | torch layer ms | torch / C |")
    print("|---:|---:|---:|---:|")
    for rows in args.rows:
        c_ms = statistics.median(times[("C layer", rows)]) * 1e3
        torch_ms = statistics.median(times[("torch layer", rows)]) * 1e3
        print(f"| {rows} | {c_ms:.2f} | {torch_ms:.2f} | {torch_ms / c_ms:.2f}x |")


if __name__ == "__main__":
    main()
