"""A prompt's prefill on the CPU in process: the embedded default (or --model) prefills N random
tokens in one forward, the C layer's attention by blocks of the prompt's rows (cpu_layer.c's
attend_block, the default) and by rows alone (attend_row, or by KV head past 2,048 keys), in
turn in one process, the median seconds of each and their ratio.

    PYTHONPATH=. python bench/cpu_prefill.py [--tokens 256 1000 3000] [--turns 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specsplit.model import cpu_layer
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.step import build_forward_batch, causal_step

# name: cpu_layer.blocked_from's setting
MODES = {"blocks of rows": 2, "rows alone": 1 << 40}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1000, 3000])
    parser.add_argument("--turns", type=int, default=2, help="alternations of the two modes")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or embedded_default_model_path()
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    page_size = 16
    gen = torch.Generator().manual_seed(0)
    print(f"{path}, float32, {args.threads} threads; a prompt's prefill, seconds (median)")
    print("| tokens | " + " | ".join(MODES) + " | blocks / alone |")
    print("|---:|---:|---:|---:|")
    was = cpu_layer.blocked_from(2)
    try:
        for n in args.tokens:
            kv = make_kv_cache(config, n // page_size + 2, page_size, torch.float32, "cpu")
            prompt = torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()
            times: dict[str, list[float]] = {name: [] for name in MODES}
            for _ in range(args.turns):
                for name, rows in MODES.items():
                    cpu_layer.blocked_from(rows)
                    seq = kv.new_seq()
                    kv.reserve(seq, n)
                    batch = build_forward_batch([causal_step(seq, prompt, [n - 1])], page_size)[0]
                    start = time.perf_counter()
                    model(batch, kv)
                    times[name].append(time.perf_counter() - start)
                    kv.release(seq)
            s = [statistics.median(times[name]) for name in MODES]
            print(f"| {n} | " + " | ".join(f"{x:.3f}" for x in s) + f" | {s[0] / s[1]:.2f}x |")
    finally:
        cpu_layer.blocked_from(was)


if __name__ == "__main__":
    main()
