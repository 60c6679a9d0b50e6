"""The input of one model forward step over a ragged batch of sequences.

Tokens of all sequences are flattened into one row of T tokens (no padding). Each sequence
brings `q_len` query tokens (pending tokens and/or draft-tree nodes) and attends to `kv_len`
cache slots (its committed prefix plus this step's own tokens) under a boolean mask.
Builders live with the engines; the model only reads this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, flat query tokens of all sequences
    positions: torch.Tensor  # [T] int64, RoPE position of each token
    slot_mapping: torch.Tensor  # [T] int64, cache slot where each token's K/V is written
    q_lens: list[int]  # [B] query tokens per sequence, sum == T
    kv_slots: list[torch.Tensor]  # B x [kv_len_b] int64, slots each sequence attends to
    masks: list[torch.Tensor]  # B x [q_len_b, kv_len_b] bool, True = may attend
    logit_indices: torch.Tensor  # [L] int64 rows of T whose logits (and hidden states) are wanted

    def __post_init__(self) -> None:
        num_tokens = self.input_ids.shape[0]
        assert self.positions.shape == (num_tokens,), self.positions.shape
        assert self.slot_mapping.shape == (num_tokens,), self.slot_mapping.shape
        assert sum(self.q_lens) == num_tokens, (self.q_lens, num_tokens)
        assert len(self.kv_slots) == len(self.masks) == len(self.q_lens)
        for q_len, slots, mask in zip(self.q_lens, self.kv_slots, self.masks, strict=True):
            assert mask.shape == (q_len, slots.shape[0]), (mask.shape, q_len, slots.shape)

    def to(self, device: torch.device | str) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            slot_mapping=self.slot_mapping.to(device, non_blocking=True),
            q_lens=self.q_lens,
            kv_slots=[s.to(device, non_blocking=True) for s in self.kv_slots],
            masks=[m.to(device, non_blocking=True) for m in self.masks],
            logit_indices=self.logit_indices.to(device, non_blocking=True),
        )


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [L, vocab] float32
    hidden_states: torch.Tensor | None  # [L, num_aux_layers * hidden] or None
