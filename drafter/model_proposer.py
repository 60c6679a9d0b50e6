"""Draft-model proposer: its own paged KV cache and batched tree drafting.

Per round and sequence: run the tokens the draft KV does not cover yet (ending with the root),
then expand the tree step by step. Step 1 takes the root's top-k; each later step forwards the
frontier (topk nodes), takes top-k children of each (topk^2 candidates) and keeps the topk best
by cumulative log-probability as the next frontier. The tree is the best `num_draft_tokens`
candidates. topk = 1 is a chain: argmax (or a sample, with its distribution) per step.
Candidate i's K/V lives at storage L + i (L = len(tokens)); it is scratch, freed after drafting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafter.engine import DraftJob, DraftSeq
from specsplit.kv_cache import KVCache, SeqKV
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import make_generator, sample, target_probs
from specsplit.step import SeqStep, build_forward_batch, causal_step
from specsplit.tree import DraftTree


def _draft_seed(seed: int | None) -> int | None:
    """A seed unrelated to the verifier's: drafts must be independent of its acceptance draws."""
    return None if seed is None else (seed * 6364136223846793005 + 1442695040888963407) % 2**63


@dataclass
class ModelSeqState:
    kv: SeqKV
    generator: torch.Generator | None = None


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

    def add(self, token: int, parent: int, score: float) -> int:
        idx = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.paths.append((self.paths[parent] if parent >= 0 else []) + [idx])
        return idx


class ModelProposer:
    def __init__(self, model: LlamaModel, kv: KVCache, vocab_size: int, max_context: int) -> None:
        self.model = model
        self.kv = kv
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.device = kv.k[0].device

    @classmethod
    def load(
        cls,
        model_path: str,
        *,
        num_layers: int | None,
        device: str,
        dtype: torch.dtype,
        num_pages: int,
        page_size: int,
    ) -> ModelProposer:
        model, config = load_model(model_path, dtype=dtype, device=device, num_layers=num_layers)
        kv = make_kv_cache(
            config, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
        )
        return cls(model, kv, config.vocab_size, config.max_position_embeddings)

    # -- per-sequence state ----------------------------------------------------------------

    def new_state(self, seq: DraftSeq) -> ModelSeqState:
        return ModelSeqState(self.kv.new_seq())

    def _state(self, seq: DraftSeq) -> ModelSeqState:
        assert isinstance(seq.state, ModelSeqState)
        return seq.state

    def truncate(self, seq: DraftSeq, length: int) -> None:
        kv = self._state(seq).kv
        kv.kv_committed_len = min(kv.kv_committed_len, length)
        self.kv.trim(kv, kv.kv_committed_len)

    def kv_committed_len(self, seq: DraftSeq) -> int:
        return self._state(seq).kv.kv_committed_len

    def release(self, seq: DraftSeq) -> None:
        self.kv.release(self._state(seq).kv)

    @property
    def num_pages_used(self) -> int:
        return self.kv.allocator.num_used

    @property
    def num_pages_free(self) -> int:
        return self.kv.allocator.num_free

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    # -- drafting --------------------------------------------------------------------------

    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        try:
            for job in jobs:
                state = self._state(job.seq)
                self.kv.reserve(state.kv, len(job.seq.tokens) + job.spec.max_draft_tokens)
            root_logits = self._catch_up(jobs)  # [B, vocab]
            trees = self._expand(jobs, root_logits)
        finally:
            for job in jobs:
                kv = self._state(job.seq).kv
                self.kv.trim(kv, kv.kv_committed_len)
        return trees

    def _catch_up(self, jobs: list[DraftJob]) -> torch.Tensor:
        """Run the tokens the draft KV does not cover; logits at each root."""
        steps = []
        for job in jobs:
            kv = self._state(job.seq).kv
            new = job.seq.tokens[kv.kv_committed_len :]
            steps.append(causal_step(kv, new, [len(new) - 1]))
        logits = self._forward(steps)
        for job in jobs:
            self._state(job.seq).kv.kv_committed_len = len(job.seq.tokens)
        return logits

    def _forward(self, steps: list[SeqStep]) -> torch.Tensor:
        batch, _ = build_forward_batch(steps)
        return self.model(batch.to(self.device), self.kv).logits

    def _expand(self, jobs: list[DraftJob], root_logits: torch.Tensor) -> list[DraftTree]:
        trees = [_Expansion(job) for job in jobs]
        for tree, logits in zip(trees, root_logits, strict=True):
            if tree.job.spec.num_steps > 0:
                self._grow(tree, [-1], logits[None])
        max_steps = max((job.spec.num_steps for job in jobs), default=0)
        for step in range(1, max_steps):
            active = [t for t in trees if t.job.spec.num_steps > step]
            logits = self._forward([self._frontier_step(t) for t in active])
            offset = 0
            for tree in active:
                f = len(tree.frontier)
                self._grow(tree, tree.frontier, logits[offset : offset + f])
                offset += f
        return [self._select(t) for t in trees]

    def _frontier_step(self, tree: _Expansion) -> SeqStep:
        """Forward the frontier: each node sees the prefix, its ancestors and itself."""
        kv = self._state(tree.job.seq).kv
        base = kv.kv_committed_len
        mask = torch.zeros(len(tree.frontier), base + len(tree.tokens), dtype=torch.bool)
        mask[:, :base] = True
        for row, node in enumerate(tree.frontier):
            mask[row, [base + a for a in tree.paths[node]]] = True
        return SeqStep(
            seq=kv,
            input_ids=[tree.tokens[node] for node in tree.frontier],
            positions=[base - 1 + len(tree.paths[node]) for node in tree.frontier],
            storage=[base + node for node in tree.frontier],
            mask=mask,
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
                state = self._state(job.seq)
                if state.generator is None:
                    state.generator = make_generator(_draft_seed(job.sampling.seed), logits.device)
                q = target_probs(logits, job.sampling)  # [1, vocab]
                token = int(sample(q, state.generator)[0])
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

    def _select(self, tree: _Expansion) -> DraftTree:
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
