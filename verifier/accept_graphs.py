"""Acceptance (greedy, and lossless sampling), the bonus token and the accepted path's K/V
compaction as CUDA graphs.

`specsplit.kernels.accept` runs them as ~50 small torch ops over the batch, a fixed sequence for
a given (batch, tree width): on an H100 host their launches cost ~0.4 ms per round at batch 1
and ~1.4 ms at batch 8 (bench/profile_step.py), against ~1 ms of GPU time for a SmolLM2 step.
Captured at warm-up once per (batch bucket, power-of-two tree width), a round costs the argmax
of the logits, one host-to-device copy of the round's integers, one replay and the round's one
device-to-host copy. The ops are the same: the graph gives exactly the eager path's results
(tests/gpu/test_accept_graphs.py). On a GPU a greedy round's acceptance and K/V moves are one
Triton kernel (`greedy_accept`, specsplit/kernels/accept_walk.py, the torch ops its reference):
one launch and the compaction's two ops where the torch ops made the graph's 58 kernel nodes at
batch 1; the SmolLM2 round on the device 1.052 -> 0.964 ms (bench/RESULTS.md, forty-second
session).

Inputs travel as one int64 host array (pinned, one per graph) in the layout `AcceptGraphs.layout`
gives (verifier/accept_layout.py): rows of the batch padded to the bucket (parents -2: nothing
accepted, every move scratch -> scratch), and of each sequence's page table only the window its
tree's storage spans (`page_window`: a fixed width per tree width, whatever the context length).

A sampled round (any sequence with temperature > 0) replays a graph of its own: `sampled_accept`
over the round's logits copied into a buffer the sampled graphs share, and one more (float64)
host array, `Sampling`: each sequence's params, its uniforms and its draft distribution on a
support of DRAFT_SUPPORT tokens a node. Eagerly its ~500 ops cost ~4.5 ms of host time a round
at batch 32 on an H100 host (bench/profile_step.py --temperature 1); on the graphs a SmolLM2
verify round of 1 + 3 tokens took 3.9 ms against 5.7 at batch 32, 1.6 against 3.5 at batch 1
(bench/RESULTS.md). Graphs with top-k / top-p (each row's cut at one probability threshold,
specsplit/kernels/nucleus.py) are captured at warm-up too: temperature with top-p is what most
clients send, and a graph captured on first use stalls that round (the stream synchronized) in
the middle of traffic.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from specsplit.kernels.accept import accept_greedy_batched, compact_accepted_kv, compact_and_pack
from specsplit.kernels.accept_sampling import accept_sampling_batched
from specsplit.kernels.accept_walk import accept_walk
from specsplit.kv_cache import KVCache
from specsplit.model.graph_buffers import CaptureStream, HostMirrors
from specsplit.sampling import target_probs_rows
from specsplit.tree import DRAFT_SUPPORT
from verifier.accept_layout import Layout, Sampling, padded, window_pages

log = logging.getLogger(__name__)
# greedy acceptance on a GPU as one Triton kernel (specsplit/kernels/accept_walk.py) and the K/V
# compaction's two ops, where the torch ops are 58 kernel nodes at batch 1 (forty-second session);
# SPECSPLIT_TRITON_ACCEPT=0 runs the torch ops instead (A/B), as does a missing triton
TRITON_ACCEPT = (
    os.environ.get("SPECSPLIT_TRITON_ACCEPT", "1") != "0"
    and importlib.util.find_spec("triton") is not None
)


def greedy_accept(
    layout: Layout,
    inputs: torch.Tensor,  # layout's flat int64 inputs, on the device
    argmax: torch.Tensor,  # [>= rows] int64 the target's argmax at each of the round's rows
    kv: KVCache,
) -> torch.Tensor:
    """Greedy acceptance, the bonus token and the accepted path's K/V compaction for a round
    laid out as `layout` (a graph's body, or run eagerly): [bucket, 2 + width] as
    compact_and_pack's."""
    row_index, draft_tokens, parents, base, table = layout.parts(inputs)
    if TRITON_ACCEPT and inputs.is_cuda:
        packed, src, dst = accept_walk(
            argmax, row_index, draft_tokens, parents, base, table, kv.page_size, kv.scratch_slot
        )
        compact_accepted_kv(kv.data, src, dst)
        return packed
    accepted = accept_greedy_batched(argmax[row_index], draft_tokens, parents)
    return compact_and_pack(accepted, base, table, kv.data, kv.page_size, kv.scratch_slot)


def sampled_accept(
    layout: Layout,
    sampling: Sampling,
    inputs: torch.Tensor,  # layout's flat int64 inputs, on the device
    floats: torch.Tensor,  # sampling's flat float64 inputs, on the device
    logits: torch.Tensor,  # [>= rows, vocab] the round's logits
    kv: KVCache,
) -> torch.Tensor:
    """Lossless sampling acceptance (greedy rows walk a one-hot target), the bonus token and
    the accepted path's K/V compaction for a round laid out as `layout` and `sampling`: a
    fixed sequence of ops (a graph's body, or run eagerly). [bucket, 2 + width] as
    compact_and_pack's."""
    row_index, draft_tokens, parents, base, table = layout.parts(inputs)
    temperature, top_p, top_k, has_q, uniforms, q_tokens, q_probs = sampling.parts(floats)
    bucket, rows = row_index.shape

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return values[:, None].expand(bucket, rows).reshape(-1)

    probs = target_probs_rows(
        logits.index_select(0, row_index.reshape(-1)),
        per_row(temperature),
        per_row(top_k.long()),
        per_row(top_p),
        sampling.filters,
    ).view(bucket, rows, -1)
    q = (q_tokens.long(), q_probs) if sampling.support else None
    accepted = accept_sampling_batched(probs, draft_tokens, parents, uniforms, q, has_q > 0)
    return compact_and_pack(accepted, base, table, kv.data, kv.page_size, kv.scratch_slot)


class _Graph:
    """One layout's graph: greedy (the argmax of the round's logits copied in), or sampled
    (`sampling`: the round's logits copied into the shared `logits` buffer, and the sampled
    inputs' own host mirrors)."""

    def __init__(
        self,
        layout: Layout,
        max_rows: int,
        kv: KVCache,
        sampling: Sampling | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        device = kv.device
        self.layout, self.sampling = layout, sampling
        self.inputs = torch.zeros(sum(layout.sizes), dtype=torch.int64, device=device)
        # the inputs' host mirrors (int64, and float64 for a sampled graph), taken in turn: a
        # round fills one and copies it in, and each is free again once its copy has run,
        # behind every step queued before it. Two, and more (up to the forward's HOST_MIRRORS)
        # as rounds find the next one's copy still queued (decode steps queued ahead)
        self.hosts = HostMirrors(self._new_mirror)
        self.argmax = torch.zeros(
            max_rows if sampling is None else 0, dtype=torch.int64, device=device
        )
        self.floats = torch.zeros(0, dtype=torch.float64, device=device)
        self.logits = logits
        if sampling is not None:
            size = sum(sampling.sizes)
            self.floats = torch.zeros(size, dtype=torch.float64, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None
        self.kv = kv

    def _new_mirror(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One more pair of pinned host mirrors: the layout's, the sampling's (empty where
        greedy)."""
        floats = sum(self.sampling.sizes) if self.sampling is not None else 0
        return (
            torch.zeros(sum(self.layout.sizes), dtype=torch.int64).pin_memory(),
            torch.zeros(floats, dtype=torch.float64).pin_memory(),
        )

    def body(self) -> torch.Tensor:
        """[bucket, 2 + width]: accepted drafts, bonus token, accepted nodes (-1 padded)."""
        if self.sampling is not None:
            assert self.logits is not None
            return sampled_accept(
                self.layout, self.sampling, self.inputs, self.floats, self.logits, self.kv
            )
        return greedy_accept(self.layout, self.inputs, self.argmax, self.kv)


class AcceptGraphs:
    """The graphs of one verifier engine: every layout `capture_all` captures at warm-up, any
    other on its first use. Padding sequences accept nothing and move scratch slots only, so
    the KV cache is safe to share with the forward's graphs. Sampled rounds have their own
    graphs (a layout and its Sampling), which read the round's logits from one buffer they
    share (`logits`, made at the first sampled capture)."""

    def __init__(
        self, kv: KVCache, batch_sizes: list[int], max_rows: int, vocab_size: int = 0
    ) -> None:
        """batch_sizes: the buckets (ascending, as the forward's graphs); max_rows: the most
        logits rows a round can have (the largest bucket x the largest query length);
        vocab_size: the logits' width (0: no sampled graphs)."""
        self.kv = kv
        self.batch_sizes = batch_sizes
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.graphs: dict[tuple[Layout, Sampling | None], _Graph] = {}
        self._layouts: dict[tuple[int, int], Layout | None] = {}  # layout() by its arguments
        self.pool: Any = None  # the graphs' memory pool handle, made at the first capture
        self.capture_stream = CaptureStream()
        self.logits: torch.Tensor | None = None  # the sampled graphs' [max_rows, vocab] input

    def layout(self, num_seqs: int, width: int) -> Layout | None:
        """The padded layout for a round of `num_seqs` trees of at most `width` nodes, or None
        (more sequences or logits rows than the graphs hold). One Layout per shape: its
        properties are made once."""
        key = (num_seqs, width)
        if key not in self._layouts:
            self._layouts[key] = self._make_layout(num_seqs, width)
        return self._layouts[key]

    def _make_layout(self, num_seqs: int, width: int) -> Layout | None:
        if num_seqs > self.batch_sizes[-1] or num_seqs * (width + 1) > self.max_rows:
            return None
        bucket = next(b for b in self.batch_sizes if b >= num_seqs)
        # tree widths padded to a power of two (nodes past a tree's end are padding, as in a
        # batch of unequal trees): trees cut short near max_new_tokens share their graphs
        padded_width = padded(width)
        return Layout(bucket, padded_width, window_pages(padded_width, self.kv.page_size))

    def sampling(self, layout: Layout, support: int, filters: bool) -> Sampling | None:
        """The sampled inputs of a round laid out as `layout` whose draft distributions have
        supports of at most `support` tokens, or None (a support past DRAFT_SUPPORT, or no
        sampled graphs). A round with trees takes DRAFT_SUPPORT-wide supports whether or not
        its trees carry a distribution: one graph for both."""
        if not self.vocab_size or support > DRAFT_SUPPORT:
            return None
        return Sampling(layout.bucket, layout.width, DRAFT_SUPPORT if layout.width else 0, filters)

    def capture_all(self, max_width: int) -> None:
        """Capture every layout of trees up to `max_width` nodes: greedy, sampled, and sampled
        with top-k / top-p (a round past these, a wider draft support, captures its own on
        first use)."""
        for layout in self.layouts(max_width):
            for sampling in (None, self.sampling(layout, 0, False), self.sampling(layout, 0, True)):
                if (layout, sampling) not in self.graphs:
                    self.graphs[(layout, sampling)] = self._capture(layout, sampling)
        log.info("captured %d acceptance graphs", len(self.graphs))

    def layouts(self, max_width: int) -> list[Layout]:
        """Every layout a round of trees up to `max_width` nodes takes (a 6-node tree takes
        the 8-wide graph; 5 sequences the bucket of 8), largest first: captured in this order
        the smaller graphs' [rows, vocab] intermediates reuse the blocks the larger ones freed
        in the pool they share, where smallest first each larger size took new blocks."""
        found = {
            self.layout(num_seqs, width)
            for num_seqs in range(1, self.batch_sizes[-1] + 1)
            for width in range(max_width + 1)
        }
        return sorted(
            (layout for layout in found if layout is not None),
            key=lambda layout: (layout.bucket, layout.width),
            reverse=True,
        )

    def host_arrays(
        self, layout: Layout, sampling: Sampling | None = None
    ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """Layout.host_arrays in the graph's pinned host mirror (captured now if it was not),
        and Sampling.host_arrays' parts in its own ([] for a greedy graph): `run` copies them
        in without a staging copy."""
        graph = self.graphs.get((layout, sampling))
        if graph is None:
            graph = self.graphs[(layout, sampling)] = self._capture(layout, sampling)
        ints, floats = graph.hosts.take()
        host, parts = layout.host_arrays(ints.numpy())
        float_parts: list[np.ndarray] = []
        if sampling is not None:
            _, float_parts = sampling.host_arrays(floats.numpy())
        return host, parts, float_parts

    def run(
        self,
        layout: Layout,
        logits: torch.Tensor,
        num_seqs: int,
        sampling: Sampling | None = None,
        place: Callable[[list[torch.Tensor]], None] | None = None,
        argmax: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay the graph of (`layout`, `sampling`) over its host mirrors (`host_arrays`,
        filled) and the round's logits ([L, vocab], L <= max_rows): per sequence [accepted
        drafts, bonus, nodes...] on the device, a view of the graph's output (valid until its
        next replay). place: rewrites the inputs on the device once copied in (a chained
        round's, verifier/chain.py). argmax: [L] a greedy round's argmax of the logits
        (`queue_accept` takes it, where the forward's graph did not), copied in."""
        graph = self.graphs[(layout, sampling)]
        rows = logits.shape[0]
        assert rows <= self.max_rows, (rows, self.max_rows)
        ints, floats = graph.hosts.current
        graph.inputs.copy_(ints, non_blocking=True)
        if place is not None:
            place(layout.parts(graph.inputs))
        if sampling is not None:
            assert graph.logits is not None
            graph.floats.copy_(floats, non_blocking=True)
            graph.logits[:rows].copy_(logits)
        else:
            assert argmax is not None, "a greedy round comes with its argmax"
            graph.argmax[:rows].copy_(argmax)
        graph.hosts.copied(graph.inputs.device)
        graph.graph.replay()
        assert graph.out is not None
        return graph.out[:num_seqs]

    def _capture(self, layout: Layout, sampling: Sampling | None) -> _Graph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        device = self.kv.device
        if sampling is not None and self.logits is None:
            self.logits = torch.zeros(self.max_rows, self.vocab_size, device=device)
        graph = _Graph(layout, self.max_rows, self.kv, sampling, self.logits)
        host, _ = layout.host_arrays()  # all padding: nothing moves but scratch slots
        graph.inputs.copy_(torch.from_numpy(host))
        if sampling is not None:
            floats, _ = sampling.host_arrays()
            graph.floats.copy_(torch.from_numpy(floats))
        stream = self.capture_stream(device)
        with torch.cuda.stream(stream):
            graph.body()  # allocations settle outside the capture
            with torch.cuda.graph(graph.graph, pool=self.pool, stream=stream):
                graph.out = graph.body()
        torch.cuda.current_stream(device).wait_stream(stream)
        log.debug("captured the acceptance graph for %s, %s", layout, sampling)
        return graph
