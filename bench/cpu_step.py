"""A CPU decode / verify step of the embedded default (or --model) in process, in turn in one
process (so a shared machine's drift hits all alike), the median ms of each: the decoder layers
in one C call (specsplit/model/cpu_layer.c) reading the GGUF's packed blocks
(specsplit/model/cpu_quant.py), the same reading the float32 weights, and the torch layer on
float32 weights. On a CPU with AMX's 8-bit tiles or AVX-512 VNNI the packed row is the 8-bit
route's panels (cpu_gemm.c's int8_gemm / vnni_gemm; the default, $SPECSPLIT_CPU_INT8=0 for the
float32 route's packed blocks), labelled so.

    PYTHONPATH=. python bench/cpu_step.py [--context 200] [--rows 1 4] [--steps 30] \
        [--attention-by auto|query-head|kv-head|kv-head-split|rows-blocked] \
        [--kv-dtype float32 float16] [--variants "C layer, packed"]

--kv-dtype: the KV cache's dtype, each its own cache, in turn (float16: `--kv-dtype float16`'s
cache, which only the C layer and the torch layer read).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specsplit.model import cpu_gemm, cpu_layer, cpu_quant
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.step import build_forward_batch, causal_step

# name: ($SPECSPLIT_CPU_LAYER, $SPECSPLIT_CPU_QUANT)
VARIANTS = {
    "C layer, packed": ("1", "1"),
    "C layer, float32": ("1", "0"),
    "torch layer, float32": ("0", "0"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="tokens a step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps a turn")
    parser.add_argument("--turns", type=int, default=3, help="alternations of the two layers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--attention-by",
        choices=["auto", "query-head", "kv-head", "kv-head-split", "rows-blocked"],
        default="auto",
        help="the C layer's attention by query head (attend_row), by KV head (attend_block a "
        "row at a time) or by KV head with each row's keys split over the threads "
        "(attend_split) at any context and rows, or by blocks of a sequence's rows "
        "(attend_block) at any rows; auto: blocks of rows from 2 rows (cpu_layer.c's "
        "BLOCKED_FROM_ROWS), else by KV head (GROUPED_FROM_KEYS: at any length), split for "
        "one-row steps (SPLIT_ROWS)",
    )
    parser.add_argument(
        "--kv-dtype", nargs="+", choices=["float32", "float16"], default=["float32"]
    )
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), help="in turn"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.attention_by != "auto":
        cpu_layer.grouped_from(1 << 40 if args.attention_by == "query-head" else 0)
        cpu_layer.split_rows(1 << 40 if args.attention_by == "kv-head-split" else 0)
        cpu_layer.blocked_from(0 if args.attention_by == "rows-blocked" else 1 << 40)
    path = args.model or embedded_default_model_path()
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    page_size = 16
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, config.vocab_size, (args.context,), generator=gen).tolist()
    caches = {}
    for kv_dtype in args.kv_dtype:
        kv = make_kv_cache(config, -(-(args.context + max(args.rows)) // page_size) + 1,
                           page_size, getattr(torch, kv_dtype), "cpu")  # fmt: skip
        seq = kv.new_seq()
        kv.reserve(seq, args.context + max(args.rows))
        model(build_forward_batch([causal_step(seq, prompt, [args.context - 1])], page_size)[0], kv)
        seq.kv_committed_len = args.context
        caches[kv_dtype] = (kv, seq)
    times: dict[tuple[str, int], list[float]] = {}

    def label(variant: str, kv_dtype: str) -> str:  # a table column's
        return f"{variant}, {kv_dtype} cache" if len(caches) > 1 else variant

    names = [label(v, d) for v in args.variants for d in caches]
    for _ in range(args.turns):
        for variant in args.variants:
            os.environ["SPECSPLIT_CPU_LAYER"], os.environ["SPECSPLIT_CPU_QUANT"] = VARIANTS[variant]
            cpu_layer.switch.cache_clear()  # (each reads its variable once)
            cpu_quant.switch.cache_clear()
            for kv_dtype, (kv, seq) in caches.items():
                name = label(variant, kv_dtype)
                for rows in args.rows:
                    tokens = torch.randint(3, config.vocab_size, (rows,), generator=gen).tolist()
                    step = causal_step(seq, tokens, list(range(rows)))
                    for index in range(args.steps + 3):
                        start = time.perf_counter()
                        model(build_forward_batch([step], page_size)[0], kv)
                        if index >= 3:  # after warm-up
                            elapsed = time.perf_counter() - start
                            times.setdefault((name, rows), []).append(elapsed)
    route = "; packed = 4-bit / 8-bit panels, x as two 8-bit parts" if cpu_gemm.int8_route() else ""
    print(f"{path}, float32, {args.threads} threads, {args.context} tokens of context{route}")
    print("| rows | " + " | ".join(f"{name} ms" for name in names) + " | each / the first |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for rows in args.rows:
        ms = [statistics.median(times[(name, rows)]) * 1e3 for name in names]
        ratios = " / ".join(f"{m / ms[0]:.2f}x" for m in ms[1:])
        print(f"| {rows} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {ratios} |")


if __name__ == "__main__":
    main()
