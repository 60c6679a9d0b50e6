"""Greedy acceptance, the bonus token and the accepted path's K/V compaction as CUDA graphs.

`specsplit.kernels.accept` runs them as ~50 small torch ops over the batch, a fixed sequence for
a given (batch, tree width): on an H100 host their launches cost ~0.4 ms per round at batch 1
and ~1.4 ms at batch 8 (bench/profile_step.py), against ~1 ms of GPU time for a SmolLM2 step.
Captured once per (batch bucket, power-of-two tree width, page-table width bucket), a round costs
the argmax of the logits, one host-to-device copy of the round's integers, one replay and the
round's one device-to-host copy. The ops are the same: the graph gives exactly the eager path's
results (tests/gpu/test_accept_graphs.py).

Inputs travel as one int64 host array in the layout `AcceptGraphs.layout` gives: rows of the
batch padded to the bucket (parents -2: nothing accepted, every move scratch -> scratch), the
page table padded with page 0 (only real moves read it, within each sequence's pages).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specsplit.kernels.accept import accept_greedy_batched, compact_and_pack
from specsplit.kv_cache import KVCache

log = logging.getLogger(__name__)

MIN_PAGES = 8  # page-table widths are bucketed to powers of two from here


@dataclass(frozen=True)
class Layout:
    """The padded shapes of one graph: `bucket` rows, `width` tree nodes, `pages` columns."""

    bucket: int
    width: int
    pages: int

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """row_index [B, N + 1], draft tokens [B, N], parents [B, N], base [B], pages [B, P]."""
        b, n = self.bucket, self.width
        return [(b, n + 1), (b, n), (b, n), (b,), (b, self.pages)]

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(shape)) for shape in self.shapes]

    def parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parts of a flat tensor laid out as host_arrays' (on the device), as views."""
        return [
            part.view(shape)
            for part, shape in zip(flat.split(self.sizes), self.shapes, strict=True)
        ]

    def host_arrays(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """A zeroed host array and its parts as views (parents -2: padding)."""
        host = np.zeros(sum(self.sizes), dtype=np.int64)
        parts = [
            part.reshape(shape)
            for part, shape in zip(
                np.split(host, np.cumsum(self.sizes)[:-1]), self.shapes, strict=True
            )
        ]
        parts[2][:] = -2
        return host, parts


class _Graph:
    def __init__(self, layout: Layout, max_rows: int, kv: KVCache) -> None:
        device = kv.device
        self.layout = layout
        self.inputs = torch.zeros(sum(layout.sizes), dtype=torch.int64, device=device)
        self.argmax = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None
        self.kv = kv

    def body(self) -> torch.Tensor:
        """[bucket, 2 + width]: accepted drafts, bonus token, accepted nodes (-1 padded)."""
        row_index, draft_tokens, parents, base, table = self.layout.parts(self.inputs)
        accepted = accept_greedy_batched(self.argmax[row_index], draft_tokens, parents)
        kv = self.kv
        return compact_and_pack(accepted, base, table, kv.data, kv.page_size, kv.scratch_slot)


class AcceptGraphs:
    """The graphs of one verifier engine, captured on first use of each layout (the warm-up's
    rehearsal captures the common ones). Padding sequences accept nothing and move scratch
    slots only, so the KV cache is safe to share with the forward's graphs."""

    def __init__(self, kv: KVCache, batch_sizes: list[int], max_rows: int) -> None:
        """batch_sizes: the buckets (ascending, as the forward's graphs); max_rows: the most
        logits rows a round can have (the largest bucket x the largest query length)."""
        self.kv = kv
        self.batch_sizes = batch_sizes
        self.max_rows = max_rows
        self.graphs: dict[Layout, _Graph] = {}
        self.pool: Any = None  # the graphs' memory pool handle, made at the first capture

    def layout(self, num_seqs: int, width: int, max_pages: int) -> Layout | None:
        """The padded layout for a round, or None (more sequences than the largest bucket)."""
        if num_seqs > self.batch_sizes[-1] or num_seqs * (width + 1) > self.max_rows:
            return None  # more sequences or logits rows than the graphs hold
        bucket = next(b for b in self.batch_sizes if b >= num_seqs)
        pages = max(MIN_PAGES, 1 << (max_pages - 1).bit_length())
        # tree widths padded to a power of two (nodes past a tree's end are padding, as in a
        # batch of unequal trees): trees cut short near max_new_tokens share their graphs
        padded_width = 1 << (width - 1).bit_length() if width else 0
        return Layout(bucket, padded_width, pages)

    def run(
        self, layout: Layout, host: np.ndarray, logits: torch.Tensor, num_seqs: int
    ) -> list[list[int]]:
        """Replay the layout's graph over `host` (Layout.host_arrays, filled) and the round's
        logits ([L, vocab], L <= max_rows); per sequence [accepted drafts, bonus, nodes...]."""
        graph = self.graphs.get(layout)
        if graph is None:
            graph = self.graphs[layout] = self._capture(layout)
        rows = logits.shape[0]
        assert rows <= self.max_rows, (rows, self.max_rows)
        graph.inputs.copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
        torch.argmax(logits, dim=-1, out=graph.argmax[:rows])
        graph.graph.replay()
        assert graph.out is not None
        result: list[list[int]] = graph.out[:num_seqs].tolist()  # the round's one D2H copy
        return result

    def _capture(self, layout: Layout) -> _Graph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = _Graph(layout, self.max_rows, self.kv)
        host, _ = layout.host_arrays()  # all padding: nothing moves but scratch slots
        graph.inputs.copy_(torch.from_numpy(host))
        stream = torch.cuda.Stream(self.kv.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            graph.body()  # allocations settle outside the capture
            with torch.cuda.graph(graph.graph, pool=self.pool, stream=stream):
                graph.out = graph.body()
        torch.cuda.current_stream(self.kv.device).wait_stream(stream)
        log.debug("captured the acceptance graph for %s", layout)
        return graph
