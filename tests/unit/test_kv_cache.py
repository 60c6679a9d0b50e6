"""A sequence's page table as the int32 array the batches read (`SeqKV.table_array`)."""

from __future__ import annotations

import numpy as np
import torch

from specsplit.kv_cache import KVCache


def test_the_page_tables_int32_mirror_follows_every_change() -> None:
    """`SeqKV.table_array` is the page table as int32 after pages are added, trimmed and added
    again (other pages, the same indices), released, on a fork, and after the table is assigned
    whole; only the pages added since the last call are copied in."""
    kv = KVCache(1, 1, 2, 64, 4, torch.float32, "cpu")
    seq, taken = kv.new_seq(), []
    assert seq.table_array().tolist() == []
    for length in (3, 9, 40, 100, 17, 5, 60, 0, 70):
        kv.trim(seq, length) if length < seq.kv_allocated_len else kv.reserve(seq, length)
        assert seq.table_array().dtype == np.int32
        assert seq.table_array().tolist() == seq.page_table
        taken += kv.allocator.alloc(1)  # (the next pages are not the ones just freed)
    seq.kv_committed_len = 30
    fork = kv.fork(seq, 30)
    kv.reserve(fork, 45)
    assert fork.table_array().tolist() == fork.page_table
    assert seq.table_array().tolist() == seq.page_table  # (the fork's pages are its own)
    kv.release(fork)
    kv.release(seq)
    assert seq.table_array().tolist() == [] and fork.table_array().tolist() == []
    other = kv.new_seq()
    other.page_table = [7, 3, 9]
    assert other.table_array().tolist() == [7, 3, 9]
    other.page_table = [2]  # assigned whole: mirrored anew
    assert other.table_array().tolist() == [2]
    kv.allocator.free(taken)
