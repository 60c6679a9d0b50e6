"""Tree expansion as tensor ops over the whole batch (drafter/tree_draft.py's algorithm, the
same trees): every step of every sequence's expansion runs on the device, the host reads the
candidates once at the end. On a GPU each (topk, num_steps, batch bucket) is one CUDA graph,
captured on first use: a draft round is one replay, not one forward and one host sync per step.
This module holds the graphs (capture, inputs, replay, outputs); the steps themselves, and how
candidates are numbered, are drafter/expansion_steps.py's `ExpansionSteps`.

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
from typing import Any

import numpy as np
import torch

from drafter.expansion_buffers import ExpansionBuffers
from drafter.expansion_inputs import (
    Ahead,
    Candidates,
    ExpansionInputs,
    PoolRows,
    RuleRun,
    Shape,
)
from drafter.expansion_steps import (
    CatchUpForward,
    ExpansionSteps,
    FrontierForward,
    RowRules,
    RowsWrite,
)
from specsplit import metrics
from specsplit.kv_cache import KVCache, SeqKV
from specsplit.model.cuda_graphs import batch_buckets
from specsplit.model.graph_buffers import CaptureStream
from specsplit.tree import DraftProbs, cut_rows

log = logging.getLogger(__name__)

# a fused key (catch-up in the run) not captured at warm-up is captured at its round that asks
# for it this many times at one batch bucket (`DeviceExpansion.ready`): a shape that keeps
# coming (a client's own spec, `--ahead-guesses 4`, the short chains near max_new_tokens) gets
# the one-replay run, a one-off keeps the unfused path rather than a 10-50 ms capture in
# traffic. Unfused, a Draft of a chain of 2 took 1.35 ms on two H200s against 0.63 for the
# fused default chain of 3 (SmolLM2 + the shipped head, batch 1, bench/RESULTS.md)
FUSED_CAPTURE_AFTER = 8


class DeviceExpansion(ExpansionBuffers, ExpansionSteps):
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
    new rows a run with a catch-up writes before the catch-up reads them; None: it has none.
    `rule_rows`: the proposer's logit rules' rows (its RuleTables, made at the first call): a
    run of a key with `rules` counts in the changes crossing with it (`RuleRun.deltas`), then
    bends every step's logits, each row by its sequence's rules; None: no key can."""

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
        catch_up_lens: tuple[int, ...] = (),
        rule_rows: Callable[[], RowRules] | None = None,
    ) -> None:
        """catch_up: the proposer's catch-up forward, which keys with `catch_up` run (None: none
        can). catch_up_lens: the catch-up lengths a key's graph may have (the proposer's padded
        lengths; () = any)."""
        self.forward = forward
        self.catch_up = catch_up
        self.kv = kv
        self.vocab_size = vocab_size
        self.scored_ids = scored_ids
        self.scored = vocab_size if scored_ids is None else scored_ids.shape[0]
        self.max_context = max_context
        self.feature = feature
        self.graphs = graphs and kv.device.type == "cuda"
        self.batch_sizes = batch_buckets(max_batch_size)
        self.pool: Any = None  # the graphs' memory pool handle, made at the first capture
        self.capture_stream = CaptureStream()
        self.captured: dict[
            tuple[Shape | Ahead, int], tuple[torch.cuda.CUDAGraph, ExpansionInputs]
        ] = {}
        # how often `ready` was asked for each (key, bucket) not captured
        self.asked: dict[tuple[Shape | Ahead, int], int] = {}
        # pinned host mirrors of each graph's crossing input (rule slots, meta) and packed
        # output, its sampling input and the supports' probabilities
        self.host: dict[tuple[Shape | Ahead, int], tuple[torch.Tensor, ...]] = {}
        self.pool_rows = pool_rows
        self.write_rows = write_rows
        self.catch_up_lens = catch_up_lens
        self.rule_rows = rule_rows
        # the graphs' new pool rows: one device buffer all of them read (each a view of its
        # first bucket * q rows; grown for a larger one, whose earlier views keep the old),
        # and its pinned host mirror (free again after each run, which waits for its copies)
        self.rows_buffer: torch.Tensor | None = None
        self.host_rows: torch.Tensor | None = None

    def ready(self, key: Shape | Ahead, bs: int) -> bool:
        """Whether an expansion of `key` (a fused catch-up's) for `bs` rows is to run: eagerly,
        from a graph already captured (warm-up captures the usual shapes), or from one its
        `expand` captures now, this being the FUSED_CAPTURE_AFTER-th time the key was asked
        for at this batch bucket; False before that (the caller takes the unfused path), and
        always for a catch-up of a length outside `catch_up_lens` (tokens since a run of plain
        rounds, tens of them: a graph for each length as it came, ~0.3 s apiece in the round,
        made the 8B mirror's TTFT p99 ~0.7 s under the speculation gate's probes)."""
        bucket = self._bucket(bs)
        if not self.graphs or bucket is None or (key, bucket) in self.captured:
            return True
        if key.catch_up and self.catch_up_lens and key.catch_up not in self.catch_up_lens:
            return False
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
        rules: RuleRun | None = None,  # with shape.rules: the rows' slots, the count changes
    ) -> list[Candidates]:
        """Each sequence's candidates (with `shape.catch_up` = q, after its catch-up of q
        entries from `catch_ups`, as `expand_ahead`'s)."""
        bs, n = len(seqs), shape.num_candidates
        assert (root_logits is None) == bool(shape.catch_up), shape
        out, probs = self._run(
            shape, seqs, root_logits, root_features, [], sampling, catch_ups, new_rows, rules
        )
        cands = out[: bs * 3 * n].reshape(bs, 3, n)
        found = [_candidates(cands, b) for b in range(bs)]
        if shape.sampled:
            self._attach_supports(found, out[bs * 3 * n :], probs)
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
        sampling: np.ndarray | None = None,  # [B, 3 + num_steps] a sampled chain's rows
        rules: RuleRun | None = None,  # with key.shape.rules: the rows' slots, count changes
    ) -> list[list[tuple[int, int, Candidates]]]:
        """Draft-ahead in one run (one graph replay): with `key.catch_up` = q, first each
        sequence's entries at storage [base - q, base) from `catch_ups` (causal; the last one
        the root's, whose logits and output the rest starts from, in place of `root_logits`
        and `root_features`); then the chain's nodes a step each (each reads its parent's
        output), the guessed bonus tokens at every accept length k (the likeliest at node k but
        the chain's next node), then each outcome's bonus and its tree, all in the sequence's
        own storage past the root: the chain at base + [0, L), outcome o's bonus at
        base + L + o * (1 + n) and its candidates after it, each row seeing only its ancestors.
        `new_rows` (a row pool's): written into the pool before the catch-up reads it. A
        sampled chain's outcomes (`key.shape.sampled`) all draw at its row of `sampling`.
        Per sequence, per outcome (k, j): (k, bonus, its tree's candidates)."""
        bs, n, g = len(seqs), key.shape.num_candidates, key.guesses
        assert (root_logits is None) == bool(key.catch_up), key
        assert (sampling is not None) == key.shape.sampled, key
        out, probs = self._run(
            key, seqs, root_logits, root_features, chains, sampling, catch_ups, new_rows, rules
        )
        rows = bs * key.num_outcomes
        cands = out[: rows * 3 * n].reshape(rows, 3, n)
        end = rows * 3 * n + bs * (key.chain_len + 1) * g
        bonus = out[rows * 3 * n : end].reshape(bs, key.chain_len + 1, g)
        found = [_candidates(cands, r) for r in range(rows)]
        if key.shape.sampled:
            self._attach_supports(found, out[end:], probs)
        return [
            [
                (k, int(bonus[b, k, j]), found[(b * (key.chain_len + 1) + k) * g + j])
                for k in range(key.chain_len + 1)
                for j in range(g)
            ]
            for b in range(bs)
        ]

    def _attach_supports(
        self,
        found: list[Candidates],  # a sampled chain's each, rows in order
        ids: np.ndarray,  # flat [rows, n, S] the supports' tokens (out's part after the rest)
        probs: np.ndarray,  # flat [rows, n, S] their probabilities
    ) -> None:
        """Give each sampled chain's candidates its nodes' cut distributions."""
        rows, n = len(found), len(found[0].tokens) if found else 0
        if not rows:
            return
        # cut to the rows' own widths at once (as they cross the wire), a part a candidate
        cut = cut_rows(ids.reshape(rows * n, -1), probs.reshape(rows * n, -1))
        every = DraftProbs.ragged(cut, self.vocab_size)
        for candidates, part in zip(found, every.split([n] * rows), strict=True):
            candidates.draft_probs = part

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
        rules: RuleRun | None = None,
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
                rules,
            )
            if sampling is not None:
                host_sampling[:bs].copy_(torch.from_numpy(sampling))
                inputs.sampling.copy_(host_sampling, non_blocking=True)
            graph.replay()
            metrics.count_drafter_forward(None)
            host_out.copy_(inputs.out, non_blocking=True)
            host_probs.copy_(inputs.probs, non_blocking=True)
            torch.cuda.current_stream(self.kv.device).synchronize()  # the mirrors are free after
            return _first_rows(host_out.numpy(), key, bucket, bs), host_probs.numpy()[
                : inputs.probs.numel() // bucket * bs
            ]
        why = "no graphs" if not self.graphs else "batch" if bucket is None else "context"
        metrics.count_drafter_forward(why)
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
        host = torch.zeros(inputs.crossing.shape, dtype=torch.int32)
        self._load(
            inputs, host, None, seqs, root_logits, root_features, chains, catch_ups, new_rows,
            rules,
        )  # fmt: skip
        if sampling is not None:
            inputs.sampling.copy_(torch.from_numpy(sampling))
        self._body(key, inputs)
        return inputs.out.cpu().numpy(), inputs.probs.cpu().numpy()

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
        crossing = np.zeros(tuple(inputs.crossing.shape), dtype=np.int32)  # (rule slots 0)
        chain_len = key.chain_len if isinstance(key, Ahead) else 0
        catch_up = key.catch_up
        self._fill_meta(
            crossing[inputs.meta_start :],
            [],
            bucket,
            [[0] * chain_len] if chain_len else [],
            [[0] * catch_up] if catch_up else [],
            inputs.row_slots,
        )
        inputs.crossing.copy_(torch.from_numpy(crossing))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = self.capture_stream(device)
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
            for buffer in (inputs.crossing, inputs.out, inputs.sampling, inputs.probs)
        )
        if logged:  # one in traffic: a first round of its shape at this batch size
            log.info("captured the expansion graph of %s at batch %d", key, bucket)


def _candidates(out: np.ndarray, row: int) -> Candidates:
    """Row `row` of expansion output [rows, 3, n] as Candidates."""
    return Candidates(out[row, 0].tolist(), out[row, 1].tolist(), out[row, 2].tolist())


def _first_rows(out: np.ndarray, key: Shape | Ahead, bucket: int, bs: int) -> np.ndarray:
    """The flat output of a graph's `bucket` rows cut to its first `bs` (the padding after)."""
    # a row's part of each: candidates (draft-ahead's: then the bonus tokens), then a sampled
    # chain's supports' tokens
    shape = key.shape if isinstance(key, Ahead) else key
    chains = key.num_outcomes if isinstance(key, Ahead) else 1
    parts = [chains * 3 * shape.num_candidates]
    if isinstance(key, Ahead):
        parts.append((key.chain_len + 1) * key.guesses)
    if shape.sampled:
        parts.append((len(out) - bucket * sum(parts)) // bucket)
    if len(parts) == 1:
        return out[: bs * parts[0]]
    starts = np.cumsum([0, *parts]) * bucket
    return np.concatenate([out[s : s + bs * p] for s, p in zip(starts[:-1], parts, strict=True)])
