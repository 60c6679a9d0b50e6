"""The host-side layout of the acceptance graphs' inputs (verifier/accept_graphs.py runs them).

`Layout`: one graph's padded shapes (batch bucket, tree width: `padded`, a power of two) for a
round's int64 inputs in one flat host array; each sequence's page table enters as only the window
its tree's storage spans (`window_pages` wide, cut by `page_window`). `Sampling`: a sampled round's
float64 inputs (params, uniforms, draft supports) in one more. Both are `_Flat`: parts back to
back, one copy to the device; `eager_layout` / `eager_sampling` make one per shape off the graphs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch


def padded(width: int) -> int:
    """A tree width's graph width: the next power of two (0 stays 0)."""
    return 1 << (width - 1).bit_length() if width else 0


def window_pages(width: int, page_size: int) -> int:
    """Pages of a window that holds storage [base, base + width) wherever base falls."""
    return 1 + -(-width // page_size)


def page_window(
    table: np.ndarray,  # [B, max_pages] each sequence's page table
    base: np.ndarray,  # [B] storage index of tree node 0
    pages: int,  # the window's width (window_pages)
    page_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """([B, pages] the table's columns from base's page on, [B] base within the window's first
    page): the tree's storage has the same slots through the window as through the table.
    Columns past a table's end repeat its last entry (no real move reads them)."""
    first = base // page_size
    cols = np.minimum(first[:, None] + np.arange(pages), table.shape[1] - 1)
    rows = np.arange(table.shape[0])[:, None]  # (indexing: np.take_along_axis costs 2 us more)
    return table[rows, cols], base - first * page_size


class _Flat:
    """A flat host array of `dtype` holding parts of `shapes` back to back: one copy to the
    device carries them all."""

    dtype: type = np.int64

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        raise NotImplementedError

    @functools.cached_property  # a layout's properties are read every round: made once
    def sizes(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    @functools.cached_property
    def _bounds(self) -> list[tuple[int, int]]:
        ends = np.cumsum(self.sizes).tolist()
        return [(end - size, end) for size, end in zip(self.sizes, ends, strict=True)]

    def parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parts of a flat tensor laid out as host_arrays' (on the device), as views."""
        return [
            part.view(shape)
            for part, shape in zip(flat.split(self.sizes), self.shapes, strict=True)
        ]

    def host_arrays(self, host: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
        """A host array of padding (`host`, reset, or a new one) and its parts as views."""
        if host is None:
            host = np.zeros(sum(self.sizes), dtype=self.dtype)
        else:
            host[:] = 0
        parts = [
            host[start:end].reshape(shape)
            for (start, end), shape in zip(self._bounds, self.shapes, strict=True)
        ]
        self._pad(parts)
        return host, parts

    def _pad(self, parts: list[np.ndarray]) -> None:
        """Set the padding values that are not 0."""


@dataclass(frozen=True)
class Layout(_Flat):
    """The padded shapes of one graph: `bucket` rows, `width` tree nodes, `pages` columns of
    each sequence's page-table window."""

    bucket: int
    width: int
    pages: int

    @functools.cached_property
    def shapes(self) -> list[tuple[int, ...]]:
        """row_index [B, N + 1], draft tokens [B, N], parents [B, N], base [B] (within the
        window), page-table window [B, P]."""
        b, n = self.bucket, self.width
        return [(b, n + 1), (b, n), (b, n), (b,), (b, self.pages)]

    def _pad(self, parts: list[np.ndarray]) -> None:
        parts[2][:] = -2  # parents: padding, never tried


@dataclass(frozen=True)
class Sampling(_Flat):
    """A sampled round's own inputs (float64: token ids and top-k are exact in it), beside its
    Layout's: each sequence's sampling params, its uniforms (one per node, the bonus's in
    column `width`) and its draft distribution on a support of `support` tokens a node (0:
    none in the round). `filters`: some sequence has top-k or top-p (the graph finds each
    row's cut threshold). Padding rows are greedy and carry no draft distribution."""

    bucket: int
    width: int
    support: int
    filters: bool

    dtype = np.float64

    @functools.cached_property
    def shapes(self) -> list[tuple[int, ...]]:
        """temperature [B], top_p [B], top_k [B], carries q [B], uniforms [B, N + 1], q's
        tokens [B, N, S] and probabilities [B, N, S]."""
        b, n, k = self.bucket, self.width, self.support
        return [(b,), (b,), (b,), (b,), (b, n + 1), (b, n, k), (b, n, k)]

    def _pad(self, parts: list[np.ndarray]) -> None:
        parts[1][:] = 1.0  # top_p: off


# off the graphs (the CPU; rounds past them) a round's Layout and Sampling, one per shape: their
# properties, cached on the instance, are made once, not each round (~20 us at batch 1)
eager_layout = functools.lru_cache(maxsize=256)(Layout)
eager_sampling = functools.lru_cache(maxsize=256)(Sampling)
