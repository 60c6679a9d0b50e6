"""Batched tree drafting shared by the model-backed proposers (draft model, EAGLE-3 head).

Step 1 takes the root's top-k; each later step forwards the frontier (topk nodes), takes top-k
children of each (topk^2 candidates) and keeps the topk best by cumulative log-probability as
the next frontier. The tree is the best `num_draft_tokens` candidates. topk = 1 is a chain:
argmax (or a sample, with its distribution) per step. Candidate i's K/V lives at storage
base + i (base = the proposer's kv_committed_len); it is scratch, freed after drafting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from drafter.draft_ahead import DraftAhead, rows_of
from drafter.draft_rules import RuleTables
from drafter.expansion import DeviceExpansion
from drafter.expansion_inputs import Ahead, PoolRows, Shape
from drafter.expansion_keys import ExpansionKeys, expansion_key
from drafter.host_expansion import Expansion, HostExpansion
from drafter.types import DraftJob, DraftSeq
from specsplit import metrics
from specsplit.kernels.triton_jit import building, building_ahead
from specsplit.kv_cache import KVCache, KVPages, SeqKV
from specsplit.model.attention import warm_up_attention
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.cuda_graphs import CudaGraphRunner, why_eager
from specsplit.model.transfer import on_device
from specsplit.sampling import make_generator
from specsplit.step import SeqStep, build_forward_batch
from specsplit.tree import DraftTree

# catch-up lengths captured as CUDA graphs: a round's accepted drafts + bonus (a chain of 3
# brings 1..4 new tokens) padded up to the next of these
CATCH_UP_LENS = (1, 2, 4, 8)
# expansions captured at warm-up for every batch bucket: the gateway's default spec (a chain of
# 3), greedy and sampled, and the shorter chains it asks for near a request's max_new_tokens
# where no longer chain shares the round (`_share_chain_length`: a lone stream, or the last few);
# other shapes are captured at their first round in each bucket (10-50 ms that round)
EXPANSION_SHAPES = tuple(
    Shape(topk=1, num_steps=steps, sampled=sampled)
    for sampled in (False, True)
    for steps in (3, 2, 1)
)
# draft-ahead's expansions captured at warm-up for every batch bucket: the gateway's defaults
# (gateway/scheduler.py: 2 bonus guesses at each accept length of a chain of 3 being verified;
# a plain round's (3 + 1) x 2 = 8 guesses at the root), which its overlap gate probes at each
# batch size it meets (`up`'s default on two GPUs): before, each was captured in its first such
# round, 10-50 ms on an 8B head; greedy and sampled
AHEAD_SHAPES = tuple(
    ahead
    for sampled in (False, True)
    for ahead in (Ahead(3, 2, Shape(1, 3, sampled)), Ahead(0, 8, Shape(1, 3, sampled)))
)
# and the shorter chains' near a request's max_new_tokens (chains of 2 and 1, and a plain
# round's (n + 1) x 2 guesses for them), without a catch-up: captured in traffic, each took
# ~0.3 s of a round (the 8B mirror's speculation at 20 requests a second, TTFT p99 134 ms)
AHEAD_NEAR_END = tuple(
    ahead
    for sampled in (False, True)
    for n in (2, 1)
    for ahead in (Ahead(n, 2, Shape(1, n, sampled)), Ahead(0, (n + 1) * 2, Shape(1, n, sampled)))
)
# keys also captured with the catch-up in the same run (`catch_up`: `TreeProposer._fused_expand`,
# `_fused_ahead`) at every catch-up length: the gateway's default chain of 3, greedy and
# sampled (the shorter chains near max_new_tokens catch up first, from their own graphs), and
# AHEAD_SHAPES; other keys once they keep coming (expansion.FUSED_CAPTURE_AFTER). Beside a
# chain of 3 a draft model catches up the last round's 1-4 new tokens (accepted drafts and the
# bonus), an EAGLE head 2-5 entries (the gateway sends the root again, which drops its entry),
# padded to a length in CATCH_UP_LENS
# EXPANSION_SHAPES bent by logit rules or a guide's root mask (drafter/draft_rules.py), greedy
# and sampled: captured at warm-up too, the rule tables made then. With the default chain's
# alone, a penalised request's first round at each batch size captured the shorter chains' near
# its max_new_tokens (2 a bucket; the first in inference mode traced 3 torch.compile graphs):
# 0.38 s at batch 1 against 0.04 warm on an H200 (random SmolLM2, repetition 1.2)
RULED_SHAPES = tuple(dataclasses.replace(shape, rules=True) for shape in EXPANSION_SHAPES)
FUSED_SHAPES: tuple[Shape | Ahead, ...] = (
    *(shape for shape in EXPANSION_SHAPES + RULED_SHAPES if shape.num_steps == 3),
    *AHEAD_SHAPES,
)


def _draft_seed(seed: int | None) -> int | None:
    """A seed unrelated to the verifier's: drafts must be independent of its acceptance draws."""
    return None if seed is None else (seed * 6364136223846793005 + 1442695040888963407) % 2**63


@dataclass
class DraftKVState:
    """A sequence's state in a model-backed proposer: its draft KV and sampling generator."""

    kv: SeqKV
    generator: torch.Generator | None = None


class TreeProposer(HostExpansion, DraftAhead, ExpansionKeys, KVPages):
    """Tree expansion over a model with its own paged KV (`self.kv`); per-sequence state is a
    DraftKVState. Subclasses provide `_step_forward` (one forward over a ForwardBatch) and
    `_forward_frontier` (logits [sum of frontiers, vocab]).

    On a GPU the catch-up steps (the new tokens of each sequence, padded to a length in
    `catch_up_lens` by recomputing a few cached entries) replay CUDA graphs, and so does the
    whole expansion of a tree or chain, greedy or sampled (drafter/expansion.py: every step in
    one replay, one host sync a round); prefills run eagerly."""

    kv: KVCache
    device: torch.device
    max_context: int
    num_heads: int  # the model's attention heads (queries)
    graphs: CudaGraphRunner | None = None
    catch_up_lens: tuple[int, ...] = ()  # ascending; () = catch-up steps are not padded
    graph_features: tuple[int, torch.dtype] | None = None  # the step's features input, if any
    vocab_size: int
    # expand trees on the device (drafter/expansion.py; CUDA graphs on a GPU), else a step at a
    # time on the host
    device_expansion: bool = True
    # a Draft or a draft-ahead call runs its catch-up in the expansion's own device run where it
    # can (`_fused_expand`, `_fused_ahead`); off: the catch-up first (the reference)
    fused_catch_up: bool = True
    device_expansion_runner: DeviceExpansion | None = None
    # [Vs] the target id of each column of the model's logits where it scores a vocabulary of
    # its own in ascending target ids (an EAGLE head's draft vocabulary): the device expansion
    # reads those columns alone (DeviceExpansion's `scored_ids`); None: the target's
    scored_ids: torch.Tensor | None = None
    rule_tables: RuleTables | None = None
    # a row pool beside the KV (an EAGLE head's target features, a row per slot): its rows'
    # (width, dtype), or None; and the round's new rows `_root_steps` took and the pool does not
    # hold yet: a fused run writes them in its own device run (`_carried_rows`), any other path
    # before its first forward (`_run_roots`), and a call that fails on the way at its end
    pool_rows: tuple[int, torch.dtype] | None = None
    unwritten: PoolRows | None = None

    def warm_up_kernels(self) -> None:
        """On a GPU, every paged-attention variant of this model's KV layout."""
        with on_device(self.device):
            warm_up_attention(self.kv, self.num_heads)

    def capture_cuda_graphs(
        self, catch_up_lens: tuple[int, ...] = CATCH_UP_LENS, max_batch_size: int = 64
    ) -> None:
        """On a GPU, capture the steps of 1 and of `catch_up_lens` tokens per sequence for
        batches up to `max_batch_size`, and the device expansion of EXPANSION_SHAPES and
        AHEAD_SHAPES and AHEAD_NEAR_END and RULED_SHAPES at every batch bucket (others are
        captured at their first use); a no-op elsewhere."""
        if self.device.type != "cuda" or not catch_up_lens:
            return
        with on_device(self.device):
            self._capture(tuple(sorted({1, *catch_up_lens})), max_batch_size)
            self.device_expansion_runner = self._new_expansion(graphs=True)
            self._made_rule_tables()  # (the ruled shapes' graphs read them)
            keys: tuple[Shape | Ahead, ...] = (
                *EXPANSION_SHAPES, *AHEAD_SHAPES, *AHEAD_NEAR_END, *RULED_SHAPES,
            )  # fmt: skip
            if self.fused_catch_up:
                keys += tuple(
                    dataclasses.replace(key, catch_up=q)
                    for key in FUSED_SHAPES
                    for q in self.catch_up_lens
                )
            for key in keys:
                self.device_expansion_runner.capture_all(key)

    def _capture(self, lens: tuple[int, ...], max_batch_size: int) -> None:
        self.graphs = CudaGraphRunner(
            self._step_forward,
            self.kv,
            self.max_context,
            max_batch_size=max_batch_size,
            max_query_len=lens[-1],
            features=self.graph_features,
        )
        with building_ahead():  # (active: the steps' kernel variants built side by side first)
            if building():
                for q in reversed(lens):
                    self.graphs.build(q)
        for q in reversed(lens):  # (largest first: the smaller reuse the larger's pool blocks)
            self.graphs.capture(q)
        self.catch_up_lens = lens

    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        """One tree per job (`_propose`); the candidates' scratch K/V is freed after. No jobs
        (a Draft of draft-ahead items alone): nothing runs (a draft model's catch-up would run
        a forward over an empty batch)."""
        if not jobs:
            return []
        with on_device(self.device):
            try:
                self._take_rules(jobs)
                return self._propose(jobs)
            finally:
                self._flush_rows()
                self._settle_rules()
                for job in jobs:
                    self.kv.trim(self._seq_kv(job.seq), self.kept_len(job.seq))

    def _propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        self._share_chain_length(jobs)
        drafting, steps = self._root_steps(jobs)
        fused = self._fused_expand(jobs, drafting, steps)
        if fused is not None:
            return fused
        drafting, root_logits, root_features = self._run_roots(drafting, steps)
        drafted = self._expand(drafting, root_logits, root_features)
        by_seq = {id(job): tree for job, tree in zip(drafting, drafted, strict=True)}
        return [by_seq.get(id(job), DraftTree()) for job in jobs]

    def _run_roots(
        self, drafting: list[DraftJob], steps: list[SeqStep]
    ) -> tuple[list[DraftJob], torch.Tensor, torch.Tensor | None]:
        """The catch-up `_root_steps` planned: its forward (the new pool rows written first).
        Returns the jobs that can draft, their roots' logits [D, vocab] in the target's
        vocabulary, and the roots' outputs [D, width] a next step reads (EAGLE) or None."""
        self._flush_rows()
        if not steps:
            return [], torch.zeros(0, self.vocab_size, device=self.device), None
        logits, features = self._forward_roots(steps)
        return drafting, logits, features

    def _root_steps(self, jobs: list[DraftJob]) -> tuple[list[DraftJob], list[SeqStep]]:
        """Plan the catch-up of every job's sequence up to its root: pages reserved (and for
        `job.scratch_len` entries past it) and each sequence's entries counted as caught up
        (an EAGLE head's new feature rows taken, `unwritten`). Returns the jobs that can
        draft and the catch-up's steps, causal, one per sequence with entries to compute (in
        the jobs' order; a drafting job's with the logits of its last row, its root)."""
        raise NotImplementedError

    def _flush_rows(self) -> None:
        """Write the new pool rows `_root_steps` took (`unwritten`), if any."""
        rows, self.unwritten = self.unwritten, None
        if rows is not None:
            self._write_rows(rows)

    def _write_rows(self, rows: PoolRows) -> None:
        """Write host rows into the row pool (a proposer with one: `pool_rows`)."""
        raise NotImplementedError

    def _forward_roots(self, steps: list[SeqStep]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The catch-up's forward over `steps`: the logits of their logit rows [D, vocab] in the
        target's vocabulary and those rows' outputs [D, width] (EAGLE) or None."""
        raise NotImplementedError

    def _catch_up_features(self, batch: ForwardBatch) -> torch.Tensor | None:
        """What a catch-up step's rows read besides their tokens ([T, width] on the device;
        None: nothing): the device expansion's catch-up (`_catch_up_outputs`)."""
        return None

    def _catch_up_outputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A catch-up forward on the device (drafter/expansion.py CatchUpForward)."""
        return self._frontier_outputs(batch, self._catch_up_features(batch))

    def _forward_rows(
        self, steps: list[SeqStep], features: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over `steps`: their logit rows in the target's vocabulary, and the
        rows' outputs a next step reads (EAGLE) or None."""
        out = self._run(steps, features)
        return self._tree_logits(out.logits), out.hidden_states

    def _step_forward(
        self, batch: ForwardBatch, aux_layers: tuple[int, ...], features: torch.Tensor | None
    ) -> ForwardOutput:
        raise NotImplementedError

    def _run(self, steps: list[SeqStep], features: torch.Tensor | None = None) -> ForwardOutput:
        """One forward over `steps`: a CUDA graph's replay where one fits, else eager."""
        batch, _ = build_forward_batch(steps, self.kv.page_size)
        out = None if self.graphs is None else self.graphs.forward(batch, (), features)
        if out is not None:
            metrics.count_drafter_forward(None)
            return out
        metrics.count_drafter_forward(why_eager(self.graphs, batch, features is not None))
        return self._step_forward(batch.to(self.device), (), features)

    def _catch_up_starts(self, starts: list[int], ends: list[int]) -> list[int]:
        """Where each sequence's catch-up step (entries [start, end)) begins: at `starts`, or
        earlier, recomputing a few cached entries, so that every step has the same length and
        it is one in `catch_up_lens` (a graph's replay; a ragged batch runs eagerly)."""
        longest = max((e - s for s, e in zip(starts, ends, strict=True)), default=0)
        q = next((n for n in self.catch_up_lens if n >= longest), None)
        if q is None or any(e < q for e in ends):
            return starts
        return [e - q for e in ends]

    def _state(self, seq: DraftSeq) -> DraftKVState:
        assert isinstance(seq.state, DraftKVState)
        return seq.state

    def _seq_kv(self, seq: DraftSeq) -> SeqKV:
        return self._state(seq).kv

    def _set_generator(self, seq: DraftSeq, seed: int | None) -> torch.Generator:
        """The sequence's draft generator, on the host (its uniforms travel with the round's
        other inputs)."""
        state = self._state(seq)
        if state.generator is None:
            state.generator = make_generator(_draft_seed(seed))
        return state.generator

    def kv_committed_len(self, seq: DraftSeq) -> int:
        return self._seq_kv(seq).kv_committed_len

    def kept_len(self, seq: DraftSeq) -> int:
        """Storage a sequence's pages keep between rounds (its entries; an EAGLE proposer's
        features too): a round's scratch past it is freed."""
        return self.kv_committed_len(seq)

    def release(self, seq: DraftSeq) -> None:
        self.kv.release(self._seq_kv(seq))
        if self.rule_tables is not None:
            self.rule_tables.release(seq)

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def _forward_frontier(self, trees: list[Expansion]) -> torch.Tensor:
        """Logits [sum of frontiers, vocab] of the trees' frontiers (the subclass's)."""
        raise NotImplementedError

    def _expand(
        self,
        jobs: list[DraftJob],
        root_logits: torch.Tensor,  # [B, vocab]
        root_features: torch.Tensor | None = None,  # [B, width] the root's outputs (EAGLE)
    ) -> list[DraftTree]:
        """One tree per job: on the device (DeviceExpansion, one run per shape; sampled chains
        their own) where `device_expansion` is on, else here on the host, a step at a time."""
        trees: list[DraftTree] = [DraftTree() for _ in jobs]
        on_host: list[int] = []
        groups: dict[Shape, list[int]] = {}
        for i, job in enumerate(jobs):
            if self._expands_on_device(job):
                groups.setdefault(expansion_key(job), []).append(i)
            elif job.spec.num_steps > 0:
                on_host.append(i)

        for shape, idx in groups.items():
            roots = rows_of(root_logits, root_features, idx)
            grown = self._expand_shape(shape, [jobs[i] for i in idx], *roots)
            for i, tree in zip(idx, grown, strict=True):
                trees[i] = tree
        if on_host:
            roots = rows_of(root_logits, root_features, on_host)
            grown = self._expand_on_host([jobs[i] for i in on_host], *roots)
            for i, tree in zip(on_host, grown, strict=True):
                trees[i] = tree
        return trees

    def _frontier_outputs(
        self, batch: ForwardBatch, features: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One frontier step on the device: logits in the vocabulary the expansion scores
        (`scored_ids`), and the rows' outputs the next step reads (an EAGLE head's), or None."""
        out = self._step_forward(batch, (), features)
        logits = out.logits if self.scored_ids is not None else self._tree_logits(out.logits)
        return logits, out.hidden_states

    def _write_pool_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The row pool's write on the device (rows [n, width] at slots [n] int64; a device
        run's, `DeviceExpansion.write_rows`)."""
        raise NotImplementedError

    def _tree_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """A step's logits in the target's vocabulary (an EAGLE head with its own maps them)."""
        return logits
