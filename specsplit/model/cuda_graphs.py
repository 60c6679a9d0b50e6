"""CUDA graphs of a model's decode and verify steps (DESIGN.md §6): the target's, the draft
model's and an EAGLE head's.

A step where every sequence brings the same number of query tokens `q` (1 for decode and a
chain's draft steps, 1 + num_draft_tokens for verify, a drafter's catch-up padded to a captured
q) is replayed from a graph captured at warm-up for the smallest bucketed batch size that holds
it. The graph reads fixed input buffers (specsplit/model/graph_buffers.py); a step copies its
metadata in (one host-to-device copy), padding the batch up to the bucket with sequences that
read and write only the cache's scratch page. Logits and hidden states of every row land in
fixed output buffers; the step's wanted rows are gathered from them, or taken as views where
they are all its rows in order and the caller asks for views. A q may be
captured for fewer batch buckets (`capture(max_batch=)`: the verifier's prefill graphs, a prompt
of up to 128 tokens, at most 4 at once). Any other shape (a longer prefill, a batch over the
largest bucket) runs eagerly: the same forward, the same tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from specsplit.kernels.triton_jit import building
from specsplit.kv_cache import KVCache
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.graph_buffers import CaptureStream, GraphBuffers
from specsplit.model.llama import LlamaModel

log = logging.getLogger(__name__)

# a runner's batch buckets: these below its largest (`max_batch_size`, --graph-max-batch), then it
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes graphs are captured for, up to `max_batch_size` (a batch pads to the
    smallest that holds it)."""
    return [b for b in BATCH_SIZES if b < max_batch_size] + [max_batch_size]


def smallest_q(q_sizes: dict[int, list[int]], num_seqs: int, most: int) -> int | None:
    """The smallest captured q (`q_sizes`: each q's batch buckets) that holds `most` new tokens
    a sequence and has a bucket for `num_seqs` sequences (a prefill's q has few), or None."""
    return min(
        (q for q, sizes in q_sizes.items() if q >= most and sizes[-1] >= num_seqs), default=None
    )


# the most parts `graph_parts` launches a round in (each one's results are copied before the
# next launches); whether parts beat one eager launch is `CudaGraphRunner.parts_pay`'s measure
MAX_PARTS = 8


def graph_parts(
    news: list[int],
    q_sizes: dict[int, list[int]],
    max_parts: int = MAX_PARTS,
    pays: Callable[[list[list[int]]], bool] | None = None,
) -> list[list[int]]:
    """A batch's sequences (each bringing `news[i]` new tokens: pending and tree) by position,
    as one step, or in parts where one step would find no captured graph (`q_sizes`: each q's
    batch buckets, `CudaGraphRunner.q_sizes`) but each part does, at most `max_parts`: the
    short runs (decode steps, trees) in one, the long ones (a newcomer's prefill, a resumed
    sequence's tokens since its last features) in as few as the graphs that hold them take
    (prefill graphs: 4 sequences). One step would run the whole batch eagerly, a host-bound
    forward (an 8B-shaped target: ~30 ms against ~6 for a replay; SmolLM2: 27-48 ms against
    ~2). `pays`: given each part's runs, whether the parts cost less than one launch (else
    one launch: many long runs in parts on a large model are the device's work, padded to the
    graphs' q, not the host's). Sizes only: a part may still run eagerly for its context
    (`plan`)."""

    def fits(n: int, most: int) -> bool:
        return smallest_q(q_sizes, n, most) is not None

    everyone = list(range(len(news)))
    if not news or fits(len(news), max(news)):
        return [everyone]
    # the most sequences in the short part first; none at last (every run long)
    for q in [*sorted(q_sizes, reverse=True), 0]:
        short = [i for i in everyone if news[i] <= q]
        long = [i for i in everyone if news[i] > q]
        if short and not fits(len(short), max(news[i] for i in short)):
            continue
        most = max(news[i] for i in long)
        # the most sequences a graph that holds the longest run takes
        size = max((sizes[-1] for n, sizes in q_sizes.items() if n >= most), default=0)
        if size == 0:
            break  # none holds it: a smaller q only makes the long part longer
        parts = ([short] if short else []) + [long[k : k + size] for k in range(0, len(long), size)]
        if len(parts) > max_parts or (pays and not pays([[news[i] for i in p] for p in parts])):
            return [everyone]
        return parts
    return [everyone]


def why_eager(runner: CudaGraphRunner | None, batch: ForwardBatch, device_rows: bool) -> str:
    """Why no captured graph ran `batch`: "no graphs" without a runner (the CPU), else the
    runner's reason (`CudaGraphRunner.why_eager`)."""
    return "no graphs" if runner is None else runner.why_eager(batch, device_rows)


def _replay_ms(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, times: int = 3) -> float:
    """A captured graph's replay on the device in ms (after one untimed), the mean of `times`."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(times):
        graph.replay()
    end.record(stream)
    end.synchronize()
    return float(start.elapsed_time(end)) / times


# The forward a runner captures: (batch, aux_layers, features) -> logits (and hidden states) of
# every row. features: [T, feature_width] per-token inputs besides the tokens (an EAGLE head's
# fused target features or its own earlier outputs); None for a plain model.
StepForward = Callable[[ForwardBatch, tuple[int, ...], torch.Tensor | None], ForwardOutput]


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
        greedy: bool = False,
    ) -> None:
        self.step_forward = forward
        self.greedy = greedy  # each replay also takes its logits rows' argmax (ForwardOutput)
        self.kv = kv
        self.device = kv.device
        self.features = features
        self.batch_sizes = batch_buckets(max_batch_size)
        self.max_pages = -(-(max_context + max_query_len) // kv.page_size)
        self.max_query_len = max_query_len
        self.q_sizes: dict[int, list[int]] = {}  # each captured q's batch buckets
        self.pool: Any = None  # one memory pool for every graph
        self.capture_stream = CaptureStream()  # and one stream for every capture
        self.buffers: dict[tuple[int, tuple[int, ...]], GraphBuffers] = {}
        self.graphs: dict[tuple[int, tuple[int, ...], int], torch.cuda.CUDAGraph] = {}
        # each (q, bucket)'s replay on the device in ms, timed at its capture (without layers)
        self.replay_ms: dict[tuple[int, int], float] = {}
        # a round's wall time run eagerly, and a graph round's host time beyond its replay, in
        # ms: timed at the verifier's warm-up (`time_rounds`); None = not timed, parts pay
        self.eager_round_ms: float | None = None
        self.part_host_ms = 0.0

    @classmethod
    def for_model(
        cls,
        model: LlamaModel,
        kv: KVCache,
        max_context: int | None = None,
        max_batch_size: int = 64,
        max_query_len: int = 64,
        greedy: bool = False,
    ) -> CudaGraphRunner:
        """Graphs of a plain model's steps (the target's, a draft model's); greedy: each replay
        also takes its logits rows' argmax (the verifier's acceptance reads it)."""

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
            greedy=greedy,
        )

    # -- capture ---------------------------------------------------------------------------

    def capture(
        self, q: int, aux_layers: tuple[int, ...] = (), max_batch: int | None = None
    ) -> None:
        """Capture every bucket for steps of `q` query tokens per sequence (largest first, so
        the smaller ones reuse its memory); with `max_batch`, only the buckets up to it, for
        this q with any layers (prefills: few at once, many rows each, logits of every row):
        a q's buckets are set by its first capture."""
        key = (q, aux_layers)
        if key in self.buffers:
            return
        sizes = self._sizes(q, max_batch)
        buffers = self.buffers[key] = self._new_buffers(q, sizes[-1])
        stream = self.capture_stream(self.device)
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
                if not aux_layers:
                    self.replay_ms[(q, bs)] = _replay_ms(graph, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for q=%d aux=%s, batch sizes %s", q, aux_layers, sizes)

    def build(self, q: int, aux_layers: tuple[int, ...] = (), max_batch: int | None = None) -> None:
        """Inside `building_ahead` (the caller's block): a step of every bucket `capture(q,
        aux_layers, max_batch)` takes, once, on throwaway buffers, so that its Triton kernels'
        variants build side by side before the captures (the steps compute nothing: no launch
        of ours runs)."""
        assert building(), "CudaGraphRunner.build runs inside building_ahead"
        if (q, aux_layers) in self.buffers:
            return
        sizes = self._sizes(q, max_batch)
        buffers = self._new_buffers(q, sizes[-1])
        for bs in reversed(sizes):
            self._run(buffers, buffers.batch(bs, self.kv.page_size), aux_layers, bs * q)
        del buffers  # (their blocks back to the device: the captures allocate from their pool)
        torch.cuda.empty_cache()

    def _sizes(self, q: int, max_batch: int | None) -> list[int]:
        """q's batch buckets, set by its first capture (or build)."""
        assert 1 <= q <= self.max_query_len, (q, self.max_query_len)
        if q not in self.q_sizes:
            limit = self.batch_sizes[-1] if max_batch is None else max_batch
            assert limit <= self.batch_sizes[-1], (limit, self.batch_sizes)
            self.q_sizes[q] = [b for b in self.batch_sizes if b < limit] + [limit]
        return self.q_sizes[q]

    def _new_buffers(self, q: int, bucket: int) -> GraphBuffers:
        """Input and output buffers for steps of `q` tokens a sequence up to `bucket`
        sequences, filled with an empty batch (every row on the scratch page)."""
        buffers = GraphBuffers(bucket, q, self.max_pages, self.features, self.device, self.greedy)
        buffers.fill(self._empty_batch(), bucket, self.kv.scratch_page, self.kv.scratch_slot)
        return buffers

    def graph_ms(self, news: list[int]) -> float:
        """The replay time in ms (timed at capture) of the graph that holds a step of these
        sequences (`news`: each one's new tokens), 0 where none does or none was timed."""
        q = smallest_q(self.q_sizes, len(news), max(news))
        if q is None:
            return 0.0
        bucket = next(b for b in self.q_sizes[q] if b >= len(news))
        return self.replay_ms.get((q, bucket), 0.0)

    def parts_pay(self, parts: list[list[int]]) -> bool:
        """Whether a round in `parts` (each part's new tokens a sequence), replayed one after
        another, costs less than one eager launch of them all: each part its graph's replay
        (timed at capture) and a graph round's host time beside it, against the larger of an
        eager round's wall time (host-bound) and the device's time for the round's tokens at
        the largest graph's rate (a large model's long runs: the device's work, which the
        parts pad to their graphs' q). True where the warm-up timed no rounds."""
        if self.eager_round_ms is None:
            return True
        parts_ms = sum(self.graph_ms(part) + self.part_host_ms for part in parts)
        (q, bs), ms = max(self.replay_ms.items(), key=lambda item: item[0][0] * item[0][1])
        tokens = sum(sum(part) for part in parts)
        return parts_ms < max(self.eager_round_ms, tokens * ms / (q * bs))

    def sizes(self, q: int) -> list[int]:
        """The batch buckets captured for steps of q query tokens."""
        return self.q_sizes[q]

    def _run(
        self, buffers: GraphBuffers, batch: ForwardBatch, aux_layers: tuple[int, ...], t: int
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
        """(q, batch size) of the graph that can run `batch`, or None (`_plan`)."""
        found = self._plan(batch, device_rows)
        return None if isinstance(found, str) else found

    def why_eager(self, batch: ForwardBatch, device_rows: bool = False) -> str:
        """Why no captured graph runs `batch` (`_plan`'s reason; "none" where one does)."""
        found = self._plan(batch, device_rows)
        return found if isinstance(found, str) else "none"

    def _plan(self, batch: ForwardBatch, device_rows: bool) -> tuple[int, int] | str:
        """(q, batch size) of the graph that can run `batch` (host metadata): the smallest
        captured q that holds its longest sequence; a sequence with fewer query tokens (a ragged
        batch, a tree's frontier, or q not captured itself) is padded to q (GraphBuffers.fill):
        with q > 1 every sequence's new tokens must fit the graph's [q, q] mask, so q also holds
        the most new tokens of any sequence. device_rows: some of the inputs come from the
        device (features, tokens): only a batch that needs no padding rows between its
        sequences. Else why none does: "batch" (more sequences than the largest bucket, or
        none), "context" (a page table longer than the graphs'), "run" (no captured q holds a
        sequence's new tokens with a bucket for the batch), "rows" (device inputs that would
        need padding rows)."""
        bs = batch.num_seqs
        if bs == 0 or bs > self.batch_sizes[-1]:
            return "batch"
        if batch.block_table.shape[1] > self.max_pages:
            return "context"
        # one query token per sequence sees all its new tokens: no mask (a chain's draft step)
        one = batch.max_q_len == 1 and (batch.tree_mask is None or batch.tree_mask.shape[2] == 1)
        need = 1
        if not one:  # its most new tokens (in numpy: torch's CPU ops cost ~10 us each here)
            news = batch.kv_lens.numpy() - batch.prefix_lens.numpy()
            need = max(batch.max_q_len, int(news.max()))
        q = smallest_q(self.q_sizes, bs, need)  # any layers: forward() captures these on use
        if q is None or (q == 1 and not one):
            return "run"
        if device_rows and batch.input_ids.shape[0] != bs * q:
            # padding rows would need the device's features or tokens scattered there too
            return "rows"
        return q, next(b for b in self.q_sizes[q] if b >= bs)

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
        in_order = views and buffers.in_order("rows", num_rows, t)  # (GraphBuffers.rows)

        def logit_rows(out: torch.Tensor) -> torch.Tensor:  # the logits' rows of an output
            return out[:t] if in_order else buffers.gather(out[:t], "rows", num_rows)

        logits = logit_rows(buffers.logits)
        hidden = None
        if buffers.hidden_states is not None:
            if batch.hidden_indices is None:  # the logits' rows
                hidden = logit_rows(buffers.hidden_states)
            else:
                num = batch.hidden_indices.shape[0]
                hidden = buffers.rows(buffers.hidden_states[:t], "hidden_rows", num, views)
        greedy = None if buffers.greedy is None else logit_rows(buffers.greedy)
        return ForwardOutput(logits, hidden, greedy, static=in_order)
