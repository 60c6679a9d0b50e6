"""The verifier engine: one target forward over pending tokens + draft trees, acceptance, KV commit.

State per sequence is its SeqKV (page table + kv_committed_len) and its sampling generator.
A round is validated as a whole before anything changes, so a refused request leaves every
sequence as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from specsplit.acceptance import AcceptResult, accept_greedy, accept_sampling
from specsplit.errors import Code, ServiceError, check_seq_ids, invalid
from specsplit.kv_cache import KVCache, SeqKV
from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import make_generator, target_probs
from specsplit.step import build_forward_batch, verify_step

log = logging.getLogger(__name__)


@dataclass
class VerifierSeq:
    kv: SeqKV
    generator: torch.Generator | None = None  # created on the first sampled round


class VerifierEngine:
    def __init__(self, model: LlamaModel, kv: KVCache, max_context: int, vocab_size: int) -> None:
        self.model = model
        self.kv = kv
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.num_layers = model.config.num_layers  # hidden_state_layers go up to this
        self.device = kv.k[0].device
        self.seqs: dict[str, VerifierSeq] = {}

    @classmethod
    def load(
        cls,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_pages: int = 2048,
        page_size: int = 16,
    ) -> VerifierEngine:
        model, config = load_model(model_path, dtype=dtype, device=device)
        kv = make_kv_cache(
            config, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
        )
        return cls(model, kv, config.max_position_embeddings, config.vocab_size)

    @property
    def num_pages_used(self) -> int:
        return self.kv.allocator.num_used

    @property
    def num_pages_free(self) -> int:
        return self.kv.allocator.num_free

    def warmup(self) -> None:
        """One prefill + one tree round on a throwaway sequence, then release it."""
        from specsplit.tree import DraftTree

        out = self.verify(
            [VerifyInput("__warmup__", True, 0, [0, 1, 2], DraftTree([3, 4], [-1, 0]))]
        )
        self.verify(
            [
                VerifyInput(
                    "__warmup__",
                    False,
                    out[0].kv_committed_len,
                    [out[0].bonus_token],
                    DraftTree([5, 6], [-1, -1]),
                )
            ]
        )
        self.release(["__warmup__"])
        self.check_integrity()

    # -- the round -------------------------------------------------------------------------

    @torch.inference_mode()
    def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        self._validate(inputs)
        for item in inputs:
            if item.begin:
                self.seqs[item.seq_id] = VerifierSeq(self.kv.new_seq())
        seqs = [self.seqs[item.seq_id] for item in inputs]
        self._reserve(inputs, seqs)

        aux = inputs[0].hidden_state_layers if inputs else ()
        steps = []
        for item, seq in zip(inputs, seqs, strict=True):
            p, n = len(item.pending_tokens), len(item.tree)
            # rows: the root (last pending token) and every tree node; all pending rows too
            # when hidden states are wanted
            first = 0 if aux else p - 1
            steps.append(
                verify_step(seq.kv, item.pending_tokens, item.tree, list(range(first, p + n)))
            )
        batch, row_slices = build_forward_batch(steps)
        out = self.model(batch.to(self.device), self.kv, aux_layers=aux)

        results = []
        for item, seq, rows in zip(inputs, seqs, row_slices, strict=True):
            p = len(item.pending_tokens)
            logits = out.logits[rows][p - 1 :] if aux else out.logits[rows]  # [n + 1, vocab]
            accepted = self._accept(item, seq, logits)
            result = self._commit(item, seq, accepted)
            if out.hidden_states is not None:
                # [p + num_accepted_drafts, layers * hidden]: pending tokens, then the accepted path
                keep = list(range(p)) + [p + node for node in accepted.accepted_nodes]
                result.hidden_states = out.hidden_states[rows][keep].to(torch.bfloat16)
            results.append(result)
        return results

    def _accept(self, item: VerifyInput, seq: VerifierSeq, logits: torch.Tensor) -> AcceptResult:
        if item.sampling.greedy:
            return accept_greedy(item.tree, logits)
        if seq.generator is None:
            seq.generator = make_generator(item.sampling.seed, logits.device)
        tree = item.tree
        if tree.draft_probs is not None and tree.draft_probs.device != logits.device:
            tree = replace(tree, draft_probs=tree.draft_probs.to(logits.device))
        return accept_sampling(tree, target_probs(logits, item.sampling), seq.generator)

    def _commit(self, item: VerifyInput, seq: VerifierSeq, result: AcceptResult) -> VerifyOutput:
        """Move the accepted path's K/V right after the pending tokens; free the rest."""
        base = seq.kv.kv_committed_len + len(item.pending_tokens)
        if result.accepted_nodes:
            src = seq.kv.slots(base, base + len(item.tree))[result.accepted_nodes]
            dst = seq.kv.slots(base, base + len(result.accepted_nodes))
            self.kv.move(src, dst)
        seq.kv.kv_committed_len = base + len(result.accepted_nodes)
        self.kv.trim(seq.kv, seq.kv.kv_committed_len)
        return VerifyOutput(
            seq_id=item.seq_id,
            accepted_tokens=[item.tree.tokens[i] for i in result.accepted_nodes],
            bonus_token=result.bonus_token,
            kv_committed_len=seq.kv.kv_committed_len,
        )

    # -- checks and memory -----------------------------------------------------------------

    def _validate(self, inputs: list[VerifyInput]) -> None:
        check_seq_ids(inputs, self.seqs, "verifier")
        for item in inputs:
            if item.hidden_state_layers != inputs[0].hidden_state_layers:
                raise invalid("hidden_state_layers must be the same for every sequence of a round")
            # layer i < num_layers: decoder layer i's output; num_layers: after the final norm
            bad_layers = [x for x in item.hidden_state_layers if not 0 <= x <= self.num_layers]
            if bad_layers:
                raise invalid(
                    f"hidden_state_layers {bad_layers} outside [0, {self.num_layers}] "
                    f"({self.num_layers} = the last hidden state, after the final norm)"
                )
            committed = 0 if item.begin else self.seqs[item.seq_id].kv.kv_committed_len
            if item.kv_committed_len != committed:
                raise invalid(
                    f"kv_committed_len = {item.kv_committed_len} for {item.seq_id!r}, "
                    f"the verifier has {committed}"
                )
            if not item.pending_tokens:
                raise invalid(f"pending_tokens empty for {item.seq_id!r}")
            bad = [t for t in item.pending_tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise invalid(
                    f"pending_tokens {bad[:4]} outside the vocabulary [0, {self.vocab_size})"
                )
            try:
                item.tree.validate(self.vocab_size)
                item.sampling.validate()
            except ValueError as e:
                raise invalid(f"{item.seq_id!r}: {e}") from e
            depth = max(item.tree.depths(), default=0)
            if committed + len(item.pending_tokens) + depth > self.max_context:
                raise invalid(
                    f"{item.seq_id!r}: kv_committed_len + pending_tokens + tree depth exceeds "
                    f"the context ({self.max_context})"
                )

    def _reserve(self, inputs: list[VerifyInput], seqs: list[VerifierSeq]) -> None:
        """Reserve room for pending + tree of every sequence, or nothing at all."""
        lengths = [
            seq.kv.kv_committed_len + len(item.pending_tokens) + len(item.tree)
            for item, seq in zip(inputs, seqs, strict=True)
        ]
        need = sum(self.kv.num_new_pages(seq.kv, n) for seq, n in zip(seqs, lengths, strict=True))
        if need > self.kv.allocator.num_free:
            for item in inputs:
                if item.begin:
                    del self.seqs[item.seq_id]
            raise ServiceError(
                Code.RESOURCE_EXHAUSTED,
                f"verifier KV cache full: round needs {need} pages, "
                f"{self.kv.allocator.num_free} free",
            )
        for seq, length in zip(seqs, lengths, strict=True):
            self.kv.reserve(seq.kv, length)

    def release(self, seq_ids: list[str]) -> int:
        released = 0
        for seq_id in seq_ids:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                self.kv.release(seq.kv)
                released += 1
        return released

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        assert sum(len(s.kv.page_table) for s in self.seqs.values()) == self.kv.allocator.num_used
        for seq_id, seq in self.seqs.items():
            assert 0 <= seq.kv.kv_committed_len <= seq.kv.kv_allocated_len, seq_id
