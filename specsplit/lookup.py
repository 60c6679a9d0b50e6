"""Prompt lookup: draft by copying what followed an earlier occurrence of the sequence's last
few tokens. The drafter's `NgramProposer` drafts trees with it; the verifier drafts chains with
it inside a round's further decode steps (`VerifyInput.lookup`), where no drafter, no RPC and no
gateway trip sits between one step's tokens and the next step's draft.

For the longest suffix (max_ngram down to min_ngram tokens) that occurred before, the tokens
that followed its most recent earlier occurrences. Each sequence keeps an index of where its
n-grams start (`NgramIndex`), extended by the tokens that arrive and cut back where the
sequence is truncated, so a draft looks its suffixes up instead of scanning the context (a scan
that found nothing took 2 ms at 8,000 tokens, a sequence and a round)."""

from __future__ import annotations

MIN_NGRAM = 1
MAX_NGRAM = 3
# the verifier's chains (TokenHistory) follow suffixes of at least two tokens: a one-token match
# rarely continues as before. Replaying SmolLM2-135M-Instruct's greedy answers (the 2-core VM,
# 128 tokens each, chains of 3), chains after one-token matches had 10% of their tokens accepted
# on the chat prompts (1,101 drafted) and 21% on the edits, after two tokens 20% / 36%, after
# three 70% / 75%; without the one-token chains the chat steps draft 0.43 tokens a step instead
# of 1.38 (1.17 tokens a step instead of 1.23), the edits 1.80 instead of 2.51 (2.09 instead of
# 2.28): a third of the rows verified for most of the tokens gained
LOOKUP_MIN_NGRAM = 2


class NgramIndex:
    """Where each n-gram of a sequence's first `length` tokens starts, ascending, for every n in
    `sizes`."""

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
        else:
            for end in range(self.length, length, -1):
                for n in self.sizes:
                    if end >= n:
                        key = tuple(tokens[end - n : end])
                        starts = self.starts[key]
                        starts.pop()  # the latest: ends are cut latest first
                        if not starts:
                            del self.starts[key]
        self.length = min(self.length, length)

    def continuations(self, tokens: list[int], depth: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations (<= depth tokens) of the longest suffix of
        `tokens` (indexed here first) that occurred before, most recent occurrence first."""
        self.extend(tokens)
        n_tokens = len(tokens)
        for n in range(min(self.sizes.stop - 1, n_tokens - 1), self.sizes.start - 1, -1):
            found: list[list[int]] = []
            for start in reversed(self.starts.get(tuple(tokens[n_tokens - n :]), ())):
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


class TokenHistory:
    """A sequence's tokens as the verifier committed them (`put` at each commit's position,
    `cut` at a truncation), and their n-gram index, extended only when a lookup asks. A commit
    past the tokens it holds (a path that committed without telling it) leaves it unknown:
    lookups find nothing until the sequence starts again. Chains follow suffixes of at least
    `min_ngram` tokens."""

    def __init__(self, min_ngram: int = LOOKUP_MIN_NGRAM) -> None:
        self.tokens: list[int] = []
        self.index = NgramIndex(range(min_ngram, MAX_NGRAM + 1))
        self.known = True

    def put(self, position: int, tokens: list[int]) -> None:
        """tokens[position:] are now `tokens`."""
        if position == 0:
            self.known = True
        elif position > len(self.tokens) and self.known:
            self.known = False
            self.cut(0)
        if self.known:
            self.cut(position)
            self.tokens += tokens

    def cut(self, length: int) -> None:
        if length < self.index.length:
            self.index.cut(self.tokens, length)
        del self.tokens[length:]

    def chain(self, position: int, last: int, depth: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest suffix of the
        first `position` tokens + `last` (at most `depth`; none where nothing matched, or where
        fewer are held). What it holds past `position` goes (the round at it rewrites it)."""
        if not self.known or depth <= 0 or len(self.tokens) < position:
            return []
        self.cut(position)
        self.tokens.append(last)  # (indexed with them; the next commit puts it again)
        try:
            found = self.index.continuations(self.tokens, depth, 1)
        finally:
            self.cut(len(self.tokens) - 1)
        return found[0] if found else []
