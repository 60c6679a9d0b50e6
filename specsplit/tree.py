"""Draft trees: `n` proposed tokens, each with a parent (-1 = the root, the last pending token).

Nodes are stored parents-first: parent[i] < i. Depth of a child of the root is 1.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

# A sampled chain's drafts come from the draft model's distribution cut to its DRAFT_SUPPORT
# most likely tokens, renormalized: rejection sampling is lossless for any draft distribution the
# verifier is told exactly, and this one crosses the wire as 256 entries a node, not the
# vocabulary's (bench/RESULTS.md: 590 KB a sequence a round at SmolLM2's, ~50 ms a round of
# conversions at batch 32). The tokens it leaves out carry little of the draft model's mass, so
# acceptance hardly changes (tests/unit/test_lossless_sampling_math.py). The verifier's
# acceptance graphs take supports of up to this many tokens.
DRAFT_SUPPORT = 256
# ... and cut again after its likeliest tokens holding all but DRAFT_TAIL of the mass: a peaked
# row (most of a real model's: SmolLM2 at T = 0.7 keeps 14 tokens at the median, 3 at the first
# quartile) crosses the wire as those few (specsplit/wire_columns.py sends each row at its own
# width). A node's acceptance drops by at most DRAFT_TAIL.
DRAFT_TAIL = 1e-3


class Flat(NamedTuple):
    """A support's rows at their own widths, back to back (as the wire carries them): row i's
    entries at [sum(widths[:i]), sum(widths[:i + 1])) of `tokens` and `probs`."""

    tokens: np.ndarray  # [total] int32
    probs: np.ndarray  # [total] float32
    widths: np.ndarray  # [n] int64


class DraftProbs:
    """A sampled chain's draft distributions, one row per node (the distribution its token was
    drawn from), each as its support: token `tokens[i, j]` has probability `probs[i, j]` (0 for
    padding), every other token of the vocabulary 0. The drafter draws from its distribution cut
    to the most likely tokens (DRAFT_SUPPORT): acceptance stays lossless for
    any draft distribution it is told exactly, and a row crosses the wire as k entries, not a
    vocabulary's worth (196 KB a node at SmolLM2's 49152, 512 KB at 128K).

    Held padded ([n, k] tensors) or ragged (`DraftProbs.ragged`: each row up to its last nonzero
    entry, as the wire carries them), so that a round's rows cross the gateway, and are split
    and joined there, without being padded and cut again; `tokens` / `probs` pad a ragged one
    on first use."""

    def __init__(self, tokens: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> None:
        self._tokens: torch.Tensor | None = tokens  # [n, k] int64
        self._probs: torch.Tensor | None = probs  # [n, k] float32 (float64 in exact tests)
        self.vocab_size = vocab_size
        self._flat: Flat | None = None

    @staticmethod
    def ragged(flat: Flat, vocab_size: int) -> DraftProbs:
        """Rows at their own widths (none padded until asked for)."""
        probs = DraftProbs.__new__(DraftProbs)
        probs._tokens = probs._probs = None
        probs.vocab_size, probs._flat = vocab_size, flat
        return probs

    @property
    def tokens(self) -> torch.Tensor:
        return self._padded()[0]

    @property
    def probs(self) -> torch.Tensor:
        return self._padded()[1]

    @property
    def shape(self) -> tuple[int, int]:
        """The dense shape, [n, vocab]."""
        return len(self), self.vocab_size

    @property
    def padded(self) -> bool:
        """Whether the [n, k] tensors are held (made, or asked for once)."""
        return self._tokens is not None

    @property
    def width(self) -> int:
        """k: the padded rows' width (a ragged one's widest row, at least 1)."""
        if self._tokens is not None:
            return int(self._tokens.shape[1])
        assert self._flat is not None
        return padded_width(self._flat.widths)

    def __len__(self) -> int:
        if self._tokens is not None:
            return int(self._tokens.shape[0])
        assert self._flat is not None
        return int(self._flat.widths.size)

    def flat(self) -> Flat:
        """The rows at their own widths (a padded one's cut after each row's last nonzero
        probability: a drafter's rows hold their kept tokens first, `draw_from_cut`)."""
        if self._flat is None:
            tokens, probs = self.tokens.detach().cpu(), self.probs.detach().cpu().float()
            self._flat = cut_rows(tokens.numpy(), probs.numpy())
        return self._flat

    def as_ragged(self) -> DraftProbs:
        return self if self._tokens is None else DraftProbs.ragged(self.flat(), self.vocab_size)

    def fill(self, tokens: np.ndarray, probs: np.ndarray) -> None:
        """Write the rows into the first columns of `tokens` and `probs` ([n, >= width] host
        arrays of zeros, any dtypes), each row's padding left as it is."""
        if self._tokens is not None:
            k = self.width
            tokens[:, :k], probs[:, :k] = self.tokens.cpu().numpy(), self.probs.cpu().numpy()
            return
        flat, k = self.flat(), self.width
        kept = _kept(flat.widths, k)
        tokens[:, :k][kept], probs[:, :k][kept] = flat.tokens, flat.probs

    def rows(self, keep: list[int] | slice) -> DraftProbs:
        """The rows `keep` (a slice: views, no copy; all of them: this one)."""
        start, stop, step = keep.indices(len(self)) if isinstance(keep, slice) else (0, 0, 0)
        if (start, stop, step) == (0, len(self), 1):
            return self  # (a chain's every draft, `select_tree`: per sequence a round)
        if self._flat is not None and step == 1:
            flat = self.flat()
            widths = flat.widths[start:stop]
            begin = int(flat.widths[:start].sum())
            end = begin + int(widths.sum())
            return DraftProbs.ragged(
                Flat(flat.tokens[begin:end], flat.probs[begin:end], widths), self.vocab_size
            )
        return DraftProbs(self.tokens[keep], self.probs[keep], self.vocab_size)

    def add_to(self, out: torch.Tensor) -> torch.Tensor:
        """`out` [n, vocab] (zeros: the dense distributions) with these rows' probabilities
        added, on its device."""
        device = out.device
        tokens = self.tokens.to(device, non_blocking=True)
        return out.scatter_add_(1, tokens, self.probs.to(device, out.dtype, non_blocking=True))

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[n, vocab], in the probabilities' dtype."""
        return self.add_to(torch.zeros(self.shape, dtype=self.probs.dtype, device=device))

    @staticmethod
    def of(dense: torch.Tensor) -> DraftProbs:
        """The support of [n, vocab] distributions (k: the most nonzero entries of a row)."""
        k = max(int((dense != 0).sum(dim=-1).max()), 1) if dense.numel() else 1
        probs, tokens = dense.topk(min(k, dense.shape[-1]), dim=-1)
        return DraftProbs(tokens, probs, dense.shape[-1])

    def split(self, counts: list[int]) -> list[DraftProbs]:
        """Consecutive rows, `counts[i]` for part i (views; ragged where this one is)."""
        if self._flat is not None:
            flat = self.flat()
            rows = list(itertools.accumulate(counts, initial=0))
            ends = np.concatenate([[0], np.cumsum(flat.widths)])[rows].tolist()
            return [
                DraftProbs.ragged(
                    Flat(flat.tokens[a:b], flat.probs[a:b], flat.widths[r:s]), self.vocab_size
                )
                for (a, b), (r, s) in zip(
                    itertools.pairwise(ends), itertools.pairwise(rows), strict=True
                )
            ]
        tokens, probs = self.tokens.split(counts), self.probs.split(counts)
        return [DraftProbs(t, p, self.vocab_size) for t, p in zip(tokens, probs, strict=True)]

    @staticmethod
    def cat(parts: list[DraftProbs]) -> DraftProbs:
        """Rows of one vocabulary, in order: ragged ones (or ones cut once) joined ragged, others
        padded to the widest. Joined by numpy: torch.cat's OpenMP region waits for every worker
        (specsplit.model.batch)."""
        if len(parts) == 1:
            return parts[0]
        vocab_size = parts[0].vocab_size
        if all(part._flat is not None for part in parts):
            flats = [part.flat() for part in parts]
            return DraftProbs.ragged(
                Flat(*(np.concatenate(column) for column in zip(*flats, strict=True))),
                vocab_size,
            )
        k = max(part.width for part in parts)
        tokens = np.concatenate([_pad(p.tokens, k).numpy() for p in parts])
        probs = np.concatenate([_pad(p.probs, k).numpy() for p in parts])
        return DraftProbs(torch.from_numpy(tokens), torch.from_numpy(probs), vocab_size)

    def _padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The [n, k] tokens and probabilities (a ragged one's padded once, kept)."""
        if self._tokens is None or self._probs is None:
            n, k = len(self), self.width
            tokens, probs = np.zeros((n, k), dtype=np.int64), np.zeros((n, k), dtype=np.float32)
            self.fill(tokens, probs)
            self._tokens, self._probs = torch.from_numpy(tokens), torch.from_numpy(probs)
        return self._tokens, self._probs


def cut_rows(tokens: np.ndarray, probs: np.ndarray) -> Flat:
    """[n, k] rows of a support -> each cut after its last nonzero probability (all of a row
    with none: width 0), back to back."""
    nonzero = probs != 0
    last = probs.shape[1] - np.argmax(nonzero[:, ::-1], axis=1)
    widths = np.where(nonzero.any(axis=1), last, 0).astype(np.int64)
    kept = _kept(widths, probs.shape[1])
    return Flat(tokens[kept].astype(np.int32), probs[kept], widths)


def padded_width(widths: np.ndarray) -> int:
    """k: the width rows of these widths pad to (the widest, at least 1)."""
    return max(int(widths.max()) if widths.size else 0, 1)


def _kept(widths: np.ndarray, k: int) -> np.ndarray:
    """[n, k] bool: each row's first widths[i] columns."""
    return np.arange(k) < widths[:, None]


def _pad(rows: torch.Tensor, k: int) -> torch.Tensor:
    """[n, j] -> [n, k] with zeros after (a support's padding); the CPU."""
    rows = rows.cpu()
    return rows if rows.shape[1] == k else F.pad(rows, (0, k - rows.shape[1]))


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # [n] proposed token ids
    parents: list[int] = field(default_factory=list)  # [n] parent node index, -1 = root
    # the draft distribution each token was sampled from (the one at its parent), or None for
    # deterministic proposals (top-k trees, n-gram)
    draft_probs: DraftProbs | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the field when the tree is malformed."""
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError(f"tree.parents has {len(self.parents)} entries, tree.tokens has {n}")
        if n and not (min(self.tokens) >= 0 and max(self.tokens) < vocab_size):
            i = next(i for i, t in enumerate(self.tokens) if not 0 <= t < vocab_size)
            raise ValueError(
                f"tree.tokens[{i}] = {self.tokens[i]} outside the vocabulary [0, {vocab_size})"
            )
        # a chain (most rounds) has valid parents and no siblings: the checks below are per node
        if not self.is_chain:
            self._check_parents()
        if self.draft_probs is not None:
            if tuple(self.draft_probs.shape) != (n, vocab_size):
                raise ValueError(
                    f"tree.draft_probs shape {tuple(self.draft_probs.shape)} != ({n}, {vocab_size})"
                )
            if any(c > 1 for c in self.num_children()):
                raise ValueError(
                    "tree.draft_probs is only supported for chains (one child per node)"
                )

    def _check_parents(self) -> None:
        """Each parent -1 or an earlier node, then no two siblings the same token."""
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(
                    f"tree.parents[{i}] = {parent}: must be -1 or an earlier node (< {i})"
                )
        siblings: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            if (parent, token) in siblings:
                raise ValueError(
                    f"tree.tokens[{i}] = {token} repeats a sibling under parent {parent}"
                )
            siblings.add((parent, token))

    @property
    def is_chain(self) -> bool:
        """Every node the only child of the one before (the empty tree too)."""
        return self.parents == list(range(-1, len(self.parents) - 1))

    def fitted(self, num_steps: int, num_draft_tokens: int) -> DraftTree:
        """The tree cut to at most `num_steps` levels and `num_draft_tokens` nodes
        (parents-first: the first nodes of the shallow ones form a tree), e.g. a tree drafted
        ahead for a shape the next round no longer allows (near max_new_tokens)."""
        if len(self.tokens) <= min(num_steps, num_draft_tokens):  # no node deeper than n
            return self  # (most trees: a hint cuts one per outcome, 384 a round at batch 32)
        keep = [i for i, d in enumerate(self.depths()) if d <= num_steps][:num_draft_tokens]
        if len(keep) == len(self.tokens):
            return self
        if not keep:  # (no draft probabilities either: a plain round's)
            return DraftTree()
        index = {old: new for new, old in enumerate(keep)}
        probs = None if self.draft_probs is None else self.draft_probs.rows(keep)
        return DraftTree(
            [self.tokens[i] for i in keep],
            [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
            probs,
        )

    def depths(self) -> list[int]:
        return depths(self.parents)

    def num_children(self) -> list[int]:
        """Children per node, with the root last: [n + 1]."""
        counts = [0] * (len(self.tokens) + 1)
        for parent in self.parents:
            counts[parent] += 1  # parent -1 lands on the root slot at the end
        return counts

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root) in index order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first level down to `node` (empty for the root)."""
        path: list[int] = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: mask[i, j] = node j is node i or one of its ancestors."""
        return torch.from_numpy(ancestor_mask(self.parents))


def depths(parents: list[int] | tuple[int, ...]) -> list[int]:
    """Each node's depth in a tree of these parents (a child of the root: 1)."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


def ancestor_mask(parents: list[int] | tuple[int, ...]) -> np.ndarray:
    """[n, n] bool for a tree of these parents: mask[i, j] = node j is node i or one of its
    ancestors."""
    mask = np.eye(len(parents), dtype=bool)  # numpy: a row op costs ~1 us, a torch one ~5
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask
