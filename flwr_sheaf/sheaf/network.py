"""Network sheaf on an undirected graph: orientation, coboundary, Laplacian, total variation.

Paper Sec. 3: node stalks ``R^{d_i}``, edge stalk of the larger dimension, restriction maps
re-parameterised as in Eq. 10 so that each oriented edge (head h, tail t, ``d_h >= d_t``)
carries one ``V`` in ``St(d_h, d_t)`` and the coboundary is ``(Delta z)_e = z_h - V z_t``
(Eq. 5 with ``O = I``; Eq. 11). ``L = Delta^T Delta`` (Eq. 6); ``TV(z) = ||Delta z||^2`` (Eq. 9).
Pure torch + networkx; knows nothing of Flower or CNNs.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx
import torch

from .procrustes import procrustes
from .validation import check_pilots

__all__ = ["orient_edge", "NetworkSheaf"]


def orient_edge(a: int, d_a: int, b: int, d_b: int) -> tuple[int, int]:
    """Orientation of an undirected edge by stalk dimension (paper Sec. 3, "embedding orientation").

    Args:
        a, b: partition-ids of the endpoints (distinct).
        d_a, d_b: their stalk dimensions.

    Returns:
        ``(head, tail)``: the head has the larger stalk dimension; on a tie the larger
        partition-id is the head (deterministic; matches the reference implementation).

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


class NetworkSheaf:
    """A network sheaf with Stiefel restriction maps on an undirected graph.

    Args:
        graph: undirected ``networkx.Graph`` whose nodes are partition-ids.
        dims: stalk dimension ``d_i`` per node.
        maps: optional ``{(head, tail): V}`` with ``V`` of shape ``(d_head, d_tail)``; missing
            maps start as the truncated identity ``I[:d_h, :d_t]`` (the reference's init).

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

    # ------------------------------------------------------------------ structure
    def offsets(self) -> dict[int, int]:
        """Start index of each node's block in the stacked 0-cochain ``C^0 = (+)_i R^{d_i}``.

        Returns:
            ``{partition-id: int offset}``; blocks are laid out in ascending partition-id order
            (the column order of :meth:`coboundary` and :meth:`laplacian`).
        """
        off, pos = {}, 0
        for n in sorted(self.dims):
            off[n] = pos
            pos += self.dims[n]
        return off

    def coboundary(self) -> torch.Tensor:
        """Dense coboundary ``Delta`` (Eq. 5, re-parameterised as Eq. 10/11).

        Returns:
            float64 ``(sum_e d_head(e), sum_i d_i)`` matrix; edge blocks in ``self.edges`` order,
            node blocks sorted by partition-id; block row of edge (h, t) is ``[I at h, -V at t]``.
        """
        off = self.offsets()
        n_cols = sum(self.dims.values())
        n_rows = sum(self.dims[h] for h, _ in self.edges)
        delta = torch.zeros(n_rows, n_cols, dtype=torch.float64)
        row = 0
        for h, t in self.edges:
            dh, dt = self.dims[h], self.dims[t]
            delta[row : row + dh, off[h] : off[h] + dh] = torch.eye(dh, dtype=torch.float64)
            delta[row : row + dh, off[t] : off[t] + dt] = -self.maps[(h, t)].double()
            row += dh
        return delta

    def laplacian(self) -> torch.Tensor:
        """Sheaf Laplacian ``L = Delta^T Delta`` (Eq. 6): float64, symmetric PSD, ``(sum d_i, sum d_i)``."""
        delta = self.coboundary()
        return delta.T @ delta

    # ------------------------------------------------------------------ signals
    def total_variation(self, z: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Sheaf total variation ``sum_e ||z_h - V z_t||^2`` (Eq. 9 / Eq. 11).

        Args:
            z: per node either a vector ``(d_i,)`` or row-wise pilots ``(K, d_i)`` (then the
                Frobenius norm over all K rows, i.e. the sum of the per-pilot TVs).

        Returns:
            Scalar tensor (differentiable w.r.t. ``z``).

        Raises:
            ValueError: a node is missing or has the wrong dimension / NaN entries.
        """
        total = None
        for h, t in self.edges:
            zh, zt = self._rows(z, h), self._rows(z, t)
            if zh.shape[0] != zt.shape[0]:
                raise ValueError(f"edge {h}->{t}: {zh.shape[0]} vs {zt.shape[0]} pilot rows")
            v = self.maps[(h, t)].to(zh.dtype)
            term = ((zh - zt @ v.T) ** 2).sum()
            total = term if total is None else total + term
        return total if total is not None else torch.zeros(())

    def _rows(self, z: Mapping[int, torch.Tensor], n: int) -> torch.Tensor:
        if n not in z:
            raise ValueError(f"no signal for partition-id {n}")
        x = z[n]
        x = x.unsqueeze(0) if x.ndim == 1 else x
        check_pilots(x, f"signal of partition-id {n}", d=self.dims[n])
        return x

    def fit_maps(self, pilots: Mapping[int, torch.Tensor]) -> None:
        """Refit every restriction map by Procrustes on row-wise pilots (Eq. 18).

        Args:
            pilots: per node a ``(K, d_i)`` float tensor (the same ``K`` pilot rows everywhere) or
                a ``(d_i,)`` vector (one pilot).

        Updates ``self.maps[(h, t)]`` in place to float64 ``(d_h, d_t)`` maps with orthonormal
        columns (:func:`~flwr_sheaf.sheaf.procrustes.procrustes`).

        Raises:
            ValueError: a node without pilots, a wrong ``d_i``, differing row counts, NaN/inf.
        """
        for h, t in self.edges:
            self.maps[(h, t)] = procrustes(self._rows(pilots, h), self._rows(pilots, t)).double()
