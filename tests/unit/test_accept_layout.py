"""The padded layouts of the verifier's acceptance graphs (verifier/accept_layout.py; the graphs,
verifier/accept_graphs.py, themselves run on a GPU: tests/gpu/test_accept_graphs.py): which round
gets which graph, and the host array's parts."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from specsplit.kernels.accept import accepted_kv_moves
from specsplit.kv_cache import KVCache
from specsplit.model.graph_buffers import HOST_MIRRORS
from specsplit.tree import DRAFT_SUPPORT
from verifier.accept_graphs import AcceptGraphs, _Graph
from verifier.accept_layout import (
    Layout,
    Sampling,
    eager_layout,
    eager_sampling,
    page_window,
    window_pages,
)


@pytest.fixture
def graphs() -> AcceptGraphs:
    kv = KVCache(1, 1, 16, 8, 16, torch.float32, "cpu")
    return AcceptGraphs(kv, batch_sizes=[1, 2, 4, 8], max_rows=8 * 5)


def test_a_round_takes_the_next_bucket_and_power_of_two_widths(graphs) -> None:
    """Page size 16: a window of 2 pages holds up to 16 nodes wherever they start."""
    assert graphs.layout(1, 3) == Layout(1, 4, 2)
    assert graphs.layout(3, 4) == Layout(4, 4, 2)
    assert graphs.layout(5, 0) == Layout(8, 0, 1)  # no trees: decode rounds too


def test_trees_cut_short_share_the_full_trees_graph(graphs) -> None:
    """A 16-node tree and the shorter ones near max_new_tokens (capped spec) use one graph."""
    assert {graphs.layout(2, n) for n in (9, 12, 13, 16)} == {Layout(2, 16, 2)}
    assert [graphs.layout(1, n).width for n in (1, 2, 5, 8)] == [1, 2, 8, 8]


@pytest.mark.parametrize("max_width", [1, 3, 4, 6, 8])
def test_warm_up_captures_every_layout_a_round_up_to_its_width_takes(graphs, max_width) -> None:
    """A 6-node tree (1 + 6 query tokens) pads to the 8-wide graph: captured at warm-up, not
    in the middle of traffic; the largest first (the smaller reuse its memory)."""
    layouts = graphs.layouts(max_width)
    sizes = [(layout.bucket, layout.width) for layout in layouts]
    assert sizes == sorted(sizes, reverse=True)
    warm = set(layouts)
    taken = {graphs.layout(b, n) for b in range(1, 9) for n in range(max_width + 1)}
    assert taken - {None} <= warm


def test_rounds_past_the_graphs_run_eagerly(graphs) -> None:
    assert graphs.layout(9, 1) is None  # more sequences than the largest bucket
    assert graphs.layout(8, 5) is None  # 8 x 6 logits rows > 40


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_window_gives_the_tables_slots(page_size: int) -> None:
    """Every move the tree's storage can make lands on the same cache slots through the
    window (what the graph reads) as through the whole page table, at any base, for trees of
    any width up to the layout's (the context's length does not change the layout)."""
    rng = np.random.default_rng(page_size)
    for width in (1, 3, 8, 16):
        pages = window_pages(width, page_size)
        num_seqs = 6
        base = rng.integers(0, 200, num_seqs)
        table_width = (base.max() + width) // page_size + 1
        table = rng.permutation(num_seqs * table_width).reshape(num_seqs, table_width)
        window, local_base = page_window(table, base, pages, page_size)
        assert window.shape == (num_seqs, pages)
        nodes = torch.from_numpy(rng.integers(0, width, (num_seqs, width)))
        nodes = nodes.sort(dim=1).values  # the accepted path: node d at depth >= d
        accepted = torch.full((num_seqs,), width)
        want = accepted_kv_moves(
            torch.from_numpy(base), nodes, accepted, torch.from_numpy(table), page_size, -1
        )
        got = accepted_kv_moves(
            torch.from_numpy(local_base), nodes, accepted, torch.from_numpy(window), page_size, -1
        )
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True)), width


def test_graphs_host_mirror_is_reset_each_round() -> None:
    """The pinned mirror a graph reads is cleared to padding before each round's writes."""
    layout = Layout(bucket=2, width=2, pages=2)
    host, (rows, *_rest) = layout.host_arrays()
    rows[0, 1] = 5
    again, (rows2, _draft, parents, _base, _table) = layout.host_arrays(host)
    assert again is host and not rows2.any() and (parents == -2).all()


def test_host_array_parts_are_views_with_padding_parents() -> None:
    layout = Layout(bucket=4, width=3, pages=2)
    host, (rows, draft, parents, base, table) = layout.host_arrays()
    assert [part.shape for part in (rows, draft, parents, base, table)] == [
        tuple(shape) for shape in layout.shapes
    ]
    assert host.size == sum(layout.sizes) and host.dtype == np.int64
    assert (parents == -2).all() and not draft.any()  # padding: nothing accepted, no moves
    rows[1, 2] = 7
    table[3, 1] = 9
    assert 7 in host and 9 in host  # writes land in the one array that travels


def test_sampled_rounds_take_a_draft_support_wide_graph(graphs) -> None:
    """A sampled round's graph reads supports of DRAFT_SUPPORT tokens whether or not its trees
    carry a distribution; decode rounds read none; a wider support runs eagerly; an engine
    without the vocabulary's width has no sampled graphs."""
    kv = KVCache(1, 1, 16, 8, 16, torch.float32, "cpu")
    sampled = AcceptGraphs(kv, batch_sizes=[1, 2, 4, 8], max_rows=8 * 5, vocab_size=100)
    layout = sampled.layout(3, 3)
    assert layout is not None
    assert sampled.sampling(layout, 0, False) == Sampling(4, 4, DRAFT_SUPPORT, False)
    assert sampled.sampling(layout, DRAFT_SUPPORT, True) == Sampling(4, 4, DRAFT_SUPPORT, True)
    assert sampled.sampling(layout, DRAFT_SUPPORT + 1, False) is None
    decode = sampled.layout(2, 0)
    assert decode is not None and sampled.sampling(decode, 0, False) == Sampling(2, 0, 0, False)
    assert graphs.sampling(layout, 0, False) is None  # vocab_size 0


def test_sampling_host_array_pads_greedy_rows_without_a_cut() -> None:
    """Padding rows: temperature 0 (greedy, a one-hot target), top_p 1, top_k 0, no draft
    distribution; parts are views of the one float64 array that travels."""
    sampling = Sampling(bucket=2, width=3, support=4, filters=False)
    host, parts = sampling.host_arrays()
    temperature, top_p, top_k, has_q, uniforms, _q_tokens, q_probs = parts
    assert host.dtype == np.float64 and host.size == sum(sampling.sizes)
    assert [p.shape for p in parts] == [(2,), (2,), (2,), (2,), (2, 4), (2, 3, 4), (2, 3, 4)]
    assert (top_p == 1).all() and not (temperature.any() or top_k.any() or has_q.any())
    q_probs[1, 2, 3] = 0.25
    uniforms[0, 3] = 0.5
    again, (_, top_p2, *_rest) = sampling.host_arrays(host)
    assert 0.25 not in again and 0.5 not in again and (top_p2 == 1).all()  # reset each round


def test_an_eager_rounds_layout_is_made_once_per_shape() -> None:
    """Off the graphs (the CPU) a round's Layout and Sampling are one instance per shape: their
    cached properties are not made again each round."""
    assert eager_layout(2, 4, 2) is eager_layout(2, 4, 2) == Layout(2, 4, 2)
    assert eager_layout(2, 4, 2) is not eager_layout(3, 4, 2)
    assert eager_sampling(2, 4, 8, False) is eager_sampling(2, 4, 8, False)
    assert eager_sampling(2, 4, 8, False) == Sampling(2, 4, 8, False)


@pytest.mark.parametrize("sampled", [False, True])
def test_rounds_queued_ahead_take_more_host_mirrors_up_to_the_forwards(
    graphs: AcceptGraphs, sampled: bool
) -> None:
    """A graph's inputs have two pinned host mirrors, taken in turn; a round that finds the
    next one's copy still queued on the device (decode steps queued ahead) makes one more, up
    to HOST_MIRRORS, then takes the oldest once its copy has run. (Pinning, events and the
    graph object need a GPU: stand-ins here; the mirrors' bookkeeping is the same.)"""
    layout = graphs.layout(2, 0)
    sampling = Sampling(layout.bucket, layout.width, 0, False) if sampled else None
    busy = {"copies_done": False}

    def event() -> mock.Mock:  # as CUDA's: done until recorded, then as the copies are
        made = mock.Mock()
        made.query.side_effect = lambda: not made.record.called or busy["copies_done"]
        return made

    with (
        mock.patch.object(torch.Tensor, "pin_memory", lambda self: self),
        mock.patch.object(torch.cuda, "Event", event),
        mock.patch.object(torch.cuda, "CUDAGraph", mock.Mock),
        mock.patch.object(torch.cuda, "current_stream", lambda device: None),
    ):
        graph = _Graph(layout, graphs.max_rows, graphs.kv, sampling, torch.zeros(40, 8))
        graphs.graphs[(layout, sampling)] = graph
        mirrors = graph.hosts.mirrors
        assert len(mirrors) == 2
        assert all(
            floats.numel() == (sum(sampling.sizes) if sampling else 0) for _, floats in mirrors
        )
        turns = []
        for _ in range(HOST_MIRRORS + 2):
            host, _, floats = graphs.host_arrays(layout, sampling)
            graph.hosts.copied(graphs.kv.device)  # as `run` does once its copy is queued
            turns.append(graph.hosts.turn)
            assert np.shares_memory(host, graph.hosts.current[0].numpy())
            assert bool(floats) == sampled
        # the two made first, then one more each time the next is still queued, then in turn
        assert turns == [1, 0, *range(2, HOST_MIRRORS), 0, 1]
        assert len(mirrors) == HOST_MIRRORS
        assert all(
            floats.numel() == (sum(sampling.sizes) if sampling else 0) for _, floats in mirrors
        )
        busy["copies_done"] = True  # nothing queued: the mirrors in turn, none made
        for _ in range(3):
            graphs.host_arrays(layout, sampling)
        assert len(mirrors) == HOST_MIRRORS
