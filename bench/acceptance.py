"""Accepted tokens per round for candidate drafters on the bundled prompt set (greedy, or
sampled with --temperature: each request seeded by its index; outputs then differ from the
target-only run's, only their law is the same).

Runs the real engines in one process on the embedded default (or --model), all prompts as one
batch, and prints one row per drafter and draft shape with the target-only run of the same
process as baseline:

    python bench/acceptance.py --max-new-tokens 64

--adaptive adds, per drafter, a fixed row for every rung of --ladder and an adaptive
speculation row (gateway/adaptive.py) that starts on --start:

    python bench/acceptance.py --adaptive --self-layers --eagle3 HEAD_DIR --device cuda

A sampled chain's drafts come from the draft distribution cut to its DRAFT_SUPPORT likeliest
tokens (specsplit/tree.py), a size the verifier's acceptance graphs are captured for: it is not a
knob here (--draft-support, until the sixty-sixth session, had set a name no code read since the
constant moved out of drafter/tree_draft.py).
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources
from pathlib import Path

import torch

from gateway.adaptive import DEFAULT_LADDER, build_ladder, format_ladder, parse_ladder
from gateway.request import GenerationRequest
from inprocess.stack import accepted_tokens_per_round, build_local_stack, token_ids
from specsplit.messages import SpecParams
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.loader import load_model, load_tokenizer
from specsplit.prompt import apply_chat_template
from specsplit.sampling import SamplingParams

PROMPT_SETS = ("chat", "grounded")


def bundled_prompts(kind: str = "chat") -> list[list[dict[str, str]]]:
    """The chats of a bundled prompt set: "chat", the package's evaluation prompts (questions,
    little to copy), or "grounded", bench/data's edits of text or code given in the prompt
    (reformat, rename, fix spelling: much of the answer copies the prompt, where prompt lookup
    drafts well)."""
    if kind == "chat":
        text = resources.files("specsplit").joinpath("data/prompts.jsonl").read_text()
    else:
        assert kind == "grounded", kind
        text = (Path(__file__).parent / "data" / "grounded_prompts.jsonl").read_text()
    return [json.loads(line)["messages"] for line in text.splitlines() if line.strip()]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="target checkpoint (default: embedded)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--self-layers", type=int, nargs="*", default=[4, 8, 16])
    parser.add_argument("--eagle3", default=None, help="an EAGLE-3 head for --model: its rows")
    parser.add_argument("--num-steps", type=int, nargs="*", default=[3, 5])
    parser.add_argument("--adaptive", action="store_true", help="adaptive vs the ladder's rungs")
    parser.add_argument("--ladder", default=DEFAULT_LADDER, help="rungs STEPS[xTOPK[xNODES]],...")
    parser.add_argument("--start", default="3", help="the rung adaptive sequences start on")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    return parser.parse_args()


Row = tuple[str, str, int | None, SpecParams, bool]  # name, drafter kind, layers, spec, adaptive


def label(spec: SpecParams) -> str:
    return f"chain {spec.num_steps}" if spec.topk == 1 else f"tree {format_ladder([spec])}"


def rows(args: argparse.Namespace, ladder: tuple[SpecParams, ...], start: SpecParams) -> list[Row]:
    drafters: list[tuple[str, str, int | None]] = [("n-gram", "ngram", None)]
    drafters += [(f"self {layers} layers", "self", layers) for layers in args.self_layers]
    if args.eagle3:
        drafters.append(("eagle3", "eagle3", None))
    shapes = ladder if args.adaptive else [SpecParams(s, 1, s) for s in args.num_steps]
    out: list[Row] = [("target only", "ngram", None, SpecParams(0, 1, 0), False)]
    for name, kind, layers in drafters:
        for spec in shapes:
            out.append((f"{name} {label(spec)}", kind, layers, spec, False))
        if args.adaptive:
            out.append((f"{name} adaptive", kind, layers, start, True))
    return out


def main() -> None:
    args = parse_args()
    (start,) = parse_ladder(args.start)
    ladder = build_ladder(start, parse_ladder(args.ladder))
    path = args.model or embedded_default_model_path()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    tokenizer = load_tokenizer(path)
    target = load_model(path, dtype=dtype, device=args.device)
    prompts = [apply_chat_template(tokenizer, messages) for messages in bundled_prompts()]
    requests = [
        GenerationRequest(
            p, args.max_new_tokens, SamplingParams(args.temperature, seed=args.seed + i)
        )
        for i, p in enumerate(prompts)
    ]
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"

    print(
        f"model {path}\n{len(prompts)} prompts, {mode}, max_new_tokens {args.max_new_tokens}, "
        f"all prompts in one batch, {args.device} {dtype}, torch threads {torch.get_num_threads()}"
    )
    if args.adaptive:
        print(f"adaptive: ladder {format_ladder(ladder)}, starting on {args.start}")
    print(
        f"{'drafter':<28}{'accepted tokens/round':>22}{'tokens':>8}{'seconds':>9}"
        f"{'tokens/s':>10}{'vs target':>10}"
    )
    baseline_tps = None
    reference: list[list[int]] | None = None
    for name, kind, layers, spec, adaptive in rows(args, ladder, start):
        stack = build_local_stack(
            path,
            kind,
            tokenizer,
            spec,
            draft_path=args.eagle3 if kind == "eagle3" else None,
            draft_layers=layers,
            dtype=dtype,
            device=args.device,
            target=target,
            adaptive_spec=adaptive,
            adaptive_rungs=ladder,
        )
        start_s = time.perf_counter()
        results = stack.generate_all(requests)
        seconds = time.perf_counter() - start_s
        outputs = [token_ids(chunks) for chunks in results]
        if reference is None:
            reference = outputs
        same = (
            "" if outputs == reference or args.temperature else "  OUTPUT DIFFERS FROM TARGET ONLY"
        )
        tokens = sum(len(o) for o in outputs)
        tps = tokens / seconds
        baseline_tps = baseline_tps or tps
        print(
            f"{name:<28}{accepted_tokens_per_round(results):>22.3f}{tokens:>8}{seconds:>9.2f}{tps:>10.1f}"
            f"{tps / baseline_tps:>9.2f}x{same}"
        )


if __name__ == "__main__":
    main()
