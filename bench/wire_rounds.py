"""The protobuf work of one speculative round, per batch size: each message of a Draft and a
Verify built from the dataclasses and serialized on one side, parsed and converted back on the
other (specsplit/convert.py), as the gateway and the services do every round. Synthetic rounds:
chains of --depth drafts, --rows target feature rows a sequence of --width each (EAGLE-3 on
SmolLM2: 3 x 576), greedy. Median us per round over --repeats passes of --calls rounds.
--beside: the rows beside the messages (wire_tensors.Beside, as the round lane sends them), not in
their tensor fields (as gRPC does). --sampled SUPPORT: sampled chains carrying their draft
distributions (DraftProbs) of SUPPORT tokens each node; --kept: each node's row keeping only
that many of them (each row crosses at its own width). --rules full: each Verify item carries
logit rules with their context (a 64-token bias, presence / frequency / repetition penalties,
256 distinct output tokens, a 512-token prompt: bench/gpu_engine.py --rules'), as a sequence's
first round does; --rules kept: the marker later rounds send once the verifier keeps the context
(verifier/kept_rules.py).

    PYTHONPATH=. python bench/wire_rounds.py [--batch 1 8 32] [--rows 4] [--width 1728]
        [--beside] [--sampled 256 [--kept 3 14 70]] [--rules full|kept]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from specsplit import convert, wire_tensors
from specsplit.logit_rules import LogitRules, Penalties, bias_of, distinct
from specsplit.messages import DraftInput, DraftOutput, SpecParams, VerifyInput, VerifyOutput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftProbs, DraftTree
from specsplit.v1 import drafter_pb2, verifier_pb2

VOCAB = 49152  # SmolLM2's


def per_call_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    fn()
    passes = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        passes.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(passes)


def round_messages(
    batch: int,
    depth: int,
    rows: int,
    width: int,
    support: int = 0,
    kept: list[int] | None = None,
    rules: str = "",
) -> dict[str, Any]:
    """A round's four messages' contents: the Draft and Verify inputs and outputs. support:
    sampled chains whose draft distributions have that many tokens of SmolLM2's 49152 (0:
    greedy); kept: node i's row keeps kept[i % len(kept)] of them, 0 past (None: all); rules:
    "full" or "kept" (the Verify items' logit rules; "": none)."""
    chain = DraftTree(list(range(10, 10 + depth)), list(range(-1, depth - 1)))
    sampling = SamplingParams()
    if support:
        q = torch.softmax(torch.randn(depth, VOCAB), dim=-1).topk(support, dim=-1)
        values = q.values.clone()
        for node in range(depth) if kept else ():
            values[node, kept[node % len(kept)] :] = 0  # type: ignore[index]
        # ragged, as the drafter's come (cut to each row's width inside its engine call)
        chain.draft_probs = DraftProbs(q.indices, values, VOCAB).as_ragged()
        sampling = SamplingParams(temperature=0.7)
    ids = [f"seq-{i:032x}" for i in range(batch)]
    answer = torch.randn(batch * rows, width).to(torch.bfloat16)  # one Verify's rows
    hidden = list(answer.split(rows))
    layers = (1, 2, 3)
    return {
        "draft_in": [
            DraftInput(s, False, 300, [7] * rows, SpecParams(depth, 1, depth), sampling, 300, h)
            for s, h in zip(ids, hidden, strict=True)
        ],
        "draft_out": [DraftOutput(s, chain, 300, layers) for s in ids],
        "verify_in": [
            VerifyInput(
                s,
                False,
                300,
                [7],
                chain,
                sampling,
                hidden_state_layers=layers,
                rules=_rules(i, rules),
            )
            for i, s in enumerate(ids)
        ],
        "verify_out": [
            VerifyOutput(s, chain.tokens[: rows - 1], 5, 304, h)
            for s, h in zip(ids, hidden, strict=True)
        ],
    }


def _rules(seed: int, kind: str) -> LogitRules | None:
    """A sequence's logit rules with their context ("full") or the kept marker ("kept")."""
    if not kind:
        return None
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (64 + 256 + 512,), generator=gen).tolist()
    output = sorted(set(tokens[64:320]))
    penalties = Penalties(bias_of((t, -5.0) for t in tokens[:64]), 0.5, 0.5, 1.1)
    counts = tuple(1 + t % 3 for t in output)
    full = LogitRules(penalties, tuple(output), counts, distinct(tokens[320:]))
    return full.kept_context() if kind == "kept" else full


def serialized(build: Callable[..., Any], beside: bool) -> tuple[bytes, Any]:
    """A message built and serialized, and a view of its rows' bytes beside it (`beside`;
    else None)."""
    if not beside:
        return build(None).SerializeToString(), None
    rows = wire_tensors.Beside()
    return build(rows).SerializeToString(), rows.data()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4, help="feature rows a sequence a round")
    parser.add_argument("--width", type=int, default=1728)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--beside", action="store_true", help="rows beside the messages")
    parser.add_argument(
        "--sampled",
        type=int,
        default=0,
        metavar="SUPPORT",
        help="sampled chains, draft distributions of SUPPORT tokens (the drafter's 256; 49152: "
        "the whole vocabulary, as sent before the cut); 0: greedy",
    )
    parser.add_argument(
        "--kept",
        type=int,
        nargs="+",
        default=None,
        help="with --sampled: node i's row keeps KEPT[i %% len] tokens, 0 past (the embedded "
        "SmolLM2's own rows at T = 0.7: 3 14 70 254 by quartile and p90)",
    )
    parser.add_argument(
        "--rules", choices=["full", "kept"], default="", help="the Verify items' logit rules"
    )
    args = parser.parse_args()
    print(
        f"| batch | Draft request out / in | Draft answer out / in | Verify request out / in "
        f"| Verify answer out / in | round total (us; {args.rows} rows x {args.width} a sequence) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        m = round_messages(
            batch, args.depth, args.rows, args.width, args.sampled, args.kept, args.rules
        )
        pairs = (
            (partial(convert.draft_request_to_proto, m["draft_in"]), drafter_pb2.DraftRequest,
             convert.draft_request_from_proto),
            (partial(convert.draft_response_to_proto, m["draft_out"], 1),
             drafter_pb2.DraftResponse, convert.draft_response_from_proto),
            (partial(convert.verify_request_to_proto, m["verify_in"]), verifier_pb2.VerifyRequest,
             convert.verify_request_from_proto),
            (partial(convert.verify_response_to_proto, m["verify_out"], 1),
             verifier_pb2.VerifyResponse, convert.verify_response_from_proto),
        )  # fmt: skip
        cells, total = [], 0.0
        for build, kind, read in pairs:
            wire, view = serialized(build, args.beside)
            rows = None if view is None else bytearray(view)  # as the lane reads them
            out = per_call_us(lambda b=build: serialized(b, args.beside), args.calls, args.repeats)
            back = per_call_us(
                lambda k=kind, r=read, w=wire, b=rows: r(k.FromString(w), b),
                args.calls,
                args.repeats,
            )
            cells.append(f"{out:.0f} / {back:.0f}")
            total += out + back
        print(f"| {batch} | " + " | ".join(cells) + f" | {total:.0f} |", flush=True)


if __name__ == "__main__":
    main()
