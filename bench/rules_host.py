"""The host's share of a logit-rules round, on any machine (no device work): `bend_by_rules`
building the round's table with its launch (`bend_rows`) replaced by a no-op, and
`LogitRules.after` carrying a sequence's rules through a commit (the gateway and the verifier
each do it for every sequence every round). The rules are bench/gpu_engine.py's `--rules`: a
64-token bias, presence, frequency and repetition penalties, a 512-token prompt and an output
of `--distinct` distinct tokens; every round each sequence commits its chain's first draft and
a bonus token, so after the first round the kept rows only count those in (as served).
Prints the median ms a round over `--rounds` (after 5 warm-up rounds) per batch and chain.

    PYTHONPATH=. python bench/rules_host.py [--batch 1 32] [--n 0 8] [--distinct 256 3000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import verifier.round_rules as round_rules_module
from specsplit.logit_rules import LogitRules, Penalties, bias_of, distinct
from specsplit.messages import VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from verifier.kept_rules import keep_rules
from verifier.rounds import VerifierSeq
from verifier.rule_rows import RuleRows

VOCAB = 49152  # SmolLM2's


def _rules(rng: random.Random, num_distinct: int) -> LogitRules:
    output = sorted(rng.sample(range(3, VOCAB), num_distinct))
    bias = bias_of((rng.randrange(3, VOCAB), -5.0) for _ in range(64))
    penalties = Penalties(bias, presence=0.5, frequency=0.5, repetition=1.1)
    counts = tuple(1 + t % 3 for t in output)
    prompt = distinct(rng.randrange(3, VOCAB) for _ in range(512))
    return LogitRules(penalties, tuple(output), counts, prompt)


def time_rounds(batch: int, n: int, num_distinct: int, rounds: int) -> tuple[float, float]:
    """Median ms a round: the table's build, and every sequence's `after`."""
    rng = random.Random(0)
    rows_kept = RuleRows(VOCAB, "cpu")
    seqs = [VerifierSeq(f"s{i}", None) for i in range(batch)]  # type: ignore[arg-type]
    rules = [_rules(rng, num_distinct) for _ in range(batch)]
    logits = torch.zeros(batch * (n + 1), 1)  # (only its shape is read without the launch)
    built, carried = [], []
    for round_number in range(rounds + 5):
        inputs, rows = [], []
        for i in range(batch):
            tree = DraftTree([rng.randrange(VOCAB) for _ in range(n)], list(range(-1, n - 1)))
            item = VerifyInput(f"s{i}", False, 10, [4], tree, SamplingParams(), rules=rules[i])
            inputs.append(item)
            rows.append(range(i * (n + 1), (i + 1) * (n + 1)))
        start = time.perf_counter()
        round_rules_module.bend_by_rules(inputs, logits, rows, None, (rows_kept, seqs))
        middle = time.perf_counter()
        for i, item in enumerate(inputs):
            keep_rules(item, seqs[i], item.tree.tokens[:1] + [rng.randrange(VOCAB)])
            kept = seqs[i].rules
            assert kept is not None
            rules[i] = kept
        end = time.perf_counter()
        if round_number >= 5:
            built.append(middle - start)
            carried.append(end - middle)
    return 1e3 * statistics.median(built), 1e3 * statistics.median(carried)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--n", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--distinct", type=int, nargs="+", default=[256, 3000])
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    round_rules_module.bend_rows = lambda *_args, **_kwargs: None  # (the host's share alone)
    print("| batch | chain n | distinct output tokens | table build (ms) | commits' after (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        for n in args.n:
            for num_distinct in args.distinct:
                built, carried = time_rounds(batch, n, num_distinct, args.rounds)
                print(f"| {batch} | {n} | {num_distinct} | {built:.3f} | {carried:.3f} |")


if __name__ == "__main__":
    main()
