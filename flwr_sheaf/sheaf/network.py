"""Network sheaf on an undirected graph (paper Sec. 3): orientation, coboundary (Eqs. 5, 10, 11),
Laplacian (Eq. 6), total variation (Eq. 9) and multi-hop transport (notes/variants-diagnostics.md).

Each oriented edge (head h, tail t, ``d_h >= d_t``) carries one ``V`` in ``St(d_h, d_t)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .procrustes import check_pilots, procrustes

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "orient_edge",
    "NetworkSheaf",
    "coboundary",
    "sheaf_laplacian",
    "stalk_offsets",
    "path_map",
]


def orient_edge(a: int, d_a: int, b: int, d_b: int) -> tuple[int, int]:
    """Orientation ``(head, tail)`` of the edge ``a - b`` (stalk dimensions ``d_a``, ``d_b``; paper
    Sec. 3): the head has the larger dimension, on a tie the larger partition-id (as the reference).

    Raises:
        ValueError: on a self-loop or a non-positive dimension.
    """
    if a == b:
        raise ValueError(f"self-loop on partition-id {a}")
    if d_a <= 0 or d_b <= 0:
        raise ValueError(f"stalk dimensions must be positive, got d_{a}={d_a}, d_{b}={d_b}")
    if d_a != d_b:
        return (a, b) if d_a > d_b else (b, a)
    return (a, b) if a > b else (b, a)


def stalk_offsets(dims: Mapping[int, int]) -> dict[int, int]:
    """``{node: offset}`` of each node's block in the 0-cochain ``C^0 = (+)_i R^{d_i}``, blocks in
    ascending node-id order."""
    off, pos = {}, 0
    for n in sorted(dims):
        off[n] = pos
        pos += int(dims[n])
    return off


def _check_maps(
    maps: Mapping[tuple[int, int], torch.Tensor],
    dims: Mapping[int, int],
    edges: Sequence[tuple[int, int]],
) -> None:
    for h, t in edges:
        if h == t:
            raise ValueError(f"edge {h}->{t} is a self-loop: an edge joins two different nodes")
        if h not in dims or t not in dims:
            raise ValueError(
                f"edge {h}->{t}: node {h if h not in dims else t} has no stalk dimension"
            )
        if (h, t) not in maps:
            raise ValueError(f"no restriction map for oriented edge {h}->{t}")
        v = maps[(h, t)]
        if tuple(v.shape) != (dims[h], dims[t]):
            raise ValueError(
                f"map of edge {h}->{t} must be ({dims[h]}, {dims[t]}), got {tuple(v.shape)}"
            )
        if not torch.isfinite(v).all():
            raise ValueError(f"map of edge {h}->{t} has NaN/inf entries")


def coboundary(
    maps: Mapping[tuple[int, int], torch.Tensor],
    dims: Mapping[int, int],
    edges: Sequence[tuple[int, int]],
    *,
    sparse: bool = False,
) -> torch.Tensor:
    """Coboundary ``Delta`` of a network sheaf (paper Eq. 5, re-parameterised as Eq. 10/11).

    Args:
        maps: ``{(head, tail): V (d_head, d_tail)}`` (any float dtype).
        dims: stalk dimension per node; every node gets a column block (edges or not).
        edges: oriented edges ``(head, tail)``, in row-block order.

    Returns:
        float64 ``(sum_e d_head(e), sum_i d_i)``; block row of edge (h, t) is ``[I at h, -V at t]``,
        so ``(Delta z)_e = z_h - V z_t``; column blocks by :func:`stalk_offsets`.

    Raises:
        ValueError: a self-loop, an edge without a map or a node without a dimension, a map of the
            wrong shape or with NaN/inf entries.
    """
    _check_maps(maps, dims, edges)
    off = stalk_offsets(dims)
    n_cols = sum(int(d) for d in dims.values())
    n_rows = sum(int(dims[h]) for h, _ in edges)
    # blocks never overlap: the dense matrix is the sparse one densified
    rows = [torch.zeros(0, dtype=torch.int64)]  # no edges: a 0-row matrix
    cols = [torch.zeros(0, dtype=torch.int64)]
    vals = [torch.zeros(0, dtype=torch.float64)]
    row = 0
    for h, t in edges:
        dh, dt = dims[h], dims[t]
        r = torch.arange(row, row + dh)
        rows.append(r)
        cols.append(torch.arange(off[h], off[h] + dh))
        vals.append(torch.ones(dh, dtype=torch.float64))
        rr, cc = torch.meshgrid(r, torch.arange(off[t], off[t] + dt), indexing="ij")
        rows.append(rr.reshape(-1))
        cols.append(cc.reshape(-1))
        vals.append(-maps[(h, t)].detach().double().cpu().reshape(-1))
        row += dh
    idx = torch.stack([torch.cat(rows), torch.cat(cols)])
    delta = torch.sparse_coo_tensor(
        idx, torch.cat(vals), (n_rows, n_cols), check_invariants=True
    ).coalesce()
    return delta if sparse else delta.to_dense()


def sheaf_laplacian(
    maps: Mapping[tuple[int, int], torch.Tensor],
    dims: Mapping[int, int],
    edges: Sequence[tuple[int, int]],
    *,
    sparse: bool = False,
) -> torch.Tensor:
    """Sheaf Laplacian ``L = Delta^T Delta`` (paper Eq. 6) of :func:`coboundary`'s ``Delta``
    (arguments likewise; ``sparse``: sparse COO throughout, memory ``O(sum_e d_h d_t)``).

    Returns:
        float64 symmetric positive semidefinite ``(sum_i d_i, sum_i d_i)``; its diagonal block of
        node i is ``sum_{e: i head} I + sum_{e: i tail} V_e^T V_e`` (``deg_i I`` for Stiefel maps).

    Raises:
        ValueError: as :func:`coboundary`.
    """
    delta = coboundary(maps, dims, edges, sparse=sparse)
    if not sparse:
        return delta.T @ delta
    # torch notes that its sparse CSR kernels (used inside) are "beta"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse.mm(delta.t().coalesce(), delta).coalesce()


def path_map(path: Sequence[int], maps: Mapping[tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """Compose the restriction maps along a path: transport from stalk ``path[0]`` to ``path[-1]``.

    A hop ``u -> w`` over ``(w, u)`` (w the head) embeds, ``z_w = V z_u``; over ``(u, w)`` it
    projects, ``z_w = V^T z_u`` (as :func:`flwr_sheaf.client.common.transport`); row-wise latents
    ``Z (M, d_src)`` move as ``Z T^T``.

    Returns float64 ``(d_dst, d_src)`` (a projection hop loses the part orthogonal to ``Im V``).

    Raises:
        ValueError: a path of fewer than two nodes, a hop with no map in either orientation, or
            maps whose shapes do not chain.
    """
    if len(path) < 2:
        raise ValueError(f"path {list(path)} needs at least two nodes")
    t = None
    for u, w in zip(path[:-1], path[1:]):
        if (w, u) in maps:
            m = maps[(w, u)].detach().double().cpu()
        elif (u, w) in maps:
            m = maps[(u, w)].detach().double().cpu().T
        else:
            raise ValueError(
                f"path {list(path)}: no restriction map for hop {u}->{w} (edge not in the sheaf)"
            )
        if t is not None and m.shape[1] != t.shape[0]:
            raise ValueError(
                f"path {list(path)}: hop {u}->{w} map {tuple(m.shape)} does not chain with "
                f"{tuple(t.shape)}"
            )
        t = m if t is None else m @ t
    assert t is not None, "a path of >= 2 nodes has at least one hop"
    return t


class NetworkSheaf:
    """A network sheaf with Stiefel restriction maps on an undirected graph of partition-ids.

    Args:
        maps: optional ``{(head, tail): V (d_head, d_tail)}``; missing maps start as the truncated
            identity ``I[:d_h, :d_t]`` (the reference's init).

    Raises:
        ValueError: a node without a dimension, or a map with the wrong shape / orientation.
    """

    def __init__(
        self,
        graph: nx.Graph,
        dims: Mapping[int, int],
        maps: Mapping[tuple[int, int], torch.Tensor] | None = None,
    ) -> None:
        missing = [n for n in graph.nodes if n not in dims]
        if missing:
            raise ValueError(f"no stalk dimension for node(s) {missing}")
        self.graph = graph
        self.dims = {int(n): int(dims[n]) for n in graph.nodes}
        self.edges: list[tuple[int, int]] = sorted(
            orient_edge(int(a), self.dims[a], int(b), self.dims[b]) for a, b in graph.edges
        )
        self.maps: dict[tuple[int, int], torch.Tensor] = {}
        for h, t in self.edges:
            v = None if maps is None else maps.get((h, t))
            if v is None:
                v = torch.eye(self.dims[h], self.dims[t], dtype=torch.float64)
            if tuple(v.shape) != (self.dims[h], self.dims[t]):
                raise ValueError(
                    f"map of edge {h}->{t} must be ({self.dims[h]}, {self.dims[t]}), got {tuple(v.shape)}"
                )
            self.maps[(h, t)] = v

    def laplacian(self, sparse: bool = False) -> torch.Tensor:
        """:func:`sheaf_laplacian` (Eq. 6) of this sheaf: float64 ``(sum d_i, sum d_i)``."""
        return sheaf_laplacian(self.maps, self.dims, self.edges, sparse=sparse)

    def transport_map(self, path: Sequence[int]) -> torch.Tensor:
        """:func:`path_map` along ``path`` with this sheaf's maps: float64 ``(d_dst, d_src)``;
        ValueError for a hop that is not an edge."""
        return path_map(path, self.maps)

    def edge_total_variation(
        self, pilots: Mapping[int, torch.Tensor]
    ) -> dict[tuple[int, int], float]:
        """``{(head, tail): ||A_h - V A_t||_F^2 / K}`` (Eq. 9 per pilot) on pilots ``(K, d_i)``;
        raises as :meth:`total_variation`."""
        return {e: float(term) / rows for e, term, rows in self._edge_terms(pilots)}

    def total_variation(self, z: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Sheaf total variation ``sum_e ||z_h - V z_t||^2`` (Eq. 9 / Eq. 11): a differentiable
        scalar tensor; ``z``: per node ``(d_i,)`` or row-wise pilots ``(K, d_i)`` (summed over rows).

        Raises:
            ValueError: a node is missing or has the wrong dimension / NaN entries.
        """
        total = None
        for _, term, _ in self._edge_terms(z):
            total = term if total is None else total + term
        return total if total is not None else torch.zeros(())

    def _edge_terms(self, z: Mapping[int, torch.Tensor]):
        """``((h, t), ||z_h - V z_t||_F^2, rows)`` per oriented edge, in ``self.edges`` order."""
        for h, t in self.edges:
            zh, zt = self._rows(z, h), self._rows(z, t)
            if zh.shape[0] != zt.shape[0]:
                raise ValueError(f"edge {h}->{t}: {zh.shape[0]} vs {zt.shape[0]} pilot rows")
            v = self.maps[(h, t)].to(zh.dtype)
            yield (h, t), ((zh - zt @ v.T) ** 2).sum(), zh.shape[0]

    def _rows(self, z: Mapping[int, torch.Tensor], n: int) -> torch.Tensor:
        if n not in z:
            raise ValueError(f"no signal for partition-id {n}")
        x = z[n]
        x = x.unsqueeze(0) if x.ndim == 1 else x
        check_pilots(x, f"signal of partition-id {n}", d=self.dims[n])
        return x

    def fit_maps(self, pilots: Mapping[int, torch.Tensor]) -> None:
        """Refit every map by Procrustes (Eq. 18) to float64 ``(d_h, d_t)`` on ``pilots``: per node
        ``(K, d_i)`` (the same ``K`` rows everywhere) or ``(d_i,)``.

        Raises:
            ValueError: a node without pilots, a wrong ``d_i``, differing row counts, NaN/inf.
        """
        for h, t in self.edges:
            self.maps[(h, t)] = procrustes(self._rows(pilots, h), self._rows(pilots, t)).double()
