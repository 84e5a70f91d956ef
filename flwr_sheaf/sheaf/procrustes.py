"""Closed-form restriction-map update (paper Eq. 18, sub-problems P2a / P2b): the polar factor of
``A_h^T A_t``, exact for any pilots (unlike the reference's projection: docs/deviations.md, s3).
"""

from __future__ import annotations

import torch

__all__ = ["check_pilots", "procrustes", "polar_factor", "svd_count", "SvdCounter"]


def check_pilots(
    a: torch.Tensor, name: str, d: int | None = None, k: int | None = None, finite: bool = True
) -> None:
    """Validate a row-wise pilot matrix ``a (K, d)`` (the paper's A_i is ``d x K``), named ``name`` in
    errors, against the expected ``d`` and ``k`` if given; ``finite`` checks NaN/inf (a device sync).

    Raises:
        ValueError: not 2-D, wrong ``d`` or ``K``, or (``finite``) any NaN / inf entry.
    """
    if a.ndim != 2:
        raise ValueError(f"{name}: expected a (K, d) matrix, got shape {tuple(a.shape)}")
    if d is not None and a.shape[1] != d:
        raise ValueError(
            f"{name}: stalk dimension mismatch, expected d={d}, got shape {tuple(a.shape)}"
        )
    if k is not None and a.shape[0] != k:
        raise ValueError(f"{name}: expected K={k} pilot rows, got shape {tuple(a.shape)}")
    if finite and not torch.isfinite(a).all():
        bad = int((~torch.isfinite(a)).sum())
        raise ValueError(f"{name}: {bad} NaN/inf entries in pilot matrix of shape {tuple(a.shape)}")


_SVDS = 0


def svd_count() -> int:
    """SVDs :func:`polar_factor` has computed in this process (unlocked; use :class:`SvdCounter`)."""
    return _SVDS


class SvdCounter:
    """Context manager counting the SVDs computed in its block: ``with SvdCounter() as c:
    procrustes(a, b)`` leaves ``c.n == 1``."""

    def __enter__(self) -> SvdCounter:
        self._start, self.n = _SVDS, 0
        return self

    def __exit__(self, *exc) -> None:
        self.n = _SVDS - self._start


def polar_factor(c: torch.Tensor) -> torch.Tensor:
    """Orthonormal polar factor ``U W^T`` (thin SVD ``c = U S W^T``) of a float ``c (m, n)``, ``m >= n``.

    Returns:
        ``(m, n)`` maximiser of ``tr(V^T c)`` over ``St(m, n)`` (determinant -1 kept), computed in
        float64, in ``c``'s dtype.

    Raises:
        ValueError: if ``m < n`` or ``c`` has NaN/inf entries.
    """
    if c.ndim != 2 or c.shape[0] < c.shape[1]:
        raise ValueError(f"polar_factor needs an (m, n) matrix with m >= n, got {tuple(c.shape)}")
    if not torch.isfinite(c).all():
        raise ValueError("polar_factor: cross-covariance has NaN/inf entries")
    global _SVDS
    _SVDS += 1
    u, _, wh = torch.linalg.svd(c.double(), full_matrices=False)
    return (u @ wh).to(c.dtype)


def procrustes(a_head: torch.Tensor, a_tail: torch.Tensor) -> torch.Tensor:
    """Fit the restriction map of one edge by orthogonal / Stiefel Procrustes (paper Eq. 18).

    Args:
        a_head: head pilots ``(K, d_h)``, rows paired with ``a_tail``.
        a_tail: tail pilots ``(K, d_t)``, ``d_t <= d_h``.

    Returns:
        ``V (d_h, d_t)``, ``V^T V = I``, minimising ``||a_head - a_tail V^T||_F`` (Eq. 11); float32
        unless the inputs are float64.

    Raises:
        ValueError: row counts differ, ``d_t > d_h``, or NaN/inf pilots.
    """
    check_pilots(a_head, "head pilots")
    check_pilots(a_tail, "tail pilots")
    if a_head.shape[0] != a_tail.shape[0]:
        raise ValueError(
            f"head and tail pilots must have the same rows K: {tuple(a_head.shape)} vs {tuple(a_tail.shape)}"
        )
    if a_tail.shape[1] > a_head.shape[1]:
        raise ValueError(
            f"orientation error: tail d_t={a_tail.shape[1]} exceeds head d_h={a_head.shape[1]}"
        )
    return polar_factor(a_head.detach().T @ a_tail.detach())
