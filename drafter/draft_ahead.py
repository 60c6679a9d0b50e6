"""Draft-ahead (`DraftAhead`, a mixin of TreeProposer in drafter/tree_draft.py): while the
verifier verifies a round's chain, the drafter drafts the next round's tree for each likely
outcome (an accept length along the chain and a guessed bonus token), on the device in one run
(`DeviceExpansion.expand_ahead`, with the catch-up in it where it can) or a step at a time in
forks of the sequence's KV (the reference). A sampled chain's outcomes all draw at the uniforms
its next Draft would have drawn (one draw from its generator a call, whatever the outcomes):
the tree the next round takes is drawn from its draft distributions at uniforms nothing else
has read, so the verifier's acceptance stays exact."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from drafter.draft_rules import bend_on_host
from drafter.expansion_inputs import Ahead, PoolRows, RuleRun, Shape
from drafter.host_expansion import Expansion, sampled_chain, select_tree
from drafter.types import DraftJob, DraftSeq
from specsplit.kv_cache import KVCache, SeqKV
from specsplit.messages import AheadTree
from specsplit.model.transfer import on_device
from specsplit.step import SeqStep, causal_step
from specsplit.tree import DraftTree

if TYPE_CHECKING:
    from drafter.expansion import DeviceExpansion


class DraftAhead:
    """`propose_ahead` and its two paths."""

    # the proposer's (TreeProposer), which draft-ahead uses
    kv: KVCache
    device: torch.device
    _root_steps: Callable[[list[DraftJob]], tuple[list[DraftJob], list[SeqStep]]]
    _run_roots: Callable[
        [list[DraftJob], list[SeqStep]], tuple[list[DraftJob], torch.Tensor, torch.Tensor | None]
    ]
    _fused_key: Callable[
        [
            list[DraftJob],
            list[DraftJob],
            list[SeqStep],
            Callable[[DraftJob], Shape | Ahead | None],
        ],
        Shape | Ahead | None,
    ]
    _expands_on_device: Callable[[DraftJob], bool]
    _expansion: Callable[[], DeviceExpansion]
    _carrying: Callable[[int, Callable[[PoolRows | None], Any]], Any]
    _flush_rows: Callable[[], None]
    _state: Callable[[DraftSeq], Any]  # its DraftKVState (drafter/tree_draft.py imports this)
    _seq_kv: Callable[[DraftSeq], SeqKV]
    kept_len: Callable[[DraftSeq], int]
    _forward_frontier: Callable[[list[Expansion]], torch.Tensor]
    _forward_rows: Callable[
        [list[SeqStep], torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
    ]
    _expand: Callable[[list[DraftJob], torch.Tensor, torch.Tensor | None], list[DraftTree]]
    _sampling_rows: Callable[[list[DraftJob], int], np.ndarray]
    _set_generator: Callable[[DraftSeq, int | None], torch.Generator]
    _take_rules: Callable[[list[DraftJob]], None]
    _settle_rules: Callable[[], None]
    _rule_run: Callable[[list[DraftJob], Shape], RuleRun | None]

    def propose_ahead(self, jobs: list[DraftJob]) -> list[list[AheadTree]]:
        """Draft-ahead, while the verifier verifies `job.verifying` (a chain) for each job's
        root: the chain's nodes go through the draft model as the expansion would run them
        (each reads its parent's output), and at each accept length k (0..len) the draft's
        `ahead_guesses` likeliest tokens other than the chain's next one are the guessed
        bonus tokens. Each outcome (k drafts accepted, then bonus b) is drafted in a fork of the
        sequence's KV (KVCache.fork: the prefix and the k nodes shared): b goes through the
        model, reading node k's output as a node does (EAGLE: the head's own features where
        the target's do not exist yet), then the next round's tree expands from it. Forks and
        node entries are scratch, freed before returning."""
        with on_device(self.device):
            forks: list[DraftSeq] = []
            try:
                self._take_rules(jobs)
                return self._propose_ahead(jobs, forks)
            finally:
                self._flush_rows()
                self._settle_rules()
                for fork in forks:
                    self.kv.release(self._seq_kv(fork))
                for job in jobs:
                    self.kv.trim(self._seq_kv(job.seq), self.kept_len(job.seq))

    def _propose_ahead(self, jobs: list[DraftJob], forks: list[DraftSeq]) -> list[list[AheadTree]]:
        drafting, steps = self._root_steps(jobs)
        fused = self._fused_ahead(jobs, drafting, steps)
        if fused is not None:
            return fused
        drafting, root_logits, root_features = self._run_roots(drafting, steps)
        chains = [job for job in drafting if job.verifying is not None and job.verifying.is_chain]
        rows = {id(job): i for i, job in enumerate(drafting)}
        ahead: dict[int, list[AheadTree]] = {}
        on_device = [job for job in chains if self._ahead_on_device_ok(job)]
        if on_device:
            ahead.update(self._ahead_on_device(on_device, rows, root_logits, root_features))
        in_forks = [job for job in chains if not self._ahead_on_device_ok(job)]
        if in_forks:
            ahead.update(self._ahead_in_forks(in_forks, rows, root_logits, root_features, forks))
        return [ahead.get(id(job), []) for job in jobs]

    def _ahead_on_device_ok(self, job: DraftJob) -> bool:
        """Whether `job`'s draft-ahead runs on the device (expand_ahead): where its Draft's
        expansion would (`_expands_on_device`)."""
        return self._expands_on_device(job)

    def _fused_ahead(
        self, jobs: list[DraftJob], drafting: list[DraftJob], steps: list[SeqStep]
    ) -> list[list[AheadTree]] | None:
        """Draft-ahead with the catch-up in the same device run (`_fused_key`): a draft-ahead
        call's usual batch, every job verifying a chain and drafting ahead on the device. None
        otherwise."""

        def key_of(job: DraftJob) -> Ahead | None:
            ok = job.verifying is not None and job.verifying.is_chain
            return ahead_key(job) if ok and self._ahead_on_device_ok(job) else None

        key = self._fused_key(jobs, drafting, steps, key_of)
        if not isinstance(key, Ahead):
            return None
        ahead = self._expand_ahead(key, jobs, None, None, [step.input_ids for step in steps])
        return [ahead[id(job)] for job in jobs]

    def _ahead_on_device(
        self,
        jobs: list[DraftJob],
        rows: dict[int, int],
        root_logits: torch.Tensor,
        root_features: torch.Tensor | None,
    ) -> dict[int, list[AheadTree]]:
        """Draft-ahead for `jobs` as one device run per (chain length, guesses, shape):
        DeviceExpansion.expand_ahead (a graph's replay on a GPU)."""
        groups: dict[Ahead, list[DraftJob]] = {}
        for job in jobs:
            groups.setdefault(ahead_key(job), []).append(job)
        ahead: dict[int, list[AheadTree]] = {}
        for key, group in groups.items():
            logits, features = rows_of(root_logits, root_features, [rows[id(j)] for j in group])
            ahead.update(self._expand_ahead(key, group, logits, features))
        return ahead

    def _expand_ahead(
        self,
        key: Ahead,
        jobs: list[DraftJob],
        root_logits: torch.Tensor | None,
        root_features: torch.Tensor | None,
        catch_ups: list[list[int]] | None = None,
    ) -> dict[int, list[AheadTree]]:
        """DeviceExpansion.expand_ahead of `key` for `jobs` (by id: each outcome's tree; a
        sampled chain's uniforms drawn here, once a call)."""
        seqs = [self._seq_kv(job.seq) for job in jobs]
        for kv in seqs:
            self.kv.reserve(kv, kv.kv_committed_len + key.width)
        chains = [list(job.verifying.tokens) for job in jobs if job.verifying is not None]
        steps = key.shape.num_steps
        sampling = self._sampling_rows(jobs, steps) if key.shape.sampled else None
        rules = self._rule_run(jobs, key.shape)
        given = (key, seqs, root_logits, root_features, chains, catch_ups)
        found = self._carrying(
            key.catch_up if catch_ups else 0,
            lambda new_rows: self._expansion().expand_ahead(*given, new_rows, sampling, rules),
        )
        return {
            id(job): [
                AheadTree([*chain[:k], bonus], select_tree(candidates, job.spec))
                for k, bonus, candidates in outcomes
            ]
            for job, outcomes, chain in zip(jobs, found, chains, strict=True)
        }

    def _ahead_in_forks(
        self,
        chains: list[DraftJob],
        rows: dict[int, int],
        root_logits: torch.Tensor,
        root_features: torch.Tensor | None,
        forks: list[DraftSeq],
    ) -> dict[int, list[AheadTree]]:
        """Draft-ahead a step at a time, each outcome in a fork of the sequence's KV: the
        reference of the device run. A sampled chain's forks start from a copy of its
        generator, which then moves on once: each fork draws the uniforms the device run's
        outcomes draw."""
        runs = [Expansion(job) for job in chains]
        if root_features is not None:
            for run in runs:
                run.node_hidden[-1] = root_features[rows[id(run.job)]]
        # [len + 1, vocab] per chain: the logits at the root, then at each node (bent by its
        # sequence's rules where it bends)
        logits = [[root_logits[rows[id(run.job)]]] for run in runs]
        for depth in range(1, max(len(job.verifying or ()) for job in chains) + 1):
            active = [i for i, run in enumerate(runs) if len(run.job.verifying or ()) >= depth]
            for i in active:
                run = runs[i]
                assert run.job.verifying is not None
                run.frontier = [run.add(run.job.verifying.tokens[depth - 1], depth - 2, 0.0)]
            rows_out = self._forward_frontier([runs[i] for i in active])
            for i, row in zip(active, rows_out, strict=True):
                logits[i].append(row)
        for run, per_chain in zip(runs, logits, strict=True):  # (the root's: a guide's mask too)
            stacked = torch.stack(per_chain)
            bent = bend_on_host(stacked[:1], [run.job], [0, 1], root=True)
            after = bend_on_host(stacked[1:], [run.job], [0, len(stacked) - 1])
            per_chain[:] = [bent[0], *after]
        guesses = self._guesses(runs, logits)
        outcomes: list[tuple[int, int, int]] = []  # (run, k accepted, bonus)
        steps, features = [], []
        for i, (run, per_k) in enumerate(zip(runs, guesses, strict=True)):
            parent = self._seq_kv(run.job.seq)
            base = parent.kv_committed_len
            drawing = None
            if sampled_chain(run.job):
                drawing = self._set_generator(run.job.seq, run.job.sampling.seed)
            for k, bonus_tokens in enumerate(per_k):
                for bonus in bonus_tokens:
                    kv = self.kv.fork(parent, base + k)
                    self.kv.reserve(kv, base + k + 1 + run.job.spec.max_draft_tokens)
                    generator = None if drawing is None else copy_generator(drawing)
                    state = dataclasses.replace(
                        self._state(run.job.seq), kv=kv, generator=generator
                    )
                    seq = run.job.seq  # (a fork's drafts bent as its sequence's: its rules)
                    forks.append(DraftSeq(seq.seq_id, seq.tokens, state=state, rules=seq.rules))
                    outcomes.append((i, k, bonus))
                    steps.append(causal_step(kv, [bonus], [0], start=base + k))
                    if run.node_hidden:
                        features.append(run.node_hidden[k - 1])
            if drawing is not None:  # its forks' draws, once (as `_sampling_rows` draws)
                torch.rand(run.job.spec.num_steps, generator=drawing)
        if not steps:
            return {}
        bonus_logits, bonus_features = self._forward_rows(
            steps, torch.stack(features) if features else None
        )
        fork_jobs = []
        for fork, (i, _, _) in zip(forks, outcomes, strict=True):
            self._seq_kv(fork).kv_committed_len += 1
            job = runs[i].job
            fork_jobs.append(
                DraftJob(fork, job.spec, job.sampling, rule_slot=job.rule_slot, bent=job.bent)
            )
        trees = self._expand(fork_jobs, bonus_logits, bonus_features)
        ahead: dict[int, list[AheadTree]] = {}
        for (i, k, bonus), tree in zip(outcomes, trees, strict=True):
            job = runs[i].job
            assert job.verifying is not None
            ahead.setdefault(id(job), []).append(
                AheadTree([*job.verifying.tokens[:k], bonus], tree)
            )
        return ahead

    @staticmethod
    def _guesses(runs: list[Expansion], logits: list[list[torch.Tensor]]) -> list[list[list[int]]]:
        """Per chain, per accept length k, the guessed bonus tokens: the draft's likeliest at
        node k (the root for k = 0) but the chain's own next node, which the verifier rejected
        if it stopped there (greedy). One host read for the batch."""
        g = max(run.job.ahead_guesses for run in runs)
        flat = torch.stack([row for per_chain in logits for row in per_chain])
        top = flat.topk(min(g + 1, flat.shape[1]), dim=-1).indices.tolist()
        out, row = [], 0
        for run, per_chain in zip(runs, logits, strict=True):
            chain = run.job.verifying.tokens if run.job.verifying is not None else []
            per_k = []
            for k in range(len(per_chain)):
                others = [t for t in top[row + k] if k >= len(chain) or t != chain[k]]
                per_k.append(others[: run.job.ahead_guesses])
            out.append(per_k)
            row += len(per_chain)
        return out


def ahead_key(job: DraftJob) -> Ahead:
    """The device expansion of `job`'s draft-ahead (a chain being verified)."""
    assert job.verifying is not None
    shape = Shape(job.spec.topk, job.spec.num_steps, sampled_chain(job), rules=job.bent)
    return Ahead(len(job.verifying), job.ahead_guesses, shape)


def copy_generator(generator: torch.Generator) -> torch.Generator:
    """A generator that draws what `generator` would draw next."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def rows_of(
    logits: torch.Tensor, features: torch.Tensor | None, rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rows` of the roots' logits [D, vocab] and features [D, width] (or None): the tensors
    themselves when `rows` are all of them in order (most rounds: one group), else a gather
    (its index crosses to the device first)."""
    if rows == list(range(logits.shape[0])):
        return logits, features
    index = torch.tensor(rows, device=logits.device)
    picked = None if features is None else features.index_select(0, index)
    return logits.index_select(0, index), picked
