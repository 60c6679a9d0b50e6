"""The host's time for a steady logit-rules round on a GPU, bent eagerly (Triton launches) and by
its rules graph (verifier/rules_graphs.py), and a bare replay of that graph: no model, a
SmolLM2-sized vocabulary, bench/rules_host.py's rules (a 64-token bias, the three penalties,
a 512-token prompt), decode rounds (no tree) of each `--batch`, greedy, each sequence
committing one token a round. Median us a round over `--rounds` after 10 warm-up rounds, with
the device idle (synchronized after each round) and busy (a 2 ms sleep kernel queued first,
as a step run ahead leaves it).

    PYTHONPATH=. python bench/rules_graphs.py [--batch 1 32] [--rounds 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.rules_host import VOCAB, _rules
from specsplit.messages import VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from verifier.kept_rules import keep_rules
from verifier.round_rules import bend_by_rules
from verifier.rounds import VerifierSeq
from verifier.rule_rows import RuleRows
from verifier.rules_graphs import RulesGraphs


def time_rounds(batch: int, rounds: int, graphs: RulesGraphs | None, busy: bool) -> float:
    """Median us of host a round's `bend_by_rules` takes."""
    rng = random.Random(0)
    kept = RuleRows(VOCAB, "cuda")
    seqs = [VerifierSeq(f"s{i}", None) for i in range(batch)]  # type: ignore[arg-type]
    rules = [_rules(rng, 256) for _ in range(batch)]
    buffer = torch.randn(64, VOCAB, device="cuda")
    rows = [range(i, i + 1) for i in range(batch)]
    times = []
    for number in range(rounds + 10):
        inputs = [
            VerifyInput(f"s{i}", False, 10, [4], DraftTree(), SamplingParams(), rules=rules[i])
            for i in range(batch)
        ]
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(2_000_000)
        start = time.perf_counter()
        bend_by_rules(inputs, buffer[:batch], rows, None, (kept, seqs), graphs=graphs)
        end = time.perf_counter()
        if number >= 10:
            times.append(end - start)
        for i, item in enumerate(inputs):
            keep_rules(item, seqs[i], [rng.randrange(VOCAB)])
            kept_rules = seqs[i].rules
            assert kept_rules is not None
            rules[i] = kept_rules
    return 1e6 * statistics.median(times)


def time_replay(graphs: RulesGraphs, rounds: int) -> float:
    """Median us of host a bare replay of the last graph takes."""
    graph = next(reversed(graphs.graphs.values()))
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.graph.replay()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    print("| batch | device | eager (us) | graph (us) | bare replay (us) |")
    print("|---:|---|---:|---:|---:|")
    with torch.inference_mode():
        for batch in args.batch:
            for busy in (False, True):
                eager = time_rounds(batch, args.rounds, None, busy)
                graphs = RulesGraphs(torch.device("cuda"))
                graphed = time_rounds(batch, args.rounds, graphs, busy)
                bare = time_replay(graphs, args.rounds)
                state = "busy" if busy else "idle"
                print(f"| {batch} | {state} | {eager:.1f} | {graphed:.1f} | {bare:.1f} |")


if __name__ == "__main__":
    main()
