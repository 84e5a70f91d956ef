"""FedSAF mathematics in torch (Wu et al., arXiv 2605.05959; notes/baselines-prototypes.md, s4):
GCSA, RCSA, the coordinate ablations, Prop. 1 and the two-level local objective (Eqs. (6)-(19)).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .._shared.prototypes import (
    LOSS_REDUCTIONS,
    _check_labels,
    _check_latents,
    _prototype_rows,
    _stack_protos,
    class_prototypes,
)

__all__ = [
    "MIN_ROWS",
    "STRUCTURES",
    "centered_gram",
    "rdm_vector",
    "gcsa_loss",
    "rcsa_loss",
    "mse_alignment",
    "cosine_alignment",
    "CoordinateDecomposition",
    "coordinate_decomposition",
    "structure_loss",
    "StructureInputs",
    "structure_alignment_inputs",
    "FedSAFTerms",
    "fedsaf_objective",
]

#: Fewest rows for which GCSA / RCSA carry information (identically 0 at 2 rows, undefined at 1).
MIN_ROWS = 3
#: Accepted ``structure`` values of :func:`structure_loss` / :func:`fedsaf_objective`.
STRUCTURES = ("gcsa", "rcsa", "mse", "cosine")
_EPS = 1e-12


def _check_pair(
    p: torch.Tensor,
    q: torch.Tensor,
    fn: str,
    *,
    same_dim: bool,
    need_rows: int,
    names: tuple[str, str] = ("P", "Q"),
) -> None:
    """ValueError unless ``p (n, d1)``, ``q (n, d2)`` are floating, row-paired, ``n >= need_rows`` and
    (``same_dim``) ``d1 == d2``; messages start with ``fn`` and name the matrices ``names``."""
    a, b = names
    _check_latents(p, f"{fn}: {a}", rows="n")
    _check_latents(q, f"{fn}: {b}", rows="n")
    if p.shape[0] != q.shape[0]:
        raise ValueError(
            f"{fn}: {a} and {b} must have the same number of rows (paired samples/classes), "
            f"got n={p.shape[0]} and n={q.shape[0]}"
        )
    if same_dim and p.shape[1] != q.shape[1]:
        raise ValueError(
            f"{fn}: coordinate alignment needs equal dims, got d={p.shape[1]} (P) and "
            f"d={q.shape[1]} (Q); use GCSA/RCSA or a common-dim adapter"
        )
    if p.shape[0] < need_rows:
        if need_rows == MIN_ROWS:
            raise ValueError(
                f"{fn}: needs at least MIN_ROWS={MIN_ROWS} rows, got n={p.shape[0]} (with 2 rows "
                "the structure loss is identically 0, with 1 row it is undefined)"
            )
        raise ValueError(f"{fn}: needs at least {need_rows} row(s), got n={p.shape[0]}")


def _check_eps(eps: float) -> None:
    if not (isinstance(eps, numbers.Real) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite float, got {eps!r}")


def _safe_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``max(||x||_F, eps)`` with a finite gradient everywhere (clamps the squared norm)."""
    return (x * x).sum().clamp_min(eps * eps).sqrt()


def _cosine_loss(a: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """``clamp(1 - <a, b> / (max(|a|, eps) max(|b|, eps)), 0, 1)`` for non-negative-cosine pairs."""
    cos = (a * b).sum() / (_safe_norm(a, eps) * _safe_norm(b, eps))
    return (1.0 - cos).clamp(0.0, 1.0)


def _promote(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dt = torch.promote_types(p.dtype, q.dtype)
    return p.to(dt), q.to(device=p.device, dtype=dt)


def _structure_cosine_loss(
    p: torch.Tensor,
    q: torch.Tensor,
    eps: float,
    structure: Callable[[torch.Tensor, float], torch.Tensor],
    fn: str,
) -> torch.Tensor:
    """``1 - cos(S(P), S(Q))`` for a structure operator ``S``, after the pair checks and dtype promotion."""
    _check_pair(p, q, fn, same_dim=False, need_rows=MIN_ROWS)
    p, q = _promote(p, q)
    return _cosine_loss(structure(p, eps), structure(q, eps), eps)


def centered_gram(p: torch.Tensor, eps: float = _EPS) -> torch.Tensor:
    """Centred Gram ``P_c P_c^T / max(||P_c||_F^2, eps^2)``, ``P_c = P - 1 p_bar`` (FedSAF Eq. (13)):
    ``(n, n)`` symmetric PSD in ``p``'s dtype for ``p (n, d)`` (zero when all rows coincide).

    Raises:
        ValueError: ``p`` not a 2-D floating tensor; bad ``eps``.
    """
    _check_latents(p, "centered_gram: P", rows="n")
    _check_eps(eps)
    pc = p - p.mean(dim=0, keepdim=True)
    pc = pc / _safe_norm(pc, eps)
    return pc @ pc.T


def rdm_vector(p: torch.Tensor, eps: float = _EPS) -> torch.Tensor:
    """Upper triangle ``||P~_i - P~_j||_2^2`` (``i < j``) of the row-normalised ``P~`` (FedSAF Eq. (14)):
    ``(n (n - 1) / 2,)`` non-negative, ``p``'s dtype, ``torch.triu_indices`` order, for ``p (n, d)``.

    Raises:
        ValueError: ``p`` not a 2-D floating tensor; bad ``eps``.
    """
    _check_latents(p, "rdm_vector: P", rows="n")
    _check_eps(eps)
    pn = F.normalize(p, p=2.0, dim=1, eps=eps)
    g = pn @ pn.T
    sq = torch.diagonal(g)
    rdm = (sq[:, None] + sq[None, :] - 2.0 * g).clamp_min(0.0)
    n = p.shape[0]
    iu = torch.triu_indices(n, n, offset=1, device=p.device)
    return rdm[iu[0], iu[1]]


def gcsa_loss(p: torch.Tensor, q: torch.Tensor, eps: float = _EPS) -> torch.Tensor:
    """Gram-Cosine Structural Alignment ``1 - <K_P, K_Q>_F / (||K_P||_F ||K_Q||_F)`` (FedSAF Eq. (13)), in ``[0, 1]``.

    Zero for ``Q = alpha P R + 1 b^T`` (Prop. 2); 1 with zero gradient when all rows of ``P`` or ``Q``
    are equal. ``p (n, d1)`` and ``q (n, d2)`` are row-paired; returns a 0-dim tensor (promoted dtype).

    Raises:
        ValueError: not 2-D floating; row counts differ; ``n < MIN_ROWS``; bad ``eps``.
    """
    return _structure_cosine_loss(p, q, eps, centered_gram, "gcsa_loss")


def rcsa_loss(p: torch.Tensor, q: torch.Tensor, eps: float = _EPS) -> torch.Tensor:
    """RDM-Cosine Structural Alignment ``1 - cos(v_P, v_Q)`` of :func:`rdm_vector` (FedSAF Eq. (14)), in ``[0, 1]``.

    Zero for ``Q = D P R`` (``D`` positive diagonal, Prop. 3); not translation-invariant. Shapes as
    :func:`gcsa_loss`.

    Raises:
        ValueError: not 2-D floating; row counts differ; ``n < MIN_ROWS``; bad ``eps``.
    """
    return _structure_cosine_loss(p, q, eps, rdm_vector, "rcsa_loss")


def mse_alignment(p: torch.Tensor, q: torch.Tensor, reduction: str = "mse") -> torch.Tensor:
    """Squared-L2 coordinate alignment (FedSAF Eq. (6)): ``||P - Q||_F^2 / (n d)`` (``"mse"``) or ``/ n`` (``"per_sample"``).

    ``p``, ``q``: ``(n, d)`` floating; returns a 0-dim tensor (promoted dtype).

    Raises:
        ValueError: shapes differ, ``n < 1``, unknown ``reduction``.
    """
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"reduction must be one of {LOSS_REDUCTIONS}, got {reduction!r}")
    _check_pair(p, q, "mse_alignment", same_dim=True, need_rows=1)
    p, q = _promote(p, q)
    sq = ((p - q) ** 2).sum()
    return sq / (p.shape[0] * p.shape[1]) if reduction == "mse" else sq / p.shape[0]


def cosine_alignment(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Cosine coordinate alignment ``(1/n) sum_j (1 - cos(p_j, q_j))`` (FedSAF Eq. (6)), in ``[0, 2]``.

    ``p``, ``q``: ``(n, d)`` floating; returns a 0-dim tensor (promoted dtype).

    Raises:
        ValueError: shapes differ, ``n < 1``, bad ``eps``.
    """
    _check_pair(p, q, "cosine_alignment", same_dim=True, need_rows=1)
    _check_eps(eps)
    p, q = _promote(p, q)
    return (1.0 - F.cosine_similarity(p, q, dim=1, eps=eps)).mean()


class CoordinateDecomposition(NamedTuple):
    """Terms of FedSAF Prop. 1 (Eq. (9)); ``l_coord == l_shape + l_rigid`` up to rounding."""

    l_coord: torch.Tensor  #: ``||Z^ - P^||_F^2`` (Eq. (7)), 0-dim
    l_shape: torch.Tensor  #: ``min_R ||Z^ - P^ R||_F^2 = ||Z^ - P^ R*||_F^2``, 0-dim, >= 0
    l_rigid: torch.Tensor  #: ``2 (<Z^, P^ R*> - <Z^, P^>)``, 0-dim, >= 0
    rotation: torch.Tensor  #: ``R*`` ``(d, d)`` orthogonal Procrustes solution (Eq. (8))


def coordinate_decomposition(
    z: torch.Tensor, p: torch.Tensor, normalize: bool = True, eps: float = _EPS
) -> CoordinateDecomposition:
    """FedSAF Prop. 1 (Eqs. (7)-(9)): ``||Z^ - P^||_F^2 = ||Z^ - P^ R*||_F^2 + 2(<Z^, P^ R*> - <Z^, P^>)``.

    ``R* = U V^T`` from ``P^^T Z^ = U S V^T`` on the row-normalised (``normalize``) matrices; each term
    from its own formula. A diagnostic (SVD gradients are unreliable at repeated singular values).
    ``z`` (client representations) and ``p`` (their global prototypes) are ``(n, d)`` floating.

    Raises:
        ValueError: shapes differ, ``n < 1``, bad ``eps``.
    """
    _check_pair(z, p, "coordinate_decomposition", same_dim=True, need_rows=1)
    _check_eps(eps)
    z, p = _promote(z, p)
    if normalize:
        z = F.normalize(z, dim=1, eps=eps)
        p = F.normalize(p, dim=1, eps=eps)
    u, _, vh = torch.linalg.svd(p.T @ z)
    r = u @ vh
    pr = p @ r
    l_coord = ((z - p) ** 2).sum()
    l_shape = ((z - pr) ** 2).sum()
    l_rigid = 2.0 * ((z * pr).sum() - (z * p).sum())
    return CoordinateDecomposition(l_coord, l_shape, l_rigid, r)


def structure_loss(p: torch.Tensor, q: torch.Tensor, structure: str = "gcsa") -> torch.Tensor:
    """``D(S(P), S(Q))`` (FedSAF Eq. (12)) by ``structure``: ``"gcsa"``, ``"rcsa"``, ``"mse"`` or ``"cosine"``.

    Raises:
        ValueError: unknown ``structure`` and everything the chosen loss raises.
    """
    if structure == "gcsa":
        return gcsa_loss(p, q)
    if structure == "rcsa":
        return rcsa_loss(p, q)
    if structure == "mse":
        return mse_alignment(p, q)
    if structure == "cosine":
        return cosine_alignment(p, q)
    raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")


class StructureInputs(NamedTuple):
    """Row-paired matrices for FedSAF's two alignment terms (Eqs. (16)-(18))."""

    p_local: torch.Tensor  #: ``(n_i, d)`` batch local prototypes of ``C_i`` (with gradient)
    q_global: torch.Tensor  #: ``(n_i, d_g)`` global prototypes of ``C_i`` (constants)
    z_inst: torch.Tensor  #: ``(B', d)`` features of the covered samples (with gradient)
    z_global_inst: torch.Tensor  #: ``(B', d_g)`` ``z~_j = P_g^{y_j}`` (constants)
    classes: list[int]  #: ``C_i`` in row order (ascending class id)


def structure_alignment_inputs(
    z: torch.Tensor, y: torch.Tensor, global_protos: Mapping, num_classes: int
) -> StructureInputs:
    """The prototype-level and instance-level pairs of FedSAF Eqs. (15)-(18).

    Batch prototypes ``P_i^c`` of the classes present **and** with a global prototype (s4.4),
    ascending, beside ``P_g^c``; the ``B'`` covered samples ``z_j`` beside ``P_g^{y_j}`` (detached).

    Args:
        z: ``(B, d)`` floating features.
        y: ``(B,)`` integer labels in ``[0, num_classes)``.
        global_protos: ``dict[int, Tensor(d_g)]`` (possibly empty).

    Returns :class:`StructureInputs` (0 rows when nothing is covered).

    Raises:
        ValueError: bad shapes/dtypes/labels, invalid or non-finite prototypes.
    """
    _check_latents(z)
    _check_labels(y, z.shape[0], num_classes)
    classes_g, mat = _stack_protos(global_protos, like=z)
    d_g = mat.shape[1] if classes_g else z.shape[1]
    y_dev = y.to(z.device).long()
    rows = _prototype_rows(y_dev, classes_g) if classes_g else torch.full_like(y_dev, -1)
    covered = rows >= 0
    if not bool(covered.any()):
        empty = z.new_zeros((0, d_g))
        return StructureInputs(z[:0], empty, z[:0], empty, [])
    z_cov, y_cov = z[covered], y_dev[covered]
    protos, _ = class_prototypes(z_cov, y_cov, num_classes)
    classes = sorted(protos)
    q_rows = _prototype_rows(torch.tensor(classes, dtype=torch.long, device=z.device), classes_g)
    return StructureInputs(
        p_local=torch.stack([protos[c] for c in classes]),
        q_global=mat[q_rows],
        z_inst=z_cov,
        z_global_inst=mat[rows[covered]],
        classes=classes,
    )


class FedSAFTerms(NamedTuple):
    """Value and components of the FedSAF local objective (Eq. (19))."""

    total: torch.Tensor  #: ``L_sup + lam L_proto + gamma L_inst`` (applied terms only)
    sup: torch.Tensor  #: ``L_sup`` as passed in
    proto: torch.Tensor  #: ``L_proto`` (0 attached to the graph when skipped)
    inst: torch.Tensor  #: ``L_inst`` (0 attached to the graph when skipped)
    proto_applied: bool  #: False when the term had too few rows (or no inputs)
    inst_applied: bool  #: False when the term had too few rows (or no inputs)


def _weight(v: object, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite float >= 0, got {v!r}")
    return float(v)


def fedsaf_objective(
    ce: torch.Tensor,
    P_local_protos: torch.Tensor | None,
    Q_global_protos: torch.Tensor | None,
    Z_inst: torch.Tensor | None,
    Zglobal_inst: torch.Tensor | None,
    lam: float,
    gamma: float,
    structure: str = "gcsa",
) -> FedSAFTerms:
    """FedSAF client objective ``L_sup + lam L_proto + gamma L_inst`` (Eqs. (17)-(19)).

    A term whose inputs are None or have too few rows (``MIN_ROWS`` for GCSA/RCSA, else 1) is skipped
    (0 attached to the graph, ``*_applied=False``); a weight-0 term is evaluated but not added; the
    global side is detached.

    Args:
        ce: 0-dim supervised loss ``L_sup``.
        P_local_protos: ``(n_i, d)`` batch local prototypes (with gradient) or ``None``.
        Q_global_protos: ``(n_i, d_g)`` global prototypes of the same classes, same row order.
        Z_inst: ``(B', d)`` instance features or ``None``.
        Zglobal_inst: ``(B', d_g)`` their global prototypes.
        lam, gamma: finite weights ``>= 0`` of ``L_proto`` and ``L_inst``.

    Returns :class:`FedSAFTerms` (back-propagate ``total``).

    Raises:
        ValueError: ``ce`` not a 0-dim floating tensor; bad weights; unknown ``structure``; exactly one
            matrix of a pair given; mismatched rows / dims.
    """
    if not isinstance(ce, torch.Tensor) or ce.ndim != 0 or not ce.is_floating_point():
        raise ValueError("ce must be a 0-dim floating tensor (the supervised loss)")
    lam = _weight(lam, "lam")
    gamma = _weight(gamma, "gamma")
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    need = MIN_ROWS if structure in ("gcsa", "rcsa") else 1

    def term(
        a: torch.Tensor | None, b: torch.Tensor | None, name: str
    ) -> tuple[torch.Tensor, bool]:
        if (a is None) != (b is None):
            raise ValueError(f"fedsaf_objective: {name} pair needs both matrices or neither")
        if a is None or b is None:
            return ce * 0.0, False
        _check_pair(
            a,
            b,
            f"fedsaf_objective: {name}",
            same_dim=False,
            need_rows=0,
            names=("local", "global"),
        )
        if a.shape[0] < need:
            return a.sum() * 0.0 + ce * 0.0, False
        return structure_loss(a, b.detach(), structure), True

    proto, proto_on = term(P_local_protos, Q_global_protos, "prototype-level")
    inst, inst_on = term(Z_inst, Zglobal_inst, "instance-level")
    total = ce
    if proto_on and lam != 0.0:
        total = total + lam * proto
    if inst_on and gamma != 0.0:
        total = total + gamma * inst
    return FedSAFTerms(total, ce, proto, inst, proto_on, inst_on)
