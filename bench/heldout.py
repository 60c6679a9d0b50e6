"""Held-out acceptance of EAGLE-3 heads through the real engines (greedy), heads side by side.

The first --num-prompts prompts of the held-out split of the bundled training prompt set
(specsplit/data/train_prompts.jsonl, split "heldout": never trained on), each as one sequence of
one batch; rows are target only, chains of 3, 5 and 7 and the report's default tree (the rows of
`specsplit train-drafter`'s held-out report, drafter/train_report.py):

    PYTHONPATH=. python bench/heldout.py specsplit/data/eagle3-smollm2 [OTHER_HEAD ...]
        [--num-prompts 24] [--max-new-tokens 96] [--model PATH] [--device cpu]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from drafter.train_data import Example, bundled_prompt_file, read_prompts
from drafter.train_report import engine_acceptance
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.loader import load_tokenizer
from specsplit.prompt import apply_chat_template


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("heads", nargs="+", help="EAGLE-3 head directories")
    parser.add_argument("--model", default=None, help="target checkpoint (default: embedded)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    path = args.model or embedded_default_model_path()
    tokenizer = load_tokenizer(path)
    heldout = [p for p in read_prompts(bundled_prompt_file()) if p.split == "heldout"]
    examples = [
        Example(apply_chat_template(tokenizer, p.messages), [], p.split)
        for p in heldout[: args.num_prompts]
    ]
    reports = {
        head: engine_acceptance(
            path, tokenizer, Path(head), examples, args.max_new_tokens, args.device
        )
        for head in args.heads
    }
    print(
        f"model {path}; {len(examples)} held-out prompts in one batch, greedy, "
        f"max_new_tokens {args.max_new_tokens}, device {args.device}"
    )
    print("accepted tokens per round (outputs equal to target only)")
    configs = list(next(iter(reports.values()))["configs"])
    print(f"{'config':<24}" + "".join(f"{Path(h).name:>28}" for h in args.heads))
    for config in configs:
        cells = []
        for report in reports.values():
            row = report["configs"][config]
            same = f"({row['same_output_as_target_only']}/{report['prompts']})"
            cells.append(f"{row['accepted_tokens_per_round']:>20.3f} {same:>7}")
        print(f"{config:<24}" + "".join(cells))


if __name__ == "__main__":
    main()
