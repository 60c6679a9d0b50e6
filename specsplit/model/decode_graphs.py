"""Greedy decode steps that advance themselves on the device (`AdvancingDecode`): a round's
further decode steps (VerifyInput.decode_steps) queued back to back behind its first, with no
host work between them (verifier/advancing.py `launch_advancing`).

One step is the model's forward over fixed inputs (one query token per sequence), the greedy
acceptance of a decode step (each row's argmax: its bonus token, as `queue_accept` takes it),
and the next step's inputs written in place: that token as the input id, the position, KV length
and prefix length one further, the next position's slot read from the block table. N steps are
N replays of one CUDA graph per batch bucket (its padding sequences read and write the cache's
scratch page only), each writing its tokens to row i of an [max_steps, bucket] output, i counted
on the device since the last `start`. The host fills the first step's inputs once (`start`,
after reserving every page the steps write) and reads the tokens once. Off a GPU the same body
runs eagerly on the step's own tensors, so the CPU tests its tokens against step-by-step rounds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from specsplit.kv_cache import KVCache
from specsplit.model.batch import ForwardBatch
from specsplit.model.cuda_graphs import BATCH_SIZES, empty_batch
from specsplit.model.graph_buffers import GraphBuffers
from specsplit.model.llama import LlamaModel

MAX_STEPS = 32  # the most steps between two `start`s (rows of the tokens' output)


class AdvancingDecode:
    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        max_context: int,
        max_batch_size: int = 64,
        max_steps: int = MAX_STEPS,
    ) -> None:
        self.model, self.kv = model, kv
        self.device = kv.device
        self.page_size = kv.page_size
        self.batch_sizes = [b for b in BATCH_SIZES if b < max_batch_size] + [max_batch_size]
        self.max_pages = -(-(max_context + 1) // kv.page_size)
        self.max_steps = max_steps
        width = self.batch_sizes[-1] if self.device.type == "cuda" else 0
        self.tokens_out = torch.zeros(max_steps, width, dtype=torch.int64, device=self.device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)  # steps taken
        self.buffers: GraphBuffers | None = None  # a GPU's fixed inputs (`capture`)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by batch bucket
        self.pool: Any = None
        self.batch: ForwardBatch | None = None  # the inputs the next step reads
        self.num_seqs = 0

    def capture(self) -> None:
        """A GPU's graphs, one per batch bucket (largest first, the smaller reuse its memory).
        Their warm-up runs advance padding sequences only (the scratch page)."""
        assert self.device.type == "cuda", "graphs are captured on a GPU"
        bs_max = self.batch_sizes[-1]
        self.buffers = GraphBuffers(bs_max, 1, self.max_pages, None, self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):
                self._pad_all(bs)
                batch = self.buffers.batch(bs, self.page_size)
                for _ in range(2):  # compile kernels and settle the allocator first
                    self.counter.zero_()
                    self._step(batch)
                self.counter.zero_()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self._step(batch)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _pad_all(self, bucket: int) -> None:
        """Every sequence of the bucket a padding one."""
        assert self.buffers is not None
        empty = empty_batch(self.page_size)
        self.buffers.fill(empty, bucket, self.kv.scratch_page, self.kv.scratch_slot)

    def fits(self, num_seqs: int, num_pages: int) -> bool:
        """Whether `start` takes a batch of `num_seqs` sequences of at most `num_pages` pages:
        anywhere off a GPU, within a captured bucket on one."""
        if self.device.type != "cuda":
            return True
        bucket = next((b for b in self.batch_sizes if b >= num_seqs), None)
        return bucket in self.graphs and num_pages <= self.max_pages

    def start(self, batch: ForwardBatch, tokens: torch.Tensor | None = None) -> None:
        """The first step's inputs: `batch` (host tensors, one query token per sequence at its
        next storage index, every page the steps will write in its block table; `fits`), its
        input ids replaced by `tokens` ([B] on the device) when given; the step count to 0."""
        bs = batch.num_seqs
        assert batch.max_q_len == 1 and batch.input_ids.shape[0] == bs, "one token a sequence"
        assert self.fits(bs, batch.block_table.shape[1]), (bs, batch.block_table.shape)
        self.num_seqs = bs
        self.counter.zero_()
        if self.device.type != "cuda":
            self.batch = _own_copy(batch)
            if tokens is not None:
                self.batch.input_ids.copy_(tokens)
            self.tokens_out = torch.zeros(self.max_steps, bs, dtype=torch.int64)
            return
        assert self.buffers is not None
        bucket = next(b for b in self.batch_sizes if b >= bs)
        self.buffers.fill(batch, bucket, self.kv.scratch_page, self.kv.scratch_slot, None, tokens)
        self.batch = self.buffers.batch(bucket, self.page_size)

    def step(self) -> None:
        """One decode step of the batch `start` set (queued: its graph's replay on a GPU)."""
        assert self.batch is not None, "start first"
        if self.device.type == "cuda":
            self.graphs[self.batch.num_seqs].replay()
        else:  # (a batch object a step: the CPU's attention keeps a plan per batch object)
            self._step(replace(self.batch, _plan=None))

    def tokens(self, num_steps: int) -> torch.Tensor:
        """[num_steps, B] on the device: the tokens of the steps since `start` (a view, valid
        until the next `start`), step by step."""
        assert num_steps <= self.max_steps, (num_steps, self.max_steps)
        return self.tokens_out[:num_steps, : self.num_seqs]

    def _step(self, batch: ForwardBatch) -> None:
        """The captured body: forward, argmax, the next step's inputs in place (captured in the
        grad mode the target's other graphs are, CudaGraphRunner's: their compiled kernels
        serve both)."""
        bs = batch.num_seqs
        logits = self.model(batch, self.kv).logits  # [bs, vocab] float32: every row's
        tokens = logits.argmax(dim=-1)  # [bs] the bonus tokens (a decode step's acceptance)
        self.tokens_out[:, :bs].index_copy_(0, self.counter, tokens[None])
        self.counter += 1
        batch.input_ids.copy_(tokens)
        batch.positions.add_(1)
        batch.kv_lens.add_(1)
        batch.prefix_lens.add_(1)
        pos = batch.positions
        # (after the last step the position may be past the pages reserved: its slot, never
        # written, comes from the table's last column)
        index = (pos // self.page_size).clamp(max=batch.block_table.shape[1] - 1)
        pages = batch.block_table.gather(1, index[:, None]).squeeze(1)
        batch.slot_mapping.copy_(pages.to(torch.int64) * self.page_size + pos % self.page_size)


def _own_copy(batch: ForwardBatch) -> ForwardBatch:
    """`batch` with tensors of its own (the steps write its inputs in place)."""
    return ForwardBatch(
        input_ids=batch.input_ids.clone(), positions=batch.positions.clone(),
        slot_mapping=batch.slot_mapping.clone(), cu_seqlens_q=batch.cu_seqlens_q.clone(),
        kv_lens=batch.kv_lens.clone(), prefix_lens=batch.prefix_lens.clone(),
        block_table=batch.block_table.clone(), tree_mask=None,
        logit_indices=batch.logit_indices.clone(), max_q_len=1, page_size=batch.page_size,
    )  # fmt: skip
