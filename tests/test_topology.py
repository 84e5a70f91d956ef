"""Topology builders (paper Sec. 6 "Network topology"); expected values from docs/paper.md, s8."""

from __future__ import annotations

from collections import Counter

import networkx as nx
import pytest

from flwr_sheaf.paper import PAPER_CLASS_SETS_15
from flwr_sheaf.topology import (
    build_graph,
    class_overlap_graph,
    complete_graph,
    edge_list_graph,
    ring_graph,
    validate_graph,
)

# docs/paper.md, s8 (measured on the reference implementation)
PAPER_MST = [(0, 3), (0, 8), (0, 12), (1, 2), (1, 14), (2, 6), (2, 10), (3, 9), (3, 13), (4, 11), (4, 14),
             (5, 6), (5, 7), (7, 12)]  # fmt: skip
PAPER_DEGREES = [8, 8, 10, 7, 5, 8, 7, 6, 3, 3, 4, 3, 7, 2, 3]


@pytest.fixture(scope="module")
def paper_graph() -> nx.Graph:
    return build_graph("class-overlap", 15, PAPER_CLASS_SETS_15)


def test_paper_graph_edge_count_and_weights(paper_graph):
    assert paper_graph.number_of_edges() == 42  # floor(0.4 * 15 * 14 / 2)
    assert Counter(d["weight"] for _, _, d in paper_graph.edges(data=True)) == {5: 11, 4: 16, 3: 15}


def test_paper_graph_weights_are_class_overlaps(paper_graph):
    for i, j, d in paper_graph.edges(data=True):
        assert d["weight"] == len(set(PAPER_CLASS_SETS_15[i]) & set(PAPER_CLASS_SETS_15[j]))


def test_paper_graph_mst_degrees_and_non_adjacency(paper_graph):
    for i, j in PAPER_MST:
        assert paper_graph.has_edge(i, j), (i, j)
    assert [paper_graph.degree(i) for i in range(15)] == PAPER_DEGREES
    assert sum(PAPER_DEGREES) == 2 * 42
    assert not paper_graph.has_edge(0, 1)
    assert sorted(paper_graph.nodes) == list(range(15))
    assert nx.is_connected(paper_graph)


def test_default_density_is_paper_density():
    g = class_overlap_graph(PAPER_CLASS_SETS_15)
    assert g.number_of_edges() == 42
    assert build_graph("class-overlap:0.4", 15, PAPER_CLASS_SETS_15).edges == g.edges


# Hand-derived toy: overlaps form a 4-cycle 0-1-2-3-0 (w = 1), diagonals w = 0.
# Kruskal over the lexicographically inserted pairs keeps (0,1), (0,3), (1,2); the next extra edge
# by (descending w, then index) is (2,3), then (0,2), then (1,3).
TOY = [(0, 1), (1, 2), (2, 3), (0, 3)]


@pytest.mark.parametrize(
    ("density", "edges"),
    [
        (0.5, {(0, 1), (0, 3), (1, 2)}),  # floor(3.0) = 3 = N - 1: the tree alone
        (0.7, {(0, 1), (0, 3), (1, 2), (2, 3)}),  # floor(4.2) = 4
        (0.84, {(0, 1), (0, 3), (1, 2), (2, 3), (0, 2)}),  # floor(5.04) = 5
        (1.0, {(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)}),
    ],
)
def test_class_overlap_toy_tie_breaking(density, edges):
    g = class_overlap_graph(TOY, density)
    assert {tuple(sorted(e)) for e in g.edges} == edges


def test_class_overlap_budget_from_density():
    # floor(0.3 * 105) = 31
    assert class_overlap_graph(PAPER_CLASS_SETS_15, 0.3).number_of_edges() == 31
    assert class_overlap_graph(PAPER_CLASS_SETS_15, 1.0).number_of_edges() == 105


@pytest.mark.parametrize("density", [0.0, -0.2, 1.5])
def test_class_overlap_bad_density(density):
    with pytest.raises(ValueError, match=str(density)):
        class_overlap_graph(PAPER_CLASS_SETS_15, density)


def test_class_overlap_budget_below_tree():
    # floor(0.1 * 105) = 10 < 14
    with pytest.raises(ValueError, match="below N - 1 = 14"):
        class_overlap_graph(PAPER_CLASS_SETS_15, 0.1)


def test_class_overlap_empty_class_set():
    with pytest.raises(ValueError, match="agent 1"):
        class_overlap_graph([(0, 1), ()])


def test_ring_complete_edge_list():
    assert {tuple(sorted(e)) for e in ring_graph(4).edges} == {(0, 1), (1, 2), (2, 3), (0, 3)}
    assert ring_graph(2).number_of_edges() == 1 and ring_graph(1).number_of_nodes() == 1
    assert complete_graph(6).number_of_edges() == 15
    g = edge_list_graph(" 0-1, 1-2 ,2-3", 4)
    assert {tuple(sorted(e)) for e in g.edges} == {(0, 1), (1, 2), (2, 3)}
    assert build_graph("ring", 5).number_of_edges() == 5
    assert build_graph("complete", 5).number_of_edges() == 10
    assert build_graph("0-1,1-2,2-3", 4).number_of_edges() == 3


@pytest.mark.parametrize(
    ("spec", "n", "match"),
    [
        ("star", 4, "'star'"),
        ("class-overlap:abc", 15, "abc"),
        ("0-0,0-1", 2, "self-loop"),
        ("0-1,1-7", 3, "node 7"),
        ("0-1,1-0", 2, "twice"),
        ("0-1,2-3", 4, r"not connected.*\[\[0, 1\], \[2, 3\]\]"),
        ("ring", 0, "positive integer"),
    ],
)
def test_build_graph_errors(spec, n, match):
    with pytest.raises(ValueError, match=match):
        build_graph(spec, n, PAPER_CLASS_SETS_15 if spec.startswith("class") else None)


def test_build_graph_class_overlap_needs_class_sets():
    with pytest.raises(ValueError, match="class_sets"):
        build_graph("class-overlap", 15)
    with pytest.raises(ValueError, match="14 class sets for 15 nodes"):
        build_graph("class-overlap", 15, PAPER_CLASS_SETS_15[:14])


def test_validate_graph_errors():
    g = nx.Graph([(0, 1), (2, 3)])
    with pytest.raises(ValueError, match=r"not connected: 2 components \[\[0, 1\], \[2, 3\]\]"):
        validate_graph(g, range(4))
    with pytest.raises(ValueError, match=r"partition id\(s\) \[4\]"):
        validate_graph(nx.path_graph(4), range(5))
    with pytest.raises(ValueError, match=r"node\(s\) \[3\]"):
        validate_graph(nx.path_graph(4), range(3))
    loop = nx.path_graph(3)
    loop.add_edge(1, 1)
    with pytest.raises(ValueError, match=r"self-loops at nodes \[1\]"):
        validate_graph(loop, range(3))
    with pytest.raises(ValueError, match="undirected"):
        validate_graph(nx.DiGraph([(0, 1)]), range(2))
    validate_graph(nx.path_graph(3), [0, 1, 2])  # a valid graph passes silently


def test_build_graph_takes_class_sets_as_a_numpy_array():
    # the public signature takes any sequence of class sets; a (N, k) array must not be truth-tested
    import numpy as np

    from flwr_sheaf.topology import build_graph

    sets = [[0, 1], [1, 2], [2, 0]]
    as_array = build_graph("class-overlap-knn:1", 3, class_sets=np.array(sets))
    assert sorted(as_array.edges) == sorted(
        build_graph("class-overlap-knn:1", 3, class_sets=sets).edges
    )
