"""Where draft-ahead's guesses miss: for each round that had trees drafted ahead, the outcome
the verifier gave (k accepted drafts, then the bonus token) against the guesses made for it
(the draft's likeliest tokens at node k other than the chain's next one, in the drafter's
order). Runs the engines in one process (the embedded default and its shipped EAGLE-3 head, or
--model / --eagle3) with `--overlap ahead`, `--guesses` bonus tokens per accept length, greedy
unless --temperature, the bundled prompts one stream at a time; the hit rate does not depend
on the device, so the CPU serves.

Prints, for chain rounds: how often each accept length came, and how often the bonus token was
among the first g guesses at that length; the hit rate of every uniform number of guesses
(the gateway's --ahead-guesses) and of the best split of the same number of outcomes over the
accept lengths; for plain rounds (a miss run plain, --ahead-miss plain): how often the next
token was among the first g guesses.

    PYTHONPATH=. python bench/ahead_ranks.py [--guesses 8] [--max-new-tokens 96] [--prompts 8]
        [--temperature 0.7]

--temperature T: sampled streams (each prompt seeded by its index), whose chains are drawn and
whose bonus tokens are drawn from the target's residual distribution (or its own after a whole
chain): the guesses are the draft's likeliest tokens as for greedy ones.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable

import torch

from bench.acceptance import bundled_prompts
from gateway.request import GenerationRequest
from gateway.sequence import Sequence
from inprocess.stack import build_local_stack
from specsplit.messages import SamplingParams, SpecParams
from specsplit.model.embedded import embedded_default_head_path, embedded_default_model_path
from specsplit.model.loader import load_tokenizer
from specsplit.prompt import apply_chat_template
from specsplit.tree import DraftTree

# per round with trees drafted ahead: (chain length, k accepted, the bonus token's rank among
# the guesses at k or None), a plain round's chain length being 0
Outcome = tuple[int, int, int | None]


def rank_of(guessed: dict[tuple[int, ...], DraftTree], outcome: tuple[int, ...]) -> int | None:
    """The outcome's bonus token's place among the bonus tokens guessed after the same accepted
    drafts (the drafter's order), None when it was not guessed."""
    accepted, bonus = outcome[:-1], outcome[-1]
    same_length = [key[-1] for key in guessed if key[:-1] == accepted]
    return same_length.index(bonus) if bonus in same_length else None


def recording(outcomes: list[Outcome]) -> Callable[[Sequence], DraftTree | None]:
    """Sequence.take_ahead, recording each outcome's rank before it takes the tree."""
    take = Sequence.take_ahead

    def take_ahead(seq: Sequence) -> DraftTree | None:
        if seq.ahead and seq.ahead_round == seq.stats.rounds - 1:
            outcome = tuple(seq.tokens[seq.ahead_base :])
            chain_len = max(len(key) for key in seq.ahead) - 1
            outcomes.append((chain_len, len(outcome) - 1, rank_of(seq.ahead, outcome)))
        return take(seq)

    return take_ahead


def within(ranks: Counter[int], g: int) -> int:
    """Outcomes ranked among the first `g` guesses."""
    return sum(ranks[r] for r in range(g))


def best_split(
    hits: dict[int, Counter[int]], lengths: int, outcomes: int, rounds: int
) -> tuple[float, list[int]]:
    """The split of `outcomes` guesses over accept lengths 0..lengths-1 that hits most (by
    dynamic programming over the lengths): its hit rate and the guesses per length."""
    best: dict[int, tuple[int, list[int]]] = {0: (0, [])}  # outcomes used -> (hits, split)
    for k in range(lengths):
        cumulative = [within(hits[k], g) for g in range(outcomes + 1)]
        step: dict[int, tuple[int, list[int]]] = {}
        for used, (hit, split) in best.items():
            for g in range(outcomes - used + 1):
                total = (hit + cumulative[g], [*split, g])
                if used + g not in step or total[0] > step[used + g][0]:
                    step[used + g] = total
        best = step
    hit, split = max(best.values(), key=lambda entry: entry[0])
    return hit / max(rounds, 1), split


def report(outcomes: list[Outcome], guesses: int) -> None:
    chains = [o for o in outcomes if o[0] > 0]
    plains = [o for o in outcomes if o[0] == 0]
    hit = sum(o[2] is not None for o in outcomes) / max(len(outcomes), 1)
    print(f"rounds with trees drafted ahead: {len(outcomes)}, hit rate {hit:.3f}")
    if chains:
        lengths = max(o[0] for o in chains) + 1
        n = len(chains)
        by_k = Counter(k for _, k, _ in chains)
        hits: dict[int, Counter[int]] = {k: Counter() for k in range(lengths)}
        for _, k, rank in chains:
            if rank is not None:
                hits[k][rank] += 1
        print(f"chain rounds with trees drafted ahead: {n} (chains of up to {lengths - 1})")
        print(f"  k accepted | share | bonus among the first g guesses at k, g = 1..{guesses}")
        for k in range(lengths):
            count = by_k[k]
            cumulative = [within(hits[k], g) / max(count, 1) for g in range(1, 1 + guesses)]
            print(f"  {k:10d} | {count / n:5.2f} | " + " ".join(f"{c:.2f}" for c in cumulative))
        print("  hit rate, uniform guesses per length (--ahead-guesses g) and the best split of")
        print("  the same number of outcomes:")
        for g in range(1, guesses + 1):
            uniform = sum(within(hits[k], g) for k in range(lengths)) / n
            best, split = best_split(hits, lengths, g * lengths, n)
            print(f"    g = {g}: {uniform:.3f}; {g * lengths} outcomes split {split}: {best:.3f}")
    if plains:
        n = len(plains)
        ranks = Counter(rank for _, _, rank in plains if rank is not None)
        cumulative = [within(ranks, g) / n for g in range(1, 17)]
        print(f"plain rounds with trees drafted ahead: {n}; next token among the first g guesses,")
        print("  g = 1..16: " + " ".join(f"{c:.2f}" for c in cumulative))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="target checkpoint (default: embedded)")
    parser.add_argument("--eagle3", default=None, help="its EAGLE-3 head (default: shipped)")
    parser.add_argument("--guesses", type=int, default=8, help="bonus guesses per accept length")
    parser.add_argument("--ahead-miss", choices=("plain", "draft"), default="plain")
    parser.add_argument("--chain", type=int, default=3, help="draft chain length")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=8, help="bundled prompts, one at a time")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    path = args.model or embedded_default_model_path()
    head = args.eagle3 or embedded_default_head_path()
    tokenizer = load_tokenizer(path)
    spec = SpecParams(num_steps=args.chain, topk=1, num_draft_tokens=args.chain)
    stack = build_local_stack(
        path, "eagle3", tokenizer, spec, draft_path=head, dtype=dtype, overlap="ahead"
    )
    stack.scheduler.ahead_guesses = args.guesses
    stack.scheduler.ahead_miss = args.ahead_miss
    outcomes: list[Outcome] = []
    Sequence.take_ahead = recording(outcomes)  # type: ignore[method-assign,assignment]
    chats = [apply_chat_template(tokenizer, m) for m in bundled_prompts()][: args.prompts]
    print(
        f"model {path}, head {head}, chain {args.chain}, {args.guesses} guesses per accept "
        f"length, misses {args.ahead_miss}, {len(chats)} prompts one at a time x "
        f"{args.max_new_tokens} tokens, "
        + (f"temperature {args.temperature}" if args.temperature else "greedy")
        + f", CPU {args.dtype}"
    )
    for i, chat in enumerate(chats):
        sampling = SamplingParams(temperature=args.temperature, seed=i)
        stack.generate_all([GenerationRequest(chat, args.max_new_tokens, sampling)])
    report(outcomes, args.guesses)
    hits, misses = stack.scheduler.num_ahead_hits, stack.scheduler.num_ahead_misses
    print(f"the gateway's count: {hits} hits, {misses} misses")


if __name__ == "__main__":
    main()
