"""The tree expansion's steps as tensor ops over the whole batch (`ExpansionSteps`, the mixin
DeviceExpansion in drafter/expansion.py runs, eagerly or captured as one CUDA graph): the
roots (with a catch-up of the sequences' new entries first), a chain's or a tree's growth, and
draft-ahead's chain, guesses and outcomes' trees.

Candidates are numbered as the host expansion numbers them: the root's top-k are 0..k-1, and
step s (s >= 2) adds k * k children at n_s = k + (s - 2) * k * k, child j of frontier row r at
n_s + r * k + j. Candidate i's K/V lives at storage base + i (base = the proposer's
kv_committed_len), so a frontier node's attention sees the keys the host expansion's does, in
the same order. The frontier is always k nodes of one depth, sorted by candidate index.

A chain (topk 1) takes the argmax at each step, score 0; topk > 1 keeps the k best children by
cumulative log-probability. A sampled chain (`Shape.sampled`) draws each step from its
distribution cut to DRAFT_SUPPORT tokens (`specsplit.sampling.draw_from_cut`) at a uniform its
sequence's generator drew on the host, with its params as a row of inputs: the same draws as
tree_draft's host path, and each cut distribution comes back with the candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from drafter.expansion_inputs import Ahead, ExpansionInputs, GrowConstants, Shape
from drafter.expansion_maps import cache_slots, draw_columns, draw_mapped, in_vocab, split_meta
from specsplit.kernels.argmax import greedy_tokens
from specsplit.kv_cache import KVCache
from specsplit.model.batch import ForwardBatch

# one frontier forward: (batch, features [T, width] or None) -> (logits [T, scored] float32 in
# the vocabulary the forwards score (DeviceExpansion's `scored_ids`), the step's per-row
# outputs for the next step's features or None)
FrontierForward = Callable[
    [ForwardBatch, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
]
# a catch-up forward: q causal entries per sequence (logit_indices: each one's last) -> the
# roots' logits [B, scored] float32 (as FrontierForward's) and their outputs [B, width] (the
# next step's features) or None; the proposer reads whatever else an entry needs (an EAGLE
# head: the target's features at the entry's own slot)
CatchUpForward = Callable[[ForwardBatch], tuple[torch.Tensor, torch.Tensor | None]]
# a row pool's write: (slots [n] int64, rows [n, width]) on the device -> rows at those slots
RowsWrite = Callable[[torch.Tensor, torch.Tensor], None]


class RowRules(Protocol):
    """The proposer's logit rules' rows as a run of a key with `rules` reads them
    (drafter/draft_rules.py's RuleTables): device ops alone, so a graph captures them."""

    def count_in(self, deltas: torch.Tensor) -> None:
        """The run's count changes [2, n] int32 (`ExpansionInputs.rule_deltas`) added in."""

    def bend(self, logits: torch.Tensor, slots: torch.Tensor, root: bool = False) -> torch.Tensor:
        """logits [R, scored] float32 bent at each row's rule slot [R] (slot 0: unbent);
        `root`: the roots' rows (a guide's root mask bends them too)."""


class ExpansionSteps:
    """The expansion's tensor steps, a mixin of DeviceExpansion (drafter/expansion.py), which
    sets these attributes: `forward` (one frontier step of the proposer's model), `catch_up`
    (its catch-up forward, None: none), `kv`, `vocab_size`, `scored_ids` (the target id of each
    column the forwards score, None: the target's vocabulary), `write_rows` (the row pool's
    write, None: no pool) and `rule_rows` (the logit rules' rows a key with `rules` counts its
    changes into, then bends every step's logits by, each row at its sequence's rule slot;
    None: none). Everything here is tensor ops on the device, so one graph captures a whole
    expansion."""

    forward: FrontierForward
    catch_up: CatchUpForward | None
    kv: KVCache
    vocab_size: int
    scored_ids: torch.Tensor | None
    write_rows: RowsWrite | None
    rule_rows: Callable[[], RowRules] | None

    def _body(self, key: Shape | Ahead, inputs: ExpansionInputs) -> None:
        """Every step of the expansion of `inputs`' rows; writes inputs.out."""
        if isinstance(key, Ahead):
            self._ahead_body(key, inputs)
            return
        bs = inputs.bs
        # [B] int32, [B, pages] int32, [B, q] int32, [B, q or 0] int32
        base32, table, _, catch_up, row_slots = split_meta(
            inputs.meta, bs, 0, key.catch_up, inputs.row_slots
        )
        base = base32.long()
        width = key.num_candidates
        sampling = inputs.sampling if key.sampled else None
        self._count_in(inputs)
        root_logits, root_features = self._roots(inputs, table, base32, base, catch_up, row_slots)
        rule_slots = inputs.rule_slots
        root_logits = self._bent(root_logits, rule_slots, root=True)
        out, supports = self._grow(
            key,
            inputs.grow,
            root_logits,
            root_features,
            table,
            base32,
            base,
            base,
            None,
            width,
            sampling,
            rule_slots,
        )
        if supports is None:
            inputs.out.copy_(out.reshape(-1))
            return
        ids, probs = supports
        inputs.out.copy_(torch.cat([out.reshape(-1), ids.reshape(-1)]))
        inputs.probs.copy_(probs.reshape(-1))

    def _ahead_body(self, key: Ahead, inputs: ExpansionInputs) -> None:
        """Draft-ahead's steps (`expand_ahead`) for `inputs`' rows; writes inputs.out: every
        outcome's candidates [B * outcomes, 3, n], then the bonus tokens [B, L + 1, g], then
        (a sampled chain's) every outcome's supports' tokens [B * outcomes, n, S], their
        probabilities in inputs.probs."""
        chain_len, g = key.chain_len, key.guesses
        bs, page = inputs.bs, self.kv.page_size
        consts = inputs.ahead
        assert consts is not None
        base32, table, chain32, catch_up, row_slots = split_meta(
            inputs.meta, bs, chain_len, key.catch_up, inputs.row_slots
        )
        base, chain = base32.long(), chain32.long()
        self._count_in(inputs)
        root = self._roots(inputs, table, base32, base, catch_up, row_slots)
        rule_slots = inputs.rule_slots
        logits, outputs = [self._bent(root[0], rule_slots, root=True)], [root[1]]
        # every chain node's storage, slot and KV length at once ([L, B]: a row a node)
        storage = consts.chain_cols + base  # [L, B]
        slots = cache_slots(table, storage.t(), page).t().contiguous()
        kv_lens = consts.chain_ends + base32
        for t in range(chain_len):  # the chain, a node a step: each reads its parent's output
            batch = self._node_batch(
                chain[:, t], storage[t], slots[t], kv_lens[t], base32, table,
                consts.chain_masks[t], consts.one, consts.every_row,
            )  # fmt: skip
            step_logits, step_out = self.forward(batch, outputs[-1])
            logits.append(self._bent(step_logits, rule_slots))
            outputs.append(step_out)
        # guesses: per accept length k the top g + 1 at node k, the chain's next node left out
        # [B, L + 1, g + 1] target ids
        top = self._target_ids(torch.stack(logits, dim=1).topk(g + 1, dim=-1).indices)
        after = torch.cat([chain, chain.new_full((bs, 1), -1)], dim=1)  # [B, L + 1]
        skip = (top == after[:, :, None]).to(torch.int8)
        bonus = top.gather(2, skip.argsort(dim=-1, stable=True)[:, :, :g])  # [B, L + 1, g]
        # the outcomes: row r = (b, k, j) of B * (L + 1) * g
        num = key.num_outcomes
        rows = bs * num
        base_r = base[consts.seq_of]
        prefix_r = base32[consts.seq_of]
        table_r = table[consts.seq_of]
        storage = base_r + consts.bonus_col
        slots = cache_slots(table_r, storage[:, None], page)[:, 0]
        features = None
        if outputs[0] is not None:  # node k's output (the root's for k = 0)
            per_k = torch.stack(outputs, dim=1)  # type: ignore[arg-type]
            features = per_k.reshape(bs * (chain_len + 1), -1)[consts.node_of]
        batch = ForwardBatch(
            input_ids=bonus.reshape(rows),
            positions=base_r + consts.k_of,
            slot_mapping=slots,
            cu_seqlens_q=consts.cu_rows,
            kv_lens=(prefix_r + consts.bonus_col + 1).to(torch.int32),
            prefix_lens=prefix_r,
            block_table=table_r,
            tree_mask=consts.visible[:, None, :],
            logit_indices=consts.rows,
            max_q_len=1,
            page_size=page,
        )
        root_logits, root_outputs = self.forward(batch, features)
        outcome_slots = None if rule_slots is None else rule_slots[consts.seq_of]
        root_logits = self._bent(root_logits, outcome_slots)
        start = storage + 1
        # a sampled chain's outcomes each draw at its sequence's uniforms: the ones its next
        # Draft would have drawn, whichever outcome comes
        sampling = inputs.sampling[consts.seq_of] if key.shape.sampled else None
        cands, supports = self._grow(
            key.shape,
            consts.grow,
            root_logits,
            root_outputs,
            table_r,
            prefix_r,
            start,
            base_r + consts.k_of + 1,
            consts.visible,
            key.width,
            sampling,
            outcome_slots,
        )
        parts = [cands.reshape(-1), bonus.reshape(-1)]
        if supports is not None:
            parts.append(supports[0].reshape(-1))
            inputs.probs.copy_(supports[1].reshape(-1))
        inputs.out.copy_(torch.cat(parts))

    def _roots(
        self,
        inputs: ExpansionInputs,
        table: torch.Tensor,  # [B, pages] int32
        base32: torch.Tensor,  # [B] int32: each row's entries after the catch-up
        base: torch.Tensor,  # the same, int64
        tokens: torch.Tensor,  # [B, q] int32: the catch-up's input tokens
        row_slots: torch.Tensor,  # [B, q or 0] int32: the slots of the pool's new rows
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The roots' logits and outputs: the inputs' own, or, with a catch-up of q entries a
        row (`inputs.catch_up`), computed here: entries [base - q, base) of every row, causal,
        at positions equal to their storage, the last one's logits and output (after the pool's
        new rows are written, which the catch-up reads)."""
        consts = inputs.catch_up
        if consts is None:
            return inputs.logits, inputs.features
        assert self.catch_up is not None, "this proposer has no catch-up forward"
        if inputs.new_rows is not None:
            assert self.write_rows is not None
            self.write_rows(row_slots.reshape(-1).long(), inputs.new_rows)
        q = consts.q
        storage = (base - q)[:, None] + consts.cols  # [B, q]
        batch = ForwardBatch(
            input_ids=tokens.reshape(-1).long(),
            positions=storage.reshape(-1),
            slot_mapping=cache_slots(table, storage, self.kv.page_size).reshape(-1),
            cu_seqlens_q=consts.cu,
            kv_lens=base32,
            prefix_lens=base32 - q,
            block_table=table,
            tree_mask=None,
            logit_indices=consts.last,
            max_q_len=q,
            page_size=self.kv.page_size,
        )
        return self.catch_up(batch)

    def _grow(
        self,
        shape: Shape,
        consts: GrowConstants,  # for shape.topk and R rows
        root_logits: torch.Tensor,  # [R, vocab]
        root_features: torch.Tensor | None,  # [R, width]
        table: torch.Tensor,  # [R, pages] int32
        prefix32: torch.Tensor,  # [R] int32: storage [0, prefix) visible to every node
        start: torch.Tensor,  # [R] int64: candidate 0's storage
        first_position: torch.Tensor,  # [R] int64: the position of depth-1 candidates
        visible: torch.Tensor | None,  # [R, width] bool: storage past prefix every node sees
        width: int,  # the new region's storage past prefix (masks' last dimension)
        sampling: torch.Tensor | None = None,  # [R, 3 + num_steps] a sampled chain's rows
        rule_slots: torch.Tensor | None = None,  # [R] each row's rule slot (None: unbent)
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Expand a tree of `shape` from each row's root logits (bent already); [R, 3, n]: the
        candidates' tokens, parents and best-first order, and a sampled chain's supports (tokens
        [R, n, S] and probabilities [R, n, S]) or None. A chain (topk 1) takes `_grow_chain`.
        Every step's logits are bent at its rows' `rule_slots`."""
        if shape.topk == 1:
            return self._grow_chain(
                shape, consts, root_logits, root_features, table, prefix32, start,
                first_position, visible, sampling, rule_slots,
            )  # fmt: skip
        k, n_all = shape.topk, shape.num_candidates
        bs, device, page = root_logits.shape[0], root_logits.device, self.kv.page_size
        col = start - prefix32.long()  # candidate 0's column in the masks
        tokens = torch.zeros(bs, n_all, dtype=torch.int64, device=device)
        parents = torch.full((bs, n_all), -1, dtype=torch.int64, device=device)
        scores = torch.zeros(bs, n_all, dtype=torch.float32, device=device)
        top_lp, top_tok = torch.log_softmax(root_logits.float(), dim=-1).topk(k, dim=-1)
        tokens[:, :k] = self._target_ids(top_tok)
        scores[:, :k] = top_lp
        frontier = consts.frontier  # [B, k] candidate ids
        # [B, k, width]: frontier row r sees column c (an ancestor, or itself)
        seen = torch.zeros(bs, k, width, dtype=torch.bool, device=device)
        if visible is not None:
            seen |= visible[:, None, :]
        seen.scatter_(2, (col[:, None] + frontier)[:, :, None], True)
        features = None
        if root_features is not None:
            features = root_features[:, None, :].expand(bs, k, -1)
        n = k
        for step in range(2, shape.num_steps + 1):
            storage = start[:, None] + frontier  # [B, k]
            slots = cache_slots(table, storage, page)
            batch = ForwardBatch(
                input_ids=tokens.gather(1, frontier).reshape(-1),
                positions=(first_position[:, None] + (step - 2)).expand(bs, k).reshape(-1),
                slot_mapping=slots.reshape(-1),
                cu_seqlens_q=consts.cu,
                kv_lens=(prefix32 + col + n).to(torch.int32),
                prefix_lens=prefix32,
                block_table=table,
                tree_mask=seen,
                logit_indices=consts.every_row,
                max_q_len=k,
                page_size=page,
            )
            flat = None if features is None else features.reshape(bs * k, -1)
            logits, outputs = self.forward(batch, flat)  # [B * k, V], [B * k, width]
            if rule_slots is not None:  # (a frontier row's sequence: row // k)
                logits = self._bent(logits, rule_slots[:, None].expand(bs, k).reshape(-1))
            top_lp, top_tok = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
            cum = scores.gather(1, frontier)[:, :, None] + top_lp.view(bs, k, k)
            new = k * k
            tokens[:, n : n + new] = self._target_ids(top_tok).view(bs, new)
            parents[:, n : n + new] = frontier[:, :, None].expand(bs, k, k).reshape(bs, new)
            scores[:, n : n + new] = cum.view(bs, new)
            keep = cum.view(bs, new).topk(k, dim=1).indices.sort(dim=1).values  # [B, k]
            from_row = keep // k  # the frontier row each kept child hangs from
            seen = seen.gather(1, from_row[:, :, None].expand(bs, k, width))
            seen.scatter_(2, (col[:, None] + n + keep)[:, :, None], True)
            if features is not None:
                assert outputs is not None
                per_row = outputs.view(bs, k, -1)
                features = per_row.gather(1, from_row[:, :, None].expand(bs, k, per_row.shape[2]))
            frontier = n + keep
            n += new
        order = torch.sort(-scores, dim=1, stable=True).indices
        return torch.stack([tokens, parents, order], dim=1), None

    def _grow_chain(
        self,
        shape: Shape,  # topk 1
        consts: GrowConstants,
        root_logits: torch.Tensor,
        root_features: torch.Tensor | None,
        table: torch.Tensor,
        prefix32: torch.Tensor,
        start: torch.Tensor,
        first_position: torch.Tensor,
        visible: torch.Tensor | None,
        sampling: torch.Tensor | None,
        rule_slots: torch.Tensor | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """`_grow` for a chain: node t (candidate t, depth t + 1) is the argmax of, or a draw
        from, its parent's logits (the root's for t = 0) and sits at storage start + t. Every
        forward's slots, positions, KV lengths and masks are known from the rows' storage alone,
        so they are computed once for all of the chain's forwards ([S - 1, R] each), not a
        step at a time as a tree's."""
        drawn: list[tuple[torch.Tensor, torch.Tensor]] = []  # a sampled chain's supports

        def next_token(logits: torch.Tensor) -> torch.Tensor:
            """Each row's next node: the argmax, or a draw from the cut distribution."""
            if sampling is None:  # (argmax_rows on a GPU: ~7 us less a step than torch's)
                return self._target_ids(greedy_tokens(logits))
            step = 3 + len(drawn)
            columns = draw_columns(self.scored_ids)
            read = logits if columns is not None else self._in_target_vocab(logits)
            token, ids, probs = draw_mapped(read, sampling[:, :3], sampling[:, step], columns)
            drawn.append((ids, probs))
            return token

        tokens = [next_token(root_logits)]
        if shape.num_steps > 1:
            page = self.kv.page_size
            storage = start + consts.chain_nodes  # [S - 1, R]: node t's, forwarded at step t
            slots = cache_slots(table, storage.t(), page).t().contiguous()
            positions = first_position + consts.chain_nodes
            kv_lens = (storage + 1).to(torch.int32)
            # node t sees candidates 0..t (columns col..col + t) and what every row sees
            rel = consts.cols - (start - prefix32.long())[:, None]  # [R, width]
            masks = (rel >= 0) & (rel <= consts.chain_nodes[:, :, None])  # [S - 1, R, width]
            if visible is not None:
                masks |= visible
            features = root_features
            for t in range(shape.num_steps - 1):
                batch = self._node_batch(
                    tokens[t], positions[t], slots[t], kv_lens[t], prefix32, table,
                    masks[t][:, None, :], consts.cu, consts.every_row,
                )  # fmt: skip
                logits, features = self.forward(batch, features)
                tokens.append(next_token(self._bent(logits, rule_slots)))
        cands = torch.stack(
            [torch.stack(tokens, dim=1), consts.chain_parents, consts.chain_order], dim=1
        )
        if not drawn:
            return cands, None
        ids, probs = zip(*drawn, strict=True)
        return cands, (torch.stack(ids, dim=1), torch.stack(probs, dim=1))

    def _node_batch(
        self,
        tokens: torch.Tensor,  # [R] one query token a row
        positions: torch.Tensor,  # [R]
        slots: torch.Tensor,  # [R]
        kv_lens: torch.Tensor,  # [R] int32
        prefix32: torch.Tensor,  # [R] int32
        table: torch.Tensor,  # [R, pages] int32
        mask: torch.Tensor,  # [R, 1, width] bool
        cu: torch.Tensor,  # [R + 1] int32
        rows: torch.Tensor,  # [R] the logit rows: every row
    ) -> ForwardBatch:
        """A forward of one token a row (a chain's node)."""
        return ForwardBatch(
            input_ids=tokens,
            positions=positions,
            slot_mapping=slots,
            cu_seqlens_q=cu,
            kv_lens=kv_lens,
            prefix_lens=prefix32,
            block_table=table,
            tree_mask=mask,
            logit_indices=rows,
            max_q_len=1,
            page_size=self.kv.page_size,
        )

    def _bent(
        self, logits: torch.Tensor, rule_slots: torch.Tensor | None, root: bool = False
    ) -> torch.Tensor:
        """`logits` [R, scored] bent at each row's rule slot [R] (None: as they are); `root`:
        the roots' rows (a guide's root mask bends them too)."""
        if rule_slots is None:
            return logits
        assert self.rule_rows is not None, "a key with rules needs the proposer's rule rows"
        return self.rule_rows().bend(logits, rule_slots, root)

    def _count_in(self, inputs: ExpansionInputs) -> None:
        """A key with rules: the rule rows' count changes crossing with the run counted in,
        before any step bends by them."""
        if inputs.rule_deltas is not None:
            assert self.rule_rows is not None, "a key with rules needs the proposer's rule rows"
            self.rule_rows().count_in(inputs.rule_deltas)

    def _target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids of the forwards' vocabulary as the target's."""
        return ids if self.scored_ids is None else self.scored_ids[ids]

    def _in_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, scored] logits -> [R, vocab]: in the target's vocabulary, -inf where the forwards
        score nothing."""
        if self.scored_ids is None:
            return logits
        return in_vocab(logits, self.scored_ids, self.vocab_size)
