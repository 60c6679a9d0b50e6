"""Which device expansion a Draft's jobs run (`ExpansionKeys`, a mixin of TreeProposer in
drafter/tree_draft.py): each job's key (`expansion_key`: a shape, chains at the round's longest
length), the expansion that also runs the catch-up in its own device run where every job can
(`_fused_key`: one graph replay on a GPU, no host work between the two), and the new row-pool
rows (an EAGLE head's target features) that such a run carries and writes itself
(`_carried_rows`, `_carrying`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from drafter.draft_rules import RuleTables
from drafter.expansion import DeviceExpansion
from drafter.expansion_inputs import DELTAS_PER_ROW, Ahead, PoolRows, RuleRun, Shape
from drafter.host_expansion import sampled_chain, select_tree
from drafter.types import DraftJob, DraftSeq
from specsplit.kv_cache import KVCache, SeqKV
from specsplit.model.batch import ForwardBatch
from specsplit.model.cuda_graphs import CudaGraphRunner
from specsplit.step import SeqStep
from specsplit.tree import DraftTree

_R = TypeVar("_R")


class ExpansionKeys:
    """The device expansion's keys, the fused catch-up and the rows it carries."""

    # the proposer's (TreeProposer), which these use
    kv: KVCache
    max_context: int
    vocab_size: int
    graphs: CudaGraphRunner | None
    catch_up_lens: tuple[int, ...]
    graph_features: tuple[int, torch.dtype] | None
    device_expansion: bool
    fused_catch_up: bool
    device_expansion_runner: DeviceExpansion | None
    scored_ids: torch.Tensor | None
    rule_tables: RuleTables | None  # the sequences' logit rules' rows, made at the first
    pool_rows: tuple[int, torch.dtype] | None
    unwritten: PoolRows | None
    _flush_rows: Callable[[], None]
    _write_rows: Callable[[PoolRows], None]
    _write_pool_rows: Callable[[torch.Tensor, torch.Tensor], None]
    _seq_kv: Callable[[DraftSeq], SeqKV]
    _sampling_rows: Callable[[list[DraftJob], int], np.ndarray]
    _frontier_outputs: Callable[
        [ForwardBatch, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
    ]
    _catch_up_outputs: Callable[[ForwardBatch], tuple[torch.Tensor, torch.Tensor | None]]

    def _share_chain_length(self, jobs: list[DraftJob]) -> None:
        """Greedy chains expanded on the device are drafted at the round's longest chain length
        and cut to their own after (`job.expand_steps`): one expansion (one graph replay, one
        wait) for a round whose chains the gateway capped to fewer steps near max_new_tokens,
        and no graph captured for a capped length mid-traffic. A chain's first steps do not
        depend on the later ones, so its tokens are the same. A chain rides only where its
        context has room for the longer one."""
        chains = [
            job
            for job in jobs
            if job.spec.topk == 1 and not job.ahead_guesses and self._expands_on_device(job)
        ]
        longest = max((job.spec.num_steps for job in chains), default=0)
        for job in chains:
            if job.spec.num_steps < longest <= self.max_context - len(job.seq.tokens):
                job.expand_steps = longest

    def _carried_rows(self, q: int) -> PoolRows | None:
        """The new pool rows for a run with a catch-up of q entries a sequence (`unwritten`: they
        cross with its inputs and it writes them): all of them where each sequence's fit in q
        and they are on the host; else they are written here first, and None."""
        rows = self.unwritten
        if rows is not None and rows.fit(q) and all(p.device.type == "cpu" for p in rows.parts):
            self.unwritten = None
            return rows
        self._flush_rows()
        return None

    def _carrying(self, catch_up: int, run: Callable[[PoolRows | None], _R]) -> _R:
        """`run` of a device run with a catch-up of `catch_up` entries a sequence (0: none),
        given the new pool rows it carries (`_carried_rows`) or None; where it fails, the rows
        are written here (the pool must hold what the proposer counts)."""
        new_rows = self._carried_rows(catch_up) if catch_up else None
        try:
            return run(new_rows)
        except BaseException:
            if new_rows is not None:
                self._write_rows(new_rows)
            raise

    def _expands_on_device(self, job: DraftJob) -> bool:
        """Whether `job`'s trees expand on the device (DeviceExpansion): all of them, trees,
        greedy and sampled chains, where `device_expansion` is on."""
        return self.device_expansion and job.spec.num_steps > 0

    def _fused_key(
        self,
        jobs: list[DraftJob],
        drafting: list[DraftJob],
        steps: list[SeqStep],
        key_of: Callable[[DraftJob], Shape | Ahead | None],
    ) -> Shape | Ahead | None:
        """The key of an expansion that runs the catch-up in its own device run (`catch_up`:
        one graph replay on a GPU, no host work between the two), or None where `jobs` cannot:
        every job drafts on the device with one key (`key_of`; None: it cannot) and catches up
        the same number of entries in one step ending at its root (`_catch_up_starts` pads the
        lengths), and the key's graph is captured where graphs run (warm-up: the usual shapes;
        others once asked for often enough, `DeviceExpansion.ready`). Otherwise the catch-up
        runs first, as it did before."""
        if not (self.fused_catch_up and jobs and len(drafting) == len(steps) == len(jobs)):
            return None
        q = len(steps[0].input_ids)
        keys = set()
        for job, step in zip(jobs, steps, strict=True):
            key = key_of(job)
            if not (
                key is not None
                and step.seq is self._seq_kv(job.seq)
                and len(step.input_ids) == q
                and step.logit_rows == [q - 1]
                and step.kv_len == step.seq.kv_committed_len
            ):
                return None
            keys.add(key)
        if len(keys) != 1:
            return None
        fused = dataclasses.replace(keys.pop(), catch_up=q)
        return fused if self._expansion().ready(fused, len(jobs)) else None

    def _fused_expand(
        self, jobs: list[DraftJob], drafting: list[DraftJob], steps: list[SeqStep]
    ) -> list[DraftTree] | None:
        """A Draft's trees with the catch-up in the expansion's device run (`_fused_key`):
        every job's tree of one shape expanded on the device. None otherwise."""

        def key_of(job: DraftJob) -> Shape | None:
            return expansion_key(job) if self._expands_on_device(job) else None

        key = self._fused_key(jobs, drafting, steps, key_of)
        if not isinstance(key, Shape):
            return None
        return self._expand_shape(key, jobs, None, None, [step.input_ids for step in steps])

    def _expand_shape(
        self,
        shape: Shape,
        jobs: list[DraftJob],
        root_logits: torch.Tensor | None,
        root_features: torch.Tensor | None,
        catch_ups: list[list[int]] | None = None,
    ) -> list[DraftTree]:
        """DeviceExpansion.expand of `shape` for `jobs` (a sampled chain's uniforms drawn here,
        once a round): each job's tree."""
        seqs = [self._seq_kv(job.seq) for job in jobs]
        sampling = self._sampling_rows(jobs, shape.num_steps) if shape.sampled else None
        rules = self._rule_run(jobs, shape)
        found = self._carrying(
            shape.catch_up if catch_ups else 0,
            lambda new_rows: self._expansion().expand(
                shape, seqs, root_logits, root_features, sampling, catch_ups, new_rows, rules
            ),
        )
        return [select_tree(c, job.spec) for c, job in zip(found, jobs, strict=True)]

    def _expansion(self) -> DeviceExpansion:
        """The device expansion: with CUDA graphs once capture_cuda_graphs has run, eager
        before (and on the CPU)."""
        if self.device_expansion_runner is None:
            self.device_expansion_runner = self._new_expansion(graphs=False)
        return self.device_expansion_runner

    def _new_expansion(self, graphs: bool) -> DeviceExpansion:
        return DeviceExpansion(
            self._frontier_outputs,
            self.kv,
            self.vocab_size,
            self.max_context,
            self.graph_features,
            graphs=graphs,
            max_batch_size=self.graphs.batch_sizes[-1] if self.graphs is not None else 64,
            catch_up=self._catch_up_outputs,
            scored_ids=self.scored_ids,
            pool_rows=self.pool_rows,
            write_rows=self._write_pool_rows,
            catch_up_lens=self.catch_up_lens,
            rule_rows=self._made_rule_tables,
        )

    def _take_rules(self, jobs: list[DraftJob]) -> None:
        """Each job's rule slot, its rows brought up to date (drafter/draft_rules.py), where any
        of their sequences has logit rules (the tables made at the first)."""
        if self.rule_tables is None and not any(
            job.seq.rules is not None or job.root_allowed for job in jobs
        ):
            return
        self._made_rule_tables().take(jobs)

    def _settle_rules(self) -> None:
        """At a call's end: the rule tables' count changes no run counted in (a call that ran
        no device expansion with rules) counted in now."""
        if self.rule_tables is not None:
            self.rule_tables.flush()

    def _made_rule_tables(self) -> RuleTables:
        """The rule tables, made at the first call (a fixed size: graphs read them)."""
        if self.rule_tables is None:
            self.rule_tables = RuleTables(self.vocab_size, self.scored_ids, self.kv.device)
        return self.rule_tables

    def _rule_run(self, jobs: list[DraftJob], shape: Shape) -> RuleRun | None:
        """Where `shape` bends: the jobs' rule slots, and the rule tables' count changes the
        run counts in (the round's first run takes them all), else None."""
        if not shape.rules:
            return None
        deltas = self._made_rule_tables().deltas(DELTAS_PER_ROW * len(jobs))
        return RuleRun([job.rule_slot for job in jobs], deltas)


def expansion_key(job: DraftJob) -> Shape:
    """The device expansion of `job`'s tree (a chain at its shared length)."""
    spec = job.spec
    return Shape(
        spec.topk, max(spec.num_steps, job.expand_steps), sampled_chain(job), rules=job.bent
    )
