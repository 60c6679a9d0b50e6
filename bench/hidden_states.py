"""What carrying EAGLE-3 hidden states costs a round: bytes on the wire and time.

The verifier engine (embedded default, or --model) runs one tree round for a batch of the
bundled chat prompts, with and without the head's hidden_state_layers. Each sequence's draft is
a chain of the target's own next --depth greedy tokens, so every draft is accepted and the round
returns the most rows it can (1 pending + depth accepted). The rows then go through what the
services do with them: the Verify response is serialized and parsed (verifier -> gateway), and
the Draft request carrying them is serialized and parsed (gateway -> drafter).

    PYTHONPATH=. python bench/hidden_states.py [--depth 5] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.acceptance import bundled_prompts
from specsplit import convert
from specsplit.messages import DraftInput, SpecParams, VerifyInput
from specsplit.model.config import default_aux_layers
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model, load_tokenizer
from specsplit.prompt import apply_chat_template
from specsplit.tree import DraftTree
from verifier.engine import VerifierEngine


def greedy_continuations(
    engine: VerifierEngine, prompts: list[list[int]], n: int
) -> list[list[int]]:
    """The target's next n + 1 greedy tokens after each prompt (target-only rounds)."""
    ids = [f"greedy-{i}" for i in range(len(prompts))]
    pending = [list(p) for p in prompts]
    committed = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    for round_ in range(n + 1):
        inputs = [
            VerifyInput(ids[i], round_ == 0, committed[i], pending[i], DraftTree())
            for i in range(len(prompts))
        ]
        for i, result in enumerate(engine.verify(inputs)):
            out[i].append(result.bonus_token)
            committed[i] = result.kv_committed_len
            pending[i] = [result.bonus_token]
    engine.release(ids)
    return out


def one_round(
    engine: VerifierEngine,
    prompts: list[list[int]],
    chains: list[list[int]],
    layers: tuple[int, ...],
    tag: str,
) -> tuple[float, float, int, int]:
    """(verify seconds, conversion seconds, Verify response bytes, Draft request bytes)."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    prefill = [
        VerifyInput(ids[i], True, 0, prompts[i], DraftTree(), hidden_state_layers=layers)
        for i in range(len(prompts))
    ]
    engine.verify(prefill)
    inputs = [
        VerifyInput(
            ids[i],
            False,
            len(prompts[i]),
            [chains[i][0]],
            DraftTree(chains[i][1:], list(range(-1, len(chains[i]) - 2))),
            hidden_state_layers=layers,
        )
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    outputs = engine.verify(inputs)
    verify_s = time.perf_counter() - start
    assert all(o.num_accepted_drafts == len(c) - 1 for o, c in zip(outputs, chains, strict=True))
    start = time.perf_counter()
    response = convert.verify_response_to_proto(outputs, 0).SerializeToString()
    parsed = convert.verify_response_from_proto(
        convert.verifier_pb2.VerifyResponse.FromString(response)
    )
    drafts = [
        DraftInput(
            ids[i],
            False,
            len(prompts[i]),
            [chains[i][0], *chains[i][1:], o.bonus_token],
            SpecParams(5, 1, 5),
            target_hidden_states=o.hidden_states,
        )
        for i, o in enumerate(parsed)
    ]
    request = convert.draft_request_to_proto(drafts).SerializeToString()
    convert.draft_request_from_proto(convert.drafter_pb2.DraftRequest.FromString(request))
    convert_s = time.perf_counter() - start
    engine.release(ids)
    return verify_s, convert_s, len(response), len(request)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    path = args.model or embedded_default_model_path()
    tokenizer = load_tokenizer(path)
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    engine = VerifierEngine(
        model, make_kv_cache(config, 4096, 16, torch.float32, "cpu"), 8192, config.vocab_size
    )
    prompts = [apply_chat_template(tokenizer, m) for m in bundled_prompts()]
    chains = greedy_continuations(engine, prompts, args.depth)
    layers = default_aux_layers(config.num_layers)
    rows = len(prompts) * (1 + args.depth)
    print(
        f"{len(prompts)} sequences, one round of 1 pending + {args.depth} accepted drafts each "
        f"({rows} rows), layers {layers}, hidden {config.hidden_size}, CPU fp32, median of "
        f"{args.repeats}"
    )
    print(f"{'hidden states':<15}{'verify ms':>10}{'convert ms':>11}{'Verify B':>10}{'Draft B':>9}")
    configs = (("none", ()), ("EAGLE-3", layers))
    runs: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name, _ in configs}
    for r in range(args.repeats):  # alternate, so drift on the machine hits both alike
        for name, aux in configs:
            runs[name].append(one_round(engine, prompts, chains, aux, f"{name}{r}"))
    base = None
    for name, _ in configs:
        verify_ms = statistics.median(r[0] for r in runs[name]) * 1e3
        convert_ms = statistics.median(r[1] for r in runs[name]) * 1e3
        response, request = runs[name][0][2], runs[name][0][3]
        base = base or (verify_ms, convert_ms, response, request)
        print(f"{name:<15}{verify_ms:>10.1f}{convert_ms:>11.2f}{response:>10}{request:>9}")
    assert base is not None
    added = (response - base[2] + request - base[3]) / rows
    print(
        f"added per accepted token: {added:.0f} bytes on the wire (both hops); "
        f"round time {verify_ms + convert_ms - base[0] - base[1]:+.1f} ms for {rows} rows"
    )


if __name__ == "__main__":
    main()
