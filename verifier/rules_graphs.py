"""A steady round's logit rules bent by a CUDA graph (`RulesGraphs`): the kept rows' deltas
counted in, the rule rows bent, min_p's cut and, for a greedy round, the bent logits' argmax,
one replay where the eager path (verifier/round_rules.py) launches three to five kernels through
Triton's Python launcher, ~20-60 us of host each (bench/RESULTS.md: a SmolLM2 decode step under
rules 1.36 against 0.50 ms at batch 1 on an H200, host-bound).

A round qualifies when it refills no slot (every round of a sequence after its first under
the same context) and holds back no stop tokens (min_tokens), and its logits are a view of the
forward graph's output buffer (their address is fixed). Its entries (`Steady`, gathered by
round_rules.py) are packed straight into a fixed layout (`fixed_layout`): rule rows, sequences,
deltas, path entries and a guide's distinct masks each padded to a power of two, the padding
inert (a rule row -1 bends nothing, a delta adds 0 to slot 0's token 0, a sequence
has neutral penalties, no cut, slot 0). One graph a (logits buffer, capacities, rules read,
pending inputs, greedy): captured on first use (a few ms, the stream synchronized) over its own
device table, then each round fills a pinned host mirror, copies it in and replays. The ops are
the eager path's kernels on the same values: the graph's rows equal the reference's bit for bit
(tests/gpu/test_rules_graphs_gpu.py).

A graph holds the kept rows' addresses: when `RuleRows` grows or trims its tables, the graphs
are dropped (the stream synchronized first) and captured again as rounds come. Past MAX_GRAPHS
keys a new one drops the least recently replayed graph.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specsplit.kernels.argmax import greedy_tokens
from specsplit.kernels.bend_rules import (
    DELTAS,
    PATHS,
    PENDING,
    SECTIONS,
    Layout,
    as_bits,
    bend_rows,
)
from specsplit.kernels.triton_jit import next_power_of_2
from specsplit.model.graph_buffers import CaptureStream, HostMirrors

log = logging.getLogger(__name__)

# SPECSPLIT_RULES_GRAPHS=0: every round bends eagerly (A/B)
ENABLED = os.environ.get("SPECSPLIT_RULES_GRAPHS", "1") != "0"
# graphs kept; a new key past them drops the least recently replayed (each graph: a few KiB of
# device memory, its table at its masks' capacity). The warm-up's rules rehearsal alone makes
# ~65 keys (verifier/warmup.py): at 64 with no eviction its leftovers filled the set and every
# new batch's rounds bent eagerly in traffic, building their own kernel variant (H200)
MAX_GRAPHS = 128
# a round whose masks' words (padded) pass this bends eagerly: each graph keeps its table and
# pinned mirrors at its capacity (at an 8B's vocabulary ~64 masks, at SmolLM2's ~170)
MAX_MASK_BYTES = 1 << 20
_ONE = int(as_bits(np.array(1.0)))  # a padding sequence's repetition (x / 1 is x)
_NO_CUT = int(as_bits(np.array(-np.inf)))  # its min_p cut (-inf keeps every token)
Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the kept rows: bias, counts, seen


@dataclass(frozen=True)
class Bent:
    """A round's rows bent by its rules: `argmax`, the bent logits' argmax where a graph took
    it (a greedy round's), else None (`queue_accept` takes it); `eager`: None where a rules
    graph bent them, else why not (specsplit_verifier_eager_rules_rounds' reasons)."""

    argmax: torch.Tensor | None = None
    eager: str | None = None


@dataclass
class Steady:
    """A qualifying round's entries as verifier/round_rules.py gathers them (value 1 each)."""

    deltas: tuple[list[int], list[int]]  # (slot, token) each: the commits' tokens to count in
    paths: tuple[list[int], list[int]]  # (rule row, token) each, rule rows ascending
    inputs: list[int] | None  # per rule row its input (whose pending token it counts), or none
    rows: list[int]  # per rule row its logits row
    seqs: list[int]  # per rule row its sequence
    scalars: list[tuple[float, float, float, float, int]]  # per sequence (Layout.seqs')
    flags: tuple[bool, bool, bool, bool]  # the rules read: Layout's biased, counted, repeats, cut
    # a guide's masks: per rule row its mask (NO_MASK: none), and the round's distinct masks'
    # int32 words, mask after mask (`mask_size` words each; none: no row has one)
    mask_of: list[int] | None = None
    words: np.ndarray | None = None
    mask_size: int = 0


# a round of nothing, which `pack` makes all padding (a graph's warm-up run)
_NONE = Steady(([], []), ([], []), None, [], [], [], (False,) * 4)


def width(fixed: Layout) -> int:
    """A fixed layout's table width: its parts, then its masks' words three to a column."""
    return fixed.words + -(-fixed.num_words // 3)


def fixed_layout(round_: Steady) -> Layout:
    """The fixed layout a round's entries are packed into: its rule rows, sequences and path
    entries padded to powers of two, its deltas to one as many as the rule rows at least (a
    steady round counts in the commits of one like it), a pending entry a rule row."""
    rows, seqs = next_power_of_2(len(round_.rows)), next_power_of_2(len(round_.scalars))
    deltas = next_power_of_2(max(len(round_.deltas[0]), rows))
    paths = len(round_.paths[0])
    paths = next_power_of_2(paths) if paths else 0
    words = 0 if round_.words is None else len(round_.words) // round_.mask_size
    words = next_power_of_2(words) * round_.mask_size if words else 0  # (whole masks)
    return _layout(rows, seqs, deltas, paths, words, round_.inputs is not None, round_.flags)


@functools.lru_cache(maxsize=1024)
def _layout(
    rows: int,
    seqs: int,
    deltas: int,
    paths: int,
    words: int,
    pending: bool,
    flags: tuple[bool, ...],
) -> Layout:
    sizes = dict.fromkeys(SECTIONS, 0)
    sizes[DELTAS], sizes[PATHS], sizes[PENDING] = deltas, paths, rows if pending else 0
    starts = tuple(np.cumsum([0, *(sizes[s] for s in SECTIONS)]).tolist())
    return Layout(starts, rows, seqs, words, *flags)


def pack(round_: Steady, fixed: Layout, out: np.ndarray) -> None:
    """The round's entries laid out as `fixed` in `out` ([3, width(fixed)] int32), the padding
    inert (module docstring)."""
    out.fill(0)  # (padding deltas, paths and pending entries, masks' words: unread)
    for section, (owners, tokens) in ((DELTAS, round_.deltas), (PATHS, round_.paths)):
        start, stop = fixed.starts[section], fixed.starts[section] + len(owners)
        out[0, start:stop], out[1, start:stop], out[2, start:stop] = owners, tokens, 1
    rows, seqs = len(round_.rows), len(round_.scalars)
    if round_.inputs is not None:
        out[1, fixed.starts[PENDING] : fixed.starts[PENDING] + rows] = round_.inputs
    at = fixed.rows
    out[0, at : at + rows], out[1, at : at + rows] = round_.rows, round_.seqs
    out[0, at + rows : fixed.extents] = -1  # padding rule rows: no logits row
    if round_.mask_of is not None and round_.words is not None:
        out[2, at : at + rows] = round_.mask_of
        columns = -(-len(round_.words) // 3)  # (the words three to a column, in order)
        padded = np.zeros(3 * columns, dtype=np.int32)
        padded[: len(round_.words)] = round_.words
        out[:, fixed.words : fixed.words + columns] = padded.reshape(3, columns, order="F")
    if round_.paths[0]:  # per rule row its first path entry (padding rows: none)
        firsts = np.searchsorted(round_.paths[0], np.arange(rows + 1))
        out[0, fixed.extents : fixed.extents + rows + 1] = firsts
        out[0, fixed.extents + rows + 1 : fixed.seqs] = len(round_.paths[0])
    scalars = np.array(round_.scalars).reshape(seqs, 5)
    at = fixed.seqs
    out[:, at : at + seqs] = as_bits(scalars[:, :3].T)
    out[0, at + seqs : at + fixed.num_seqs] = _ONE
    at += fixed.num_seqs  # min_p's cuts and the slots
    out[0, at : at + seqs] = as_bits(scalars[:, 3])
    out[1, at : at + seqs] = scalars[:, 4]
    out[0, at + seqs : fixed.words] = _NO_CUT


@dataclass(frozen=True)
class _Key:
    logits: tuple[int, int, int]  # the logits view's address, rows and row stride
    fixed: Layout
    inputs: int  # the pending tokens' capacity (0: none)
    greedy: bool


class _Graph:
    """One key's graph: its device table and pinned host mirrors (taken in turn, as the
    acceptance graphs'), pending tokens' buffer and the argmax it leaves (greedy)."""

    def __init__(self, key: _Key, device: torch.device, pending_dtype: torch.dtype) -> None:
        self.key = key
        self.table = torch.zeros(3, width(key.fixed), dtype=torch.int32, device=device)
        self.pending = torch.zeros(max(key.inputs, 1), dtype=pending_dtype, device=device)
        self.hosts = HostMirrors(
            lambda: torch.zeros(3, width(key.fixed), dtype=torch.int32).pin_memory()
        )
        self.graph = torch.cuda.CUDAGraph()
        self.argmax: torch.Tensor | None = None

    def body(self, logits: torch.Tensor, tables: Tables) -> torch.Tensor | None:
        pending = self.pending if self.key.inputs else None
        bend_rows(logits, self.table, self.key.fixed, tables, pending, kernel=True)
        return greedy_tokens(logits) if self.key.greedy else None


class RulesGraphs:
    """The rules graphs of one verifier engine (module docstring); `replays` counts the rounds
    they bent (tests, benchmarks). capture: False runs each qualifying round's fixed table
    through the kernels eagerly, no graph (the CPU's tests of the layout, under
    TRITON_INTERPRET=1)."""

    def __init__(self, device: torch.device | str, capture: bool = True) -> None:
        self.device = torch.device(device)
        self.capture = capture
        self.graphs: dict[_Key, _Graph] = {}
        self.pool: Any = None
        self.capture_stream = CaptureStream()
        self.tables: tuple[int, ...] = ()  # the kept rows' addresses the graphs read
        self.replays = 0
        self.evicted = 0  # graphs dropped for new keys past MAX_GRAPHS (said at the first)

    def bend(
        self,
        logits: torch.Tensor,  # [L, vocab] float32: a view of the forward graph's output
        round_: Steady,
        tables: Tables,
        pending: torch.Tensor | None,
        greedy: bool,
    ) -> Bent | str:
        """The round bent by its graph (queued), with the bent logits' argmax for a greedy
        round; or why not, and the caller bends it eagerly: "masks" (its masks pass
        MAX_MASK_BYTES). A new key past MAX_GRAPHS drops the least recently replayed graph."""
        view = _padded_view(logits)
        fixed = fixed_layout(round_)
        if 4 * fixed.num_words > MAX_MASK_BYTES:
            return "masks"
        if not self.capture:
            packed = np.empty((3, width(fixed)), dtype=np.int32)
            pack(round_, fixed, packed)
            on_device = torch.from_numpy(packed).to(self.device)
            bend_rows(view, on_device, fixed, tables, pending, kernel=True)
            self.replays += 1
            return Bent(greedy_tokens(logits) if greedy else None)
        inputs = 0 if pending is None else next_power_of_2(len(pending))
        key = _Key((view.data_ptr(), view.shape[0], view.stride(0)), fixed, inputs, greedy)
        addresses = tuple(t.data_ptr() for t in tables)
        if addresses != self.tables:  # the kept rows moved: every graph read the old ones
            if self.graphs:
                torch.cuda.current_stream(self.device).synchronize()
                self.graphs.clear()
            self.tables = addresses
        graph = self.graphs.pop(key, None)  # (put back last: the dict runs oldest first)
        if graph is None:
            if len(self.graphs) >= MAX_GRAPHS:
                self._evict()
            dtype = torch.int64 if pending is None else pending.dtype
            graph = self._capture(key, view, tables, dtype)
        self.graphs[key] = graph
        host = graph.hosts.take()
        pack(round_, fixed, host.numpy())
        graph.table.copy_(host, non_blocking=True)
        graph.hosts.copied(self.device)
        if pending is not None:
            graph.pending[: len(pending)].copy_(pending)
        graph.graph.replay()
        self.replays += 1
        return Bent(None if graph.argmax is None else graph.argmax[: logits.shape[0]])

    def _evict(self) -> None:
        """Drop the least recently replayed graph (its replays and table copies done first)."""
        torch.cuda.current_stream(self.device).synchronize()
        del self.graphs[next(iter(self.graphs))]
        if self.evicted == 0:
            log.info("%d rules graphs: the least recently replayed go for new keys", MAX_GRAPHS)
        self.evicted += 1

    def _capture(self, key: _Key, logits: torch.Tensor, tables: Tables, dtype: Any) -> _Graph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = _Graph(key, self.device, dtype)
        # the table all padding: the warm-up run bends nothing and adds zeros
        pack(_NONE, key.fixed, graph.hosts.current.numpy())
        graph.table.copy_(graph.hosts.current)
        stream = self.capture_stream(self.device)
        with torch.cuda.stream(stream):
            graph.body(logits, tables)  # compiled, allocations settled outside the capture
            with torch.cuda.graph(graph.graph, pool=self.pool, stream=stream):
                graph.argmax = graph.body(logits, tables)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        log.debug("captured a rules graph for %s (%d now)", key, len(self.graphs) + 1)
        return graph


def _padded_view(logits: torch.Tensor) -> torch.Tensor:
    """The logits' rows padded to a power of two where their buffer holds them (the forward's
    graph buffer: a batch's rows share the graph of its bucket), else the logits."""
    rows = next_power_of_2(logits.shape[0])
    stride, vocab = logits.stride(0), logits.shape[1]
    need = logits.storage_offset() + (rows - 1) * stride + vocab
    if rows == logits.shape[0] or need * logits.element_size() > logits.untyped_storage().nbytes():
        return logits
    return logits.as_strided((rows, vocab), (stride, 1))
