"""Prompt-lookup (n-gram) proposer: no weights, drafts by copying what followed earlier matches.

For the longest suffix of the tokens (max_ngram down to min_ngram) that occurred before, take the
tokens that followed its most recent earlier occurrences. topk = 1 gives one chain; topk > 1
merges the continuations of up to topk distinct matches into a trie (siblings distinct).

Each sequence keeps an index of where its n-grams start (`NgramIndex`), extended by the tokens
a call adds and cut back where the gateway truncates, so a draft looks its suffixes up instead
of scanning the context (a scan that finds nothing took 2 ms at 8,000 tokens, a sequence and a
round).
"""

from __future__ import annotations

import torch

from drafter.types import DraftJob, DraftSeq
from specsplit.messages import AheadTree
from specsplit.tree import DraftTree


class NgramIndex:
    """Where each n-gram of a sequence's first `length` tokens starts, ascending, for every n the
    proposer matches."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.starts: dict[tuple[int, ...], list[int]] = {}
        self.length = 0

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that end in tokens[self.length:]."""
        for n in self.sizes:  # (keys of one n only: each list stays ascending)
            first = max(self.length - n + 1, 0)
            keys = zip(*(tokens[first + i :] for i in range(n)), strict=False)  # (ragged)
            for start, key in enumerate(keys, first):
                self.starts.setdefault(key, []).append(start)
        self.length = max(self.length, len(tokens))

    def cut(self, tokens: list[int], length: int) -> None:
        """Forget the n-grams that end past tokens[:length] (tokens: as indexed, not yet cut)."""
        if length == 0:
            self.starts.clear()
        for end in range(self.length, length, -1) if length else ():
            for n in self.sizes:
                if end >= n:
                    key = tuple(tokens[end - n : end])
                    starts = self.starts[key]
                    starts.pop()  # the latest: ends are cut latest first
                    if not starts:
                        del self.starts[key]
        self.length = min(self.length, length)


class NgramProposer:
    def __init__(
        self,
        max_ngram: int = 3,
        min_ngram: int = 1,
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
        tokens, index = seq.tokens, seq.state
        assert isinstance(index, NgramIndex)
        index.extend(tokens)
        n_tokens = len(tokens)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            found: list[list[int]] = []
            for start in reversed(index.starts.get(tuple(tokens[n_tokens - n :]), ())):
                if start == n_tokens - n:
                    continue  # the suffix itself
                follow = tokens[start + n : start + n + depth]
                if follow not in found:
                    found.append(follow)
                    if len(found) == limit:
                        break
            if found:
                return found
        return []

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
