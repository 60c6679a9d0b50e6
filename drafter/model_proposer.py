"""Draft-model proposer: its own paged KV cache and batched tree drafting.

Per round and sequence: run the tokens the draft KV does not cover yet (ending with the root),
then expand the tree step by step. Step 1 takes the root's top-k; each later step forwards the
frontier (topk nodes), takes top-k children of each (topk^2 candidates) and keeps the topk best
by cumulative log-probability as the next frontier. The tree is the best `num_draft_tokens`
candidates. topk = 1 is a chain: argmax (or a sample, with its distribution) per step.
Candidate i's K/V lives at storage L + i (L = len(tokens)); it is scratch, freed after drafting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.engine import DraftJob, DraftSeq
from drafter.tree_draft import TreeProposer, _Expansion, ensure_generator
from specsplit.kv_cache import KVCache, SeqKV
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model
from specsplit.step import SeqStep, build_forward_batch, causal_step
from specsplit.tree import DraftTree


@dataclass
class ModelSeqState:
    kv: SeqKV
    generator: torch.Generator | None = None


class ModelProposer(TreeProposer):
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

    def _seq_kv(self, seq: DraftSeq) -> SeqKV:
        return self._state(seq).kv

    def _set_generator(
        self, seq: DraftSeq, seed: int | None, device: torch.device
    ) -> torch.Generator:
        state = self._state(seq)
        state.generator = ensure_generator(state.generator, seed, device)
        return state.generator

    def _forward_frontier(self, trees: list[_Expansion]) -> torch.Tensor:
        return self._forward([self._frontier_step(t) for t in trees])
