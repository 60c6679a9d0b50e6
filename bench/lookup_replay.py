"""Replay the target's own greedy answers through the verifier's prompt lookup (`TokenHistory`,
specsplit/lookup.py): per minimum match length, the steps a lookup round would take (those with
a chain), the tokens a step, the chain tokens drafted a step, and how many of them the answer
accepted, by the length of the match that found them. Generates the answers first (the real
engines in one process, the embedded default or --model), on the CPU unless --device.

    PYTHONPATH=. python bench/lookup_replay.py --prompts chat grounded --max-new-tokens 128 \\
        --min-ngram 1 2 3 --lookup 3
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from bench.acceptance import PROMPT_SETS, bundled_prompts
from inprocess.stack import build_local_stack, requests_for, token_ids
from specsplit.lookup import MAX_NGRAM, TokenHistory
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.loader import load_tokenizer
from specsplit.prompt import apply_chat_template
from specsplit.spec_params import SpecParams


def match_length(tokens: list[int], min_ngram: int) -> int:
    """The longest suffix of `tokens` (MAX_NGRAM down to min_ngram) that occurred before: what
    TokenHistory's chain follows (0: none)."""
    for n in range(min(MAX_NGRAM, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        if any(tokens[s : s + n] == suffix for s in range(len(tokens) - n)):
            return n
    return 0


def replay(pairs: list[tuple[list[int], list[int]]], min_ngram: int, lookup: int) -> str:
    steps = chained = drafted = accepted = 0
    by_match: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # drafted, accepted
    for prompt, answer in pairs:
        history = TokenHistory(min_ngram)
        history.put(0, prompt)
        t = 0  # answer[t] is the step's pending token
        while t < len(answer) - 1:
            position = len(prompt) + t
            chain = history.chain(position, answer[t], lookup)
            took = 0
            while took < len(chain) and t + 1 + took < len(answer):
                if chain[took] != answer[t + 1 + took]:
                    break
                took += 1
            if chain:
                chained += 1
                n = match_length([*prompt, *answer[: t + 1]], min_ngram)
                by_match[n][0] += len(chain)
                by_match[n][1] += took
            steps, drafted, accepted = steps + 1, drafted + len(chain), accepted + took
            history.put(position, answer[t : t + took + 1])
            t += took + 1
    matches = ", ".join(f"{n}: {a}/{d}" for n, (d, a) in sorted(by_match.items()))
    return (
        f"min {min_ngram}: {steps} steps ({chained} with a chain), "
        f"{(accepted + steps) / steps:.3f} tokens a step, "
        f"{drafted / steps:.2f} drafted a step; accepted/drafted by match length {matches}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="target checkpoint (default: embedded)")
    parser.add_argument("--prompts", nargs="+", choices=PROMPT_SETS, default=list(PROMPT_SETS))
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--min-ngram", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--lookup", type=int, default=3, help="chain length (--decode-lookup)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    path = args.model or embedded_default_model_path()
    tokenizer = load_tokenizer(path)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    for kind in args.prompts:
        chats = bundled_prompts(kind)[: args.num_prompts]
        prompts = [apply_chat_template(tokenizer, messages) for messages in chats]
        stack = build_local_stack(
            path, "ngram", tokenizer, SpecParams(), dtype=dtype, device=args.device
        )
        answers = [
            token_ids(c) for c in stack.generate_all(requests_for(prompts, args.max_new_tokens))
        ]
        print(f"{kind}: {len(prompts)} prompts, {sum(map(len, answers))} tokens")
        for min_ngram in args.min_ngram:
            print("  " + replay(list(zip(prompts, answers, strict=True)), min_ngram, args.lookup))


if __name__ == "__main__":
    main()
