"""Paged KV cache: a page allocator, per-layer K/V slot tensors, per-sequence page tables.

A *slot* is one token's K/V row: slot = page * page_size + offset. Every sequence owns a
page table; its token at position i lives in slot page_table[i // page_size] * page_size +
i % page_size. Lengths are the state (DESIGN.md §2): `kv_committed_len` leading tokens are
final, `kv_allocated_len` slots are reserved (page-aligned, >= committed).
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

CPU_NUM_PAGES = 2048  # a pool on the CPU when none is asked for: 32k tokens at page size 16
MIN_NUM_PAGES = 16
_ALIGN = 64  # bytes: a CPU pool's start (a cache line, torch's own allocations' alignment)


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """torch.zeros(shape), but on the CPU through calloc (numpy's zeros), whose large blocks are
    fresh pages the OS zeroes when first touched: a pool's untouched pages cost neither time
    nor resident memory. torch.zeros writes every byte: the CPU verifier's default 1.41 GiB
    pool took 0.3 s of its start on a 2-core VM (1.9-2.7 s while the VM reclaimed page cache),
    and a ready verifier held 2.37 GB resident against 1.02 GB so. Aligned to 64 bytes, in 4 KB
    pages (`_no_huge_pages`)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(nbytes + _ALIGN, np.uint8)
    _no_huge_pages(raw.ctypes.data, raw.nbytes)
    start = -raw.ctypes.data % _ALIGN
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


_PAGE = 4096
_MADV_NOHUGEPAGE = 15  # Linux's


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's madvise, from the process's own symbols (None off Linux or where it is absent)."""
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _no_huge_pages(address: int, nbytes: int) -> None:
    """Ask Linux for 4 KB pages in [address, address + nbytes) (its whole pages): numpy advises
    transparent huge pages for large blocks, and then a pool's first touch of each 2 MB region
    zeroes (and may compact memory for) all of it. A heads-outer pool is touched in 6 regions a
    layer (K and V of each KV head): the embedded default's first 256-token sequence made 390 MB
    resident in 0.48 s against 4 KB pages' few MB, and its first request through `up` paid it (a
    60-token prefill 0.86 s against 0.06); its decode steps read them no slower (3,000 tokens:
    9.1-10.2 ms either way), its prefill faster (5.65-5.69 s against 6.25-6.61). Best effort:
    the pool works either way."""
    madvise = _madvise()
    start = address - address % _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    if madvise is not None and end > start:
        madvise(start, end - start, _MADV_NOHUGEPAGE)


class KVCacheFullError(RuntimeError):
    """Not enough free pages: surfaces as RESOURCE_EXHAUSTED."""


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of K and V one cached token takes over `num_layers` layers (for sizing pools)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * element_size


def pool_num_pages(
    num_pages: int | None,
    device: torch.device | str,
    bytes_per_page: int,
    memory_fraction: float,
    reserve_bytes: int = 0,
) -> int:
    """A KV pool's pages: `num_pages` when given; else CPU_NUM_PAGES on the CPU and, on a GPU,
    `memory_fraction` of the memory free there now (after the weights), less `reserve_bytes`
    kept for other buffers, in pages of `bytes_per_page` (at least MIN_NUM_PAGES)."""
    if num_pages is not None:
        return num_pages
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_NUM_PAGES
    free, _ = torch.cuda.mem_get_info(device)
    return max(int((memory_fraction * free - reserve_bytes) // bytes_per_page), MIN_NUM_PAGES)


class PageAllocator:
    """Free-list allocator over `num_pages` pages. free + used == total, always."""

    def __init__(self, num_pages: int) -> None:
        assert num_pages > 0, num_pages
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFullError(f"KV cache full: need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            assert page in self._used, f"double free of page {page}"
            self._used.remove(page)
            self._free.append(page)

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.num_pages, (
            len(self._free),
            len(self._used),
            self.num_pages,
        )
        assert len(set(self._free)) == len(self._free), "page listed free twice"
        assert not self._used.intersection(self._free), "page both free and used"


@dataclass
class SeqKV:
    """One sequence's view of the cache."""

    page_size: int
    page_table: list[int] = field(default_factory=list)
    kv_committed_len: int = 0
    # leading pages borrowed from the sequence this one was forked from (KVCache.fork): read,
    # never written or freed here
    num_shared_pages: int = 0
    # page_table's int32 mirror for the batches built every step (`table_array`): its first
    # `_mirrored` entries are the table's (of the list `_mirrored_of`); KVCache.trim and release
    # lower the count, so only pages added since are copied in
    _array: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int32), repr=False, compare=False
    )
    _mirrored: int = field(default=0, repr=False, compare=False)
    _mirrored_of: int = field(default=0, repr=False, compare=False)

    def table_array(self) -> np.ndarray:
        """The page table as int32 (a view of the mirror, valid until the table changes): a
        step's batch reads it without converting the list, whose length grows with the context
        (~0.28 ms a step for 32 sequences of 8k tokens at page size 16 on a CPU)."""
        table, n = self.page_table, len(self.page_table)
        if id(table) != self._mirrored_of:  # (a table assigned whole)
            self._mirrored, self._mirrored_of = 0, id(table)
        if n > self._array.shape[0]:
            grown = np.zeros(max(n, 2 * self._array.shape[0], 16), np.int32)
            grown[: self._mirrored] = self._array[: self._mirrored]
            self._array = grown
        if self._mirrored < n:
            self._array[self._mirrored : n] = table[self._mirrored :]
        self._mirrored = n
        return self._array[:n]

    def cut_mirror(self, length: int) -> None:
        """The page table was cut to `length` entries (`table_array` copies what follows anew)."""
        self._mirrored = min(self._mirrored, length)

    @property
    def kv_allocated_len(self) -> int:
        return len(self.page_table) * self.page_size

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) as int64 [end - start]."""
        assert 0 <= start <= end <= self.kv_allocated_len, (start, end, self.kv_allocated_len)
        return torch.tensor(self.slots_of(range(start, end)), dtype=torch.int64)

    def slots_of(self, storage: Iterable[int]) -> list[int]:
        """Cache slots of the storage indices (positions in this sequence's pages)."""
        size, table = self.page_size, self.page_table
        return [table[i // size] * size + i % size for i in storage]


class KVCache:
    """K and V of every layer in one tensor, `data` [num_layers, 2, num_slots, num_kv_heads,
    head_dim] (K at [:, 0], V at [:, 1]), plus the page allocator. One extra page past the
    allocator's, `scratch_page`, belongs to no sequence: padded rows of a CUDA-graph step write
    there and padding moves land there.

    `heads_outer` (the default on the CPU): `data` is a view of memory laid out [num_layers, 2,
    num_kv_heads, num_slots, head_dim], so a KV head's keys of consecutive slots are contiguous
    (a page of 16 slots one run of memory a head). The CPU's attention reads a KV head's keys at
    a time (model/cpu_layer.c) and, slot-major, took 256 B of each 768 B slot (the embedded
    default's 3 heads of 64): the hardware's prefetch did not follow, and past the caches a
    step's attention ran at ~1/3 of DRAM's rate (the embedded default's one-row step at 3,000
    tokens of context 0.75x, four rows 0.61x, the same bits; bench/RESULTS.md). On a GPU slots
    stay outermost, the layout its Triton kernels were tuned on."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        heads_outer: bool | None = None,
    ) -> None:
        assert page_size > 0, page_size
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.scratch_page = num_pages
        self.scratch_slot = num_pages * page_size
        num_slots = (num_pages + 1) * page_size
        if heads_outer is None:
            heads_outer = torch.device(device).type == "cpu"
        if heads_outer:  # the same view of [num_layers, 2, num_kv_heads, num_slots, head_dim]
            shape = (num_layers, 2, num_kv_heads, num_slots, head_dim)
            self.data = lazy_zeros(shape, dtype, device).transpose(2, 3)
        else:
            shape = (num_layers, 2, num_slots, num_kv_heads, head_dim)
            self.data = lazy_zeros(shape, dtype, device)
        self.k = list(self.data[:, 0].unbind(0))  # per layer [num_slots, num_kv_heads, head_dim]
        self.v = list(self.data[:, 1].unbind(0))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def new_seq(self) -> SeqKV:
        return SeqKV(page_size=self.page_size)

    def num_new_pages(self, seq: SeqKV, length: int) -> int:
        """Pages `reserve(seq, length)` would allocate."""
        return max(0, -(-length // self.page_size) - len(seq.page_table))

    def reserve(self, seq: SeqKV, length: int) -> None:
        """Make sure `length` slots are allocated (rounded up to whole pages)."""
        self.add_pages(seq, self.num_new_pages(seq, length))

    def add_pages(self, seq: SeqKV, num: int) -> None:
        """`num` more pages at the end of `seq`'s page table (`num_new_pages` counts them)."""
        if num:
            seq.page_table.extend(self.allocator.alloc(num))

    def trim(self, seq: SeqKV, length: int) -> None:
        """Free the pages not needed to hold `length` tokens."""
        keep = -(-length // self.page_size)
        assert keep >= seq.num_shared_pages, (keep, seq.num_shared_pages)
        if keep < len(seq.page_table):
            self.allocator.free(seq.page_table[keep:])
            del seq.page_table[keep:]
            seq.cut_mirror(keep)

    def release(self, seq: SeqKV) -> None:
        self.allocator.free(seq.page_table[seq.num_shared_pages :])
        seq.page_table.clear()
        seq.cut_mirror(0)
        seq.kv_committed_len = 0
        seq.num_shared_pages = 0

    def fork(self, seq: SeqKV, length: int) -> SeqKV:
        """A sequence whose first `length` entries are `seq`'s, committed: the pages they
        fill entirely are shared (while `seq` keeps them, and the fork must be released first),
        the one they fill in part is copied; whatever the fork appends lands in its own pages.
        Draft-ahead drafts each guessed outcome of a round in a fork."""
        assert 0 <= length <= seq.kv_allocated_len, (length, seq.kv_allocated_len)
        full, part = divmod(length, self.page_size)
        fork = SeqKV(self.page_size, seq.page_table[:full], length, num_shared_pages=full)
        if part:
            (page,) = self.allocator.alloc(1)
            size, old = self.page_size, seq.page_table[full]
            self.data[:, :, page * size : page * size + part] = self.data[
                :, :, old * size : old * size + part
            ]
            fork.page_table.append(page)
        return fork

    def check_integrity(self) -> None:
        self.allocator.check_integrity()


class KVPages:
    """The pages an engine's KV pool (`kv`) has in use and free, as the services report them
    (the Release and Truncate answers, the /metrics gauges): the verifier engine's and a
    model-backed drafter's."""

    kv: KVCache

    @property
    def num_pages_used(self) -> int:
        return self.kv.allocator.num_used

    @property
    def num_pages_free(self) -> int:
        return self.kv.allocator.num_free
