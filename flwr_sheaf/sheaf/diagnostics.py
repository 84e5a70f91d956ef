"""Sheaf diagnostics of fitted restriction maps: Laplacian spectrum, near-kernel (approximate global
sections, paper Eq. 6, App. A), non-edge sampling (notes/variants-diagnostics.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .network import sheaf_laplacian

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "NEAR_KERNEL_RTOL",
    "DENSE_MAX_DIM",
    "LOBPCG_ITERATIONS",
    "NON_EDGE_STREAM",
    "LaplacianSpectrum",
    "laplacian_spectrum",
    "graph_algebraic_connectivity",
    "sample_non_edges",
]

#: near-kernel threshold, relative to ``trace(L) / sum_i d_i`` (eigenvalue < tol counts as a global section).
NEAR_KERNEL_RTOL = 1e-2
#: largest ``sum_i d_i`` solved densely (exact full spectrum); above it: sparse LOBPCG.
DENSE_MAX_DIM = 4096
#: iteration cap of the sparse solver (hard stop; the residual is reported).
LOBPCG_ITERATIONS = 100
#: random stream of the non-edge pair draw: ``numpy.random.default_rng([seed, NON_EDGE_STREAM, round])``.
NON_EDGE_STREAM = 3


@dataclass
class LaplacianSpectrum:
    """Smallest eigenvalues of a sheaf Laplacian and its near-kernel.

    Attributes:
        eigenvalues: the ``k`` smallest eigenvalues, ascending (round-off above ``-1e-12 * scale``
            clipped to 0).
        near_kernel_dim: eigenvalues below ``tolerance`` (among the ``k`` computed for LOBPCG).
        near_kernel_exact: False when the count may be higher (LOBPCG, all ``k`` below tolerance).
        tolerance, scale, n: ``NEAR_KERNEL_RTOL * scale``; ``trace(L) / n``; ``n = sum_i d_i``.
        kernel_bound: sum over connected components of ``min_i d_i``: the most global sections.
        solver: ``"dense"`` or ``"lobpcg"``; max_residual: largest ``||L x - mu x||`` of the
            computed pairs (0.0 for the dense solver).
    """

    eigenvalues: list[float] = field(default_factory=list)
    near_kernel_dim: int = 0
    near_kernel_exact: bool = True
    tolerance: float = float("nan")
    scale: float = float("nan")
    n: int = 0
    kernel_bound: int = 0
    solver: str = "dense"
    max_residual: float = 0.0


def laplacian_spectrum(
    maps: Mapping[tuple[int, int], torch.Tensor],
    dims: Mapping[int, int],
    edges: Sequence[tuple[int, int]],
    k: int,
    *,
    dense_max: int = DENSE_MAX_DIM,
    iterations: int = LOBPCG_ITERATIONS,
    seed: int = 0,
) -> LaplacianSpectrum:
    """The ``k`` smallest eigenvalues and the near-kernel dimension of ``L = Delta^T Delta`` (Eq. 6).

    Up to ``dense_max`` the spectrum is exact (dense ``eigvalsh``); above it ``torch.lobpcg`` on the
    sparse ``L`` (``iterations``, ``seed``) gives the ``k`` smallest eigenpairs and their residual.

    Args:
        maps, dims, edges: as in :func:`~flwr_sheaf.sheaf.network.coboundary`.
        k: number of smallest eigenvalues to return (>= 1; capped at ``n``).

    Raises:
        ValueError: ``k < 1``, no nodes, or bad maps (:func:`~flwr_sheaf.sheaf.network.coboundary`).
    """
    import networkx as nx

    if int(k) != k or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if not dims:
        raise ValueError("laplacian_spectrum: no nodes")
    n = sum(int(d) for d in dims.values())
    graph = nx.Graph()
    graph.add_nodes_from(dims)
    graph.add_edges_from(edges)
    bound = sum(min(int(dims[v]) for v in comp) for comp in nx.connected_components(graph))
    k = min(int(k), n)
    if n <= dense_max or n < 8:
        lap = sheaf_laplacian(maps, dims, edges)
        scale = float(torch.diagonal(lap).sum()) / n
        ev = torch.linalg.eigvalsh(lap)
        tol = NEAR_KERNEL_RTOL * scale
        return LaplacianSpectrum(
            _clip(ev[:k], scale), int((ev < tol).sum()), True, tol, scale, n, bound, "dense", 0.0
        )
    lap = sheaf_laplacian(maps, dims, edges, sparse=True)
    idx, vals = lap.indices(), lap.values()
    scale = float(vals[idx[0] == idx[1]].sum()) / n
    with warnings.catch_warnings():  # torch notes that its sparse CSR kernels are "beta"
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        csr = lap.to_sparse_csr()  # ~7x faster products than COO
        m = min(k, max(1, (n - 1) // 3))
        gen = torch.Generator().manual_seed(int(seed))
        x0 = torch.randn(n, m, generator=gen, dtype=torch.float64)
        ev, vec = torch.lobpcg(csr, k=m, X=x0, largest=False, niter=int(iterations), tol=1e-9)
        ev, order = torch.sort(ev)
        vec = vec[:, order]
        resid = torch.linalg.vector_norm(csr @ vec - vec * ev, dim=0)
    tol = NEAR_KERNEL_RTOL * scale
    count = int((ev < tol).sum())
    return LaplacianSpectrum(
        _clip(ev, scale), count, count < m, tol, scale, n, bound, "lobpcg", float(resid.max())
    )


def _clip(ev: torch.Tensor, scale: float) -> list[float]:
    floor = -1e-12 * max(scale, 1.0)
    return [0.0 if floor < float(x) < 0.0 else float(x) for x in ev]


def graph_algebraic_connectivity(graph: nx.Graph, max_nodes: int = DENSE_MAX_DIM) -> float:
    """Second-smallest eigenvalue of the combinatorial graph Laplacian (Fiedler value).

    For a consistent sheaf with orthogonal maps of equal ``d``, ``L ~ L_graph (x) I_d``: this is its
    first non-zero eigenvalue. 0.0 for a disconnected graph; NaN below two nodes or above ``max_nodes``.
    """
    import networkx as nx

    n = graph.number_of_nodes()
    if n < 2 or n > max_nodes:
        return float("nan")
    # unweighted D - A (edge attributes ignored), nodes in ascending id order
    lap = nx.laplacian_matrix(graph, nodelist=sorted(graph.nodes), weight=None).toarray()
    return max(0.0, float(torch.linalg.eigvalsh(torch.as_tensor(lap, dtype=torch.float64))[1]))


def sample_non_edges(
    graph: nx.Graph,
    nodes: Sequence[int],
    k: int,
    seed: int,
    server_round: int,
    enumerate_max: int = 100_000,
) -> list[tuple[int, int]]:
    """A deterministic draw of up to ``k`` unordered non-adjacent pairs joined by a path through ``nodes``.

    Candidates: non-adjacent ``a < b`` in one component of the subgraph induced by ``nodes``; drawn
    from ``default_rng([seed, NON_EDGE_STREAM, server_round])``. Up to ``enumerate_max`` node pairs
    all candidates are listed and sampled without replacement; above, rejection sampling (at most
    ``50 k`` draws).

    Raises:
        ValueError: ``k < 0`` or a node not in ``graph``.
    """
    import networkx as nx

    if int(k) != k or k < 0:
        raise ValueError(f"non-edge-pairs={k!r}: must be an integer >= 0")
    nodes = sorted(int(v) for v in set(nodes))
    missing = [v for v in nodes if v not in graph]
    if missing:
        raise ValueError(f"nodes {missing} are not in the graph")
    if k == 0 or len(nodes) < 2:
        return []
    sub = graph.subgraph(nodes)
    comp = {v: i for i, c in enumerate(nx.connected_components(sub)) for v in c}
    rng = np.random.default_rng([int(seed), NON_EDGE_STREAM, int(server_round)])
    if len(nodes) * (len(nodes) - 1) // 2 <= enumerate_max:
        cands = [
            (a, b)
            for i, a in enumerate(nodes)
            for b in nodes[i + 1 :]
            if not graph.has_edge(a, b) and comp[a] == comp[b]
        ]
        if len(cands) <= k:
            return cands
        pick = rng.choice(len(cands), size=int(k), replace=False)
        return sorted(cands[int(i)] for i in pick)
    out: set[tuple[int, int]] = set()
    for _ in range(50 * int(k)):
        i, j = rng.integers(0, len(nodes), size=2)
        a, b = sorted((nodes[int(i)], nodes[int(j)]))
        if a != b and not graph.has_edge(a, b) and comp[a] == comp[b]:
            out.add((a, b))
            if len(out) == k:
                break
    return sorted(out)
