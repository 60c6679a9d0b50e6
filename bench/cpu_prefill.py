"""A prompt's prefill on the CPU in process: the embedded default (or --model) prefills N random
tokens in one forward (or in --chunk tokens a forward, as `--prefill-chunk` serves it), the C
layer's attention by blocks of the prompt's rows with each block's keys across the lanes
(cpu_layer.c's attend_block with keys_across / scores_across / weigh_across, the default), by
blocks pair by pair (scores16 / weigh16 for each (row, head)), and by rows alone (attend_row;
--modes picks), in turn in one process, the median seconds of each and their ratio to the
first; the same logits asserted.

    PYTHONPATH=. python bench/cpu_prefill.py [--tokens 256 1000 3000] [--turns 2] [--chunk 512]
        [--modes across pairs rows]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specsplit.kv_cache import KVCache, SeqKV
from specsplit.model import cpu_layer
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model
from specsplit.step import build_forward_batch, causal_step

NEVER = 1 << 40
# name: (cpu_layer.blocked_from, across_from, weigh_across_from); "across" (None): cpu_layer.c's
# own settings, read at the start
MODES: dict[str, tuple[int, int, int] | None] = {
    "across": None,
    "pairs": (2, NEVER, NEVER),
    "rows": (NEVER, NEVER, NEVER),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1000, 3000])
    parser.add_argument("--turns", type=int, default=2, help="alternations of the two modes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--chunk", type=int, default=0, help="tokens a forward (0: the whole prompt in one)"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="across: blocks of rows, keys across the lanes; pairs: blocks of rows, each (row, "
        "head) alone; rows: each row alone",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or embedded_default_model_path()
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    page_size = 16
    gen = torch.Generator().manual_seed(0)
    chunk = f", {args.chunk} tokens a forward" if args.chunk else ""
    print(f"{path}, float32, {args.threads} threads{chunk}; a prompt's prefill, seconds (median)")
    print(
        "| tokens | "
        + " | ".join(args.modes)
        + " | "
        + " | ".join(f"{m} / {args.modes[0]}" for m in args.modes[1:])
        + " |"
    )
    print("|---:" * (2 * len(args.modes)) + "|")
    was = _settings((2, NEVER, NEVER))
    modes = {name: values or was for name, values in MODES.items()}
    try:
        for n in args.tokens:
            kv = make_kv_cache(config, n // page_size + 2, page_size, torch.float32, "cpu")
            prompt = torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()
            times: dict[str, list[float]] = {name: [] for name in args.modes}
            logits: dict[str, torch.Tensor] = {}
            for turn in range(args.turns):
                order = args.modes if turn % 2 == 0 else args.modes[::-1]
                for name in order:
                    _settings(modes[name])
                    seq = kv.new_seq()
                    kv.reserve(seq, n)
                    start = time.perf_counter()
                    logits[name] = _prefill(model, kv, seq, prompt, args.chunk or n, page_size)
                    times[name].append(time.perf_counter() - start)
                    kv.release(seq)
            first = logits[args.modes[0]]
            assert all(torch.equal(first, other) for other in logits.values())
            s = [statistics.median(times[name]) for name in args.modes]
            ratios = " | ".join(f"{x / s[0]:.2f}x" for x in s[1:])
            print(f"| {n} | " + " | ".join(f"{x:.3f}" for x in s) + f" | {ratios} |")
    finally:
        _settings(was)


def _settings(values: tuple[int, int, int]) -> tuple[int, int, int]:
    """cpu_layer's blocked_from, across_from and weigh_across_from set; what they were."""
    return (
        cpu_layer.blocked_from(values[0]),
        cpu_layer.across_from(values[1]),
        cpu_layer.weigh_across_from(values[2]),
    )


def _prefill(
    model: LlamaModel, kv: KVCache, seq: SeqKV, prompt: list[int], chunk: int, page_size: int
) -> torch.Tensor:
    """The prompt's forwards, `chunk` tokens each; the last one's logits."""
    done, logits = 0, None
    while done < len(prompt):
        part = prompt[done : done + chunk]
        batch = build_forward_batch([causal_step(seq, part, [len(part) - 1])], page_size)[0]
        logits = model(batch, kv).logits
        done += len(part)
        seq.kv_committed_len = done
    assert logits is not None
    return logits


if __name__ == "__main__":
    main()
