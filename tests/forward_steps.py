"""Hand-built forward steps for the model tests (the engines have their own builders): a
sequence's step as tokens, positions and a mask among its own tokens; a batch of steps; page
tables allocated out of order; the tiny Llama config the model tests share."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from specsplit.kv_cache import KVCache, SeqKV
from specsplit.model.batch import ForwardBatch
from specsplit.step import SeqStep, build_forward_batch

VOCAB = 96
TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass
class Step:
    """One sequence's part of a forward: `tokens` at `positions`, written right after the
    sequence's committed KV; `self_mask` [q, q] says which of this step's tokens each may see
    (the committed prefix is always visible)."""

    seq: SeqKV
    tokens: list[int]
    positions: list[int]
    self_mask: torch.Tensor


def causal_step(seq: SeqKV, tokens: list[int]) -> Step:
    start = seq.kv_committed_len
    q_len = len(tokens)
    positions = list(range(start, start + q_len))
    return Step(seq, tokens, positions, torch.ones(q_len, q_len, dtype=torch.bool).tril())


def make_batch(steps: list[Step]) -> ForwardBatch:
    """Logits for every token of every step."""
    seq_steps = []
    for step in steps:
        start, q_len = step.seq.kv_committed_len, len(step.tokens)
        seq_steps.append(
            SeqStep(
                seq=step.seq,
                input_ids=step.tokens,
                positions=step.positions,
                storage=list(range(start, start + q_len)),
                kv_len=start + q_len,
                prefix_len=start,
                new_mask=step.self_mask,
                logit_rows=list(range(q_len)),
            )
        )
    batch, _ = build_forward_batch(seq_steps, steps[0].seq.page_size)
    return batch


def new_seqs(kv: KVCache, lengths: list[int], rng: random.Random) -> list[SeqKV]:
    """Sequences whose pages are allocated one at a time in turn (interleaved), then shuffled:
    page tables are neither contiguous nor ordered."""
    seqs = [kv.new_seq() for _ in lengths]
    for num_pages in range(1, max(-(-n // kv.page_size) for n in lengths) + 1):
        for seq, length in zip(seqs, lengths, strict=True):
            kv.reserve(seq, min(length, num_pages * kv.page_size))
    for seq in seqs:
        rng.shuffle(seq.page_table)
    return seqs


def tree_step(seq: SeqKV, pending: int, tree_tokens: list[int], parents: list[int]) -> Step:
    """The pending token plus draft-tree nodes (parent -1 = the pending token, the root).
    Node at depth d sits at position c + d (c = committed length, pending at c); it sees the
    committed prefix, the pending token, its ancestors and itself; never its siblings."""
    c = seq.kv_committed_len
    n = len(tree_tokens)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    depths = [0] * n
    for j, parent in enumerate(parents):
        assert parent < j, "parents come before children"
        depths[j] = 1 if parent < 0 else depths[parent] + 1
        mask[j + 1, j + 1] = True
        if parent >= 0:
            mask[j + 1] |= mask[parent + 1]
    positions = [c] + [c + d for d in depths]
    return Step(seq, [pending, *tree_tokens], positions, mask)
