"""What a device expansion's run reads, written in (`ExpansionBuffers`, a mixin of
DeviceExpansion in drafter/expansion.py): the round's metadata through a host mirror (each
row's base, block table, chain, catch-up tokens and new pool rows' slots, padding rows on the
scratch page), the roots' logits and features, and the buffers of a row pool's new rows (an
eager run's, the graphs' shared one, and its pinned host mirror)."""

from __future__ import annotations

import numpy as np
import torch

from drafter.expansion_inputs import ExpansionInputs, PoolRows, RuleRun
from drafter.expansion_maps import split_meta
from specsplit.kv_cache import KVCache, SeqKV
from specsplit.model.transfer import copy_rows


class ExpansionBuffers:
    """The loading half of DeviceExpansion, which sets these attributes: `kv`, `scored_ids`
    (the forwards' columns' target ids, None: the target's vocabulary), `pool_rows` ((width,
    dtype) of the proposer's row pool, None: none), `rows_buffer` and `host_rows` (the graphs'
    new pool rows and their pinned mirror, grown here)."""

    kv: KVCache
    scored_ids: torch.Tensor | None
    pool_rows: tuple[int, torch.dtype] | None
    rows_buffer: torch.Tensor | None
    host_rows: torch.Tensor | None

    def _load(
        self,
        inputs: ExpansionInputs,
        host_meta: torch.Tensor,  # inputs.crossing's host mirror (pinned for a graph's)
        host_sampling: torch.Tensor | None,  # inputs.sampling's (a graph's), reset here
        seqs: list[SeqKV],
        root_logits: torch.Tensor | None,
        root_features: torch.Tensor | None,
        chains: list[list[int]],
        catch_ups: list[list[int]] | None,
        new_rows: PoolRows | None = None,
        rules: RuleRun | None = None,  # with a key's `rules`: the rows' slots, the count changes
    ) -> None:
        """Write the round into `inputs`: metadata (and the rows' rule slots, padding rows 0,
        and the rule tables' count changes) through the host mirror, the pool's new rows (a
        sequence's at the start of its q) through theirs (a graph's) or straight, the roots'
        logits and features (unless the run catches up to them) device to device (padding rows
        keep what they held)."""
        bs = len(seqs)
        slots = None if new_rows is None else new_rows.slots
        crossing = host_meta.numpy()
        self._fill_meta(
            crossing[inputs.meta_start :], seqs, inputs.bs, chains, catch_ups or [],
            inputs.row_slots, slots,
        )  # fmt: skip
        if inputs.rule_cols:
            assert rules is not None, "a key with rules needs each row's rule slot"
            crossing[: inputs.meta_start] = 0
            crossing[: len(rules.slots)] = rules.slots
            deltas = crossing[inputs.rule_cols : inputs.meta_start].reshape(2, -1)
            deltas[:, : rules.deltas.shape[1]] = rules.deltas
        inputs.crossing.copy_(host_meta, non_blocking=True)
        if new_rows is not None and inputs.new_rows is not None:
            q, dst = inputs.row_slots, inputs.new_rows
            host = self._host_rows(dst.shape[0]) if dst.is_cuda else dst
            for b, part in enumerate(new_rows.parts):
                copy_rows(host[b * q : b * q + part.shape[0]], [part])
            if host is not dst:
                dst.copy_(host, non_blocking=True)
        if host_sampling is not None:
            host_sampling.fill_(1.0)  # padding rows: any valid params (temperature 1)
        if root_logits is not None:  # given in the target's vocabulary
            scored = root_logits
            if self.scored_ids is not None:
                scored = root_logits.index_select(1, self.scored_ids)
            inputs.logits[:bs].copy_(scored)
        if inputs.features is not None and root_features is not None:
            inputs.features[:bs].copy_(root_features)

    def _fill_meta(
        self,
        meta: np.ndarray,
        seqs: list[SeqKV],
        bs: int,
        chains: list[list[int]],
        catch_ups: list[list[int]],
        slots_per_row: int = 0,
        row_slots: list[list[int]] | None = None,
    ) -> None:
        """Rows of `seqs` (base, block table, chain, catch-up tokens, the slots of the pool's
        new rows: `slots_per_row` a row), then padding rows up to `bs`: base 1 past their
        catch-up on the scratch page (they read and write only there). New rows' slots past a
        sequence's own (and all of them without `row_slots`) are the scratch page's first."""
        chain_len = len(chains[0]) if chains else 0
        catch_up = len(catch_ups[0]) if catch_ups else 0
        base, table, chain, tokens, slots = split_meta(meta, bs, chain_len, catch_up, slots_per_row)
        if slots_per_row:
            slots[:] = self.kv.scratch_slot
            for b, own in enumerate(row_slots or []):
                slots[b, : len(own)] = own
        for b, seq in enumerate(seqs):
            base[b] = seq.kv_committed_len
            pages = seq.table_array()
            table[b, : len(pages)] = pages
        base[len(seqs) :] = 1 + catch_up
        table[len(seqs) :] = self.kv.scratch_page
        if chains:
            chain[: len(seqs)] = chains
            chain[len(seqs) :] = 0
        if catch_ups:
            tokens[: len(seqs)] = catch_ups
            tokens[len(seqs) :] = 0

    def _new_rows(self, num: int) -> torch.Tensor | None:
        """An eager run's buffer for `num` new pool rows (None: no pool, or no catch-up)."""
        if self.pool_rows is None or not num:
            return None
        width, dtype = self.pool_rows
        return torch.zeros(num, width, dtype=dtype, device=self.kv.device)

    def _graph_rows(self, num: int) -> torch.Tensor | None:
        """A graph's view of the shared buffer of new pool rows, its first `num` (grown first
        where it is shorter; None: no pool, or no catch-up)."""
        if self.pool_rows is None or not num:
            return None
        if self.rows_buffer is None or self.rows_buffer.shape[0] < num:
            self.rows_buffer = self._new_rows(num)
        assert self.rows_buffer is not None
        return self.rows_buffer[:num]

    def _host_rows(self, num: int) -> torch.Tensor:
        """The pinned host mirror's first `num` rows (grown first where it is shorter)."""
        assert self.pool_rows is not None
        if self.host_rows is None or self.host_rows.shape[0] < num:
            width, dtype = self.pool_rows
            self.host_rows = torch.zeros(num, width, dtype=dtype).pin_memory()
        return self.host_rows[:num]
