"""Sparse graphs for many agents: ``random-regular:<k>`` and ``class-overlap-knn:<k>``."""

from __future__ import annotations

import time

import networkx as nx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    from flwr_sheaf.topology import MAX_GRAPH_EDGES, build_graph

    # class-overlap builds all pairs, then keeps floor(0.4 * pairs): 1.4 pairs <= the cap up to N=845
    n = 846
    assert 1.4 * n * (n - 1) / 2 > MAX_GRAPH_EDGES >= 1.4 * (n - 1) * (n - 2) / 2
    cs = [s.classes for s in zoo_specs(f"tiny-{n}")]
    with pytest.raises(
        ValueError,
        match=rf"N={n} agents builds .* = 500409 edges.*more than {MAX_GRAPH_EDGES} .* refused.*"
        r"class-overlap-knn:4.*random-regular:4.*ring",
    ):
        build_graph("class-overlap", n, cs)
    assert build_graph("class-overlap", 40, cs[:40]).number_of_nodes() == 40


#: Each form with parameters and an N whose edges pass the cap; the dense ones spelled as k = N - 1.
TOO_LARGE = [
    ("complete", 1001),
    ("class-overlap", 846),
    ("class-overlap:1", 708),
    ("random-regular:1999", 2000),
    ("class-overlap-knn:1999", 2000),
    ("random-regular:1000", 1000),
]


@pytest.mark.parametrize("spec, n", TOO_LARGE)
def test_every_dense_graph_is_refused_from_its_parameters_before_it_is_built(monkeypatch, spec, n):
    # before: random-regular:1999 on 2,000 agents built for 150 s and 1.4 GiB, class-overlap-knn:1999
    # 39 s / 1.6 GiB, while complete on 1,001 agents was refused at once
    import networkx as nx

    from flwr_sheaf import topology
    from flwr_sheaf.topology import MAX_GRAPH_EDGES, build_graph

    def built(*a, **k):
        raise AssertionError("the graph was built before the refusal")

    for name in ("random_regular_graph", "complete_graph", "Graph"):
        monkeypatch.setattr(nx, name, built)
    monkeypatch.setattr(topology, "_class_matrix", built)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"more than {MAX_GRAPH_EDGES} .*refused.*ring"):
        build_graph(spec, n, [[0, 1]] * n)
    assert time.perf_counter() - t0 < 0.5


@given(
    form=st.sampled_from(
        ["complete", "ring", "random-regular", "class-overlap-knn", "class-overlap"]
    ),
    n=st.integers(2, 40),
    k=st.integers(1, 39),
    density=st.sampled_from([0.2, 0.4, 0.7, 1.0]),
    seed=st.integers(0, 5),
)
def test_the_edge_estimate_bounds_the_graph_built(form, n, k, density, seed):
    from flwr_sheaf.topology import _parse_graph_spec, build_graph, edge_count

    k = min(k, n - 1)
    spec = {
        "random-regular": f"random-regular:{k}:{seed}",
        "class-overlap-knn": f"class-overlap-knn:{k}:{seed}",
        "class-overlap": f"class-overlap:{density}",
    }.get(form, form)
    rng = np.random.default_rng(seed)
    sets = [sorted(rng.choice(10, size=3, replace=False).tolist()) for _ in range(n)]
    try:
        graph = build_graph(spec, n, sets)
    except ValueError as exc:  # odd N k, a matching, a budget below a tree: refused by the builder
        assert "random-regular" in str(exc) or "edge budget" in str(exc)
        return
    edges, _ = edge_count(*_parse_graph_spec(spec), n)
    pairs = n * (n - 1) // 2
    exact = {"complete": pairs, "ring": min(n, pairs), "random-regular": n * k // 2}
    if form in exact:
        assert graph.number_of_edges() == edges == exact[form]
    else:  # knn: each agent adds <= k edges, + joins; class-overlap: all pairs built, a share kept
        assert graph.number_of_edges() <= edges


def _brute_force_joins(edges, cs, n):
    """The previous definition's component joins, agent by agent ((|A|, |B|) overlap blocks)."""
    m = np.zeros((n, 1 + max(max(c) for c in cs)), dtype=np.int64)
    for i, c in enumerate(cs):
        m[i, list(c)] = 1
    g = nx.Graph()
    g.add_nodes_from(range(n))
    g.add_edges_from(edges)
    components = sorted((sorted(c) for c in nx.connected_components(g)), key=lambda c: c[0])
    main, joins = set(components[0]), []
    for comp in components[1:]:
        a, b = np.array(sorted(main)), np.array(comp)
        w = m[a] @ m[b].T
        ia, ib = np.unravel_index(int(np.argmax(w)), w.shape)
        joins.append((int(a[ia]), int(b[ib])))
        main.update(comp)
    return joins


@pytest.mark.parametrize("seed", range(6))
def test_grouped_knn_equals_the_brute_force_definition(seed):
    """Issue 34 case 4: the grouped builder (no N x N array) gives the definition's graph: every
    agent's k picks reach its k best overlaps (brute force over all pairs), are distinct peers, and
    the graph is their union plus the component joins of the agent-by-agent definition."""
    from flwr_sheaf.topology import _knn_choices

    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(8, 60)), int(rng.integers(1, 5))
    # few distinct sets (many ties), some disjoint so that components form
    pool = [(0, 1), (0, 1, 2), (2, 3), (5,), (5, 6), (7, 8, 9), (1, 2, 3)]
    cs = [pool[int(rng.integers(0, len(pool)))] for _ in range(n)]
    m = np.zeros((n, 10), dtype=np.int64)
    for i, c in enumerate(cs):
        m[i, list(c)] = 1
    brute = m @ m.T
    distinct, set_id = np.unique(m, axis=0, return_inverse=True)
    src, dst = _knn_choices(
        set_id.reshape(-1), distinct @ distinct.T, k, np.random.default_rng([0, 7])
    )
    assert src.size == n * k
    for i in range(n):
        picks = dst[src == i]
        assert len(set(picks.tolist())) == k and i not in picks
        best = sorted((brute[i, j] for j in range(n) if j != i), reverse=True)[:k]
        assert sorted(brute[i, picks], reverse=True) == best
    g = class_overlap_knn_graph(cs, k, seed=0)
    picked = {tuple(sorted(e)) for e in zip(src.tolist(), dst.tolist())}
    joins = {tuple(sorted(e)) for e in _brute_force_joins(picked, cs, n)}
    assert {tuple(sorted(e)) for e in g.edges} == picked | joins
    assert nx.is_connected(g)
    for u, v, w in g.edges(data="weight"):
        assert w == brute[u, v]


def test_tie_draws_are_uniform_over_the_peers():
    """The draws among a tied level are uniform without replacement, the agent itself excluded."""
    from collections import Counter

    from flwr_sheaf.topology import _draw_without_replacement

    rows = 6000
    own = np.full((rows, 1), 2)
    picks = _draw_without_replacement(np.random.default_rng(1), 5, 2, [own], rows)
    assert not (picks == 2).any() and (picks[:, 0] != picks[:, 1]).all()
    counts = Counter(tuple(sorted(p)) for p in picks.tolist())
    assert len(counts) == 6  # the C(4, 2) pairs of the 4 peers
    assert all(abs(c - rows / 6) < 0.1 * rows / 6 for c in counts.values())


def _build_cost(n):
    import time
    import tracemalloc

    cs = [s.classes for s in zoo_specs(f"tiny-{n}")]
    tracemalloc.start()
    t0 = time.perf_counter()
    g = build_graph("class-overlap-knn:4", n, class_sets=cs)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert nx.is_connected(g) and min(d for _, d in g.degree()) >= 4
    return seconds, peak


def test_knn_graph_build_is_near_linear_in_time_and_memory():
    """Issue 34 case 4: 20,000 agents (class-overlap-knn:4) build in seconds with a peak memory
    about 4x that of 5,000 agents (linear), not 16x (an N x N array: 3.2 GB at 20,000)."""
    t_small, peak_small = _build_cost(5000)
    t_big, peak_big = _build_cost(20000)
    assert peak_big < 6 * peak_small, (peak_small, peak_big)
    assert peak_big < 150e6, peak_big
    assert t_big < 20.0, t_big


@pytest.mark.parametrize("graph", ["complete", "class-overlap", "class-overlap:0.1"])
def test_dense_graph_on_a_huge_zoo_is_refused_at_once_with_bounded_memory(graph):
    """Issue 34 case 4: a dense graph on zoo=tiny-100000 is refused from N alone, in well under a
    second, before the zoo's agents (or anything of size N^2) are built."""
    import time
    import tracemalloc

    from flwr_sheaf.config import ConfigError, RunConfig

    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"graph=.*N=100000.*refused.*class-overlap-knn:4"):
        RunConfig.from_run_config({"zoo": "tiny-100000", "graph": graph})  # parsing checks it
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 1.0 and peak < 5e6, (seconds, peak)


def test_knn_refuses_too_many_distinct_class_sets_by_name():
    from flwr_sheaf.topology import KNN_MAX_CLASS_SETS

    cs = [
        tuple(int(b) for b in np.flatnonzero([(i >> j) & 1 for j in range(13)])) or (13,)
        for i in range(KNN_MAX_CLASS_SETS + 1)
    ]
    with pytest.raises(
        ValueError, match=rf"{KNN_MAX_CLASS_SETS + 1} distinct class sets.*random-regular:4"
    ):
        class_overlap_knn_graph(cs, 4)
