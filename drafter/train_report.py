"""Held-out acceptance of a trained head, two ways.

1. Training-time test over every held-out answer position (greedy): the head drafts a chain from
   each root; per draft position, the rate it matches the target given that the earlier drafts
   did, and the expected accepted tokens (accepted drafts + the bonus token) for chains of 3, 5
   and 7, averaged over all roots.
2. The real engines (verifier + EAGLE-3 proposer, in one process) generating answers to held-out
   prompts: accepted tokens per round from the verifier's counts, for the same chains and the
   default tree, with target-only decoding as the reference output.

(1) runs over far more positions but reads higher than (2): in decoding, a round starts where the
last one was rejected, and misses cluster (hard stretches of text get more rounds per token), so
per-round acceptance sits below the average over all positions. On SmolLM2's held-out prompts,
CPU fp32, 24 prompts, the stage-one shipped head (README): chain 3 2.58 (1) vs 2.24 (2).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch

from drafter.train_data import Example, drafting_mask, make_batches
from drafter.train_head import Eagle3Trainable
from inprocess.stack import accepted_tokens_per_round, build_local_stack, requests_for, token_ids
from specsplit.messages import SpecParams
from specsplit.model.loader import load_model

log = logging.getLogger(__name__)

CHAINS = (3, 5, 7)
DEFAULT_TREE = SpecParams(num_steps=5, topk=4, num_draft_tokens=16)


@torch.no_grad()
def chain_acceptance(
    head: Eagle3Trainable, target: Any, examples: list[Example], max_len: int, depth: int
) -> dict[str, Any]:
    """Per-position conditional acceptance and expected accepted tokens per round (greedy)."""
    was_training = head.training
    head.eval()
    device = head.embed.device
    runs: list[torch.Tensor] = []  # per root: leading correct drafts, 0..depth
    for batch in make_batches(examples, 8192, max_len, seed=None):
        features, logits = target(batch)
        n = batch.input_ids.shape[1] - 1
        outputs = head(batch.input_ids.to(device), features, depth)
        want = logits[:, 1:].argmax(-1)  # [B, n]: the target's greedy next token per entry
        roots = drafting_mask(batch, 0, n).to(device)  # [B, n]
        root = torch.arange(n, device=device)[None, :]
        length = batch.lengths.to(device)[:, None]
        leading = torch.ones_like(roots)
        run = torch.zeros(roots.shape, dtype=torch.long, device=device)
        for step, out in enumerate(outputs):
            drafted = head.draft_ids[head.logits(out).argmax(-1)]  # [B, n] at entry r + step
            ok = torch.zeros_like(roots)
            ok[:, : n - step] = (drafted == want)[:, step:]  # indexed by the root r
            leading = leading & ok & (root + step + 2 < length)  # x_{r+step+2} exists
            run += leading.long()
        runs.append(run[roots].cpu())
    head.train(was_training)
    per_root = torch.cat(runs)  # [roots]
    rates = []
    for k in range(depth):
        reached = int((per_root >= k).sum())
        rates.append(float((per_root >= k + 1).sum()) / reached if reached else 0.0)
    expected = {n: 1.0 + float(per_root.clamp(max=n).float().mean()) for n in CHAINS if n <= depth}
    return {
        "roots": len(per_root),
        "acceptance_rate_per_position": [round(r, 4) for r in rates],
        "accepted_tokens_per_round": {f"chain {n}": round(v, 3) for n, v in expected.items()},
    }


def engine_acceptance(
    target_path: str,
    tokenizer: Any,
    head_dir: Path,
    examples: list[Example],
    max_new_tokens: int,
    device: str,
) -> dict[str, Any]:
    """Accepted tokens per round through the real engines on held-out prompts (greedy)."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = load_model(target_path, dtype=dtype, device=device)
    requests = requests_for([e.prompt_ids for e in examples], max_new_tokens)
    configs = [("target only", SpecParams(0, 1, 0))]
    configs += [(f"chain {n}", SpecParams(n, 1, n)) for n in CHAINS]
    configs.append(
        (
            f"tree {DEFAULT_TREE.num_steps}x{DEFAULT_TREE.topk}, "
            f"{DEFAULT_TREE.num_draft_tokens} nodes",
            DEFAULT_TREE,
        )
    )
    rows: dict[str, Any] = {}
    reference: list[list[int]] | None = None
    for name, spec in configs:
        stack = build_local_stack(
            target_path,
            "eagle3",
            tokenizer,
            spec,
            draft_path=str(head_dir),
            dtype=dtype,
            device=device,
            target=target,
            num_pages=4096,
        )
        results = stack.generate_all(requests)
        outputs = [token_ids(chunks) for chunks in results]
        reference = reference or outputs
        rows[name] = {
            "accepted_tokens_per_round": round(accepted_tokens_per_round(results), 3),
            "same_output_as_target_only": sum(
                o == r for o, r in zip(outputs, reference, strict=True)
            ),
        }
        log.info("%s: %s", name, rows[name])
    return {"prompts": len(examples), "max_new_tokens": max_new_tokens, "configs": rows}


def heldout_report(
    head: Eagle3Trainable,
    target: Any,
    heldout: list[Example],
    args: argparse.Namespace,
    head_dir: Path,
    tokenizer: Any,
) -> dict[str, Any]:
    chains = chain_acceptance(head, target, heldout, args.max_len, max(CHAINS))
    print(f"held-out, training-time test over {chains['roots']} roots (greedy):")
    print("  acceptance per draft position:", chains["acceptance_rate_per_position"])
    for name, value in chains["accepted_tokens_per_round"].items():
        print(f"  {name}: {value} accepted tokens per round")
    if not args.report_prompts:
        return {"training_time_test": chains}
    engines = engine_acceptance(
        args.model,
        tokenizer,
        head_dir,
        heldout[: args.report_prompts],
        args.report_new_tokens,
        args.device,
    )
    print(f"held-out, engines, {engines['prompts']} prompts x {engines['max_new_tokens']} tokens:")
    for name, row in engines["configs"].items():
        print(
            f"  {name:<24} {row['accepted_tokens_per_round']} accepted tokens per round, "
            f"{row['same_output_as_target_only']}/{engines['prompts']} outputs as target only"
        )
    return {"training_time_test": chains, "engines": engines}
