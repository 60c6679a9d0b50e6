"""`specsplit train-drafter`: an EAGLE-3 head for a target checkpoint, by self-distillation.

Everything lives under --out, and each phase resumes from what it finds there:

    answers.pt        the target's greedy answers to the prompt set (train and held-out)
    train_state.pt    head weights, optimizer, step; saved every --save-every steps and at the end
    head/             the head in the published layout (config.json + model.safetensors, bf16)
    report.json       held-out acceptance (drafter/train_report.py)

Loss: at every draft step k of the training-time test (drafter/train_head.py) the head's
draft-vocabulary distribution is pulled towards the target's (its logits restricted to the draft
vocabulary), weighted by decay^k, over positions where drafting happens (the root is the prompt's
last token or later; the predicted token is part of the answer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from drafter.eagle import load_eagle3
from drafter.eagle_checkpoint import Eagle3Config
from drafter.train_data import (
    Batch,
    Example,
    answer_prompts,
    bundled_prompt_file,
    coverage,
    draft_vocabulary,
    drafting_mask,
    make_batches,
    read_prompts,
)
from drafter.train_head import Eagle3Trainable
from drafter.train_report import heldout_report
from specsplit.model.config import default_aux_layers

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
ANSWERS_FILE = "answers.pt"
HEAD_DIR = "head"


class TargetFeatures:
    """The target (a transformers causal LM, frozen) returning the head's inputs: the outputs of
    the aux layers (pre final norm) and the logits, for right-padded dense batches."""

    def __init__(self, model: Any, aux_layers: tuple[int, ...]) -> None:
        self.model = model.eval().requires_grad_(False)
        self.aux_layers = aux_layers
        self._captured: dict[int, torch.Tensor] = {}
        layers = model.model.layers
        for index in aux_layers:
            layers[index].register_forward_hook(self._hook(index))

    def _hook(self, index: int) -> Any:
        def capture(_module: Any, _inputs: Any, output: Any) -> None:
            self._captured[index] = output[0] if isinstance(output, tuple) else output

        return capture

    @torch.no_grad()
    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> features [B, T, 3 * Ht], logits [B, T, V]."""
        device = self.model.device
        width = batch.input_ids.shape[1]
        attention = (torch.arange(width)[None, :] < batch.lengths[:, None]).long()
        out = self.model(input_ids=batch.input_ids.to(device), attention_mask=attention.to(device))
        features = torch.cat([self._captured[i] for i in self.aux_layers], dim=-1)
        self._captured.clear()
        return features, out.logits


@dataclass
class StepLoss:
    loss: torch.Tensor  # scalar, weighted over steps
    correct: list[int]  # per step: head argmax == target argmax
    counts: list[int]  # per step: positions


def ttt_loss(
    head: Eagle3Trainable,
    batch: Batch,
    features: torch.Tensor,  # [B, T, 3 * Ht]
    target_logits: torch.Tensor,  # [B, T, V]
    num_steps: int,
    decay: float,
) -> StepLoss:
    device = features.device
    n = batch.input_ids.shape[1] - 1
    outputs = head(batch.input_ids.to(device), features, num_steps)  # per step [B, n, H]
    predicted_at = target_logits[:, 1:]  # entry i predicts the target's distribution at i + 1
    total = torch.zeros((), device=device)
    correct, counts = [], []
    for step, out in enumerate(outputs):
        rows = drafting_mask(batch, step, n).to(device)
        if not rows.any():
            correct.append(0)
            counts.append(0)
            continue
        logits = head.logits(out[rows]).float()  # [N, Vd]
        target = predicted_at[rows]  # [N, V]
        p = torch.softmax(target[:, head.draft_ids].float(), dim=-1)  # [N, Vd]
        loss = -(p * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + decay**step * loss
        hits = head.draft_ids[logits.argmax(-1)] == target.argmax(-1)
        correct.append(int(hits.sum()))
        counts.append(int(rows.sum()))
    return StepLoss(total, correct, counts)


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, then cosine down to peak / 10."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def load_target(path: str, device: str) -> tuple[Any, Any, list[int]]:
    """(transformers model, tokenizer, eos ids) for `path` (directory or .gguf)."""
    from transformers import AutoModelForCausalLM

    from specsplit.model.loader import from_pretrained_args, load_config, load_tokenizer

    name, kwargs = from_pretrained_args(path)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    model = model.to(device)  # type: ignore[arg-type]
    return model, load_tokenizer(path), list(load_config(path).eos_token_ids)


def head_config(model: Any, draft_vocab_size: int) -> Eagle3Config:
    """The head mirrors one target decoder layer's shape (and its RoPE base)."""
    from specsplit.model.config import ModelConfig

    c = ModelConfig.from_hf(model.config, None)
    return Eagle3Config(
        hidden_size=c.hidden_size,
        target_hidden_size=c.hidden_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        vocab_size=c.vocab_size,
        draft_vocab_size=min(draft_vocab_size, c.vocab_size),
        max_position_embeddings=c.max_position_embeddings,
        aux_layers=default_aux_layers(c.num_layers),
    )


def train_drafter(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model is None:
        from specsplit.model.embedded import embedded_default_model_path

        args.model = embedded_default_model_path()
    model, tokenizer, eos_ids = load_target(args.model, args.device)
    prompts = read_prompts(args.prompts or bundled_prompt_file())
    if args.limit_prompts:
        prompts = prompts[: args.limit_prompts]
    examples = answer_prompts(
        model,
        tokenizer,
        prompts,
        out / ANSWERS_FILE,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.answer_batch_size,
        eos_token_ids=eos_ids,
        answers_per_prompt=args.answers_per_prompt,
        temperature=args.answer_temperature,
    )
    train = [e for e in examples if e.split == "train"]
    heldout = [e for e in examples if e.split == "heldout" and e.greedy]
    log.info("%d training and %d held-out answers", len(train), len(heldout))

    embed = model.get_input_embeddings().weight.detach().float()
    state_path = out / STATE_FILE
    state = torch.load(state_path, weights_only=False) if state_path.exists() else None
    if state is not None:
        config = Eagle3Config(**state["config"])
        head = Eagle3Trainable(config, embed, state["draft_ids"]).to(args.device)
        head.load_state_dict(state["head"])
    elif args.init_head:
        # fine-tune an existing head (its layout, draft vocabulary and weights)
        inference_head = load_eagle3(args.init_head, args.model, torch.float32, "cpu")
        head = Eagle3Trainable.from_head(inference_head).to(args.device)
        config = head.config
    else:
        config = head_config(model, args.draft_vocab_size)
        draft_ids = draft_vocabulary(train, config.draft_vocab_size, config.vocab_size)
        head = Eagle3Trainable(config, embed, draft_ids).to(args.device)
        head.init_from_target(
            model.model.norm.weight.detach().float().cpu(),
            model.get_output_embeddings().weight.detach().float().cpu(),
            args.seed,
        )
    draft_ids = head.draft_ids.cpu()
    log.info(
        "draft vocabulary %d of %d: covers %.1f%% of training and %.1f%% of held-out answer tokens",
        config.draft_vocab_size,
        config.vocab_size,
        100 * coverage(train, draft_ids),
        100 * coverage(heldout, draft_ids),
    )
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    target = TargetFeatures(model, config.aux_layers)
    finished = _train_loop(head, target, optimizer, train, state, args, state_path)
    head.save(out / HEAD_DIR)
    print(f"head written to {out / HEAD_DIR}")
    if not finished:
        print("stopped at --max-minutes; run the same command again to resume")
        return 0
    if not heldout:
        print('no held-out prompts (split "heldout" in the prompt file): no report')
    elif not args.skip_report:
        report = heldout_report(head, target, heldout, args, out / HEAD_DIR, tokenizer)
        (out / "report.json").write_text(json.dumps(report, indent=2))
    return 0


def _train_loop(
    head: Eagle3Trainable,
    target: TargetFeatures,
    optimizer: torch.optim.Optimizer,
    train: list[Example],
    state: dict[str, Any] | None,
    args: argparse.Namespace,
    state_path: Path,
) -> bool:
    """Train up to args.epochs; True when done, False when stopped by --max-minutes."""
    started = time.monotonic()
    per_epoch = len(make_batches(train, args.batch_tokens, args.max_len, seed=None))
    total = per_epoch * args.epochs
    step = state["step"] if state else 0
    autocast = args.device.startswith("cuda")

    def save() -> None:
        torch.save(
            {
                "step": step,
                "config": dataclasses.asdict(head.config),  # aux_layers stays a tuple
                "draft_ids": head.draft_ids.cpu(),
                "head": head.state_dict(),
                "optimizer": optimizer.state_dict(),
            },
            state_path,
        )

    bar = tqdm(total=total, initial=step, desc="training head", unit="step")
    head.train()
    while step < total:
        epoch, skip = divmod(step, per_epoch)
        batches = make_batches(train, args.batch_tokens, args.max_len, seed=args.seed + epoch)
        for batch in batches[skip:]:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total, args.lr, args.warmup_steps)
            features, logits = target(batch)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                result = ttt_loss(head, batch, features, logits, args.ttt_steps, args.step_decay)
            optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
            optimizer.step()
            step += 1
            accuracy = "/".join(
                f"{c / n:.2f}" if n else "-"
                for c, n in zip(result.correct, result.counts, strict=True)
            )
            bar.set_postfix(epoch=epoch, loss=f"{result.loss.item():.3f}", acc=accuracy)
            bar.update(1)
            if step % args.save_every == 0:
                save()
            if args.max_minutes and time.monotonic() - started > 60 * args.max_minutes:
                save()
                bar.close()
                return step >= total
    save()
    bar.close()
    head.eval()
    return True
