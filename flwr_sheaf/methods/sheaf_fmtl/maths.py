"""Sheaf-FMTL maths (Ben Issaid, Vepakomma and Bennis, TMLR 2025; notes/baselines-sheaf-fmtl.md, s8).

Maps ``P_ij (d_ij, n_i)`` on agent i's flattened trainable parameters ``theta_i``,
``d_ij = max(1, floor(gamma min(n_i, n_j)))`` (F0); parameter step (F1)
``theta_i -= alpha lambda sum_j P_ij^T (P_ij theta_i - P_ji theta_j)``; map step (F2)
``P_ij -= eta lambda (P_ij theta_i - P_ji theta_j) theta_i^T``. Maps start ``N(0, 0.01^2)``,
float16 at rest, float32 when used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
import torch

__all__ = [
    "edge_dim",
    "map_bytes_per_node",
    "check_map_budget",
    "init_map",
    "parameter_step",
    "map_step",
    "MAP_INIT_STD",
    "GIB",
]

#: standard deviation of the maps' Gaussian initialisation (the reference implementation's 0.01).
MAP_INIT_STD = 0.01
GIB = 2**30


def edge_dim(n_i: int, n_j: int, gamma: float) -> int:
    """``d_ij = max(1, floor(gamma * min(n_i, n_j)))`` (F0); symmetric in i and j.

    Raises:
        ValueError: a non-positive parameter count or ``gamma <= 0``.
    """
    if n_i < 1 or n_j < 1 or not gamma > 0:
        raise ValueError(
            f"edge_dim needs n_i, n_j >= 1 and gamma > 0, got n_i={n_i}, n_j={n_j}, gamma={gamma}"
        )
    return max(1, math.floor(gamma * min(int(n_i), int(n_j))))


def map_bytes_per_node(
    num_params: Mapping[int, int],
    edges: Iterable[tuple[int, int]],
    gamma: float,
    bytes_per_entry: int = 2,
) -> dict[int, int]:
    """``{partition-id: sum_{j in N(i)} d_ij * n_i * bytes_per_entry}`` (0 for an isolated node).

    ``num_params`` is ``{partition-id: n_i}``; node i of an undirected edge ``(i, j)`` owns ``P_ij``.
    """
    out = {int(p): 0 for p in num_params}
    for i, j in edges:
        d = edge_dim(num_params[i], num_params[j], gamma)
        out[int(i)] += d * int(num_params[i]) * bytes_per_entry
        out[int(j)] += d * int(num_params[j]) * bytes_per_entry
    return out


def check_map_budget(per_node: Mapping[int, int], max_gib: float, gamma: float) -> None:
    """Raise ``ValueError`` (node, sizes and both keys named) when the largest node's maps exceed ``max_gib`` GiB."""
    if not per_node:
        return
    worst = max(per_node, key=lambda p: per_node[p])
    if per_node[worst] > max_gib * GIB:
        raise ValueError(
            f"sheaf-fmtl-gamma={gamma:g}: the float16 restriction maps of partition-id {worst} need "
            f"{per_node[worst] / GIB:.3f} GiB (all nodes: {sum(per_node.values()) / GIB:.3f} GiB), more than "
            f"sheaf-fmtl-max-gib={max_gib:g}; lower sheaf-fmtl-gamma or raise sheaf-fmtl-max-gib"
        )


def init_map(d_ij: int, n_i: int, seed: int, partition_id: int, neighbour: int) -> torch.Tensor:
    """The initial ``P_ij`` ``(d_ij, n_i)`` float32, ``N(0, 0.01^2)``, seeded by
    ``SeedSequence([seed, partition_id, neighbour, 8])`` only (8: Sheaf-FMTL's stream tag).
    """
    s = int(
        np.random.SeedSequence([int(seed), int(partition_id), int(neighbour), 8]).generate_state(1)[
            0
        ]
    )
    gen = torch.Generator().manual_seed(s)
    return torch.randn(int(d_ij), int(n_i), generator=gen) * MAP_INIT_STD


def parameter_step(
    theta: torch.Tensor,
    maps: Mapping[int, torch.Tensor],
    received: Mapping[int, torch.Tensor],
    lr: float,
    lam: float,
) -> torch.Tensor:
    """(F1): ``theta - lr * lam * sum_j P_ij^T (P_ij theta - y_j)``, ``y_j = P_ji theta_j`` received.

    Args:
        theta: ``(n_i,)`` float32.
        maps: ``{j: (d_ij, n_i)}``.
        received: ``{j: (d_ij,)}`` (edges without one are skipped).
        lr, lam: alpha and lambda.

    Raises:
        ValueError: a received projection of the wrong length or with NaN/inf (the neighbour named).
    """
    grad = torch.zeros_like(theta)
    for j, y in received.items():
        p = maps[j].to(theta.dtype)
        _check_projection(y, p.shape[0], j)
        grad += p.T @ (p @ theta - y.to(theta.dtype))
    return theta - lr * lam * grad


def map_step(
    p: torch.Tensor, theta: torch.Tensor, y: torch.Tensor, eta: float, lam: float, j: int = -1
) -> torch.Tensor:
    """(F2): ``P - eta * lam * (P theta - y) theta^T`` for one edge (a new ``(d_ij, n_i)`` tensor).

    ``p`` ``(d_ij, n_i)``, ``theta`` ``(n_i,)``, ``y`` ``(d_ij,)`` the neighbour ``j``'s ``P_ji theta_j``.

    Raises:
        ValueError: ``y`` of the wrong length or with NaN/inf.
    """
    _check_projection(y, p.shape[0], j)
    diff = p @ theta - y.to(p.dtype)
    return p - (eta * lam) * torch.outer(diff, theta)


def _check_projection(y: torch.Tensor, d: int, j: int) -> None:
    if y.ndim != 1 or y.shape[0] != d:
        raise ValueError(
            f"projection from neighbour partition-id {j} has shape {tuple(y.shape)}, expected ({d},)"
        )
    if not torch.isfinite(y).all():
        raise ValueError(f"projection from neighbour partition-id {j} has NaN/inf")
