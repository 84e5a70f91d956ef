"""Sheaf maths against independent oracles (notes/numerical-checks.md, s11 items 1-5)."""

import networkx as nx
import pytest
import torch

from flwr_sheaf.paper import PAPER_ZOO_15
from flwr_sheaf.sheaf import EdgeTerm, NetworkSheaf, local_gluing_penalty, orient_edge, procrustes


def _orthogonal(d, det_sign, gen):
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if torch.sign(torch.linalg.det(q)) != det_sign:
        q[:, 0] = -q[:, 0]
    return q


@pytest.mark.parametrize("det_sign", [1.0, -1.0])
def test_procrustes_recovers_known_orthogonal_map(det_sign):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, 8, generator=gen, dtype=torch.float64)
    q = _orthogonal(8, det_sign, gen)
    assert torch.sign(torch.linalg.det(q)) == det_sign
    v = procrustes(x @ q.T, x)  # head rows z_h = Q z_t
    assert torch.allclose(v, q, atol=1e-10)


def test_procrustes_recovers_stiefel_embedding_from_anisotropic_pilots():
    gen = torch.Generator().manual_seed(1)
    scales = torch.linspace(0.2, 3.0, 5, dtype=torch.float64)
    a_t = torch.randn(300, 5, generator=gen, dtype=torch.float64) * scales
    s, _ = torch.linalg.qr(torch.randn(12, 5, generator=gen, dtype=torch.float64))
    a_h = a_t @ s.T
    v = procrustes(a_h, a_t)
    assert v.shape == (12, 5)
    assert torch.allclose(v.T @ v, torch.eye(5, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(v, s, atol=1e-10)
    assert torch.linalg.norm(a_h - a_t @ v.T) < 1e-10


def test_procrustes_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        procrustes(torch.full((4, 3), float("nan")), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="same rows"):
        procrustes(torch.zeros(4, 3), torch.zeros(5, 2))
    with pytest.raises(ValueError, match="orientation"):
        procrustes(torch.zeros(4, 2), torch.zeros(4, 3))


def test_orientation_rule_and_paper_orientations():
    assert orient_edge(0, 64, 1, 128) == (1, 0)
    assert orient_edge(3, 128, 0, 128) == (3, 0)  # tie: larger partition-id is head
    dims = {i: a.d for i, a in enumerate(PAPER_ZOO_15)}
    # A few head->tail pairs of docs/paper.md, s8, including both ties.
    for h, t in [(3, 0), (12, 9), (6, 1), (11, 4), (14, 2), (7, 0), (1, 14)]:
        assert orient_edge(t, dims[t], h, dims[h]) == (h, t)


def test_total_variation_zero_on_global_section_and_grows_by_known_amount():
    gen = torch.Generator().manual_seed(2)
    g = nx.path_graph(4)  # 0-1-2-3, equal dims: every map orthogonal, propagation is exact
    dims = {0: 4, 1: 4, 2: 4, 3: 4}
    sheaf = NetworkSheaf(g, dims)
    for e in sheaf.edges:
        sheaf.maps[e] = _orthogonal(4, 1.0, gen)
    z = {0: torch.randn(4, generator=gen, dtype=torch.float64)}
    for a, b in [(0, 1), (1, 2), (2, 3)]:
        h, t = orient_edge(a, 4, b, 4)
        v = sheaf.maps[(h, t)]
        z[b] = v @ z[a] if b == h else v.T @ z[a]
    assert float(sheaf.total_variation(z)) < 1e-20
    delta = torch.randn(4, generator=gen, dtype=torch.float64)
    for node, deg in [(1, 2), (3, 1)]:
        zp = dict(z)
        zp[node] = z[node] + delta
        # orthogonal maps preserve norms, so each incident edge grows by ||delta||^2
        assert float(sheaf.total_variation(zp)) == pytest.approx(
            deg * float(delta @ delta), rel=1e-10
        )


def test_laplacian_symmetric_psd_with_expected_kernel_on_tree():
    gen = torch.Generator().manual_seed(3)
    g = nx.Graph([(0, 1), (1, 2), (2, 3), (2, 4)])
    dims = {0: 3, 1: 3, 2: 3, 3: 3, 4: 3}
    sheaf = NetworkSheaf(g, dims)
    for e in sheaf.edges:
        sheaf.maps[e] = _orthogonal(3, 1.0, gen)
    lap = sheaf.laplacian()
    assert torch.allclose(lap, lap.T)
    ev = torch.linalg.eigvalsh(lap)
    assert ev.min() > -1e-10
    # Tree with invertible (orthogonal) maps: global sections = free choice at one node -> dim 3.
    assert int((ev.abs() < 1e-9).sum()) == 3
    # Laplacian quadratic form equals total variation.
    z = torch.randn(15, generator=gen, dtype=torch.float64)
    zd = {n: z[3 * n : 3 * n + 3] for n in range(5)}
    assert float(z @ lap @ z) == pytest.approx(float(sheaf.total_variation(zd)), rel=1e-10)


def test_laplacian_kernel_with_stiefel_maps_on_tree():
    # Star with a low-dimensional centre: z_centre free (dim 2), each head fixed to V z_centre.
    gen = torch.Generator().manual_seed(4)
    g = nx.Graph([(0, 1), (0, 2)])
    dims = {0: 2, 1: 4, 2: 3}
    sheaf = NetworkSheaf(g, dims)
    for h, t in sheaf.edges:
        sheaf.maps[(h, t)], _ = torch.linalg.qr(
            torch.randn(dims[h], dims[t], generator=gen, dtype=torch.float64)
        )
    ev = torch.linalg.eigvalsh(sheaf.laplacian())
    assert int((ev.abs() < 1e-9).sum()) == 2


def test_local_penalty_matches_eq16_and_sums_to_twice_tv_share():
    gen = torch.Generator().manual_seed(5)
    k = 7
    a_i = torch.randn(k, 4, generator=gen, dtype=torch.float64)
    a_j = torch.randn(k, 3, generator=gen, dtype=torch.float64)  # i head of (i, j)
    a_m = torch.randn(k, 6, generator=gen, dtype=torch.float64)  # i tail of (m, i)
    v_ij, _ = torch.linalg.qr(torch.randn(4, 3, generator=gen, dtype=torch.float64))
    v_mi, _ = torch.linalg.qr(torch.randn(6, 4, generator=gen, dtype=torch.float64))
    lam = 0.3
    pen, per_edge = local_gluing_penalty(
        a_i, [EdgeTerm(1, a_j, v_ij, True), EdgeTerm(2, a_m, v_mi, False)], lam
    )
    # Hand evaluation of Eq. 16 with column-wise A (d x K): ||A_i - V A_j||, ||A_m - V A_i||.
    ai, aj, am = a_i.T, a_j.T, a_m.T
    expect = (lam / 4) / (2 * k) * (((ai - v_ij @ aj) ** 2).sum() + ((am - v_mi @ ai) ** 2).sum())
    assert float(pen) == pytest.approx(float(expect), rel=1e-12)
    assert per_edge[1] == pytest.approx(float(((ai - v_ij @ aj) ** 2).sum()) / k)


def test_local_penalty_gradient_only_to_own_pilots_and_errors():
    a_i = torch.randn(5, 3, requires_grad=True)
    a_j = torch.randn(5, 3, requires_grad=True)
    pen, _ = local_gluing_penalty(a_i, [EdgeTerm(1, a_j, torch.eye(3), False)], 1.0)
    pen.backward()
    assert a_i.grad is not None and a_i.grad.abs().sum() > 0
    assert a_j.grad is None
    with pytest.raises(ValueError, match="neighbour 1"):
        local_gluing_penalty(a_i, [EdgeTerm(1, torch.randn(4, 3), torch.eye(3), True)], 1.0)
    with pytest.raises(ValueError, match="map shape"):
        local_gluing_penalty(a_i, [EdgeTerm(1, torch.randn(5, 2), torch.eye(2), True)], 1.0)
    with pytest.raises(ValueError, match="NaN"):
        local_gluing_penalty(
            a_i, [EdgeTerm(1, torch.full((5, 3), float("inf")), torch.eye(3), True)], 1.0
        )


def test_paper_graph_orientations_match_the_reference_list():
    """All 42 head->tail pairs of the paper's class-overlap graph (docs/paper.md, s8)."""
    from flwr_sheaf.paper import PAPER_CLASS_SETS_15
    from flwr_sheaf.topology import class_overlap_graph

    listed = (
        "0→5, 0→9, 0→12, 0→13, 1→2, 1→4, 1→5, 1→8, 1→10, 1→14, 3→0, 3→5, 3→9, 3→12, 3→13, 4→2, 4→3, "
        "4→14, 5→2, 5→12, 6→0, 6→1, 6→2, 6→5, 6→7, 6→10, 6→12, 7→0, 7→2, 7→3, 7→5, 7→12, 8→0, 8→2, "
        "10→2, 10→5, 11→1, 11→2, 11→4, 12→2, 12→9, 14→2"
    )
    expected = {tuple(int(x) for x in pair.split("→")) for pair in listed.split(", ")}
    g = class_overlap_graph(PAPER_CLASS_SETS_15)
    sheaf = NetworkSheaf(g, {i: a.d for i, a in enumerate(PAPER_ZOO_15)})
    assert len(expected) == 42
    assert set(sheaf.edges) == expected


def test_coboundary_refuses_a_self_loop_in_dense_and_sparse_form():
    # a self-loop's two blocks would overlap (I - V at one node); an edge joins two different nodes
    from flwr_sheaf.sheaf.network import coboundary

    for sparse in (False, True):
        with pytest.raises(ValueError, match="edge 0->0 is a self-loop"):
            coboundary({(0, 0): torch.eye(2)}, {0: 2}, [(0, 0)], sparse=sparse)
