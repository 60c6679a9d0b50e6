"""Draft-ahead's hit rate by the number of guessed bonus tokens: the real engines in one process
(the embedded default, or --model, with the shipped EAGLE-3 head), the bundled prompts as one
batch, greedy; serial rounds of the same process as the baseline.

    PYTHONPATH=. python bench/ahead_hits.py [--guesses 1 2 4] [--miss draft plain]
        [--max-new-tokens 64] [--spec 3] [--device cpu] [--model PATH] [--head DIR]

Prints per run: rounds, accepted tokens per round (accepted drafts + bonus), the hit rate
(rounds whose outcome had a tree drafted ahead, of the rounds with trees drafted ahead), the
trees drafted ahead per sequence and round ((chain length + 1) x guesses), the sequence-rounds
whose Verify waited for a Draft (misses drafted first; with --miss plain only each sequence's
first round: its misses are verified with no tree), and whether the tokens equal serial
rounds' (float32 on the CPU: they must).
"""

from __future__ import annotations

import argparse

import torch

from bench.acceptance import bundled_prompts
from gateway.adaptive import parse_ladder
from gateway.request import GenerationRequest
from inprocess.stack import build_local_stack, token_ids
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.loader import load_model, load_tokenizer
from specsplit.prompt import apply_chat_template


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--guesses", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--miss",
        nargs="+",
        choices=("draft", "plain"),
        default=["draft"],
        help="what a round not guessed does (the gateway's --ahead-miss), each run in turn",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--spec", default="3", help="a chain STEPS (draft-ahead drafts chains)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None)
    parser.add_argument("--head", default="specsplit/data/eagle3-smollm2")
    args = parser.parse_args()
    (spec,) = parse_ladder(args.spec)
    path = args.model or embedded_default_model_path()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    tokenizer = load_tokenizer(path)
    target = load_model(path, dtype=dtype, device=args.device)
    prompts = [apply_chat_template(tokenizer, m) for m in bundled_prompts()]
    requests = [GenerationRequest(p, args.max_new_tokens) for p in prompts]
    print(
        f"model {path}, head {args.head}, device {args.device}, chain {spec.num_steps}, "
        f"{len(requests)} prompts as one batch, {args.max_new_tokens} new tokens, greedy"
    )
    print(
        "| run | rounds | accepted/round | hit rate | trees ahead per round | Verifies after a"
        " Draft | same tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    baseline: list[list[int]] | None = None
    runs = [(0, "draft")] + [(g, miss) for miss in args.miss for g in args.guesses]
    for guesses, miss in runs:
        stack = build_local_stack(
            path,
            "eagle3",
            tokenizer,
            spec,
            draft_path=args.head,
            dtype=dtype,
            device=args.device,
            target=target,
            overlap="ahead" if guesses else "serial",
        )
        stack.scheduler.ahead_guesses = guesses
        stack.scheduler.ahead_miss = miss
        results = stack.generate_all(requests)
        outputs = [token_ids(chunks) for chunks in results]
        baseline = outputs if baseline is None else baseline
        rounds = sum(chunks[-1].stats.rounds for chunks in results if chunks[-1].stats)
        tokens = sum(map(len, outputs))
        hits, misses = stack.scheduler.num_ahead_hits, stack.scheduler.num_ahead_misses
        name = f"ahead, {guesses} guesses, misses {miss}" if guesses else "serial"
        rate = f"{hits / (hits + misses):.2f}" if hits + misses else "-"
        trees = (spec.num_steps + 1) * guesses if guesses else "-"
        # serial: every round; draft misses: every round but the hits; plain: first rounds
        waited = rounds if not guesses else len(requests) if miss == "plain" else rounds - hits
        print(
            f"| {name} | {rounds} | {tokens / max(rounds, 1):.2f} | {rate} | {trees} | {waited} "
            f"| {'yes' if outputs == baseline else 'no'} |"
        )


if __name__ == "__main__":
    main()
