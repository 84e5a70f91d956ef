"""Local gluing penalty of agent i (paper Eq. 16), with neighbours' pilots held constant (Eq. 19)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .procrustes import check_pilots

__all__ = ["EdgeTerm", "local_gluing_penalty", "gluing_penalty_terms"]


@dataclass
class EdgeTerm:
    """One incident edge of agent i as seen from i.

    Attributes:
        neighbour: partition-id j.
        pilots: neighbour's pilot rows ``(K, d_j)`` (a constant: no gradient flows to j).
        v: restriction map ``(d_head, d_tail)`` of the oriented edge.
        i_is_head: True when i is the head (j in N(i)^-), False when i is the tail (j in N(i)^+).
        weight: multiplier ``>= 0`` of this edge's squared residual (``drop-reweighted``: 1/q_j;
            notes/participation.md, s3.3); the Procrustes map does not depend on it.
    """

    neighbour: int
    pilots: torch.Tensor
    v: torch.Tensor
    i_is_head: bool
    weight: float = 1.0


def local_gluing_penalty(
    a_i: torch.Tensor, edges: Sequence[EdgeTerm], lam: float
) -> tuple[torch.Tensor, dict[int, float]]:
    """Agent i's gluing penalty ``R_A|_i`` (paper Eq. 16).

    ``R = (lam / d_i) / (2K) * [ sum_{j in N(i)^-} w_ij ||A_i - V_ij A_j||_F^2
                                + sum_{j in N(i)^+} w_ij ||A_j - V_ji A_i||_F^2 ]``
    with row-wise pilots (``V A_j`` is ``A_j @ V.T``) and ``w_ij = EdgeTerm.weight`` (paper: 1).

    Args:
        a_i: agent i's pilot rows ``(K, d_i)`` (differentiable).
        edges: incident edges; each neighbour's pilots must have the same K rows.
        lam: lambda >= 0 (lambda_i = lambda / d_i).

    Returns:
        ``(penalty, per_edge)``: scalar tensor, and per neighbour partition-id the unweighted mean
        squared residual ``||.||_F^2 / K`` (float).

    Raises:
        ValueError: negative lambda, shape mismatch (K or d), wrong map shape, NaN/inf pilots,
            a negative or non-finite edge weight.
    """
    penalty, sq = gluing_penalty_terms(a_i, edges, lam)
    return penalty, {j: float(v) / a_i.shape[0] for j, v in sq.items()}


def gluing_penalty_terms(
    a_i: torch.Tensor, edges: Sequence[EdgeTerm], lam: float, check_finite: bool = True
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """:func:`local_gluing_penalty` (Eq. 16) without host synchronisation: per-edge values stay on the device.

    Args:
        check_finite: check every pilot matrix for NaN/inf (a device synchronisation each; the
            training loop passes False on an accelerator and checks the loss instead).

    Returns:
        ``(penalty, sq)``: the scalar penalty and, per neighbour, the detached 0-d ``||.||_F^2``.

    Raises:
        ValueError: as :func:`local_gluing_penalty` (non-finite entries only with ``check_finite``).
    """
    if lam < 0:
        raise ValueError(f"lambda must be >= 0, got {lam}")
    check_pilots(a_i, "own pilots", finite=check_finite)
    k, d_i = a_i.shape
    total = a_i.new_zeros(())
    per_edge: dict[int, torch.Tensor] = {}
    for e in edges:
        a_j = e.pilots.to(a_i.dtype).detach()
        check_pilots(a_j, f"pilots of neighbour {e.neighbour}", k=k, finite=check_finite)
        d_j = a_j.shape[1]
        expect = (d_i, d_j) if e.i_is_head else (d_j, d_i)
        if tuple(e.v.shape) != expect:
            raise ValueError(
                f"edge with neighbour {e.neighbour}: map shape {tuple(e.v.shape)}, expected {expect}"
            )
        w = float(e.weight)
        if not (math.isfinite(w) and w >= 0.0):
            raise ValueError(
                f"edge with neighbour {e.neighbour}: weight must be finite and >= 0, got {e.weight!r}"
            )
        v = e.v.to(a_i.dtype).detach()
        resid = (a_i - a_j @ v.T) if e.i_is_head else (a_j - a_i @ v.T)
        sq = (resid**2).sum()
        per_edge[e.neighbour] = sq.detach()
        total = total + (sq if w == 1.0 else w * sq)
    return (lam / d_i) / (2 * k) * total, per_edge
