"""Homogeneous (Alg. 2) and stringent-privacy (Alg. 3/4) map steps against Alg. 1 (float64 maths, notes/variants-privacy.md)."""

import networkx as nx
import pytest
import torch

from flwr_sheaf.sheaf import (
    Received,
    SvdCounter,
    edge_terms,
    init_map,
    local_gluing_penalty,
    orient_edge,
    outgoing_pilots,
    procrustes,
    resolve_variant,
)

K, LAM = 40, 0.7


def _pilots(dims, seed):
    gen = torch.Generator().manual_seed(seed)
    return {i: torch.randn(K, d, generator=gen, dtype=torch.float64) for i, d in dims.items()}


def _roles(graph, dims):
    """{i: [(j, i_is_head)]} with the library's orientation."""
    out = {i: [] for i in graph.nodes}
    for a, b in graph.edges:
        h, _ = orient_edge(a, dims[a], b, dims[b])
        out[a].append((b, h == a))
        out[b].append((a, h == b))
    return {i: sorted(v) for i, v in out.items()}


def _penalty_and_grad(a_i, terms):
    x = a_i.clone().requires_grad_(True)
    pen, _ = local_gluing_penalty(x, terms, LAM)
    (g,) = torch.autograd.grad(pen, x)
    return float(pen.detach()), g


def _standard(pilots, roles, variant):
    """Per-node (penalty, gradient) of Alg. 1 / Alg. 2 through the library's two-step protocol."""
    if variant == "heterogeneous":
        res = {}
        for i, nb in roles.items():
            terms, _ = edge_terms(
                pilots[i], [Received(j, pilots[j], hd) for j, hd in nb], variant, "standard"
            )
            res[i] = _penalty_and_grad(pilots[i], terms)
        return res
    # homogeneous: each tail fits O on the head's raw pilots (its term) and transports its pilots with it
    tail_terms, sent = {}, {}
    for i, nb in roles.items():
        tail_terms[i], maps = edge_terms(
            pilots[i], [Received(j, pilots[j], hd) for j, hd in nb if not hd], variant, "standard"
        )
        send_raw, out = outgoing_pilots(
            pilots[i], maps, [j for j, _ in nb], [hd for _, hd in nb], variant, "standard"
        )
        assert send_raw == any(hd for _, hd in nb)
        sent.update({(i, j): m for j, m in out.items()})
    # ... and each head uses the tail's transported pilots with the identity (no SVD)
    res = {}
    for i, nb in roles.items():
        head_terms, maps = edge_terms(
            pilots[i], [Received(j, sent[(j, i)], hd) for j, hd in nb if hd], variant, "standard"
        )
        assert maps == {}
        res[i] = _penalty_and_grad(pilots[i], tail_terms[i] + head_terms)
    return res


def test_resolve_variant():
    assert resolve_variant("auto", {0: 8, 1: 8}) == "homogeneous"
    assert resolve_variant("auto", {0: 8, 1: 16}) == "heterogeneous"
    assert resolve_variant("heterogeneous", {0: 8, 1: 8}) == "heterogeneous"
    with pytest.raises(ValueError, match=r"equal stalk dimensions.*\{0: 8, 1: 16\}"):
        resolve_variant("homogeneous", {0: 8, 1: 16})


def test_homogeneous_equals_heterogeneous_with_half_the_svds():
    graph = nx.cycle_graph(5)
    graph.add_edge(0, 2)
    dims = {i: 6 for i in graph.nodes}
    pilots = _pilots(dims, 0)
    roles = _roles(graph, dims)
    with SvdCounter() as het_svds:
        het = _standard(pilots, roles, "heterogeneous")
    with SvdCounter() as hom_svds:
        hom = _standard(pilots, roles, "homogeneous")
    e = graph.number_of_edges()
    assert (het_svds.n, hom_svds.n) == (2 * e, e)
    for i in graph.nodes:
        assert abs(het[i][0] - hom[i][0]) <= 1e-10 * max(1.0, abs(het[i][0]))
        assert torch.allclose(het[i][1], hom[i][1], atol=1e-10, rtol=0)
        assert het[i][0] > 0


def _stiefel(rows, cols, seed):
    return init_map(rows, cols, (seed, 99))


@pytest.mark.parametrize(
    "dims,i",
    [({0: 5, 1: 9, 2: 7, 3: 5}, 0), ({0: 5, 1: 9, 2: 7, 3: 5}, 1), ({0: 6, 1: 6, 2: 6, 3: 6}, 0)],
)
def test_eq42_gradient_equals_standard_gradient(dims, i):
    """App. F identity (a): with i's own map at its P2c/P2d optimum, Eq. 42 = Eq. 19 for any sender maps.

    Node 0 of the first graph is a tail on every edge (P2d, Stiefel), node 1 a head on both of its
    edges with narrower tails (P2c on a rank-deficient cross-covariance), the third case is Alg. 4."""
    graph = nx.Graph([(0, 1), (0, 2), (0, 3), (1, 2)])
    pilots = _pilots(dims, 3)
    roles = _roles(graph, dims)
    std_terms, _ = edge_terms(
        pilots[i], [Received(j, pilots[j], hd) for j, hd in roles[i]], "heterogeneous", "standard"
    )
    std = _penalty_and_grad(pilots[i], std_terms)
    rec = []
    for j, hd in roles[i]:
        d_e = max(dims[i], dims[j])
        t = _stiefel(d_e, dims[j], 10 + j)  # the sender's secret map X_ij
        rec.append(Received(j, pilots[j] @ t.T, hd))
    with SvdCounter() as c:
        terms, maps = edge_terms(pilots[i], rec, "heterogeneous", "stringent")
    assert c.n == len(rec)
    for j, _hd in roles[i]:
        x = maps[j]
        assert x.shape == (max(dims[i], dims[j]), dims[i])
        assert torch.allclose(x.T @ x, torch.eye(dims[i], dtype=torch.float64), atol=1e-12)
    strict = _penalty_and_grad(pilots[i], terms)
    assert abs(std[0] - strict[0]) <= 1e-8 * max(1.0, std[0])
    assert torch.allclose(std[1], strict[1], atol=1e-8, rtol=0)
    # and a non-optimal own map gives a different (larger) penalty: the equality is not vacuous
    bad = [type(t)(t.neighbour, t.pilots, _stiefel(*t.v.shape, 77), False) for t in terms]
    assert _penalty_and_grad(pilots[i], bad)[0] > std[0] + 1e-3


def test_prop_f1_rotated_latents_give_identical_messages():
    """Prop. F.1: A and Q A (Q orthogonal) produce the same transported pilots, before and after P2c/P2d."""
    gen = torch.Generator().manual_seed(5)
    d_i, d_j = 6, 9
    a = torch.randn(K, d_i, generator=gen, dtype=torch.float64)
    q = init_map(d_i, d_i, (1, 2, 3))
    a_rot = a @ q.T  # rows of Q A
    x = init_map(d_j, d_i, (4, 5))  # i's map toward j (i tail, d_e = d_j)
    _, m1 = outgoing_pilots(a, {1: x}, [1], [False], "heterogeneous", "stringent")
    _, m2 = outgoing_pilots(a_rot, {1: x @ q.T}, [1], [False], "heterogeneous", "stringent")
    assert torch.allclose(m1[1], m2[1], atol=1e-12)
    assert not torch.allclose(a, a_rot, atol=1e-3)
    # after a map update against the same incoming message, the messages still coincide
    y = torch.randn(K, d_j, generator=gen, dtype=torch.float64)
    _, f1 = edge_terms(a, [Received(1, y, False)], "heterogeneous", "stringent")
    _, f2 = edge_terms(a_rot, [Received(1, y, False)], "heterogeneous", "stringent")
    _, n1 = outgoing_pilots(a, f1, [1], [False], "heterogeneous", "stringent")
    _, n2 = outgoing_pilots(a_rot, f2, [1], [False], "heterogeneous", "stringent")
    assert torch.allclose(n1[1], n2[1], atol=1e-10)


def test_receiver_cannot_recover_pilots_by_procrustes():
    """What j receives is A_i moved by i's secret map; aligning it to anything j holds misses A_i.

    (Aligning to A_j gives A_i in *j's* coordinates: that is what the protocol shares on purpose;
    i's own coordinates stay hidden, Prop. F.1.)"""
    gen = torch.Generator().manual_seed(7)
    d = 8
    a_i = torch.randn(K, d, generator=gen, dtype=torch.float64)
    # a correlated neighbour in its own coordinates (R_j: j's basis, unrelated to i's)
    a_j = (a_i + 0.3 * torch.randn(K, d, generator=gen, dtype=torch.float64)) @ init_map(
        d, d, (3, 3)
    ).T
    x = init_map(d, d, (11, 0, 1, 12345))
    y = a_i @ x.T
    for ref in (a_j, y, torch.eye(K, d, dtype=torch.float64)):
        est = y @ procrustes(ref, y).T  # best orthogonal move of y onto ref
        assert torch.linalg.norm(est - a_i) / torch.linalg.norm(a_i) > 0.3
    # the isometry-invariant Gram matrix is what leaks (Prop. F.1 says no more, no less)
    assert torch.allclose(y @ y.T, a_i @ a_i.T, atol=1e-10)


def test_init_map_is_orthonormal_and_keyed():
    x = init_map(9, 4, (1, 2, 3))
    assert torch.allclose(x.T @ x, torch.eye(4, dtype=torch.float64), atol=1e-12)
    assert torch.equal(x, init_map(9, 4, (1, 2, 3)))
    assert not torch.allclose(x, init_map(9, 4, (1, 2, 4)))
    with pytest.raises(ValueError, match="d_e >= d_i"):
        init_map(3, 4, (0,))


def test_bad_modes_and_shapes_are_named():
    a = torch.randn(K, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="privacy='secret'"):
        edge_terms(a, [], "heterogeneous", "secret")
    with pytest.raises(ValueError, match="must be resolved"):
        edge_terms(a, [], "auto", "standard")
    with pytest.raises(ValueError, match="neighbour 3 have d_e=2"):
        edge_terms(
            a,
            [Received(3, torch.randn(K, 2, dtype=torch.float64), True)],
            "heterogeneous",
            "stringent",
        )
    with pytest.raises(ValueError, match="no map toward neighbour partition-id 5"):
        outgoing_pilots(a, {}, [5], [True], "heterogeneous", "stringent")
