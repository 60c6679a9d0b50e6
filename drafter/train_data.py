"""Training data for `specsplit train-drafter`: the target's own greedy answers (self-distillation).

A prompt file is JSON lines: {"messages": [{"role": ..., "content": ...}, ...], "split": "train"
| "heldout"} (split optional: "train"). The bundled set is specsplit/data/train_prompts.jsonl.
Answers are written to one file after every batch, so an interrupted run resumes where it was.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specsplit.prompt import apply_chat_template

log = logging.getLogger(__name__)

SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Prompt:
    messages: list[dict[str, str]]
    split: str


@dataclass(frozen=True)
class Example:
    """One prompt and the target's greedy answer (ending with EOS unless cut at the limit)."""

    prompt_ids: list[int]
    answer_ids: list[int]
    split: str
    greedy: bool = True  # False: sampled (extra training answers; reports use greedy ones)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


def bundled_prompt_file() -> str:
    return str(resources.files("specsplit").joinpath("data/train_prompts.jsonl"))


def read_prompts(path: str) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        raw = json.loads(line)
        split = raw.get("split", "train")
        if split not in SPLITS or not raw.get("messages"):
            raise ValueError(f"{path}:{number}: want messages and a split in {SPLITS}")
        prompts.append(Prompt(raw["messages"], split))
    return prompts


def answer_prompts(
    model: Any,  # a transformers causal LM on `device`
    tokenizer: Any,
    prompts: list[Prompt],
    path: Path,
    *,
    max_new_tokens: int,
    batch_size: int,
    eos_token_ids: list[int],
    answers_per_prompt: int = 1,
    temperature: float = 0.8,
) -> list[Example]:
    """The model's answers to `prompts`: a greedy one each, then `answers_per_prompt - 1` more
    sampled at `temperature`. Resumes from (and appends to) `path`."""
    done: list[Example] = []
    if path.exists():
        done = [Example(**e) for e in torch.load(path, weights_only=True)]
    once = [(apply_chat_template(tokenizer, p.messages), p.split) for p in prompts]
    encoded = [(ids, split, copy == 0) for copy in range(answers_per_prompt) for ids, split in once]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
    device = next(model.parameters()).device
    bar = tqdm(total=len(encoded), initial=len(done), desc="answering prompts", unit="prompt")
    while len(done) < len(encoded):
        batch = encoded[len(done) : len(done) + batch_size]
        greedy = batch[0][2]
        batch = [b for b in batch if b[2] == greedy]  # one decoding mode per generate call
        width = max(len(ids) for ids, _, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, _, _) in enumerate(batch):  # left padding: answers start at `width`
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else temperature,
                top_p=None,
                top_k=None,
                eos_token_id=eos_token_ids,
                pad_token_id=pad,
            )
        for (ids, split, _), row in zip(batch, out[:, width:].tolist(), strict=True):
            done.append(Example(ids, cut_at_eos(row, eos_token_ids), split, greedy))
        torch.save([e.__dict__ for e in done], path)
        bar.update(len(batch))
    bar.close()
    return done


def cut_at_eos(tokens: list[int], eos_token_ids: list[int]) -> list[int]:
    """Tokens up to and including the first EOS (all of them if none)."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens


def draft_vocabulary(examples: list[Example], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids most frequent in the answers (ties: lower id), sorted [size]."""
    counts = Counter(t for e in examples for t in e.answer_ids)
    ranked = sorted(range(vocab_size), key=lambda t: (-counts.get(t, 0), t))
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


def coverage(examples: list[Example], draft_ids: torch.Tensor) -> float:
    """Share of answer tokens the draft vocabulary contains (a drafted token's ceiling)."""
    kept = set(draft_ids.tolist())
    tokens = [t for e in examples for t in e.answer_ids]
    return sum(t in kept for t in tokens) / max(len(tokens), 1)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded with 0
    lengths: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]


def drafting_mask(batch: Batch, step: int, num_entries: int) -> torch.Tensor:
    """[B, n] bool: entry i of draft step `step` is trained on. Its root r = i - step must be a
    place drafting starts from (r >= prompt_len - 2: the root token is the prompt's last or
    later) and the token it predicts, x_{i+2}, must exist."""
    i = torch.arange(num_entries)[None, :]
    return (i - step >= batch.prompt_lens[:, None] - 2) & (i + 2 < batch.lengths[:, None])


def make_batches(
    examples: list[Example], max_tokens: int, max_len: int, seed: int | None
) -> list[Batch]:
    """Examples grouped by length into batches of at most `max_tokens` padded tokens; with a
    seed, the batch order is shuffled."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].tokens))
    groups: list[list[int]] = [[]]
    for i in order:
        width = min(len(examples[i].tokens), max_len)
        if groups[-1] and width * (len(groups[-1]) + 1) > max_tokens:
            groups.append([])
        groups[-1].append(i)
    if seed is not None:
        random.Random(seed).shuffle(groups)
    batches = []
    for group in groups:
        if not group:
            continue
        seqs = [examples[i].tokens[:max_len] for i in group]
        width = max(len(s) for s in seqs)
        input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            input_ids[row, : len(s)] = torch.tensor(s)
        batches.append(
            Batch(
                input_ids,
                torch.tensor([len(s) for s in seqs]),
                torch.tensor([min(len(examples[i].prompt_ids), max_len) for i in group]),
            )
        )
    return batches
