"""The host expansion: a draft round's trees grown a step at a time on the host, the reference
the device expansion (drafter/expansion.py) matches, and the path of rounds it does not take
(`TreeProposer._expand`): `HostExpansion`, a mixin of TreeProposer that declares what it uses
of it; `Expansion`, one job's tree being grown; `select_tree`, the tree a round sends of either
expansion's candidates."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from drafter.draft_rules import bend_on_host
from drafter.expansion_inputs import Candidates
from drafter.expansion_maps import draw_columns, draw_mapped
from drafter.types import DraftJob, DraftSeq
from specsplit.kv_cache import SeqKV
from specsplit.messages import SpecParams
from specsplit.step import SeqStep
from specsplit.tree import DraftProbs, DraftTree


@dataclass
class Expansion:
    """A tree being drafted for one job."""

    job: DraftJob
    tokens: list[int] = field(default_factory=list)  # candidates
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative log-probability
    paths: list[list[int]] = field(default_factory=list)  # candidate -> its ancestors and itself
    frontier: list[int] = field(default_factory=list)  # candidates forwarded next step
    draft_probs: list[DraftProbs] = field(default_factory=list)  # chain sampling: q per node
    sampling: np.ndarray | None = None  # a sampled chain's row (`_sampling_rows`)
    # per-node outputs a later step reads (EAGLE: the head's hidden state; -1 = the root)
    node_hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, token: int, parent: int, score: float) -> int:
        idx = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.paths.append((self.paths[parent] if parent >= 0 else []) + [idx])
        return idx


class HostExpansion:
    """A round's trees grown a level at a time (`_expand_on_host`): each level's frontier
    forwarded by the proposer, what the host needs of its logits (a greedy chain's argmax, a
    tree's top-k, a sampled chain's draw) read in one copy for the batch."""

    # the proposer's (TreeProposer), which the host expansion uses: the scored columns, the
    # frontier forward (logits [sum of frontiers, vocab]), a sequence's draft KV and generator
    scored_ids: torch.Tensor | None
    _forward_frontier: Callable[[list[Expansion]], torch.Tensor]
    _seq_kv: Callable[[DraftSeq], SeqKV]
    _set_generator: Callable[[DraftSeq, int | None], torch.Generator]

    def _expand_on_host(
        self,
        jobs: list[DraftJob],  # each with num_steps > 0
        root_logits: torch.Tensor,  # [B, vocab]
        root_features: torch.Tensor | None,  # [B, width]
    ) -> list[DraftTree]:
        trees = [Expansion(job) for job in jobs]
        sampled = [tree for tree in trees if sampled_chain(tree.job)]
        if sampled:
            steps = max(tree.job.spec.num_steps for tree in sampled)
            rows = self._sampling_rows([tree.job for tree in sampled], steps)
            for tree, row in zip(sampled, rows, strict=True):
                tree.sampling = row
        if root_features is not None:
            for tree, features in zip(trees, root_features, strict=True):
                tree.node_hidden[-1] = features
        self._grow_all(trees, [[-1] for _ in trees], root_logits, root=True)
        max_steps = max((t.job.spec.num_steps for t in trees), default=0)
        for step in range(1, max_steps):
            active = [t for t in trees if t.job.spec.num_steps > step]
            logits = self._forward_frontier(active)  # [sum of frontiers, vocab]
            self._grow_all(active, [t.frontier for t in active], logits)
        return [self._select(t) for t in trees]

    def _grow_all(
        self,
        trees: list[Expansion],
        parents: list[list[int]],  # per tree its frontier (-1 = the root)
        logits: torch.Tensor,  # [sum of frontiers, vocab], the trees' rows in order
        root: bool = False,  # the roots' rows (a guide's root mask bends them too)
    ) -> None:
        """Grow every tree by one level. What the host needs of the logits (argmax of greedy
        chains, top-k of trees, sampled chains' draws) crosses in a copy or two for the whole
        batch, not one per tree."""
        starts = list(itertools.accumulate((len(p) for p in parents), initial=0))
        logits = bend_on_host(logits, [t.job for t in trees], starts, root)
        greedy_chain = [t.job.spec.topk == 1 and t.job.sampling.greedy for t in trees]
        argmax = logits.argmax(dim=-1).tolist() if any(greedy_chain) else []
        k = max((t.job.spec.topk for t in trees if t.job.spec.topk > 1), default=0)
        top: tuple[torch.Tensor, torch.Tensor] | None = None
        if k:  # over the scored columns where the model has its own (the device expansion's)
            columns = self.scored_ids
            scored = logits if columns is None else logits.index_select(1, columns)
            top_lp, top_tok = torch.log_softmax(scored.float(), dim=-1).topk(k, dim=-1)
            if columns is not None:
                top_tok = columns[top_tok]
            top = (top_lp.cpu(), top_tok.cpu())  # [rows, k] each
        sampled = [i for i, t in enumerate(trees) if t.job.spec.topk == 1 and not greedy_chain[i]]
        draws = self._draw_sampled(
            [trees[i] for i in sampled], [starts[i] for i in sampled], logits
        )
        drawn = dict(zip(sampled, draws, strict=True))
        for i, (tree, tree_parents) in enumerate(zip(trees, parents, strict=True)):
            rows = slice(starts[i], starts[i + 1])
            if greedy_chain[i]:
                tree.frontier = [tree.add(argmax[rows.start], tree_parents[0], 0.0)]
            elif i in drawn:
                token, probs = drawn[i]
                tree.draft_probs.append(probs)
                tree.frontier = [tree.add(token, tree_parents[0], 0.0)]
            else:
                assert top is not None
                kt = tree.job.spec.topk
                self._grow_topk(tree, tree_parents, top[0][rows, :kt], top[1][rows, :kt])

    def _draw_sampled(
        self, trees: list[Expansion], rows: list[int], logits: torch.Tensor
    ) -> list[tuple[int, DraftProbs]]:
        """Sampled chains' next drafts (tree j's from logits[rows[j]]), each drawn from its
        draft distribution cut to the DRAFT_SUPPORT likeliest tokens and renormalized (kept with
        it: the verifier's acceptance needs it exactly), at the uniform its sequence's generator
        drew for this step (`_sampling_rows`): the device expansion's draws. All the chains in
        one draw_from_cut; its results cross to the host in one copy each."""
        if not trees:
            return []
        device = logits.device
        table = torch.from_numpy(
            np.stack([tree.sampling for tree in trees if tree.sampling is not None])
        )
        steps = torch.tensor([3 + len(tree.tokens) for tree in trees])
        uniforms = table.gather(1, steps[:, None]).squeeze(1)
        picked = logits.index_select(0, torch.tensor(rows, device=device))
        columns = draw_columns(self.scored_ids)  # (the device expansion's: `draw_mapped`)
        if columns is not None:
            picked = picked.index_select(1, columns)
        tokens, ids, probs = draw_mapped(
            picked, table[:, :3].to(device), uniforms.to(device), columns
        )
        tokens_h, ids_h, probs_h = tokens.tolist(), ids.cpu(), probs.cpu()
        vocab_size = logits.shape[-1]
        return [
            (tokens_h[r], DraftProbs(ids_h[r : r + 1], probs_h[r : r + 1], vocab_size))
            for r in range(len(trees))
        ]

    def _sampling_rows(self, jobs: list[DraftJob], steps: int) -> np.ndarray:
        """[J, 3 + steps] float32, sampled chains' rows as draw_from_cut reads them: temperature,
        top_p, top_k, then a uniform per step, drawn from the sequence's own generator on the
        host. A chain draws its own num_steps uniforms whatever length it is expanded to (the
        rest are 0.5, their drafts cut): its draws do not depend on the batch it is in."""
        rows = np.full((len(jobs), 3 + steps), 0.5, dtype=np.float32)
        for r, job in enumerate(jobs):
            params, n = job.sampling, job.spec.num_steps
            rows[r, :3] = (params.temperature, params.top_p, params.top_k)
            generator = self._set_generator(job.seq, params.seed)
            rows[r, 3 : 3 + n] = torch.rand(n, generator=generator).numpy()
        return rows

    def _frontier_step(self, tree: Expansion) -> SeqStep:
        """Forward the frontier: each node sees the prefix, its ancestors and itself."""
        kv = self._seq_kv(tree.job.seq)
        base = kv.kv_committed_len
        mask: torch.Tensor | None = None  # a chain's newest node sees everything: causal
        if tree.job.spec.topk > 1:
            mask = torch.zeros(len(tree.frontier), len(tree.tokens), dtype=torch.bool)
            for row, node in enumerate(tree.frontier):
                mask[row, tree.paths[node]] = True
        return SeqStep(
            seq=kv,
            input_ids=[tree.tokens[node] for node in tree.frontier],
            positions=[base - 1 + len(tree.paths[node]) for node in tree.frontier],
            storage=[base + node for node in tree.frontier],
            kv_len=base + len(tree.tokens),
            prefix_len=base,
            new_mask=mask,
            logit_rows=list(range(len(tree.frontier))),
        )

    @staticmethod
    def _grow_topk(
        tree: Expansion,
        parents: list[int],  # [f] frontier nodes, -1 = the root
        top_lp: torch.Tensor,  # [f, k] host: their children's log-probs
        top_tok: torch.Tensor,  # [f, k] host: their children's tokens
    ) -> None:
        """Each frontier node's top-k children; the k best by cumulative log-prob go on."""
        k = top_lp.shape[1]
        base = torch.tensor([tree.scores[p] if p >= 0 else 0.0 for p in parents])
        cum = (base[:, None] + top_lp).flatten()  # [f * k]
        toks = top_tok.flatten().tolist()
        children = [tree.add(toks[i], parents[i // k], float(cum[i])) for i in range(len(toks))]
        keep = cum.topk(min(k, len(children))).indices.tolist()
        tree.frontier = sorted(children[i] for i in keep)

    @staticmethod
    def _select(tree: Expansion) -> DraftTree:
        if tree.job.spec.topk == 1:
            probs = DraftProbs.cat(tree.draft_probs) if tree.draft_probs else None
            return DraftTree(tree.tokens, tree.parents, probs)
        # best first; ties go to the shallower node so a parent always ranks before its
        # children (a child's score never exceeds its parent's)
        n = len(tree.tokens)
        order = sorted(range(n), key=lambda i: (-tree.scores[i], len(tree.paths[i]), i))
        return select_tree(Candidates(tree.tokens, tree.parents, order), tree.job.spec)


def sampled_chain(job: DraftJob) -> bool:
    """A chain that draws its drafts (and sends their distributions); trees are deterministic."""
    return job.spec.topk == 1 and not job.sampling.greedy


def select_tree(candidates: Candidates, spec: SpecParams) -> DraftTree:
    """The tree of a chain's first `num_steps` candidates (all of them, unless it rode a longer
    chain; a sampled chain's with their distributions), or of a tree's best
    `num_draft_tokens`."""
    if spec.topk == 1:
        steps = spec.num_steps
        probs = candidates.draft_probs
        return DraftTree(
            candidates.tokens[:steps],
            candidates.parents[:steps],
            None if probs is None else probs.rows(slice(0, steps)),
        )
    chosen = sorted(candidates.order[: spec.num_draft_tokens])
    new_index = {old: new for new, old in enumerate(chosen)}
    parents = [candidates.parents[i] for i in chosen]
    return DraftTree(
        [candidates.tokens[i] for i in chosen],
        [new_index[p] if p >= 0 else -1 for p in parents],
    )
