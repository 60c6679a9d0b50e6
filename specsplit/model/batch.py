"""The input of one model forward step over a ragged batch of sequences (DESIGN.md §6).

Tokens of all sequences are flattened into one row of T tokens (no padding). Sequence b brings
`q_len` query tokens (pending tokens and/or draft-tree nodes, `cu_seqlens_q[b]:cu_seqlens_q[b+1]`)
and attends to storage indices [0, kv_lens[b]) of its pages (`block_table[b]`): the first
`prefix_lens[b]` always, the rest (its new tokens) under `tree_mask[b]`, or causally when
`tree_mask` is None. Builders live in specsplit/step.py; the model only reads this.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from specsplit.kernels.paged_attention_reference import reference_plan
from specsplit.model.transfer import to_device

# the attention backend's per-forward host plan (paged_attention_reference.reference_plan)
_Plan = list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, flat query tokens of all sequences
    positions: torch.Tensor  # [T] int64, RoPE position of each token
    slot_mapping: torch.Tensor  # [T] int64, cache slot where each token's K/V is written
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, query token offsets
    kv_lens: torch.Tensor  # [B] int32, storage [0, kv_len) attended
    prefix_lens: torch.Tensor  # [B] int32, storage [0, prefix_len) visible to every query
    block_table: torch.Tensor  # [B, max_pages] int32 page ids
    tree_mask: torch.Tensor | None  # [B, max_q, max_new] bool among new tokens; None = causal
    logit_indices: torch.Tensor  # [L] int64 rows of T whose logits (and hidden states) are wanted
    max_q_len: int  # >= every q_len (the attention grid)
    page_size: int
    # [H] int64 rows of T whose hidden states are wanted (aux_layers); None = logit_indices
    hidden_indices: torch.Tensor | None = None
    _plan: _Plan | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        num_tokens = self.input_ids.shape[0]
        num_seqs = self.kv_lens.shape[0]
        assert self.positions.shape == (num_tokens,), self.positions.shape
        assert self.slot_mapping.shape == (num_tokens,), self.slot_mapping.shape
        assert self.cu_seqlens_q.shape == (num_seqs + 1,), self.cu_seqlens_q.shape
        assert self.prefix_lens.shape == (num_seqs,), self.prefix_lens.shape
        assert self.block_table.dim() == 2 and self.block_table.shape[0] == num_seqs
        if self.tree_mask is not None:
            assert self.tree_mask.dim() == 3 and self.tree_mask.shape[0] == num_seqs

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The same batch on `device`: integer metadata travels in one copy."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        names = [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]
        names = [n for n in names if n != "tree_mask"]  # hidden_indices: only when it is set
        host = [getattr(self, n) for n in names]
        moved = to_device(torch.cat([t.reshape(-1).to(torch.int64) for t in host]), device)
        parts = dict(zip(names, moved.split([t.numel() for t in host]), strict=True))
        kwargs = {
            n: part.view(t.shape).to(t.dtype)
            for (n, part), t in zip(parts.items(), host, strict=True)
        }
        mask = None if self.tree_mask is None else to_device(self.tree_mask, device)
        return ForwardBatch(
            **kwargs, tree_mask=mask, max_q_len=self.max_q_len, page_size=self.page_size
        )

    def reference_plan(self) -> _Plan:
        """Per sequence (q_start, q_end, slots [kv_len], dense mask [q_len, kv_len]), built once
        per forward for the plain-torch attention (the CPU path) and reused by every layer."""
        if self._plan is None:
            self._plan = reference_plan(
                self.cu_seqlens_q,
                self.kv_lens,
                self.prefix_lens,
                self.block_table,
                self.page_size,
                self.tree_mask,
            )
        return self._plan


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [L, vocab] float32
    hidden_states: torch.Tensor | None  # [H, num_aux_layers * hidden] or None
    greedy: torch.Tensor | None = None  # [L] int64, each logits row's argmax, where computed
    # the logits are a view of a graph's output buffer (their address the same each replay)
    static: bool = False
