"""The verifier's host work a decode step: rounds of --steps greedy decode steps at each
--batch (VerifyInput.decode_steps, decode ahead on: the engine's further-step loop, the step
run ahead, the commit), with the model's forward replaced by a stub that returns fixed logits
(LABELLED: no forward runs), so the median ms a step is the bookkeeping alone: building each
step's batch, reserving pages, the acceptance's inputs, the commit. On a GPU the step run ahead
leaves the host one device step to do all this (the device idles where the host is slower);
this measures it on any machine, the CPU included.

--chain K: a speculative round's instead, ms a round: each sequence's bonus token and a chain of
K drafts (the last one rejected), its hidden states of --layers wanted as an EAGLE drafter asks
(none: --layers with no values); the tree's batch, its acceptance, the hidden rows and the commit.

    PYTHONPATH=. python bench/decode_host.py [--batch 8 32 64] [--steps 16] [--rounds 20]
        [--chain 3] [--layers 0 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.support import save_tiny_llama
from verifier.engine import VerifierEngine
from verifier.rounds import decode_step

PROMPT_LEN = 20


def engine_with_stub(directory: Path, max_batch: int) -> VerifierEngine:
    """A CPU engine on a tiny random checkpoint whose forward is a stub: every row's logits
    favour token 7 (so every step's bonus token is known, and the acceptance runs as usual)."""
    model, config = load_model(str(save_tiny_llama(directory, seed=1)), torch.float32, "cpu")
    kv = make_kv_cache(config, 64 * max_batch, 16, torch.float32, "cpu")
    engine = VerifierEngine(model, kv, 2048, config.vocab_size, decode_ahead=True)
    vocab, width = config.vocab_size, config.hidden_size

    def stub(batch: ForwardBatch, kv: object, aux_layers: tuple[int, ...] = ()) -> ForwardOutput:
        logits = torch.zeros(batch.logit_indices.shape[0], vocab)
        logits[:, 7] = 1.0
        hidden = None
        if aux_layers:  # the rows asked for, zeros
            rows = batch.hidden_indices if batch.hidden_indices is not None else batch.logit_indices
            hidden = torch.zeros(rows.shape[0], len(aux_layers) * width)
        return ForwardOutput(logits=logits, hidden_states=hidden)

    engine.model = stub  # type: ignore[assignment]
    return engine


def _begin(
    engine: VerifierEngine, batch: int, layers: tuple[int, ...] = ()
) -> tuple[list[str], list[VerifyOutput]]:
    """`batch` sequences' prompts verified: their ids and first results."""
    greedy = SamplingParams()
    ids = [f"b{batch}-{i}" for i in range(batch)]
    prompts = [[(7 * i + j) % 250 + 1 for j in range(PROMPT_LEN)] for i in range(batch)]
    begin = zip(ids, prompts, strict=True)
    items = [VerifyInput(s, True, 0, p, DraftTree(), greedy, layers) for s, p in begin]
    return ids, engine.verify(items)


def ms_a_step(engine: VerifierEngine, batch: int, steps: int, rounds: int) -> float:
    """Median host ms a decode step over `rounds` rounds of `steps` steps at `batch`."""
    greedy = SamplingParams()
    ids, outs = _begin(engine, batch)
    times = []
    for r in range(rounds + 3):  # three rounds to warm up
        start = time.perf_counter()
        outs = engine.verify(
            [
                decode_step(s, o.kv_committed_len, o.bonus_token, greedy, steps)
                for s, o in zip(ids, outs, strict=True)
            ]
        )
        if r >= 3:
            times.append((time.perf_counter() - start) / steps)
    engine.release(ids)
    return 1e3 * statistics.median(times)


def ms_a_chain_round(
    engine: VerifierEngine, batch: int, chain: int, layers: tuple[int, ...], rounds: int
) -> float:
    """Median host ms a speculative round over `rounds` rounds at `batch`: each sequence's
    bonus token and a chain of `chain` drafts, all but the last the stub's token (accepted),
    hidden states of `layers` wanted."""
    greedy = SamplingParams()
    ids, outs = _begin(engine, batch, layers)
    tree = DraftTree([7] * (chain - 1) + [5], list(range(-1, chain - 1)))
    times = []
    for r in range(rounds + 3):  # three rounds to warm up
        start = time.perf_counter()
        outs = engine.verify(
            [
                VerifyInput(s, False, o.kv_committed_len, [o.bonus_token], tree, greedy, layers)
                for s, o in zip(ids, outs, strict=True)
            ]
        )
        if r >= 3:
            times.append(time.perf_counter() - start)
    engine.release(ids)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--steps", type=int, default=16, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--chain", type=int, default=0, help="drafts a speculative round")
    parser.add_argument("--layers", type=int, nargs="*", default=[0, 1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers = tuple(args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        engine = engine_with_stub(Path(tmp), max(args.batch))
        if args.chain:
            print(
                f"verifier host ms a speculative round (chain of {args.chain}, hidden states of "
                f"layers {list(layers)}), FORWARD STUBBED (bookkeeping only), CPU"
            )
        else:
            print("verifier host ms a decode step, FORWARD STUBBED (bookkeeping only), CPU")
        for batch in args.batch:
            if args.chain:
                ms = ms_a_chain_round(engine, batch, args.chain, layers, args.rounds)
                print(f"batch {batch:3d}: {ms:.3f} ms a round")
            else:
                ms = ms_a_step(engine, batch, args.steps, args.rounds)
                print(f"batch {batch:3d}: {ms:.3f} ms a step ({args.steps} steps a round)")


if __name__ == "__main__":
    main()
