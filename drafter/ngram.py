"""Prompt-lookup (n-gram) proposer: no weights, drafts by copying what followed earlier matches
(specsplit/lookup.py). topk = 1 gives one chain; topk > 1 merges the continuations of up to
topk distinct matches into a trie (siblings distinct). Each sequence's state is its n-gram
index, extended by the tokens a call adds and cut back where the gateway truncates.
"""

from __future__ import annotations

import torch

from drafter.types import DraftJob, DraftSeq
from specsplit.lookup import MAX_NGRAM, MIN_NGRAM, NgramIndex
from specsplit.messages import AheadTree
from specsplit.tree import DraftTree


class NgramProposer:
    def __init__(
        self,
        max_ngram: int = MAX_NGRAM,
        min_ngram: int = MIN_NGRAM,
        vocab_size: int = 1 << 62,
        max_context: int = 1 << 62,
    ) -> None:
        assert 1 <= min_ngram <= max_ngram, (min_ngram, max_ngram)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.vocab_size = vocab_size  # only checked by the verifier
        self.max_context = max_context
        self.device = torch.device("cpu")  # no model: it drafts on the host

    def new_state(self, seq: DraftSeq) -> NgramIndex:
        return NgramIndex(range(self.min_ngram, self.max_ngram + 1))

    def truncate(self, seq: DraftSeq, length: int) -> None:
        assert isinstance(seq.state, NgramIndex)
        seq.state.cut(seq.tokens, length)

    def kv_committed_len(self, seq: DraftSeq) -> int:
        return 0  # no KV

    def release(self, seq: DraftSeq) -> None:
        """Nothing held."""

    def capture_cuda_graphs(self, catch_up_lens: tuple[int, ...], max_batch_size: int) -> None:
        """No model: nothing to capture."""

    def warm_up_kernels(self) -> None:
        """No model: nothing to build."""

    @property
    def num_pages_used(self) -> int:
        return 0

    @property
    def num_pages_free(self) -> int:
        return 0

    def check_integrity(self) -> None:
        """No allocator."""

    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        return [self._propose_one(job) for job in jobs]

    def propose_ahead(self, jobs: list[DraftJob]) -> list[list[AheadTree]]:
        """None: prompt lookup has no distribution to guess the bonus tokens from."""
        return [[] for _ in jobs]

    def continuations(self, seq: DraftSeq, depth: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations (<= depth tokens) of the longest suffix of the
        sequence's tokens that occurred before, most recent occurrence first."""
        assert isinstance(seq.state, NgramIndex)
        return seq.state.continuations(seq.tokens, depth, limit)

    def _propose_one(self, job: DraftJob) -> DraftTree:
        spec = job.spec
        if spec.num_steps == 0:
            return DraftTree()
        tree = DraftTree()
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for branch in self.continuations(job.seq, spec.num_steps, spec.topk):
            parent = -1
            for token in branch:
                node = children.get((parent, token))
                if node is None:
                    if len(tree) == spec.num_draft_tokens:
                        return tree
                    node = len(tree)
                    tree.tokens.append(token)
                    tree.parents.append(parent)
                    children[(parent, token)] = node
                parent = node
        return tree
