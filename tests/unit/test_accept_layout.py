"""The padded layouts of the verifier's acceptance graphs (verifier/accept_graphs.py; the graphs
themselves run on a GPU: tests/gpu/test_accept_graphs.py): which round gets which graph, and the
host array's parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsplit.kv_cache import KVCache
from verifier.accept_graphs import MIN_PAGES, AcceptGraphs, Layout


@pytest.fixture
def graphs() -> AcceptGraphs:
    kv = KVCache(1, 1, 16, 8, 16, torch.float32, "cpu")
    return AcceptGraphs(kv, batch_sizes=[1, 2, 4, 8], max_rows=8 * 5)


def test_a_round_takes_the_next_bucket_and_power_of_two_widths(graphs) -> None:
    assert graphs.layout(1, 3, 5) == Layout(1, 4, MIN_PAGES)
    assert graphs.layout(3, 4, 9) == Layout(4, 4, 16)
    assert graphs.layout(8, 4, 33) == Layout(8, 4, 64)
    assert graphs.layout(5, 0, 1) == Layout(8, 0, MIN_PAGES)  # no trees: decode rounds too


def test_trees_cut_short_share_the_full_trees_graph(graphs) -> None:
    """A 16-node tree and the shorter ones near max_new_tokens (capped spec) use one graph."""
    assert {graphs.layout(2, n, 4) for n in (9, 12, 13, 16)} == {Layout(2, 16, MIN_PAGES)}
    assert [graphs.layout(1, n, 4).width for n in (1, 2, 5, 8)] == [1, 2, 8, 8]


def test_rounds_past_the_graphs_run_eagerly(graphs) -> None:
    assert graphs.layout(9, 1, 4) is None  # more sequences than the largest bucket
    assert graphs.layout(8, 5, 4) is None  # 8 x 6 logits rows > 40


def test_host_array_parts_are_views_with_padding_parents() -> None:
    layout = Layout(bucket=4, width=3, pages=8)
    host, (rows, draft, parents, base, table) = layout.host_arrays()
    assert [part.shape for part in (rows, draft, parents, base, table)] == [
        tuple(shape) for shape in layout.shapes
    ]
    assert host.size == sum(layout.sizes) and host.dtype == np.int64
    assert (parents == -2).all() and not draft.any()  # padding: nothing accepted, no moves
    rows[1, 2] = 7
    table[3, 5] = 9
    assert 7 in host and 9 in host  # writes land in the one array that travels
