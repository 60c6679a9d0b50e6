"""Batched tree drafting shared by the model-backed proposers (draft model, EAGLE-3 head).

Step 1 takes the root's top-k; each later step forwards the frontier (topk nodes), takes top-k
children of each (topk^2 candidates) and keeps the topk best by cumulative log-probability as
the next frontier. The tree is the best `num_draft_tokens` candidates. topk = 1 is a chain:
argmax (or a sample, with its distribution) per step. Candidate i's K/V lives at storage
base + i (base = the proposer's kv_committed_len); it is scratch, freed after drafting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafter.types import DraftJob, DraftSeq
from specsplit.kv_cache import KVCache, SeqKV
from specsplit.sampling import make_generator, sample, target_probs
from specsplit.step import SeqStep
from specsplit.tree import DraftTree


def _draft_seed(seed: int | None) -> int | None:
    """A seed unrelated to the verifier's: drafts must be independent of its acceptance draws."""
    return None if seed is None else (seed * 6364136223846793005 + 1442695040888963407) % 2**63


@dataclass
class _Expansion:
    """A tree being drafted for one job."""

    job: DraftJob
    tokens: list[int] = field(default_factory=list)  # candidates
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative log-probability
    paths: list[list[int]] = field(default_factory=list)  # candidate -> its ancestors and itself
    frontier: list[int] = field(default_factory=list)  # candidates forwarded next step
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # chain sampling: q per node
    # per-node outputs a later step reads (EAGLE: the head's hidden state; -1 = the root)
    node_hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, token: int, parent: int, score: float) -> int:
        idx = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.paths.append((self.paths[parent] if parent >= 0 else []) + [idx])
        return idx


@dataclass
class DraftKVState:
    """A sequence's state in a model-backed proposer: its draft KV and sampling generator."""

    kv: SeqKV
    generator: torch.Generator | None = None


class TreeProposer:
    """Tree expansion over a model with its own paged KV (`self.kv`); per-sequence state is a
    DraftKVState. Subclasses provide `_forward_frontier` (logits [sum of frontiers, vocab])."""

    kv: KVCache

    def _state(self, seq: DraftSeq) -> DraftKVState:
        assert isinstance(seq.state, DraftKVState)
        return seq.state

    def _seq_kv(self, seq: DraftSeq) -> SeqKV:
        return self._state(seq).kv

    def _set_generator(
        self, seq: DraftSeq, seed: int | None, device: torch.device
    ) -> torch.Generator:
        state = self._state(seq)
        if state.generator is None:
            state.generator = make_generator(_draft_seed(seed), device)
        return state.generator

    def kv_committed_len(self, seq: DraftSeq) -> int:
        return self._seq_kv(seq).kv_committed_len

    def release(self, seq: DraftSeq) -> None:
        self.kv.release(self._seq_kv(seq))

    @property
    def num_pages_used(self) -> int:
        return self.kv.allocator.num_used

    @property
    def num_pages_free(self) -> int:
        return self.kv.allocator.num_free

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def _forward_frontier(self, trees: list[_Expansion]) -> torch.Tensor:
        raise NotImplementedError

    def _expand(
        self,
        jobs: list[DraftJob],
        root_logits: torch.Tensor,  # [B, vocab]
        trees: list[_Expansion] | None = None,
    ) -> list[DraftTree]:
        trees = trees if trees is not None else [_Expansion(job) for job in jobs]
        for tree, logits in zip(trees, root_logits, strict=True):
            if tree.job.spec.num_steps > 0:
                self._grow(tree, [-1], logits[None])
        max_steps = max((t.job.spec.num_steps for t in trees), default=0)
        for step in range(1, max_steps):
            active = [t for t in trees if t.job.spec.num_steps > step]
            logits = self._forward_frontier(active)
            offset = 0
            for tree in active:
                f = len(tree.frontier)
                self._grow(tree, tree.frontier, logits[offset : offset + f])
                offset += f
        return [self._select(t) for t in trees]

    def _frontier_step(self, tree: _Expansion) -> SeqStep:
        """Forward the frontier: each node sees the prefix, its ancestors and itself."""
        kv = self._seq_kv(tree.job.seq)
        base = kv.kv_committed_len
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

    def _grow(self, tree: _Expansion, parents: list[int], logits: torch.Tensor) -> None:
        """Add children of `parents` ([f] nodes, -1 = root) given their logits [f, vocab]."""
        job = tree.job
        if job.spec.topk == 1:  # chain fast path: no sort, no top-k
            (parent,) = parents
            if job.sampling.greedy:
                token = int(logits[0].argmax())
            else:
                generator = self._set_generator(job.seq, job.sampling.seed, logits.device)
                q = target_probs(logits, job.sampling)  # [1, vocab]
                token = int(sample(q, generator)[0])
                tree.draft_probs.append(q[0].float().cpu())
            tree.frontier = [tree.add(token, parent, 0.0)]
            return
        k = job.spec.topk
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [f, vocab]
        top_lp, top_tok = logprobs.topk(k, dim=-1)  # [f, k]
        base = torch.tensor([tree.scores[p] if p >= 0 else 0.0 for p in parents])
        cum = (base[:, None] + top_lp.cpu()).flatten()  # [f * k]
        toks = top_tok.cpu().flatten().tolist()
        children = [tree.add(toks[i], parents[i // k], float(cum[i])) for i in range(len(toks))]
        keep = cum.topk(min(k, len(children))).indices.tolist()
        tree.frontier = sorted(children[i] for i in keep)

    @staticmethod
    def _select(tree: _Expansion) -> DraftTree:
        spec = tree.job.spec
        n = len(tree.tokens)
        if spec.topk == 1:
            probs = torch.stack(tree.draft_probs) if tree.draft_probs else None
            return DraftTree(tree.tokens, tree.parents, probs)
        # best num_draft_tokens by score; ties go to the shallower node so a parent always
        # ranks before its children (a child's score never exceeds its parent's)
        order = sorted(range(n), key=lambda i: (-tree.scores[i], len(tree.paths[i]), i))
        chosen = sorted(order[: spec.num_draft_tokens])
        new_index = {old: new for new, old in enumerate(chosen)}
        parents = [new_index[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in chosen]
        return DraftTree([tree.tokens[i] for i in chosen], parents)
