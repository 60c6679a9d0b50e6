"""Guided decoding's and logit rules' cost in process (inprocess/stack.py on the embedded GGUF,
or --model): the same chat prompts generated plain, under a JSON schema (response_format), a
regex and allowed token ids, and (--rules) under presence and frequency penalties and under a
repetition penalty, each greedy and one request at a time; per mode ms a round, tokens a round
and tokens/s, the plain rounds in the same run. The drafter bends its drafts by the rules
(drafter/draft_rules.py) but not by a guide, so tokens a round says what each costs
speculation. Each
mode runs --passes times and the first pass (a guide's compile and its states' first masks) is
reported apart from the rest.

    PYTHONPATH=. python bench/guided.py [--model PATH] [--device cuda]
        [--drafter ngram|self|eagle3] [--rules] [--max-new-tokens 48] [--passes 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gateway.guides import GuideAsk
from gateway.request import GenerationRequest, ModelInfo, build_request
from inprocess.stack import build_local_stack
from specsplit.logit_rules import Penalties
from specsplit.messages import SpecParams
from specsplit.model.embedded import embedded_default_head_path, embedded_default_model_path
from specsplit.model.loader import load_config, load_tokenizer
from specsplit.sampling import SamplingParams

PROMPTS = [
    "Describe a fictional person with a name, an age and two hobbies, as JSON.",
    "Name a big city and its population, as JSON.",
    "Give a book title, its author and the year it came out, as JSON.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "value": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "value"],
}
MODES = {
    "plain": {},
    "json schema": {"guide": GuideAsk("response_format", "json_schema", json.dumps(SCHEMA))},
    "regex": {"guide": GuideAsk("guided_regex", "regex", r"[A-Z][a-z]+( [a-z]+){2,12}\.")},
    "allowed ids": {"allowed_token_ids": list(range(17, 2000))},
}
RULES = {  # (--rules)
    "presence 0.5 + frequency 0.5": {"penalties": Penalties(presence=0.5, frequency=0.5)},
    "repetition 1.3": {"penalties": Penalties(repetition=1.3)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target (default: the embedded GGUF)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--drafter", default="ngram", choices=["ngram", "self", "eagle3"])
    parser.add_argument("--rules", action="store_true", help="the logit rules' modes too")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    path = args.model or embedded_default_model_path()
    tokenizer = load_tokenizer(path)
    config = load_config(path)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    drafter = {"self": "model", "eagle3": "eagle3"}.get(args.drafter, "ngram")
    head = embedded_default_head_path() if args.drafter == "eagle3" else None
    stack = build_local_stack(
        path, drafter, tokenizer, SpecParams(3, 1, 3), draft_path=head, device=args.device,
        dtype=dtype,
    )  # fmt: skip
    eos = config.eos_token_ids or (tokenizer.eos_token_id,)
    model = ModelInfo(tokenizer, config.vocab_size, 4096, tuple(eos))
    print(f"{path} on {args.device}, drafter {args.drafter}, greedy, one request at a time")
    print("| mode | pass | ms a round | tokens a round | tokens/s |\n|---|---|---:|---:|---:|")
    for name, extra in (MODES | RULES if args.rules else MODES).items():
        firsts, rest = [], []
        for p in range(args.passes):
            rows = []
            for prompt in PROMPTS:
                request: GenerationRequest = build_request(
                    model,
                    "chat",
                    [{"role": "user", "content": prompt}],
                    max_new_tokens=args.max_new_tokens,
                    sampling=SamplingParams(),
                    **extra,
                )  # type: ignore[arg-type]
                start = time.perf_counter()
                chunks = stack.generate_all([request])[0]
                wall = time.perf_counter() - start
                stats = chunks[-1].stats
                assert stats is not None
                rows.append((wall, stats.rounds, chunks[-1].completion_tokens))
            (firsts if p == 0 else rest).append(rows)
        for label, runs in (("first", firsts), ("later", rest)):
            rows = [row for run in runs for row in run]
            if not rows:
                continue
            wall = sum(r[0] for r in rows)
            rounds = sum(r[1] for r in rows)
            tokens = sum(r[2] for r in rows)
            ms = statistics.median(r[0] / r[1] * 1e3 for r in rows)
            print(f"| {name} | {label} | {ms:.1f} | {tokens / rounds:.2f} | {tokens / wall:.1f} |")


if __name__ == "__main__":
    main()
