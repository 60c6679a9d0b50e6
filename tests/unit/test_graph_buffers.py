"""The CUDA graphs' fixed inputs and outputs (specsplit/model/graph_buffers.py), on the
CPU: one byte buffer seen as the int64, int32 and mask arrays, moved in one copy, and a step's
wanted rows as views of the outputs only where they are all its rows in order. (Pinned memory
and CUDA events need a GPU: here plain memory stands in for both, the copy is the same.)"""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from specsplit.kv_cache import SeqKV
from specsplit.model.graph_buffers import HOST_MIRRORS, GraphBuffers
from specsplit.step import decode_batch

MAX_BS, Q, MAX_PAGES = 4, 3, 5


@pytest.fixture
def buffers() -> Iterator[GraphBuffers]:
    with (
        mock.patch.object(torch.Tensor, "pin_memory", lambda self: self),
        mock.patch.object(torch.cuda, "Event", mock.Mock),
        mock.patch.object(torch.cuda, "current_stream", mock.Mock()),  # (fill records on it)
    ):
        yield GraphBuffers(MAX_BS, Q, MAX_PAGES, None, torch.device("cpu"))


def _filled(copies_done: bool, steps: int) -> list[tuple[torch.Tensor, mock.Mock]]:
    """`steps` decode steps' fills of one GraphBuffers (q = 1), each step's mirror (its copied
    bytes) and its copy's event; copies_done: whether each event reports its copy as run."""

    def event() -> mock.Mock:  # as CUDA's: done until recorded, then as the copies are
        made = mock.Mock()
        made.query.side_effect = lambda: not made.record.called or copies_done
        return made

    with (
        mock.patch.object(torch.Tensor, "pin_memory", lambda self: self),
        mock.patch.object(torch.cuda, "Event", event),
        mock.patch.object(torch.cuda, "current_stream", mock.Mock()),
    ):
        buffers = GraphBuffers(MAX_BS, 1, MAX_PAGES, None, torch.device("cpu"))
        seqs = [SeqKV(4, [2, 3], 5), SeqKV(4, [1], 2)]
        filled = []
        for step in range(steps):
            batch, _ = decode_batch(seqs, [10 + step, 20 + step], page_size=4)
            buffers.fill(batch, 2, scratch_page=0, scratch_slot=0)
            assert buffers.host["input_ids"][:2].tolist() == [10 + step, 20 + step]
            assert buffers.host["all_rows"][:3].tolist() == [0, 1, 2]  # (each mirror's)
            # what the graph reads: this step's inputs, moved from its mirror
            assert buffers.dev["input_ids"][:2].tolist() == [10 + step, 20 + step]
            assert buffers.dev["kv_lens"][:2].tolist() == [6, 3]  # (committed + 1)
            filled.append((buffers.host_copied, buffers.mirrors.event))
    return filled


def test_launches_queued_ahead_take_more_mirrors_and_wait_for_their_own_copy_only() -> None:
    """While the next mirror's copy has not run (steps queued ahead on the device) a launch
    takes a new one, up to HOST_MIRRORS, then the oldest again once its copy has run: one
    mirror made each launch wait for the device to reach the step before it."""
    filled = _filled(copies_done=False, steps=HOST_MIRRORS + 2)
    mirrors = [host.data_ptr() for host, _ in filled]
    assert len(set(mirrors)) == HOST_MIRRORS
    assert mirrors[HOST_MIRRORS:] == mirrors[:2]  # then in turn
    for host_event in filled[HOST_MIRRORS:]:
        assert host_event[1].synchronize.call_count == 2  # its first use's and this one's
    assert all(event.record.call_count >= 1 for _, event in filled)  # each after its copy


def test_launches_with_nothing_queued_ahead_keep_one_mirror() -> None:
    """Every copy has run by the next launch (nothing queued ahead): one mirror, as many MB as
    a long context's page tables take, is all that is made."""
    filled = _filled(copies_done=True, steps=4)
    assert len({host.data_ptr() for host, _ in filled}) == 1


def test_the_arrays_share_one_buffer_and_cross_in_one_copy(buffers: GraphBuffers) -> None:
    host, dev = buffers.host, buffers.dev
    t = MAX_BS * Q
    assert dev["all_rows"].tolist() == list(range(t))  # made once, at construction
    assert dev["cu_seqlens_q"].tolist() == list(range(0, t + 1, Q))
    for name in ("input_ids", "positions", "slot_mapping", "rows", "hidden_rows"):
        assert dev[name].dtype == torch.int64 and dev[name].shape == (t,)
    for name in ("kv_lens", "prefix_lens"):
        assert dev[name].dtype == torch.int32 and dev[name].shape == (MAX_BS,)
    assert dev["block_table"].shape == (MAX_BS, MAX_PAGES)
    assert dev["tree_mask"].dtype == torch.bool and dev["tree_mask"].shape == (MAX_BS, Q, Q)
    for name in ("input_ids", "cu_seqlens_q", "tree_mask"):  # each array's start 256-aligned
        assert dev[name].data_ptr() % 256 == buffers.dev_bytes.data_ptr() % 256
    host["input_ids"][:3] = [5, 6, 7]
    host["kv_lens"][:] = [7, 8, 9, 10]
    host["block_table"][2, 4] = 11
    host["tree_mask"][1, 2, 0] = True
    buffers.dev_copied.copy_(buffers.host_copied)  # what `fill` moves
    assert dev["input_ids"][:4].tolist() == [5, 6, 7, 0]
    assert dev["kv_lens"].tolist() == [7, 8, 9, 10]
    assert dev["block_table"][2, 4].item() == 11
    assert dev["tree_mask"][1].tolist() == [[False] * 3, [False] * 3, [True, False, False]]


def test_a_step_of_all_its_rows_in_order_gets_views_only_when_asked(buffers: GraphBuffers) -> None:
    t = 2 * Q  # two sequences of Q tokens
    out = torch.arange(MAX_BS * Q * 2, dtype=torch.float32).view(MAX_BS * Q, 2)[:t]
    buffers.host["rows"][:t] = range(t)
    buffers.dev_copied.copy_(buffers.host_copied)
    view = buffers.rows(out, "rows", t, views=True)
    assert view.data_ptr() == out.data_ptr() and torch.equal(view, out)
    gathered = buffers.rows(out, "rows", t, views=False)
    assert gathered.data_ptr() != out.data_ptr() and torch.equal(gathered, out)


@pytest.mark.parametrize(
    "rows",
    [
        [0, 1, 2, 3, 4],  # fewer rows than the step's (a round without every row's logits)
        [0, 1, 2, 4, 5, 3],  # all of them, out of order
        [0, 2, 3, 4, 5, 5],  # padding between sequences (a ragged batch's)
    ],
)
def test_other_rows_are_gathered(buffers: GraphBuffers, rows: list[int]) -> None:
    t = 2 * Q
    out = torch.arange(MAX_BS * Q * 2, dtype=torch.float32).view(MAX_BS * Q, 2)[:t]
    buffers.host["rows"][: len(rows)] = rows
    buffers.dev_copied.copy_(buffers.host_copied)
    got = buffers.rows(out, "rows", len(rows), views=True)
    assert got.data_ptr() != out.data_ptr()
    assert torch.equal(got, out[rows])
