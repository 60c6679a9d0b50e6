"""Per-sequence shares of a forward step, and the ragged ForwardBatch built from them.

Each sequence's cache is addressed by *storage index* (its logical slot number, mapped to a
physical slot through its page table). A step writes K/V for its query tokens at the given
storage indices and attends over storage [0, kv_len) under an explicit mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.kv_cache import SeqKV
from specsplit.model.batch import ForwardBatch
from specsplit.tree import DraftTree


@dataclass
class SeqStep:
    seq: SeqKV
    input_ids: list[int]  # [q] query tokens
    positions: list[int]  # [q] RoPE positions
    storage: list[int]  # [q] storage index each token's K/V is written to
    mask: torch.Tensor  # [q, kv_len] bool, True = may attend
    logit_rows: list[int]  # rows of this step (0..q-1) whose logits are wanted

    @property
    def kv_len(self) -> int:
        return int(self.mask.shape[1])


def causal_step(seq: SeqKV, tokens: list[int], logit_rows: list[int]) -> SeqStep:
    """`tokens` appended causally after the seq's committed prefix."""
    return verify_step(seq, tokens, DraftTree(), logit_rows)


def verify_step(seq: SeqKV, pending: list[int], tree: DraftTree, logit_rows: list[int]) -> SeqStep:
    """Pending tokens (causal) then tree nodes (prefix + pending + ancestors + self).

    With c = kv_committed_len and p pending tokens: pending i sits at position c + i, a tree
    node at depth d at c + p - 1 + d; node j's K/V goes to storage c + p + j.
    """
    c, p, n = seq.kv_committed_len, len(pending), len(tree)
    assert p >= 1, "a step needs at least one pending token (the root)"
    mask = torch.zeros(p + n, c + p + n, dtype=torch.bool)
    mask[:, :c] = True
    mask[:p, c : c + p] = torch.ones(p, p, dtype=torch.bool).tril()
    mask[p:, c : c + p] = True
    mask[p:, c + p :] = tree.ancestor_mask()
    positions = list(range(c, c + p)) + [c + p - 1 + d for d in tree.depths()]
    return SeqStep(
        seq=seq,
        input_ids=list(pending) + list(tree.tokens),
        positions=positions,
        storage=list(range(c, c + p + n)),
        mask=mask,
        logit_rows=logit_rows,
    )


def build_forward_batch(steps: list[SeqStep]) -> tuple[ForwardBatch, list[slice]]:
    """Concatenate steps; returns the batch and each step's slice of the logit rows."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[torch.Tensor] = []
    logit_indices: list[int] = []
    logit_slices: list[slice] = []
    offset = 0
    for step in steps:
        q = len(step.input_ids)
        assert len(step.positions) == len(step.storage) == q == step.mask.shape[0]
        input_ids += step.input_ids
        positions += step.positions
        slot_mapping.append(step.seq.slots_of(torch.tensor(step.storage, dtype=torch.int64)))
        start = len(logit_indices)
        logit_indices += [offset + row for row in step.logit_rows]
        logit_slices.append(slice(start, len(logit_indices)))
        offset += q
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.cat(slot_mapping) if slot_mapping else torch.zeros(0, dtype=torch.int64),
        q_lens=[len(step.input_ids) for step in steps],
        kv_slots=[step.seq.slots(0, step.kv_len) for step in steps],
        masks=[step.mask for step in steps],
        logit_indices=torch.tensor(logit_indices, dtype=torch.int64),
    )
    return batch, logit_slices
