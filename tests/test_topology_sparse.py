"""Sparse graphs for many agents: ``random-regular:<k>`` and ``class-overlap-knn:<k>``."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from flwr_sheaf.models.zoo import zoo_specs
from flwr_sheaf.paper import PAPER_CLASS_SETS_15
from flwr_sheaf.topology import build_graph, class_overlap_knn_graph, random_regular_graph


@pytest.mark.parametrize("n", [15, 100, 1000])
def test_random_regular_is_connected_regular_and_seeded(n):
    g = build_graph("random-regular:4", n)
    assert sorted(g.nodes) == list(range(n)) and nx.is_connected(g)
    assert {d for _, d in g.degree()} == {4}
    assert g.number_of_edges() == 2 * n
    assert sorted(g.edges) == sorted(build_graph("random-regular:4", n).edges)
    assert sorted(g.edges) != sorted(build_graph("random-regular:4:1", n).edges)


def test_random_regular_errors_are_named():
    with pytest.raises(ValueError, match="even"):
        random_regular_graph(15, 3)
    with pytest.raises(ValueError, match="exceeds"):
        random_regular_graph(5, 5)
    with pytest.raises(ValueError, match="perfect matching"):
        random_regular_graph(10, 1)
    with pytest.raises(ValueError, match="not integers"):
        build_graph("random-regular:x", 10)
    with pytest.raises(ValueError, match="expected"):
        build_graph("random-regular:4:1:2", 10)
    assert random_regular_graph(2, 1).number_of_edges() == 1
    assert random_regular_graph(1, 3).number_of_nodes() == 1


def _overlap(cs, i, j):
    return len(set(cs[i]) & set(cs[j]))


@pytest.mark.parametrize("n", [15, 100, 300, 1000])
def test_class_overlap_knn_picks_best_overlaps_and_is_connected(n):
    cs = [s.classes for s in zoo_specs(f"tiny-{n}")]
    k = 4
    g = build_graph(f"class-overlap-knn:{k}", n, class_sets=cs)
    assert sorted(g.nodes) == list(range(n)) and nx.is_connected(g)
    assert min(d for _, d in g.degree()) >= k
    assert g.number_of_edges() <= n * k + n  # k per node, plus at most one bridge per component
    for i in range(0, n, max(1, n // 50)):
        ov = sorted((_overlap(cs, i, j) for j in range(n) if j != i), reverse=True)
        kth_best = ov[k - 1]
        chosen = [j for j in g.neighbors(i) if _overlap(cs, i, j) >= kth_best]
        assert len(chosen) >= k  # i's own k picks all reach the k-th best overlap
    for u, v, data in g.edges(data=True):
        assert data["weight"] == _overlap(cs, u, v)
    assert sorted(g.edges) == sorted(build_graph(f"class-overlap-knn:{k}", n, class_sets=cs).edges)


def test_class_overlap_knn_ties_are_random_not_by_index():
    cs = [(0, 1, 2)] * 40  # everyone identical: all ties
    g = class_overlap_knn_graph(cs, 3, seed=0)
    assert nx.is_connected(g)
    assert any(abs(u - v) > 3 for u, v in g.edges)  # not a band of nearest indices
    assert sorted(g.edges) != sorted(class_overlap_knn_graph(cs, 3, seed=1).edges)


def test_class_overlap_knn_bridges_disjoint_groups():
    cs = [(0, 1)] * 6 + [(5, 6)] * 6  # two groups with no shared class
    g = class_overlap_knn_graph(cs, 2)
    assert nx.is_connected(g)
    bridges = [(u, v) for u, v in g.edges if (u < 6) != (v < 6)]
    assert len(bridges) == 1 and g.edges[bridges[0]]["weight"] == 0


def test_class_overlap_knn_on_the_paper_zoo_and_errors():
    g = build_graph("class-overlap-knn:3", 15, class_sets=PAPER_CLASS_SETS_15)
    assert nx.is_connected(g) and min(d for _, d in g.degree()) >= 3
    with pytest.raises(ValueError, match="class_sets"):
        build_graph("class-overlap-knn:3", 15)
    with pytest.raises(ValueError, match="degree k"):
        build_graph("class-overlap-knn:0", 15, class_sets=PAPER_CLASS_SETS_15)
    with pytest.raises(ValueError, match="empty"):
        class_overlap_knn_graph([(0,), ()], 1)
    assert class_overlap_knn_graph([(0, 1)], 1).number_of_nodes() == 1


def test_sparse_graph_build_is_fast_at_one_thousand_agents():
    import time

    cs = [s.classes for s in zoo_specs("tiny-1000")]
    t0 = time.perf_counter()
    build_graph("class-overlap-knn:6", 1000, class_sets=cs)
    build_graph("random-regular:6", 1000)
    assert time.perf_counter() - t0 < 5.0


def test_dense_class_overlap_graph_is_refused_for_many_agents_with_the_sparse_ones_named():
    from flwr_sheaf.topology import CLASS_OVERLAP_MAX_NODES, build_graph

    n = CLASS_OVERLAP_MAX_NODES + 1
    cs = [s.classes for s in zoo_specs(f"tiny-{n}")]
    with pytest.raises(
        ValueError,
        match=rf"N={n} agents.*refused above N={CLASS_OVERLAP_MAX_NODES}.*"
        r"class-overlap-knn:4.*random-regular:4.*ring",
    ):
        build_graph("class-overlap", n, cs)
    assert (
        build_graph("class-overlap", CLASS_OVERLAP_MAX_NODES, cs[:-1]).number_of_nodes()
        == CLASS_OVERLAP_MAX_NODES
    )


def test_knn_graph_from_distinct_class_sets_equals_the_row_by_row_definition():
    """The grouped computation gives the graph of the definition: each agent's k best overlaps (ties
    broken by the seeded jitter), recomputed here with the plain (N, C) product per row."""
    import networkx as nx

    from flwr_sheaf.topology import class_overlap_knn_graph

    cs = [s.classes for s in zoo_specs("tiny-60")]
    m = np.zeros((60, 10), dtype=np.int64)
    for i, c in enumerate(cs):
        m[i, list(c)] = 1
    rng = np.random.default_rng([3, 7])
    ref = nx.Graph()
    ref.add_nodes_from(range(60))
    for i in range(60):
        w = m @ m[i]
        score = w + 0.5 * rng.random(60)
        score[i] = -np.inf
        for j in np.argpartition(-score, 3)[:4]:
            ref.add_edge(i, int(j), weight=int(w[j]))
    g = class_overlap_knn_graph(cs, 4, seed=3)
    assert set(ref.edges(data="weight")) <= set(g.edges(data="weight"))
    # beyond the k-NN picks only the edges joining the components (one per extra component)
    assert g.number_of_edges() - ref.number_of_edges() == nx.number_connected_components(ref) - 1
