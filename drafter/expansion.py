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
cumulative log-probability. Sampled chains stay on the host path (their draws are per tree).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from specsplit.kv_cache import KVCache, SeqKV
from specsplit.model.batch import ForwardBatch
from specsplit.model.cuda_graphs import BATCH_SIZES

log = logging.getLogger(__name__)

# one frontier forward: (batch, features [T, width] or None) -> (logits [T, vocab] float32 in
# the target's vocabulary, the step's per-row outputs for the next step's features or None)
FrontierForward = Callable[
    [ForwardBatch, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
]


@dataclass(frozen=True)
class Shape:
    topk: int
    num_steps: int

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.num_steps - 1) * self.topk * self.topk


@dataclass
class Candidates:
    """One sequence's expansion: every candidate's token and parent (-1 = the root), and the
    candidates best first (score descending, ties to the lower index: a parent before its
    children)."""

    tokens: list[int]
    parents: list[int]
    order: list[int]


class _Inputs:
    """What one expansion reads and writes, for a batch of `bs` rows: the fixed buffers of a
    CUDA graph, or one eager run's tensors."""

    def __init__(
        self,
        shape: Shape,
        bs: int,
        vocab: int,
        feature: tuple[int, torch.dtype] | None,
        max_pages: int,
        device: torch.device,
    ) -> None:
        n = shape.num_candidates
        self.logits = torch.zeros(bs, vocab, dtype=torch.float32, device=device)
        self.features = (
            None
            if feature is None
            else torch.zeros(bs, feature[0], dtype=feature[1], device=device)
        )
        # int32: every row's base [bs], then the block table [bs, max_pages] (_split)
        self.meta = torch.zeros(bs * (1 + max_pages), dtype=torch.int32, device=device)
        self.out = torch.zeros(bs, 3, n, dtype=torch.int64, device=device)  # tokens, parents, order


class DeviceExpansion:
    """The expansion of TreeProposer on the device. `forward` runs one frontier step of the
    proposer's model over `kv`; `feature` is (width, dtype) of the per-row outputs a step feeds
    the next (an EAGLE head's), None when steps read none. `graphs`: capture CUDA graphs (on a
    GPU), else every expansion runs eagerly."""

    def __init__(
        self,
        forward: FrontierForward,
        kv: KVCache,
        vocab_size: int,
        max_context: int,
        feature: tuple[int, torch.dtype] | None,
        graphs: bool,
        max_batch_size: int = 64,
    ) -> None:
        self.forward = forward
        self.kv = kv
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.feature = feature
        self.graphs = graphs and kv.device.type == "cuda"
        self.batch_sizes = [b for b in BATCH_SIZES if b < max_batch_size] + [max_batch_size]
        self.pool: Any = None  # the graphs' memory pool handle, made at the first capture
        self.captured: dict[tuple[Shape, int], tuple[torch.cuda.CUDAGraph, _Inputs]] = {}
        # pinned host mirrors of each graph's meta input and packed output
        self.host: dict[tuple[Shape, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def max_pages(self, shape: Shape) -> int:
        return -(-(self.max_context + shape.num_candidates) // self.kv.page_size)

    # -- running ---------------------------------------------------------------------------

    def expand(
        self,
        shape: Shape,
        seqs: list[SeqKV],  # each with base = kv_committed_len, pages reserved for the tree
        root_logits: torch.Tensor,  # [B, vocab] float32 on the device
        root_features: torch.Tensor | None,  # [B, width] the root's outputs (EAGLE)
    ) -> list[Candidates]:
        bs = len(seqs)
        bucket = next((b for b in self.batch_sizes if b >= bs), None)
        width = max(len(s.page_table) for s in seqs)
        if self.graphs and bucket is not None and width <= self.max_pages(shape):
            key = (shape, bucket)
            if key not in self.captured:
                self._capture(shape, bucket)
            graph, inputs = self.captured[key]
            host_meta, host_out = self.host[key]
            self._load(inputs, host_meta, seqs, root_logits, root_features)
            graph.replay()
            host_out.copy_(inputs.out, non_blocking=True)
            torch.cuda.current_stream(self.kv.device).synchronize()  # the mirrors are free after
            out = host_out.numpy()
        else:
            inputs = _Inputs(shape, bs, self.vocab_size, self.feature, width, self.kv.device)
            host = torch.zeros(inputs.meta.shape, dtype=torch.int32)
            self._load(inputs, host, seqs, root_logits, root_features)
            self._body(shape, inputs)
            out = inputs.out.cpu().numpy()
        return [
            Candidates(out[b, 0].tolist(), out[b, 1].tolist(), out[b, 2].tolist())
            for b in range(bs)
        ]

    def _load(
        self,
        inputs: _Inputs,
        host_meta: torch.Tensor,  # inputs.meta's host mirror (pinned for a graph's)
        seqs: list[SeqKV],
        root_logits: torch.Tensor,
        root_features: torch.Tensor | None,
    ) -> None:
        """Write the round into `inputs`: metadata through the host mirror, the roots' logits
        and features device to device (padding rows keep what they held)."""
        bs = len(seqs)
        self._fill_meta(host_meta.numpy(), seqs, inputs.logits.shape[0])
        inputs.meta.copy_(host_meta, non_blocking=True)
        inputs.logits[:bs].copy_(root_logits)
        if inputs.features is not None and root_features is not None:
            inputs.features[:bs].copy_(root_features)

    def _fill_meta(self, meta: np.ndarray, seqs: list[SeqKV], bs: int) -> None:
        """Rows of `seqs` (base, block table), then padding rows up to `bs`: base 1 on the
        scratch page (they read and write only there)."""
        base, table = _split(meta, bs)
        for b, seq in enumerate(seqs):
            base[b] = seq.kv_committed_len
            table[b, : len(seq.page_table)] = seq.page_table
        base[len(seqs) :] = 1
        table[len(seqs) :] = self.kv.scratch_page

    def capture_all(self, shape: Shape) -> None:
        """The graphs of `shape` at every batch bucket (warm-up), largest first."""
        for bucket in reversed(self.batch_sizes):
            if (shape, bucket) not in self.captured:
                self._capture(shape, bucket)

    def _capture(self, shape: Shape, bucket: int) -> None:
        device = self.kv.device
        inputs = _Inputs(
            shape, bucket, self.vocab_size, self.feature, self.max_pages(shape), device
        )
        meta = np.zeros(tuple(inputs.meta.shape), dtype=np.int32)
        self._fill_meta(meta, [], bucket)  # every row padding while capturing
        inputs.meta.copy_(torch.from_numpy(meta))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._body(shape, inputs)  # settle kernels and the allocator first
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self._body(shape, inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.captured[(shape, bucket)] = (graph, inputs)
        self.host[(shape, bucket)] = (
            torch.zeros_like(inputs.meta, device="cpu").pin_memory(),
            torch.zeros_like(inputs.out, device="cpu").pin_memory(),
        )
        log.info("captured the expansion graph of %s at batch %d", shape, bucket)

    # -- the expansion ---------------------------------------------------------------------

    def _body(self, shape: Shape, inputs: _Inputs) -> None:
        """Every step of the expansion of `inputs`' rows; writes inputs.out."""
        k, n_all = shape.topk, shape.num_candidates
        bs, device, page = inputs.logits.shape[0], inputs.logits.device, self.kv.page_size
        base32, table = _split(inputs.meta, bs)  # [B] int32, [B, pages] int32
        base = base32.long()
        tokens = torch.zeros(bs, n_all, dtype=torch.int64, device=device)
        parents = torch.full((bs, n_all), -1, dtype=torch.int64, device=device)
        scores = torch.zeros(bs, n_all, dtype=torch.float32, device=device)
        if k == 1:
            tokens[:, 0] = inputs.logits.argmax(dim=-1)
        else:
            top_lp, top_tok = torch.log_softmax(inputs.logits, dim=-1).topk(k, dim=-1)
            tokens[:, :k] = top_tok
            scores[:, :k] = top_lp
        rows_k = torch.arange(k, device=device)
        frontier = rows_k.expand(bs, k)  # [B, k] candidate ids
        # [B, k, n_all]: frontier row r sees candidate i (an ancestor, or itself)
        seen = torch.eye(k, n_all, dtype=torch.bool, device=device).expand(bs, k, n_all).clone()
        features = None
        if inputs.features is not None:
            features = inputs.features[:, None, :].expand(bs, k, -1)
        cu = torch.arange(0, bs * k + 1, k, dtype=torch.int32, device=device)
        every_row = torch.arange(bs * k, device=device)
        n = k
        for step in range(2, shape.num_steps + 1):
            storage = base[:, None] + frontier  # [B, k]
            slots = table.gather(1, storage // page).long() * page + storage % page
            batch = ForwardBatch(
                input_ids=tokens.gather(1, frontier).reshape(-1),
                positions=(base[:, None] + (step - 2)).expand(bs, k).reshape(-1),
                slot_mapping=slots.reshape(-1),
                cu_seqlens_q=cu,
                kv_lens=base32 + n,
                prefix_lens=base32,
                block_table=table,
                tree_mask=seen,
                logit_indices=every_row,
                max_q_len=k,
                page_size=page,
            )
            flat = None if features is None else features.reshape(bs * k, -1)
            logits, outputs = self.forward(batch, flat)  # [B * k, V], [B * k, width]
            if k == 1:
                tokens[:, n] = logits.argmax(dim=-1)
                parents[:, n] = frontier[:, 0]
                keep = torch.zeros(bs, 1, dtype=torch.int64, device=device)
                new = 1
            else:
                top_lp, top_tok = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
                cum = scores.gather(1, frontier)[:, :, None] + top_lp.view(bs, k, k)
                new = k * k
                tokens[:, n : n + new] = top_tok.view(bs, new)
                parents[:, n : n + new] = frontier[:, :, None].expand(bs, k, k).reshape(bs, new)
                scores[:, n : n + new] = cum.view(bs, new)
                keep = cum.view(bs, new).topk(k, dim=1).indices.sort(dim=1).values  # [B, k]
            from_row = keep // k  # the frontier row each kept child hangs from
            seen = seen.gather(1, from_row[:, :, None].expand(bs, k, n_all))
            seen.scatter_(2, (n + keep)[:, :, None], True)
            if features is not None:
                assert outputs is not None
                per_row = outputs.view(bs, k, -1)
                features = per_row.gather(1, from_row[:, :, None].expand(bs, k, per_row.shape[2]))
            frontier = n + keep
            n += new
        order = torch.sort(-scores, dim=1, stable=True).indices
        inputs.out.copy_(torch.stack([tokens, parents, order], dim=1))


A = TypeVar("A", np.ndarray, torch.Tensor)


def _split(meta: A, bs: int) -> tuple[A, A]:
    """The flat meta buffer of `bs` rows as (base [bs], block table [bs, pages]) views."""
    return meta[:bs], meta[bs:].reshape(bs, -1)
