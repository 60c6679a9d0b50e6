"""Accepted tokens per round for candidate drafters on the bundled prompt set (greedy).

Runs the real engines in one process on the embedded default (or --model), all prompts as one
batch, and prints one row per drafter with the target-only run of the same process as baseline:

    python bench/acceptance.py --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

import torch

from gateway.request import GenerationRequest
from gateway.text import apply_chat_template
from specsplit.local import build_local_stack
from specsplit.messages import SpecParams
from specsplit.model.loader import embedded_default_model_path, load_model, load_tokenizer


def bundled_prompts() -> list[list[dict[str, str]]]:
    text = resources.files("specsplit").joinpath("data/prompts.jsonl").read_text()
    return [json.loads(line)["messages"] for line in text.splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="target checkpoint (default: embedded)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--self-layers", type=int, nargs="*", default=[4, 8, 16])
    parser.add_argument("--num-steps", type=int, nargs="*", default=[3, 5])
    args = parser.parse_args()

    path = args.model or embedded_default_model_path()
    tokenizer = load_tokenizer(path)
    target = load_model(path, dtype=torch.float32, device="cpu")
    prompts = [apply_chat_template(tokenizer, messages) for messages in bundled_prompts()]
    requests = [GenerationRequest(p, args.max_new_tokens) for p in prompts]

    configs: list[tuple[str, str, int | None, SpecParams]] = [
        ("target only", "ngram", None, SpecParams(0, 1, 0))
    ]
    for steps in args.num_steps:
        configs.append((f"n-gram chain {steps}", "ngram", None, SpecParams(steps, 1, steps)))
        for layers in args.self_layers:
            configs.append(
                (f"self {layers} layers chain {steps}", "self", layers, SpecParams(steps, 1, steps))
            )

    print(
        f"model {path}\n{len(prompts)} prompts, greedy, max_new_tokens {args.max_new_tokens}, "
        f"all prompts in one batch, CPU, torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'drafter':<28}{'accepted tokens/round':>22}{'tokens':>8}{'seconds':>9}"
        f"{'tokens/s':>10}{'vs target':>10}"
    )
    baseline_tps = None
    reference: list[list[int]] | None = None
    for name, kind, layers, spec in configs:
        stack = build_local_stack(path, kind, tokenizer, spec, draft_layers=layers, target=target)
        start = time.perf_counter()
        results = stack.generate_all(requests)
        seconds = time.perf_counter() - start
        outputs = [[t for chunk in chunks for t in chunk.token_ids] for chunks in results]
        if reference is None:
            reference = outputs
        same = "" if outputs == reference else "  OUTPUT DIFFERS FROM TARGET ONLY"
        rounds = sum(chunks[-1].stats.rounds for chunks in results if chunks[-1].stats)
        accepted = sum(
            chunks[-1].stats.num_accepted_tokens for chunks in results if chunks[-1].stats
        )
        tokens = sum(len(o) for o in outputs)
        tps = tokens / seconds
        baseline_tps = baseline_tps or tps
        print(
            f"{name:<28}{accepted / rounds:>22.3f}{tokens:>8}{seconds:>9.2f}{tps:>10.1f}"
            f"{tps / baseline_tps:>9.2f}x{same}"
        )


if __name__ == "__main__":
    main()
