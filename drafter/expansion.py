"""Tree expansion as tensor ops over the whole batch (drafter/tree_draft.py's algorithm, the
same trees): every step of every sequence's expansion runs on the device, the host reads the
candidates once at the end. On a GPU each (topk, num_steps, batch bucket) is one CUDA graph,
captured on first use: a draft round is one replay, not one forward and one host sync per step.

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

Draft-ahead (`expand_ahead`, key `Ahead`) runs in the same way, one graph per (chain length,
guesses, shape, catch-up, batch bucket), captured on first use: the chain being verified, the
guessed bonus tokens and every outcome's tree, all in the sequence's own storage past the root.
A key with `catch_up` = q (`Shape.catch_up`, `Ahead.catch_up`) first runs the sequences'
catch-up to their roots (q entries each, ending at the root's; `CatchUpForward`) in the same
run, so that a Draft or a draft-ahead call is one replay: no separate catch-up step, no host
work between the two. A proposer with a row pool (`PoolRows`: an EAGLE head's target features,
a row per KV slot) hands such a run the round's new rows too: they cross with the inputs and the
run writes them into the pool before its catch-up reads it, instead of a copy and a scatter of
their own before the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from drafter.expansion_inputs import (
    Ahead,
    Candidates,
    ExpansionInputs,
    GrowConstants,
    PoolRows,
    Shape,
)
from specsplit.kv_cache import KVCache, SeqKV
from specsplit.model.batch import ForwardBatch
from specsplit.model.cuda_graphs import BATCH_SIZES
from specsplit.model.transfer import copy_rows
from specsplit.sampling import draw_from_cut
from specsplit.tree import DRAFT_SUPPORT, DraftProbs

log = logging.getLogger(__name__)

# a fused key (catch-up in the run) not captured at warm-up is captured at its round that asks
# for it this many times at one batch bucket (`DeviceExpansion.ready`): a shape that keeps
# coming (a client's own spec, `--ahead-guesses 4`, the short chains near max_new_tokens) gets
# the one-replay run, a one-off keeps the unfused path rather than a 10-50 ms capture in
# traffic. Unfused, a Draft of a chain of 2 took 1.35 ms on two H200s against 0.63 for the
# fused default chain of 3 (SmolLM2 + the shipped head, batch 1, bench/RESULTS.md)
FUSED_CAPTURE_AFTER = 8

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


class DeviceExpansion:
    """The expansion of TreeProposer on the device. `forward` runs one frontier step of the
    proposer's model over `kv`; `feature` is (width, dtype) of the per-row outputs a step feeds
    the next (an EAGLE head's), None when steps read none. `graphs`: capture CUDA graphs (on a
    GPU), else every expansion runs eagerly.

    `scored_ids` ([Vs] int64 on the device, ascending): the target id of each column of the
    forwards' logits where they score a vocabulary of their own (an EAGLE head's draft
    vocabulary); None: their logits are the target's. A greedy chain's argmax and draft-ahead's
    guesses then run over those Vs columns and map the ids they pick (ascending: an argmax picks
    what it would over the target's vocabulary with -inf elsewhere), and so do a tree's
    log-probabilities and top-k (the host expansion's too) and a sampled chain's draw where Vs
    holds a whole support (`draw_columns`; the host expansion draws over the same columns).

    `pool_rows` ((width, dtype)) and `write_rows`: the proposer's row pool (`PoolRows`), whose
    new rows a run with a catch-up writes before the catch-up reads them; None: it has none."""

    def __init__(
        self,
        forward: FrontierForward,
        kv: KVCache,
        vocab_size: int,
        max_context: int,
        feature: tuple[int, torch.dtype] | None,
        graphs: bool,
        max_batch_size: int = 64,
        catch_up: CatchUpForward | None = None,
        scored_ids: torch.Tensor | None = None,
        pool_rows: tuple[int, torch.dtype] | None = None,
        write_rows: RowsWrite | None = None,
    ) -> None:
        """catch_up: the proposer's catch-up forward, which keys with `catch_up` run (None: none
        can)."""
        self.forward = forward
        self.catch_up = catch_up
        self.kv = kv
        self.vocab_size = vocab_size
        self.scored_ids = scored_ids
        self.scored = vocab_size if scored_ids is None else scored_ids.shape[0]
        self.max_context = max_context
        self.feature = feature
        self.graphs = graphs and kv.device.type == "cuda"
        self.batch_sizes = [b for b in BATCH_SIZES if b < max_batch_size] + [max_batch_size]
        self.pool: Any = None  # the graphs' memory pool handle, made at the first capture
        self.captured: dict[
            tuple[Shape | Ahead, int], tuple[torch.cuda.CUDAGraph, ExpansionInputs]
        ] = {}
        # how often `ready` was asked for each (key, bucket) not captured
        self.asked: dict[tuple[Shape | Ahead, int], int] = {}
        # pinned host mirrors of each graph's meta input and packed output, its sampling input
        # and the supports' probabilities
        self.host: dict[tuple[Shape | Ahead, int], tuple[torch.Tensor, ...]] = {}
        self.pool_rows = pool_rows
        self.write_rows = write_rows
        # the graphs' new pool rows: one device buffer all of them read (each a view of its
        # first bucket * q rows; grown for a larger one, whose earlier views keep the old),
        # and its pinned host mirror (free again after each run, which waits for its copies)
        self.rows_buffer: torch.Tensor | None = None
        self.host_rows: torch.Tensor | None = None

    def ready(self, key: Shape | Ahead, bs: int) -> bool:
        """Whether an expansion of `key` (a fused catch-up's) for `bs` rows is to run: eagerly,
        from a graph already captured (warm-up captures the usual shapes), or from one its
        `expand` captures now, this being the FUSED_CAPTURE_AFTER-th time the key was asked
        for at this batch bucket; False before that (the caller takes the unfused path)."""
        bucket = self._bucket(bs)
        if not self.graphs or bucket is None or (key, bucket) in self.captured:
            return True
        asked = self.asked.get((key, bucket), 0) + 1
        self.asked[(key, bucket)] = asked
        return asked >= FUSED_CAPTURE_AFTER

    def _bucket(self, bs: int) -> int | None:
        """The smallest batch bucket that holds `bs` rows (None: none does)."""
        return next((b for b in self.batch_sizes if b >= bs), None)

    def max_pages(self, key: Shape | Ahead) -> int:
        width = key.width if isinstance(key, Ahead) else key.num_candidates
        return -(-(self.max_context + width) // self.kv.page_size)

    # -- running ---------------------------------------------------------------------------

    def expand(
        self,
        shape: Shape,
        seqs: list[SeqKV],  # each with base = kv_committed_len, pages reserved for the tree
        root_logits: torch.Tensor | None,  # [B, vocab] float32 on the device (None: catch-up)
        root_features: torch.Tensor | None,  # [B, width] the root's outputs (EAGLE)
        sampling: np.ndarray | None = None,  # [B, 3 + num_steps] a sampled chain's rows
        catch_ups: list[list[int]] | None = None,  # [B][shape.catch_up] the catch-ups' tokens
        new_rows: PoolRows | None = None,  # with a catch-up: the pool's new rows, a part a seq
    ) -> list[Candidates]:
        """Each sequence's candidates (with `shape.catch_up` = q, after its catch-up of q
        entries from `catch_ups`, as `expand_ahead`'s)."""
        bs, n = len(seqs), shape.num_candidates
        assert (root_logits is None) == bool(shape.catch_up), shape
        out, probs = self._run(
            shape, seqs, root_logits, root_features, [], sampling, catch_ups, new_rows
        )
        cands = out[: bs * 3 * n].reshape(bs, 3, n)
        found = [_candidates(cands, b) for b in range(bs)]
        if shape.sampled:
            ids = torch.from_numpy(out[bs * 3 * n :].reshape(bs, n, -1))
            weights = torch.from_numpy(probs.reshape(bs, n, -1))
            for b, candidates in enumerate(found):
                candidates.draft_probs = DraftProbs(ids[b], weights[b], self.vocab_size)
        return found

    def expand_ahead(
        self,
        key: Ahead,
        seqs: list[SeqKV],  # each with base = kv_committed_len, pages reserved for key.width
        root_logits: torch.Tensor | None,  # [B, vocab] float32 on the device (None: catch-up)
        root_features: torch.Tensor | None,  # [B, width] the root's outputs (EAGLE)
        chains: list[list[int]],  # [B][key.chain_len] the chains being verified
        catch_ups: list[list[int]] | None = None,  # [B][key.catch_up] the catch-ups' tokens
        new_rows: PoolRows | None = None,  # with a catch-up: the pool's new rows, a part a seq
    ) -> list[list[tuple[int, int, Candidates]]]:
        """Draft-ahead in one run (one graph replay): with `key.catch_up` = q, first each
        sequence's entries at storage [base - q, base) from `catch_ups` (causal; the last one
        the root's, whose logits and output the rest starts from, in place of `root_logits`
        and `root_features`); then the chain's nodes a step each (each reads its parent's
        output), the guessed bonus tokens at every accept length k (the likeliest at node k but
        the chain's next node), then each outcome's bonus and its tree, all in the sequence's
        own storage past the root: the chain at base + [0, L), outcome o's bonus at
        base + L + o * (1 + n) and its candidates after it, each row seeing only its ancestors.
        `new_rows` (a row pool's): written into the pool before the catch-up reads it.
        Per sequence, per outcome (k, j): (k, bonus, its tree's candidates)."""
        bs, n, g = len(seqs), key.shape.num_candidates, key.guesses
        assert (root_logits is None) == bool(key.catch_up), key
        out, _ = self._run(
            key, seqs, root_logits, root_features, chains, catch_ups=catch_ups, new_rows=new_rows
        )
        rows = bs * key.num_outcomes
        bonus = out[rows * 3 * n :].reshape(bs, key.chain_len + 1, g)
        cands = out[: rows * 3 * n].reshape(rows, 3, n)
        return [
            [
                (k, int(bonus[b, k, j]), _candidates(cands, (b * (key.chain_len + 1) + k) * g + j))
                for k in range(key.chain_len + 1)
                for j in range(g)
            ]
            for b in range(bs)
        ]

    def _run(
        self,
        key: Shape | Ahead,
        seqs: list[SeqKV],
        root_logits: torch.Tensor | None,
        root_features: torch.Tensor | None,
        chains: list[list[int]],
        sampling: np.ndarray | None = None,
        catch_ups: list[list[int]] | None = None,
        new_rows: PoolRows | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One expansion of `key` (a graph's replay where one fits, else eager): `inputs.out`
        and `inputs.probs` on the host, cut to the rows of `seqs`."""
        assert new_rows is None or (key.catch_up and new_rows.fit(key.catch_up)), key
        bs = len(seqs)
        bucket = self._bucket(bs)
        width = max(len(s.page_table) for s in seqs)
        if self.graphs and bucket is not None and width <= self.max_pages(key):
            if (key, bucket) not in self.captured:
                self._capture(key, bucket)
            graph, inputs = self.captured[(key, bucket)]
            host_meta, host_out, host_sampling, host_probs = self.host[(key, bucket)]
            sampled = None if sampling is None else host_sampling
            self._load(
                inputs,
                host_meta,
                sampled,
                seqs,
                root_logits,
                root_features,
                chains,
                catch_ups,
                new_rows,
            )
            if sampling is not None:
                host_sampling[:bs].copy_(torch.from_numpy(sampling))
                inputs.sampling.copy_(host_sampling, non_blocking=True)
            graph.replay()
            host_out.copy_(inputs.out, non_blocking=True)
            host_probs.copy_(inputs.probs, non_blocking=True)
            torch.cuda.current_stream(self.kv.device).synchronize()  # the mirrors are free after
            return _first_rows(host_out.numpy(), key, bucket, bs), host_probs.numpy()[
                : inputs.probs.numel() // bucket * bs
            ]
        inputs = ExpansionInputs(
            key,
            bs,
            self.vocab_size,
            self.scored,
            self.feature,
            width,
            self.kv.device,
            self._new_rows(bs * key.catch_up),
        )
        host = torch.zeros(inputs.meta.shape, dtype=torch.int32)
        self._load(
            inputs, host, None, seqs, root_logits, root_features, chains, catch_ups, new_rows
        )
        if sampling is not None:
            inputs.sampling.copy_(torch.from_numpy(sampling))
        self._body(key, inputs)
        return inputs.out.cpu().numpy(), inputs.probs.cpu().numpy()

    def _load(
        self,
        inputs: ExpansionInputs,
        host_meta: torch.Tensor,  # inputs.meta's host mirror (pinned for a graph's)
        host_sampling: torch.Tensor | None,  # inputs.sampling's (a graph's), reset here
        seqs: list[SeqKV],
        root_logits: torch.Tensor | None,
        root_features: torch.Tensor | None,
        chains: list[list[int]],
        catch_ups: list[list[int]] | None,
        new_rows: PoolRows | None = None,
    ) -> None:
        """Write the round into `inputs`: metadata through the host mirror, the pool's new rows
        (a sequence's at the start of its q) through theirs (a graph's) or straight, the roots'
        logits and features (unless the run catches up to them) device to device (padding rows
        keep what they held)."""
        bs = len(seqs)
        slots = None if new_rows is None else new_rows.slots
        self._fill_meta(
            host_meta.numpy(), seqs, inputs.bs, chains, catch_ups or [], inputs.row_slots, slots
        )
        inputs.meta.copy_(host_meta, non_blocking=True)
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
        base, table, chain, tokens, slots = _split(meta, bs, chain_len, catch_up, slots_per_row)
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

    def capture_all(self, key: Shape | Ahead) -> None:
        """The graphs of `key` at every batch bucket (warm-up), largest first; one log line."""
        buckets = [b for b in reversed(self.batch_sizes) if (key, b) not in self.captured]
        for bucket in buckets:
            self._capture(key, bucket, logged=False)
        log.info("captured the expansion graphs of %s at batch sizes %s", key, buckets[::-1])

    def _capture(self, key: Shape | Ahead, bucket: int, logged: bool = True) -> None:
        device = self.kv.device
        inputs = ExpansionInputs(
            key,
            bucket,
            self.vocab_size,
            self.scored,
            self.feature,
            self.max_pages(key),
            device,
            self._graph_rows(bucket * key.catch_up),
        )
        meta = np.zeros(tuple(inputs.meta.shape), dtype=np.int32)
        chain_len = key.chain_len if isinstance(key, Ahead) else 0
        catch_up = key.catch_up
        self._fill_meta(
            meta,
            [],
            bucket,
            [[0] * chain_len] if chain_len else [],
            [[0] * catch_up] if catch_up else [],
            inputs.row_slots,
        )
        inputs.meta.copy_(torch.from_numpy(meta))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._body(key, inputs)  # settle kernels and the allocator first
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self._body(key, inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.captured[(key, bucket)] = (graph, inputs)
        self.host[(key, bucket)] = tuple(
            torch.zeros_like(buffer, device="cpu").pin_memory()
            for buffer in (inputs.meta, inputs.out, inputs.sampling, inputs.probs)
        )
        if logged:  # one in traffic: a first round of its shape at this batch size
            log.info("captured the expansion graph of %s at batch %d", key, bucket)

    # -- the expansion ---------------------------------------------------------------------

    def _body(self, key: Shape | Ahead, inputs: ExpansionInputs) -> None:
        """Every step of the expansion of `inputs`' rows; writes inputs.out."""
        if isinstance(key, Ahead):
            self._ahead_body(key, inputs)
            return
        bs = inputs.bs
        # [B] int32, [B, pages] int32, [B, q] int32, [B, q or 0] int32
        base32, table, _, catch_up, row_slots = _split(
            inputs.meta, bs, 0, key.catch_up, inputs.row_slots
        )
        base = base32.long()
        width = key.num_candidates
        sampling = inputs.sampling if key.sampled else None
        root_logits, root_features = self._roots(inputs, table, base32, base, catch_up, row_slots)
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
        )
        if supports is None:
            inputs.out.copy_(out.reshape(-1))
            return
        ids, probs = supports
        inputs.out.copy_(torch.cat([out.reshape(-1), ids.reshape(-1)]))
        inputs.probs.copy_(probs.reshape(-1))

    def _ahead_body(self, key: Ahead, inputs: ExpansionInputs) -> None:
        """Draft-ahead's steps (`expand_ahead`) for `inputs`' rows; writes inputs.out: every
        outcome's candidates [B * outcomes, 3, n], then the bonus tokens [B, L + 1, g]."""
        chain_len, g = key.chain_len, key.guesses
        bs, page = inputs.bs, self.kv.page_size
        consts = inputs.ahead
        assert consts is not None
        base32, table, chain32, catch_up, row_slots = _split(
            inputs.meta, bs, chain_len, key.catch_up, inputs.row_slots
        )
        base, chain = base32.long(), chain32.long()
        root = self._roots(inputs, table, base32, base, catch_up, row_slots)
        logits, outputs = [root[0]], [root[1]]
        # every chain node's storage, slot and KV length at once ([L, B]: a row a node)
        storage = consts.chain_cols + base  # [L, B]
        slots = _slots(table, storage.t(), page).t().contiguous()
        kv_lens = consts.chain_ends + base32
        for t in range(chain_len):  # the chain, a node a step: each reads its parent's output
            batch = self._node_batch(
                chain[:, t], storage[t], slots[t], kv_lens[t], base32, table,
                consts.chain_masks[t], consts.one, consts.every_row,
            )  # fmt: skip
            step_logits, step_out = self.forward(batch, outputs[-1])
            logits.append(step_logits)
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
        slots = _slots(table_r, storage[:, None], page)[:, 0]
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
        start = storage + 1
        cands, _ = self._grow(
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
        )
        inputs.out.copy_(torch.cat([cands.reshape(-1), bonus.reshape(-1)]))

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
            slot_mapping=_slots(table, storage, self.kv.page_size).reshape(-1),
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
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Expand a tree of `shape` from each row's root logits; [R, 3, n]: the candidates'
        tokens, parents and best-first order, and a sampled chain's supports (tokens [R, n, S]
        and probabilities [R, n, S]) or None. A chain (topk 1) takes `_grow_chain`."""
        if shape.topk == 1:
            return self._grow_chain(
                shape, consts, root_logits, root_features, table, prefix32, start,
                first_position, visible, sampling,
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
            slots = _slots(table, storage, page)
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
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """`_grow` for a chain: node t (candidate t, depth t + 1) is the argmax of, or a draw
        from, its parent's logits (the root's for t = 0) and sits at storage start + t. Every
        forward's slots, positions, KV lengths and masks are known from the rows' storage alone,
        so they are computed once for all of the chain's forwards ([S - 1, R] each), not a
        step at a time as a tree's."""
        drawn: list[tuple[torch.Tensor, torch.Tensor]] = []  # a sampled chain's supports

        def next_token(logits: torch.Tensor) -> torch.Tensor:
            """Each row's next node: the argmax, or a draw from the cut distribution."""
            if sampling is None:
                return self._target_ids(logits.argmax(dim=-1))
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
            slots = _slots(table, storage.t(), page).t().contiguous()
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
                tokens.append(next_token(logits))
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

    def _target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids of the forwards' vocabulary as the target's."""
        return ids if self.scored_ids is None else self.scored_ids[ids]

    def _in_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, scored] logits -> [R, vocab]: in the target's vocabulary, -inf where the forwards
        score nothing."""
        if self.scored_ids is None:
            return logits
        return in_vocab(logits, self.scored_ids, self.vocab_size)


def in_vocab(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, C] logits of the ids `ids` [C] -> [R, vocab_size]: each at its id, -inf elsewhere
    (an EAGLE head's draft logits in the target's vocabulary)."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    full[:, ids] = logits
    return full


def draw_columns(scored_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The columns a sampled chain's draw reads, by their target ids: a vocabulary of the
    proposer's own (`scored_ids`) where it holds a whole support (DRAFT_SUPPORT ids, so the
    supports keep their width), else None: the target's. Either way the draw is exactly one
    from the distribution it reports (tokens outside the scored ones have probability 0)."""
    if scored_ids is None or scored_ids.shape[0] < DRAFT_SUPPORT:
        return None
    return scored_ids


def draw_mapped(
    logits: torch.Tensor,  # [R, C] the logits of `columns` (None: of the target's vocabulary)
    params: torch.Tensor,  # [R, 3]
    uniforms: torch.Tensor,  # [R]
    columns: torch.Tensor | None,  # [C] each column's target id
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`draw_from_cut` over `logits`' columns, the draws and the supports' tokens as the
    target's ids (the host and the device expansion draw alike)."""
    token, ids, probs = draw_from_cut(logits, params, uniforms, DRAFT_SUPPORT)
    if columns is not None:
        token, ids = columns[token], columns[ids]
    return token, ids, probs


def _slots(table: torch.Tensor, storage: torch.Tensor, page: int) -> torch.Tensor:
    """Cache slots [R, q] of storage indices [R, q] through each row's block table [R, pages]."""
    return table.gather(1, storage // page).long() * page + storage % page


def _candidates(out: np.ndarray, row: int) -> Candidates:
    """Row `row` of expansion output [rows, 3, n] as Candidates."""
    return Candidates(out[row, 0].tolist(), out[row, 1].tolist(), out[row, 2].tolist())


def _first_rows(out: np.ndarray, key: Shape | Ahead, bucket: int, bs: int) -> np.ndarray:
    """The flat output of a graph's `bucket` rows cut to its first `bs` (the padding after)."""
    if not isinstance(key, Ahead):  # candidates, then a sampled chain's supports' tokens
        cands = 3 * key.num_candidates
        if not key.sampled:
            return out[: bs * cands]
        ids = (len(out) - bucket * cands) // bucket
        return np.concatenate([out[: bs * cands], out[bucket * cands :][: bs * ids]])
    per_row = key.num_outcomes * 3 * key.shape.num_candidates
    bonus = (key.chain_len + 1) * key.guesses
    return np.concatenate([out[: bs * per_row], out[bucket * per_row :][: bs * bonus]])


A = TypeVar("A", np.ndarray, torch.Tensor)


def _split(
    meta: A, bs: int, chain_len: int, catch_up: int = 0, row_slots: int = 0
) -> tuple[A, A, A, A, A]:
    """The flat meta buffer of `bs` rows as (base [bs], block table [bs, pages], chains
    [bs, chain_len], catch-up tokens [bs, catch_up], new pool rows' slots [bs, row_slots])
    views."""
    slots = len(meta) - bs * row_slots
    end = slots - bs * catch_up
    start = end - bs * chain_len
    tables = meta[bs:start]
    return (
        meta[:bs],
        tables.reshape(bs, -1),
        meta[start:end].reshape(bs, chain_len),
        meta[end:slots].reshape(bs, catch_up),
        meta[slots:].reshape(bs, row_slots),
    )
