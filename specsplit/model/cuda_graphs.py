"""CUDA graphs of a model's decode and verify steps (DESIGN.md §6): the target's, the draft
model's and an EAGLE head's.

A step where every sequence brings the same number of query tokens `q` (1 for decode and a
chain's draft steps, 1 + num_draft_tokens for verify, a drafter's catch-up padded to a captured
q) is replayed from a graph captured at warm-up for the smallest bucketed batch size that holds
it. The graph reads fixed input buffers; a step copies its
metadata in (a handful of small host-to-device copies), padding the batch up to the bucket with
sequences that read and write only the cache's scratch page. Logits and hidden states of every
row land in fixed output buffers; the step's wanted rows are gathered from them. A q may be
captured for fewer batch buckets (`capture(max_batch=)`: the verifier's prefill graphs, a prompt
of up to 128 tokens, at most 4 at once). Any other shape (a longer prefill, a batch over the
largest bucket) runs eagerly: the same forward, the same tokens.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from specsplit.kv_cache import KVCache
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.llama import LlamaModel

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64)

# The forward a runner captures: (batch, aux_layers, features) -> logits (and hidden states) of
# every row. features: [T, feature_width] per-token inputs besides the tokens (an EAGLE head's
# fused target features or its own earlier outputs); None for a plain model.
StepForward = Callable[[ForwardBatch, tuple[int, ...], torch.Tensor | None], ForwardOutput]


class _Buffers:
    """Fixed inputs and outputs of the graphs of one (q, aux_layers). The inputs are views of
    one packed device tensor with a pinned host mirror: a step fills the mirror and moves it in
    one asynchronous copy (a pageable copy would wait for the GPU each time). The outputs are
    sized from the first (largest) warm-up run."""

    def __init__(
        self,
        max_bs: int,
        q: int,
        max_pages: int,
        features: tuple[int, torch.dtype] | None,  # (width, dtype) of a features input
        device: torch.device,
    ) -> None:
        t = max_bs * q
        self.q, self.max_bs, self.max_pages = q, max_bs, max_pages
        # one pinned host mirror and its device copy, bytes seen as three arrays (a step moves
        # them in one copy, ~10 us of host work each): int64, each [max_bs * q]: input_ids,
        # positions, slot_mapping, the step's logit rows, its hidden-state rows, and every row
        # (an arange: what the graphs compute); int32: cu_seqlens_q [max_bs + 1], kv_lens,
        # prefix_lens [max_bs], block_table; the bool mask [max_bs, q, q] (copied where q > 1)
        sizes = [6 * t * 8, (1 + 3 * max_bs + max_bs * max_pages) * 4, max_bs * q * q]
        # each array 256-byte aligned, as an allocation of its own would be (kernels' loads)
        ends = list(itertools.accumulate(-(-size // 256) * 256 for size in sizes))
        self.host_bytes = torch.zeros(ends[-1], dtype=torch.uint8).pin_memory()
        self.dev_bytes = self.host_bytes.to(device)
        # (the mask's bytes are copied only where q > 1: the two arrays before it are all of a
        # step's inputs otherwise)
        num_copied = ends[-1] if q > 1 else ends[1]
        self.host_copied = self.host_bytes[:num_copied]
        self.dev_copied = self.dev_bytes[:num_copied]
        host64, host32, host_mask = self._arrays(self.host_bytes, sizes, ends)
        host64[5 * t :] = torch.arange(t)
        host32[: max_bs + 1] = torch.arange(0, t + 1, q, dtype=torch.int32)
        self.dev_bytes.copy_(self.host_bytes)
        self.copied = torch.cuda.Event()
        # views made once: numpy ones of the mirrors (a step fills them at numpy's cost, ~1 us
        # a slice, not torch's ~5 us), tensor ones of the device inputs
        self.host: dict[str, Any] = {
            name: None if view is None else view.numpy()
            for name, view in self._views(host64, host32, host_mask).items()
        }
        self.dev: dict[str, Any] = self._views(*self._arrays(self.dev_bytes, sizes, ends))
        self.causal = np.tril(np.ones((q, q), dtype=bool))
        self.features = (
            None
            if features is None
            else torch.zeros(t, features[0], dtype=features[1], device=device)
        )
        self.logits: torch.Tensor | None = None  # [max_bs * q, vocab] float32
        self.hidden_states: torch.Tensor | None = None  # [max_bs * q, width] when there are any

    def keep(self, out: ForwardOutput) -> None:
        """Copy a run's outputs (all rows) into the fixed output buffers, made on the first."""
        t = out.logits.shape[0]
        if self.logits is None:  # the first run: the largest bucket
            self.logits = torch.zeros_like(out.logits, dtype=torch.float32)
            if out.hidden_states is not None:
                self.hidden_states = torch.zeros_like(out.hidden_states)
        self.logits[:t].copy_(out.logits)
        if self.hidden_states is not None and out.hidden_states is not None:
            self.hidden_states[:t].copy_(out.hidden_states)

    def _arrays(
        self, data: torch.Tensor, sizes: list[int], ends: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The int64, int32 and mask arrays in `data`'s bytes (pieces of `sizes` bytes, each
        starting where the one before ends, `ends`)."""
        starts = [0, *ends[:-1]]
        pieces = [data[a : a + size] for a, size in zip(starts, sizes, strict=True)]
        mask = pieces[2].view(torch.bool).view(self.max_bs, self.q, self.q)
        return pieces[0].view(torch.int64), pieces[1].view(torch.int32), mask

    def _views(
        self, packed64: torch.Tensor, packed32: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, Any]:
        t, n = self.max_bs * self.q, self.max_bs
        ids, positions, slots, rows, hidden_rows, all_rows = packed64.split(t)
        cu, kv_lens, prefix_lens, table = packed32.split([n + 1, n, n, n * self.max_pages])
        return dict(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            rows=rows,
            hidden_rows=hidden_rows,
            all_rows=all_rows,
            cu_seqlens_q=cu,
            kv_lens=kv_lens,
            prefix_lens=prefix_lens,
            block_table=table.view(n, self.max_pages),
            tree_mask=mask if self.q > 1 else None,
        )

    def batch(self, bs: int, page_size: int) -> ForwardBatch:
        """Device views of the first `bs` sequences: the graph of bucket `bs` reads these."""
        v, q = self.dev, self.q
        t = bs * q
        return ForwardBatch(
            input_ids=v["input_ids"][:t],
            positions=v["positions"][:t],
            slot_mapping=v["slot_mapping"][:t],
            cu_seqlens_q=v["cu_seqlens_q"][: bs + 1],
            kv_lens=v["kv_lens"][:bs],
            prefix_lens=v["prefix_lens"][:bs],
            block_table=v["block_table"][:bs],
            tree_mask=None if v["tree_mask"] is None else v["tree_mask"][:bs],
            logit_indices=v["all_rows"][:t],  # fixed memory the graph may read
            max_q_len=q,
            page_size=page_size,
        )

    def fill(
        self,
        batch: ForwardBatch,
        bucket: int,
        scratch_page: int,
        scratch_slot: int,
        features: torch.Tensor | None = None,  # [T, width] on the device
        tokens: torch.Tensor | None = None,  # [T] on the device: the input ids, not the host's
    ) -> None:
        """Write `batch` (host tensors) and padding up to `bucket` into the host mirrors, then
        move them to the device (asynchronously, after the last move has finished); features go
        device to device (the padding rows keep what they held). A sequence with fewer than q
        query tokens is padded at its end with rows that read its first new token and write
        the scratch slot (CudaGraphRunner.plan)."""
        self.copied.synchronize()  # the mirrors are free again
        v, q, bs = self.host, self.q, batch.num_seqs
        t, t_pad = bs * q, bucket * q
        cu = batch.cu_seqlens_q.numpy()
        q_lens = np.diff(cu)
        ragged = bool((q_lens != q).any())
        dst: Any = slice(0, t)  # where each token's row goes: in order, or at b * q + i
        if ragged:
            seq = np.repeat(np.arange(bs), q_lens)  # [T] the sequence of each token
            dst = seq * q + np.arange(cu[-1]) - cu[:-1][seq]
            v["input_ids"][:t] = 0
            v["positions"][:t] = 0
            v["slot_mapping"][:t] = scratch_slot
        v["input_ids"][dst] = batch.input_ids.numpy()
        v["positions"][dst] = batch.positions.numpy()
        v["slot_mapping"][dst] = batch.slot_mapping.numpy()
        rows = batch.logit_indices.numpy()
        v["rows"][: rows.shape[0]] = dst[rows] if ragged else rows
        if batch.hidden_indices is not None:
            rows = batch.hidden_indices.numpy()
            v["hidden_rows"][: rows.shape[0]] = dst[rows] if ragged else rows
        v["kv_lens"][:bs] = batch.kv_lens.numpy()
        v["prefix_lens"][:bs] = batch.prefix_lens.numpy()
        width = batch.block_table.shape[1]
        v["block_table"][:bs, :width] = batch.block_table.numpy()
        if v["tree_mask"] is not None:
            self._fill_mask(batch, q_lens, ragged)
        # padding sequences: q causal tokens on the scratch page
        v["input_ids"][t:t_pad] = 0
        v["positions"][t:t_pad] = 0
        v["slot_mapping"][t:t_pad] = scratch_slot
        v["kv_lens"][bs:bucket] = q
        v["prefix_lens"][bs:bucket] = 0
        v["block_table"][bs:bucket] = scratch_page
        if v["tree_mask"] is not None:
            v["tree_mask"][bs:bucket] = self.causal
        self.dev_copied.copy_(self.host_copied, non_blocking=True)
        if features is not None:
            assert self.features is not None, "this graph takes no features"
            self.features[:t].copy_(features)
        if tokens is not None:  # over the host's input ids, in stream order
            self.dev["input_ids"][:t].copy_(tokens)
        self.copied.record(torch.cuda.current_stream(self.dev_bytes.device))

    def rows(self, out: torch.Tensor, name: str, num: int, views: bool) -> torch.Tensor:
        """The first `num` rows named `name` ("rows", "hidden_rows": filled by the last `fill`)
        of the step's outputs `out` ([t, width]): `out` itself where `views` allows it and they
        are its rows 0..t-1 in order, else gathered."""
        if (
            views
            and num == out.shape[0]
            and np.array_equal(self.host[name][:num], self.host["all_rows"][:num])
        ):
            return out
        return out.index_select(0, self.dev[name][:num])

    def _fill_mask(self, batch: ForwardBatch, q_lens: np.ndarray, ragged: bool) -> None:
        """Each sequence's [q, q] mask among its new tokens: the batch's tree mask or causal
        (query i sees the new tokens up to its own), padding rows see the first new token."""
        mask, bs = self.host["tree_mask"], batch.num_seqs
        num_new = batch.kv_lens.numpy() - batch.prefix_lens.numpy()  # (numpy: ~10 us less)
        tree = None if batch.tree_mask is None else batch.tree_mask.numpy()
        if not ragged and (num_new == self.q).all():
            mask[:bs] = self.causal if tree is None else tree
            return
        mask[:bs] = False
        for b in range(bs):
            q_len, new = int(q_lens[b]), int(num_new[b])
            if tree is None:
                mask[b, :q_len, :new] = np.tri(q_len, new, new - q_len, dtype=bool)
            else:
                mask[b, :q_len, :new] = tree[b, :q_len, :new]
            mask[b, q_len:, 0] = True


class CudaGraphRunner:
    """Captured runs of `forward` over `kv`, keyed by (q, aux_layers, bucket): every q given to
    `capture` at warm-up without hidden states, and the same q with a new set of hidden-state
    layers (an EAGLE drafter's) captured on its first use. `features`: (width, dtype) of the
    per-token features input `forward` takes (an EAGLE head), None = none."""

    def __init__(
        self,
        forward: StepForward,
        kv: KVCache,
        max_context: int,
        max_batch_size: int = 64,
        max_query_len: int = 64,
        features: tuple[int, torch.dtype] | None = None,
    ) -> None:
        self.step_forward = forward
        self.kv = kv
        self.device = kv.device
        self.features = features
        self.batch_sizes = [b for b in BATCH_SIZES if b < max_batch_size] + [max_batch_size]
        self.max_pages = -(-(max_context + max_query_len) // kv.page_size)
        self.max_query_len = max_query_len
        self.q_sizes: dict[int, list[int]] = {}  # each captured q's batch buckets
        self.pool: Any = None  # one memory pool for every graph
        self.buffers: dict[tuple[int, tuple[int, ...]], _Buffers] = {}
        self.graphs: dict[tuple[int, tuple[int, ...], int], torch.cuda.CUDAGraph] = {}

    @classmethod
    def for_model(
        cls,
        model: LlamaModel,
        kv: KVCache,
        max_context: int | None = None,
        max_batch_size: int = 64,
        max_query_len: int = 64,
    ) -> CudaGraphRunner:
        """Graphs of a plain model's steps (the target's, a draft model's)."""

        def forward(
            batch: ForwardBatch, aux_layers: tuple[int, ...], _: torch.Tensor | None
        ) -> ForwardOutput:
            return model(batch, kv, aux_layers=aux_layers)

        return cls(
            forward,
            kv,
            max_context or model.config.max_position_embeddings,
            max_batch_size=max_batch_size,
            max_query_len=max_query_len,
        )

    # -- capture ---------------------------------------------------------------------------

    def capture(
        self, q: int, aux_layers: tuple[int, ...] = (), max_batch: int | None = None
    ) -> None:
        """Capture every bucket for steps of `q` query tokens per sequence (largest first, so
        the smaller ones reuse its memory); with `max_batch`, only the buckets up to it, for
        this q with any layers (prefills: few at once, many rows each, logits of every row):
        a q's buckets are set by its first capture."""
        assert 1 <= q <= self.max_query_len, (q, self.max_query_len)
        if q not in self.q_sizes:
            limit = self.batch_sizes[-1] if max_batch is None else max_batch
            assert limit <= self.batch_sizes[-1], (limit, self.batch_sizes)
            self.q_sizes[q] = [b for b in self.batch_sizes if b < limit] + [limit]
        key = (q, aux_layers)
        if key in self.buffers:
            return
        sizes = self.q_sizes[q]
        buffers = _Buffers(sizes[-1], q, self.max_pages, self.features, self.device)
        self.buffers[key] = buffers
        empty = self._empty_batch()
        buffers.fill(empty, sizes[-1], self.kv.scratch_page, self.kv.scratch_slot)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(sizes):
                batch = buffers.batch(bs, self.kv.page_size)
                for _ in range(2):  # compile kernels and settle the allocator first
                    self._run(buffers, batch, aux_layers, bs * q)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self._run(buffers, batch, aux_layers, bs * q)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(q, aux_layers, bs)] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for q=%d aux=%s, batch sizes %s", q, aux_layers, sizes)

    def sizes(self, q: int) -> list[int]:
        """The batch buckets captured for steps of q query tokens."""
        return self.q_sizes[q]

    def _run(
        self, buffers: _Buffers, batch: ForwardBatch, aux_layers: tuple[int, ...], t: int
    ) -> None:
        features = None if buffers.features is None else buffers.features[:t]
        buffers.keep(self.step_forward(batch, aux_layers, features))

    def _empty_batch(self) -> ForwardBatch:
        """No sequences: filling buffers with it pads every sequence."""
        none = torch.zeros(0, dtype=torch.int64)
        none32 = torch.zeros(0, dtype=torch.int32)
        return ForwardBatch(
            input_ids=none,
            positions=none,
            slot_mapping=none,
            cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
            kv_lens=none32,
            prefix_lens=none32,
            block_table=torch.zeros(0, 1, dtype=torch.int32),
            tree_mask=None,
            logit_indices=none,
            max_q_len=0,
            page_size=self.kv.page_size,
        )

    # -- replay ----------------------------------------------------------------------------

    def plan(self, batch: ForwardBatch, device_rows: bool = False) -> tuple[int, int] | None:
        """(q, batch size) of the graph that can run `batch` (host metadata), or None: the
        smallest captured q that holds its longest sequence; a sequence with fewer query tokens
        (a ragged batch, a tree's frontier, or q not captured itself) is padded to q
        (_Buffers.fill): with q > 1 every sequence's new tokens must fit the graph's [q, q]
        mask, so q also holds the most new tokens of any sequence. device_rows: some of the
        inputs come from the device (features, tokens): only a batch that needs no padding
        rows between its sequences."""
        bs = batch.num_seqs
        if bs == 0 or bs > self.batch_sizes[-1] or batch.block_table.shape[1] > self.max_pages:
            return None
        captured = self.q_sizes  # any layers: forward() captures these on use
        # one query token per sequence sees all its new tokens: no mask (a chain's draft step)
        one = batch.max_q_len == 1 and (batch.tree_mask is None or batch.tree_mask.shape[2] == 1)
        # the most new tokens of any sequence, in numpy (torch's CPU ops cost ~10 us each here)
        news = 0 if one else int((batch.kv_lens.numpy() - batch.prefix_lens.numpy()).max())
        need = 1 if one else max(batch.max_q_len, news)
        # the smallest q that holds it and has a bucket for its batch (a prefill's q has few)
        q = min((n for n, sizes in captured.items() if n >= need and sizes[-1] >= bs), default=None)
        if q is None or (q == 1 and not one):
            return None
        if device_rows and batch.input_ids.shape[0] != bs * q:
            # padding rows would need the device's features or tokens scattered there too
            return None
        return q, next(b for b in captured[q] if b >= bs)

    def forward(
        self,
        batch: ForwardBatch,
        aux_layers: tuple[int, ...] = (),
        features: torch.Tensor | None = None,  # [T, width] on the device
        tokens: torch.Tensor | None = None,  # [T] on the device: input ids the host lacks
        place: Callable[[ForwardBatch], None] | None = None,
        views: bool = False,
    ) -> ForwardOutput | None:
        """Replay the graph for `batch` (host tensors; `tokens`, when given, in place of its
        input ids; `place`, when given, rewrites the graph's inputs on the device first: a
        chained round's, verifier/chain.py) and return its wanted rows, or None when no captured
        graph fits (the caller runs the step eagerly). views: wanted rows that are all the
        step's rows in order (no padding between sequences: most rounds) come back as views of
        the graph's output buffers, not gathered copies (~20 us of host work each): valid until
        the graph's next replay, which the device runs after whatever the caller queued on them
        first (the verifier's acceptance and rows, queued at once)."""
        plan = self.plan(batch, features is not None or tokens is not None or place is not None)
        if plan is None:
            return None
        q, bucket = plan
        # hidden states asked for (an EAGLE drafter): capture the same q with these layers too
        self.capture(q=q, aux_layers=aux_layers)  # once; a no-op after
        bs = batch.num_seqs
        buffers = self.buffers[(q, aux_layers)]
        buffers.fill(batch, bucket, self.kv.scratch_page, self.kv.scratch_slot, features, tokens)
        if place is not None:
            place(buffers.batch(bucket, self.kv.page_size))
        self.graphs[(q, aux_layers, bucket)].replay()
        assert buffers.logits is not None
        t, num_rows = bs * q, batch.logit_indices.shape[0]
        logits = buffers.rows(buffers.logits[:t], "rows", num_rows, views)
        hidden = None
        if buffers.hidden_states is not None:
            if batch.hidden_indices is None:  # the logits' rows
                hidden = buffers.rows(buffers.hidden_states[:t], "rows", num_rows, views)
            else:
                num = batch.hidden_indices.shape[0]
                hidden = buffers.rows(buffers.hidden_states[:t], "hidden_rows", num, views)
        return ForwardOutput(logits=logits, hidden_states=hidden)
