"""bench/graph_probe.py reads a CUDA graph's DOT dump (cudaGraphDebugDotPrint's format, as torch
2.11 / CUDA 13 writes it): node types counted, edges, forks and joins."""

from __future__ import annotations

from pathlib import Path

from bench.graph_probe import dot_summary


def node(i: int, kind: str) -> str:
    return (
        f'"graph_1_node_{i}"[style="bold" shape="record" label="{{{kind}\n'
        f"| {{ID | {i} (topoId: {i}) | _ZN2at6native6kernel\\<\\<\\<1,128,0\\>\\>\\>}}\n"
        '| {cooperative | 0}\n}"];\n'
    )


def test_a_dot_dump_is_summed_up_by_node_type_edges_forks_and_joins(tmp_path: Path) -> None:
    path = tmp_path / "graph.dot"
    body = node(0, "KERNEL") + node(1, "MEMCPY") + node(2, "KERNEL") + node(3, "KERNEL")
    edges = [(0, 1), (0, 2), (1, 3), (2, 3)]  # a fork at 0, a join at 3
    body += "".join(f'"graph_1_node_{a}" -> "graph_1_node_{b}";\n' for a, b in edges)
    path.write_text(f'digraph dot {{\nsubgraph cluster_1 {{\nlabel="graph_1";\n{body}}}\n}}\n')
    assert dot_summary(str(path)) == ("4 nodes (KERNEL:3 MEMCPY:1), 4 edges, 1 forks, 1 joins")


def test_a_straight_line_of_kernels_has_no_fork_or_join(tmp_path: Path) -> None:
    path = tmp_path / "line.dot"
    body = "".join(node(i, "KERNEL") for i in range(3))
    body += '"graph_1_node_0" -> "graph_1_node_1";\n"graph_1_node_1" -> "graph_1_node_2";\n'
    path.write_text(f"digraph dot {{\n{body}}}\n")
    assert dot_summary(str(path)) == "3 nodes (KERNEL:3), 2 edges, 0 forks, 0 joins"
