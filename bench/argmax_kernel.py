"""Greedy decoding's argmax on a GPU, inside CUDA graphs: `torch.argmax` (one block a row)
against `specsplit.kernels.argmax.argmax_rows` (chunks of a row over many programs, then one
program a row) at several chunk sizes, bf16 logits of SmolLM2's vocabulary (49152) and its
EAGLE-3 head's (32000), rows 1 / 8 / 32. A graph holds `--calls` calls, each on logits of its
own (so that they come from HBM or L2 as after a step's lm_head, not from L1), timed by
bench/attention_kernel.py's `time_in_graph` (CUDA events, the median over `--replays` divided by
the calls).
Prints us a call and whether every result equals torch.argmax's.

    PYTHONPATH=. python bench/argmax_kernel.py [--replays 50] [--calls 20]
"""

from __future__ import annotations

import argparse

import torch

from bench.attention_kernel import time_in_graph
from specsplit.kernels.argmax import argmax_rows

CHUNKS = (512, 1024, 2048, 4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, bf16, us a call (median of {args.replays} replays)")
    print("| vocab | rows | torch.argmax | " + " | ".join(f"chunk {c}" for c in CHUNKS) + " |")
    print("|---:|---:|---:|" + "---:|" * len(CHUNKS))
    for vocab in (49152, 32000):
        for rows in (1, 8, 32):
            inputs = [torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
                      for _ in range(args.calls)]  # fmt: skip
            want = [torch.empty(rows, dtype=torch.int64, device="cuda") for _ in inputs]
            calls = [
                lambda x=x, o=o: torch.argmax(x, dim=-1, out=o)
                for x, o in zip(inputs, want, strict=True)
            ]
            cells = [f"{time_in_graph(calls, args.replays):.1f}"]
            for chunk in CHUNKS:
                got = [torch.empty_like(o) for o in want]
                calls = [
                    lambda x=x, o=o, c=chunk: argmax_rows(x, out=o, chunk=c)
                    for x, o in zip(inputs, got, strict=True)
                ]
                us = time_in_graph(calls, args.replays)
                same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
                cells.append(f"{us:.1f}{'' if same else ' (differs!)'}")
            print(f"| {vocab} | {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
