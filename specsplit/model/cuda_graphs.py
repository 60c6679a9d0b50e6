"""CUDA graphs of a model's decode and verify steps (DESIGN.md §6).

A step where every sequence brings the same number of query tokens `q` (1 for decode, 1 +
num_draft_tokens for verify) is replayed from a graph captured at warm-up for the smallest
bucketed batch size that holds it. The graph reads fixed input buffers; a step copies its
metadata in (a handful of small host-to-device copies), padding the batch up to the bucket with
sequences that read and write only the cache's scratch page. Logits and hidden states of every
row land in fixed output buffers; the step's wanted rows are gathered from them. Any other shape
(prefill, ragged q, a batch over the largest bucket) runs eagerly: the same forward, the same
tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from specsplit.kv_cache import KVCache
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.llama import LlamaModel

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64)


@dataclass
class _Buffers:
    """Fixed inputs and outputs of the graphs of one (q, aux_layers)."""

    input_ids: torch.Tensor  # [max_bs * q] int64
    positions: torch.Tensor  # [max_bs * q] int64
    slot_mapping: torch.Tensor  # [max_bs * q] int64
    cu_seqlens_q: torch.Tensor  # [max_bs + 1] int32
    kv_lens: torch.Tensor  # [max_bs] int32
    prefix_lens: torch.Tensor  # [max_bs] int32
    block_table: torch.Tensor  # [max_bs, max_pages] int32
    tree_mask: torch.Tensor | None  # [max_bs, q, q] bool (q > 1)
    rows: torch.Tensor  # [max_bs * q] int64 arange: every row's logits
    logits: torch.Tensor  # [max_bs * q, vocab] float32
    hidden_states: torch.Tensor | None  # [max_bs * q, len(aux) * hidden]

    def batch(self, bs: int, q: int, page_size: int) -> ForwardBatch:
        """Views of the first `bs` sequences: the graph of bucket `bs` reads exactly these."""
        t = bs * q
        return ForwardBatch(
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            slot_mapping=self.slot_mapping[:t],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            kv_lens=self.kv_lens[:bs],
            prefix_lens=self.prefix_lens[:bs],
            block_table=self.block_table[:bs],
            tree_mask=None if self.tree_mask is None else self.tree_mask[:bs],
            logit_indices=self.rows[:t],  # a view: the graph must not read freed memory
            max_q_len=q,
            page_size=page_size,
        )


class CudaGraphRunner:
    """Captured forwards of `model` over `kv`, keyed by (q, aux_layers, bucket)."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        max_batch_size: int = 64,
        max_context: int | None = None,
        max_query_len: int = 64,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = kv.device
        self.batch_sizes = [b for b in BATCH_SIZES if b < max_batch_size] + [max_batch_size]
        max_context = max_context or model.config.max_position_embeddings
        self.max_pages = -(-(max_context + max_query_len) // kv.page_size)
        self.max_query_len = max_query_len
        self.pool: Any = None  # one memory pool for every graph
        self.buffers: dict[tuple[int, tuple[int, ...]], _Buffers] = {}
        self.graphs: dict[tuple[int, tuple[int, ...], int], torch.cuda.CUDAGraph] = {}

    # -- capture ---------------------------------------------------------------------------

    def capture(self, q: int, aux_layers: tuple[int, ...] = ()) -> None:
        """Capture every bucket for steps of `q` query tokens per sequence (largest first, so
        the smaller ones reuse its memory)."""
        key = (q, aux_layers)
        if key in self.buffers:
            return
        assert 1 <= q <= self.max_query_len, (q, self.max_query_len)
        buffers = self._new_buffers(q, aux_layers)
        self.buffers[key] = buffers
        self._pad(buffers, 0, self.batch_sizes[-1], q)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):
                batch = buffers.batch(bs, q, self.kv.page_size)
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
        log.info(
            "captured CUDA graphs for q=%d aux=%s, batch sizes %s", q, aux_layers, self.batch_sizes
        )

    def _run(
        self, buffers: _Buffers, batch: ForwardBatch, aux_layers: tuple[int, ...], t: int
    ) -> None:
        out = self.model(batch, self.kv, aux_layers=aux_layers)
        buffers.logits[:t].copy_(out.logits)
        if buffers.hidden_states is not None and out.hidden_states is not None:
            buffers.hidden_states[:t].copy_(out.hidden_states)

    def _new_buffers(self, q: int, aux_layers: tuple[int, ...]) -> _Buffers:
        n, t = self.batch_sizes[-1], self.batch_sizes[-1] * q
        config = self.model.config

        def ints(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        hidden = None
        if aux_layers:
            width = len(aux_layers) * config.hidden_size
            hidden = torch.zeros(t, width, dtype=self.model.dtype, device=self.device)
        return _Buffers(
            input_ids=ints(t, dtype=torch.int64),
            positions=ints(t, dtype=torch.int64),
            slot_mapping=ints(t, dtype=torch.int64),
            cu_seqlens_q=torch.arange(0, t + 1, q, dtype=torch.int32, device=self.device),
            kv_lens=ints(n),
            prefix_lens=ints(n),
            block_table=ints(n, self.max_pages),
            tree_mask=ints(n, q, q, dtype=torch.bool) if q > 1 else None,
            rows=torch.arange(t, dtype=torch.int64, device=self.device),
            logits=torch.zeros(t, config.vocab_size, dtype=torch.float32, device=self.device),
            hidden_states=hidden,
        )

    def _pad(self, buffers: _Buffers, start: int, end: int, q: int) -> None:
        """Sequences [start, end) become padding: q tokens on the scratch page, causal."""
        if start >= end:
            return
        kv = self.kv
        buffers.input_ids[start * q : end * q].zero_()
        buffers.positions[start * q : end * q].zero_()
        buffers.slot_mapping[start * q : end * q].fill_(kv.scratch_slot)
        buffers.kv_lens[start:end].fill_(q)
        buffers.prefix_lens[start:end].zero_()
        buffers.block_table[start:end].fill_(kv.scratch_page)
        if buffers.tree_mask is not None:
            causal = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
            buffers.tree_mask[start:end] = causal

    # -- replay ----------------------------------------------------------------------------

    def bucket(self, batch: ForwardBatch, aux_layers: tuple[int, ...]) -> int | None:
        """The batch size of the graph that can run `batch` (host metadata), or None."""
        bs = batch.num_seqs
        if bs == 0 or bs > self.batch_sizes[-1] or batch.block_table.shape[1] > self.max_pages:
            return None
        q = batch.max_q_len
        if (q, aux_layers) not in self.buffers or batch.input_ids.shape[0] != bs * q:
            return None  # a ragged batch: some sequence has fewer than q tokens
        if batch.tree_mask is not None and tuple(batch.tree_mask.shape[1:]) != (q, q):
            return None
        if (
            batch.tree_mask is None
            and q > 1
            and bool((batch.kv_lens - batch.prefix_lens != q).any())
        ):
            return None
        return next(b for b in self.batch_sizes if b >= bs)

    def forward(self, batch: ForwardBatch, aux_layers: tuple[int, ...]) -> ForwardOutput | None:
        """Replay the graph for `batch` (host tensors) and return its wanted rows, or None when
        no captured graph fits (the caller runs the step eagerly)."""
        bucket = self.bucket(batch, aux_layers)
        if bucket is None:
            return None
        q, bs = batch.max_q_len, batch.num_seqs
        buffers = self.buffers[(q, aux_layers)]
        t = bs * q
        buffers.input_ids[:t].copy_(batch.input_ids, non_blocking=True)
        buffers.positions[:t].copy_(batch.positions, non_blocking=True)
        buffers.slot_mapping[:t].copy_(batch.slot_mapping, non_blocking=True)
        buffers.kv_lens[:bs].copy_(batch.kv_lens, non_blocking=True)
        buffers.prefix_lens[:bs].copy_(batch.prefix_lens, non_blocking=True)
        width = batch.block_table.shape[1]
        buffers.block_table[:bs, :width].copy_(batch.block_table, non_blocking=True)
        if buffers.tree_mask is not None:
            if batch.tree_mask is not None:
                buffers.tree_mask[:bs].copy_(batch.tree_mask, non_blocking=True)
            else:
                buffers.tree_mask[:bs] = torch.ones(
                    q, q, dtype=torch.bool, device=self.device
                ).tril()
        self._pad(buffers, bs, bucket, q)
        self.graphs[(q, aux_layers, bucket)].replay()
        rows = batch.logit_indices.to(self.device, non_blocking=True)
        logits = buffers.logits[:t].index_select(0, rows)
        hidden = None
        if buffers.hidden_states is not None:
            hidden = buffers.hidden_states[:t].index_select(0, rows)
        return ForwardOutput(logits=logits, hidden_states=hidden)
