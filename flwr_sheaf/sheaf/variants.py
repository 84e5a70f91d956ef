"""Sheaf-FRL variants of the map step: homogeneous (paper Alg. 2, Eq. 24) and stringent privacy (Alg. 3/4, App. F).

Per mode, what agent i receives and which maps it fits (Eqs. 18, 24, 42): notes/variants-privacy.md,
s1-s2. Matrices are row-wise ``(K, d)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .gluing import EdgeTerm
from .procrustes import check_pilots, procrustes

__all__ = [
    "VARIANTS",
    "PRIVACY_MODES",
    "Received",
    "resolve_variant",
    "edge_dim",
    "edge_terms",
    "outgoing_pilots",
    "init_map",
    "receiver_sends_raw",
]

VARIANTS = ("auto", "heterogeneous", "homogeneous")
PRIVACY_MODES = ("standard", "stringent")


def resolve_variant(variant: str, dims: Mapping[int, int]) -> str:
    """The variant (``"heterogeneous"`` or ``"homogeneous"``) a run's ``sheaf-variant`` resolves to
    for stalk dimensions ``dims``: ``auto`` -> ``homogeneous`` iff every ``d_i`` is equal.

    Raises:
        ValueError: an unknown variant, or ``homogeneous`` with unequal d_i (the dimensions named).
    """
    if variant not in VARIANTS:
        raise ValueError(f"sheaf-variant={variant!r}: must be one of {VARIANTS}")
    equal = len(set(dims.values())) <= 1
    if variant == "homogeneous" and not equal:
        raise ValueError(
            f"sheaf-variant='homogeneous' needs equal stalk dimensions, got d = "
            f"{dict(sorted(dims.items()))} (use 'heterogeneous' or 'auto')"
        )
    if variant == "auto":
        return "homogeneous" if equal else "heterogeneous"
    return variant


def edge_dim(d_i: int, d_j: int) -> int:
    """Edge stalk dimension ``d_e = max(d_i, d_j)`` (paper App. A, "Embedding vs. compression")."""
    return max(int(d_i), int(d_j))


def receiver_sends_raw(variant: str, privacy: str, sender_is_head: bool) -> bool:
    """Whether a sender's message on one edge is its raw pilot matrix: always for
    ``standard``+``heterogeneous``, from the head for ``homogeneous``, never for ``stringent``.

    Raises:
        ValueError: unknown ``variant`` (must be resolved: no ``auto``) or ``privacy``.
    """
    if privacy not in PRIVACY_MODES:
        raise ValueError(f"privacy={privacy!r}: must be one of {PRIVACY_MODES}")
    if variant not in VARIANTS[1:]:
        raise ValueError(f"sheaf-variant={variant!r}: must be resolved to one of {VARIANTS[1:]}")
    if privacy == "stringent":
        return False
    return variant == "heterogeneous" or sender_is_head


@dataclass
class Received:
    """What agent i holds of one neighbour j for the gluing term.

    Attributes:
        neighbour: partition-id j.
        matrix: ``(K, d_j)`` raw pilots, or ``(K, d_e)`` pilots transported by j's map.
        i_is_head: whether i is the head of edge (i, j) (larger d; tie: larger partition-id).
        weight: edge-term multiplier ``w_ij >= 0`` (1 in the paper).
    """

    neighbour: int
    matrix: torch.Tensor
    i_is_head: bool
    weight: float = 1.0


def edge_terms(
    own: torch.Tensor,
    received: Sequence[Received],
    variant: str,
    privacy: str,
    normalise: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[EdgeTerm], dict[int, torch.Tensor]]:
    """Agent i's incident gluing terms and the maps it fitted (module docstring for the modes).

    Args:
        own: i's current pilots ``(K, d_i)``.
        variant: resolved: ``heterogeneous`` or ``homogeneous``.
        privacy: ``standard`` or ``stringent``.
        normalise: applied to both matrices before each Procrustes fit only (e.g.
            :func:`flwr_sheaf.sheaf.pilots.parseval`); None = no normalisation.

    Returns:
        ``(terms, maps)``: the :class:`EdgeTerm` list for
        :func:`~flwr_sheaf.sheaf.gluing.local_gluing_penalty`, and i's maps by neighbour:
        ``(d_h, d_t)`` for ``standard`` (Eq. 18; homogeneous: only where i is the tail),
        ``X_ji (d_e, d_i)`` for ``stringent`` (P2c/P2d).

    Raises:
        ValueError: unknown mode, or a received matrix of the wrong shape / with NaN (named).
    """
    receiver_sends_raw(variant, privacy, True)  # validates the mode (ValueError)
    check_pilots(own, "own pilots")
    k, d_i = own.shape
    nz = normalise or (lambda a: a)
    own_fit = nz(own)
    terms, maps = [], {}
    for r in received:
        m = r.matrix
        check_pilots(m, f"pilots received from neighbour partition-id {r.neighbour}", k=k)
        if privacy == "stringent":
            if m.shape[1] < d_i:
                raise ValueError(
                    f"transported pilots of neighbour {r.neighbour} have d_e={m.shape[1]} < d_i={d_i}"
                )
            # P2c (i head: d_e = d_i, O(d_i)) or P2d (i tail: St(d_e, d_i))
            x = procrustes(nz(m), own_fit)
            maps[r.neighbour] = x
            # ||Y - A_i X^T||, Eq. 42
            terms.append(EdgeTerm(r.neighbour, m, x, False, float(r.weight)))
        elif variant == "homogeneous" and r.i_is_head:
            if m.shape[1] != d_i:
                raise ValueError(
                    f"homogeneous: pilots of neighbour {r.neighbour} have d={m.shape[1]}, own d={d_i}"
                )
            eye = torch.eye(d_i, dtype=m.dtype, device=m.device)
            # ||A_h - O A_t||, O A_t received
            terms.append(EdgeTerm(r.neighbour, m, eye, True, float(r.weight)))
        else:
            v = procrustes(own_fit, nz(m)) if r.i_is_head else procrustes(nz(m), own_fit)
            maps[r.neighbour] = v
            terms.append(EdgeTerm(r.neighbour, m, v, r.i_is_head, float(r.weight)))
    return terms, maps


def outgoing_pilots(
    own: torch.Tensor,
    maps: Mapping[int, torch.Tensor],
    neighbours: Sequence[int],
    heads: Sequence[bool],
    variant: str,
    privacy: str,
) -> tuple[bool, dict[int, torch.Tensor]]:
    """What agent i uploads after training: its raw pilots or not, and per-edge transported pilots.

    Args:
        own: i's final pilots ``(K, d_i)``.
        maps: i's maps by neighbour (homogeneous: ``O (d, d)`` where i is the tail; stringent:
            ``X_ji (d_e, d_i)``).
        heads: whether i heads the edge to each of ``neighbours``.

    Returns:
        ``(send_raw, transported)``: whether some neighbour gets ``A_i`` itself, and per neighbour
        ``(K, d_e)`` rows of ``X A_i`` (Alg. 2/3/4 line 6).

    Raises:
        ValueError: a needed map is missing or has the wrong shape (neighbour named).
    """
    k, d_i = own.shape
    send_raw, out = False, {}
    for j, i_head in zip(neighbours, heads):
        if receiver_sends_raw(variant, privacy, i_head):
            send_raw = True
            continue
        if j not in maps:
            raise ValueError(
                f"no map toward neighbour partition-id {j} to transport the pilots with"
            )
        x = maps[j].to(own.dtype)
        if x.ndim != 2 or x.shape[1] != d_i or x.shape[0] < d_i:
            raise ValueError(
                f"map toward neighbour {j} has shape {tuple(x.shape)}, expected (d_e >= {d_i}, {d_i})"
            )
        out[j] = own @ x.T
    return send_raw, out


def init_map(d_e: int, d_i: int, key: Sequence[int]) -> torch.Tensor:
    """Agent i's initial map ``X_ji^0`` (Alg. 3/4 line 1): Haar-distributed float64 ``(d_e, d_i)``,
    ``X^T X = I``, by QR of a Gaussian from ``SeedSequence(key)`` with Mezzadri's sign fix.

    Args:
        key: non-negative integers (seed, partition-id, neighbour, node secret).

    Raises:
        ValueError: ``d_e < d_i`` or a non-positive dimension.
    """
    if d_i < 1 or d_e < d_i:
        raise ValueError(f"init_map needs d_e >= d_i >= 1, got ({d_e}, {d_i})")
    rng = np.random.default_rng(np.random.SeedSequence([int(x) for x in key]))
    q, r = np.linalg.qr(rng.standard_normal((d_e, d_i)))
    q = q * np.sign(np.where(np.diag(r) == 0, 1.0, np.diag(r)))
    return torch.from_numpy(np.ascontiguousarray(q))
