"""Draft-model proposer: its own paged KV cache and batched tree drafting (drafter/tree_draft.py).

Per round and sequence: run the tokens the draft KV does not cover yet (ending with the root),
then expand the tree; candidate i's K/V lives at storage L + i (L = len(tokens)), scratch freed
after drafting.
"""

from __future__ import annotations

import torch

from drafter.host_expansion import Expansion
from drafter.tree_draft import DraftKVState, TreeProposer
from drafter.types import DraftJob, DraftSeq
from specsplit.kv_cache import KVCache, pool_num_pages
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.llama import LlamaModel, kv_cache_bytes_per_token, make_kv_cache
from specsplit.model.loader import load_model
from specsplit.step import SeqStep, causal_step


class ModelProposer(TreeProposer):
    def __init__(self, model: LlamaModel, kv: KVCache, vocab_size: int, max_context: int) -> None:
        self.model = model
        self.kv = kv
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.device = kv.k[0].device
        self.num_heads = model.config.num_heads

    @classmethod
    def load(
        cls,
        model_path: str,
        *,
        num_layers: int | None,
        device: str,
        dtype: torch.dtype,
        num_pages: int | None,
        page_size: int,
        kv_memory_fraction: float,
    ) -> ModelProposer:
        """num_pages None: sized by `pool_num_pages` (on a GPU: `kv_memory_fraction` of the
        memory free after loading the weights)."""
        model, _ = load_model(model_path, dtype=dtype, device=device, num_layers=num_layers)
        return cls.for_model(model, num_pages, page_size, kv_memory_fraction)

    @classmethod
    def for_model(
        cls, model: LlamaModel, num_pages: int | None, page_size: int, kv_memory_fraction: float
    ) -> ModelProposer:
        """A proposer over a loaded model, its KV pool sized as `load` says."""
        config, dtype, device = model.config, model.dtype, model.device
        per_page = kv_cache_bytes_per_token(config, dtype) * page_size
        num_pages = pool_num_pages(num_pages, device, per_page, kv_memory_fraction)
        kv = make_kv_cache(
            config, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
        )
        return cls(model, kv, config.vocab_size, config.max_position_embeddings)

    # -- per-sequence state ----------------------------------------------------------------

    def new_state(self, seq: DraftSeq) -> DraftKVState:
        return DraftKVState(self.kv.new_seq())

    def truncate(self, seq: DraftSeq, length: int) -> None:
        kv = self._state(seq).kv
        kv.kv_committed_len = min(kv.kv_committed_len, length)
        self.kv.trim(kv, kv.kv_committed_len)

    # -- drafting --------------------------------------------------------------------------

    def _root_steps(self, jobs: list[DraftJob]) -> tuple[list[DraftJob], list[SeqStep]]:
        """Each sequence's tokens the draft KV does not cover, the root's logits."""
        kvs = [self._state(job.seq).kv for job in jobs]
        for job, kv in zip(jobs, kvs, strict=True):
            self.kv.reserve(kv, len(job.seq.tokens) + job.scratch_len)
        ends = [len(job.seq.tokens) for job in jobs]
        starts = self._catch_up_starts([kv.kv_committed_len for kv in kvs], ends)
        steps = [
            causal_step(kv, job.seq.tokens[start:], [end - start - 1], start=start)
            for kv, job, start, end in zip(kvs, jobs, starts, ends, strict=True)
        ]
        for kv, end in zip(kvs, ends, strict=True):
            kv.kv_committed_len = end
        return jobs, steps

    def _forward_roots(self, steps: list[SeqStep]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._run(steps).logits, None  # [B, vocab]

    def _step_forward(
        self, batch: ForwardBatch, aux_layers: tuple[int, ...], features: torch.Tensor | None
    ) -> ForwardOutput:
        return self.model(batch, self.kv, aux_layers=aux_layers)

    def _forward_frontier(self, trees: list[Expansion]) -> torch.Tensor:
        return self._run([self._frontier_step(t) for t in trees]).logits
