"""Whitening and colouring layers for the node stalks (paper Sec. 3, "Heterogeneous latent space
geometry", and App. G; design: notes/stability.md, s2).

Every encoder ends in a whitening layer (zero mean, identity covariance) and the head starts with
its exact left inverse, a colouring layer. Unlike the reference (docs/deviations.md, s4) it
decorrelates. Statistics and solves run in float64; buffers have the module's dtype, outputs the input's.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor, nn

__all__ = [
    "Whitening",
    "Colouring",
    "regularised_covariance",
    "low_variance_fraction",
    "effective_rank",
]

#: Absolute eigenvalue floor of every regularised covariance (an all-zero one stays factorisable).
ABS_FLOOR = 1e-8

_COMPUTE_DTYPE = torch.float64


def _check_matrix(z: Tensor, d: int | None, name: str, min_rows: int, finite: bool = True) -> None:
    """Validate a row-wise float sample matrix ``(M, d)``: shape, rows, (``finite``) no NaN/inf."""
    if not isinstance(z, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(z).__name__}")
    if not z.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {z.dtype}")
    if z.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (rows, d) matrix, got shape {tuple(z.shape)}")
    if d is not None and z.shape[1] != d:
        raise ValueError(
            f"{name} must have shape (B, d={d}) (the layer's stalk dimension), got {tuple(z.shape)}"
        )
    if z.shape[0] < min_rows:
        raise ValueError(
            f"{name} needs at least {min_rows} rows (an unbiased covariance needs B >= 2), "
            f"got B={z.shape[0]}"
        )
    if finite and not bool(torch.isfinite(z).all()):
        bad = int((~torch.isfinite(z)).sum())
        raise ValueError(f"{name} contains {bad} non-finite (NaN or inf) entries")


def _mean_cov(z: Tensor) -> tuple[Tensor, Tensor]:
    """Mean ``(d,)`` and unbiased covariance ``(d, d)`` of ``z (M, d)`` in float64 (differentiable)."""
    z64 = z.to(_COMPUTE_DTYPE)
    mu = z64.mean(dim=0)
    zc = z64 - mu
    cov = zc.mT @ zc / (z64.shape[0] - 1)
    return mu, 0.5 * (cov + cov.mT)


def regularised_covariance(cov: Tensor, shrinkage: float = 0.0, eps: float = 1e-3) -> Tensor:
    """``Sigma_reg = (1 - shrinkage) Sigma + shrinkage diag(Sigma) + (eps trace(Sigma) / d + 1e-8) I``.

    Args:
        cov: symmetric PSD ``(d, d)`` float tensor ``Sigma``.
        eps: relative eigenvalue floor ``>= 0``.

    Returns:
        ``(d, d)`` tensor like ``cov`` (differentiable), smallest eigenvalue ``>= eps trace / d + 1e-8``.

    Raises:
        ValueError: if ``cov`` is not square 2-D, or ``shrinkage``/``eps`` are out of range.
    """
    if cov.ndim != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"cov must be a square (d, d) matrix, got shape {tuple(cov.shape)}")
    _check_hyper(shrinkage, eps)
    d = cov.shape[0]
    diag = torch.diagonal(cov)
    eye = torch.eye(d, dtype=cov.dtype, device=cov.device)
    floor = eps * diag.sum() / d + ABS_FLOOR
    return (1.0 - shrinkage) * cov + shrinkage * torch.diag_embed(diag) + floor * eye


def _check_hyper(shrinkage: float, eps: float) -> None:
    if not (0.0 <= float(shrinkage) <= 1.0):
        raise ValueError(f"shrinkage must lie in [0, 1], got shrinkage={shrinkage}")
    if not (float(eps) >= 0.0 and math.isfinite(float(eps))):
        raise ValueError(f"eps must be a finite number >= 0, got eps={eps}")


class Whitening(nn.Module):
    """Cholesky whitening of a ``d``-dimensional stalk (paper Sec. 3; App. G: fitted on pilot latents).

    ``zhat = (z - mu) @ L^{-T}``, ``L = cholesky(Sigma_reg)`` (:func:`regularised_covariance`; ZCA up
    to a rotation the maps absorb: notes/stability.md, s2.3). Like ``nn.BatchNorm1d``, train mode uses
    the batch's statistics (``B >= 2``) and updates ``running_mean (d,)`` (init 0) and ``running_cov
    (d, d)`` (init ``I``) by EMA with ``momentum``; eval mode uses the running ones (``L`` cached).
    ``shrinkage`` and ``eps`` as in :func:`regularised_covariance` (``eps`` bounds :meth:`max_gain`).

    Args:
        momentum: EMA weight of the newest batch, in ``(0, 1]``.
        check_finite: check inputs for NaN/inf and train-mode Cholesky failures (device syncs;
            :meth:`fit` always checks).

    Raises:
        ValueError: on a non-positive ``d`` or out-of-range ``shrinkage``/``eps``/``momentum``.
    """

    running_mean: Tensor
    running_cov: Tensor

    def __init__(
        self,
        d: int,
        shrinkage: float = 0.0,
        eps: float = 1e-3,
        momentum: float = 0.1,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            raise ValueError(f"d must be a positive int, got d={d!r}")
        _check_hyper(shrinkage, eps)
        if not (0.0 < float(momentum) <= 1.0):
            raise ValueError(f"momentum must lie in (0, 1], got momentum={momentum}")
        self.d = d
        self.shrinkage = float(shrinkage)
        self.eps = float(eps)
        self.momentum = float(momentum)
        self.check_finite = bool(check_finite)
        self.register_buffer("running_mean", torch.zeros(d, dtype=torch.float32))
        self.register_buffer("running_cov", torch.eye(d, dtype=torch.float32))
        self._cache: tuple[tuple, Tensor, Tensor] | None = None

    # ------------------------------------------------------------------ internals
    def _validate(self, z: Tensor, name: str, min_rows: int) -> None:
        _check_matrix(z, self.d, name, min_rows, finite=self.check_finite)

    def _cache_key(self) -> tuple:
        rm, rc = self.running_mean, self.running_cov
        buffers = (rm.data_ptr(), rc.data_ptr(), rm._version, rc._version, rm.device, rc.dtype)
        # factors computed under inference_mode cannot be saved for a later backward
        return (*buffers, self.shrinkage, self.eps, torch.is_inference_mode_enabled())

    def _running_factor(self) -> tuple[Tensor, Tensor]:
        """Cached ``(mu (d,), L (d, d))`` of the running statistics, float64, no grad."""
        key = self._cache_key()
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1], self._cache[2]
        with torch.no_grad():
            mu = self.running_mean.detach().to(_COMPUTE_DTYPE)
            cov = self.running_cov.detach().to(_COMPUTE_DTYPE)
            if not bool(torch.isfinite(cov).all() and torch.isfinite(mu).all()):
                raise ValueError("running statistics contain NaN or inf; refit with fit()")
            chol = _cholesky(regularised_covariance(0.5 * (cov + cov.mT), self.shrinkage, self.eps))
        self._cache = (key, mu, chol)
        return mu, chol

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def finite_checks(self, enabled: bool):
        """Temporarily turn the NaN/inf and Cholesky failure checks on or off (off: no device sync;
        non-finite values propagate and the caller must catch them)."""
        before = self.check_finite
        self.check_finite = bool(enabled) and before
        try:
            yield self
        finally:
            self.check_finite = before

    def forward(self, z: Tensor) -> Tensor:
        """Whiten latents ``z (B, d)`` to ``(B, d)`` in ``z``'s dtype (train mode differentiable).

        Raises:
            ValueError: wrong shape/``d``, non-finite entries, or ``B < 2`` in train mode.
        """
        if self.training:
            self._validate(z, "z", min_rows=2)
            mu, cov = _mean_cov(z)
            chol = _cholesky(
                regularised_covariance(cov, self.batch_shrinkage(z.shape[0]), self.eps),
                check=self.check_finite,
            )
            with torch.no_grad():
                for buf, new in ((self.running_mean, mu), (self.running_cov, cov)):
                    buf.mul_(1.0 - self.momentum).add_(
                        new.detach().to(buf.dtype), alpha=self.momentum
                    )
            self._cache = None  # the eval-mode factor is stale
        else:
            self._validate(z, "z", min_rows=0)
            mu, chol = self._running_factor()
        zc = z.to(_COMPUTE_DTYPE) - mu
        # zhat = zc @ L^{-T}  <=>  zhat @ L^T = zc.
        zhat = torch.linalg.solve_triangular(chol.mT, zc, upper=True, left=False)
        return zhat.to(z.dtype)

    def batch_shrinkage(self, batch_size: int) -> float:
        """Shrinkage of a train-mode batch of ``B = batch_size`` rows: ``max(shrinkage, 1 - (B - 1) / d)``
        clipped to ``[shrinkage, 1]`` (notes/stability.md, s2.4)."""
        return max(self.shrinkage, min(1.0, max(0.0, 1.0 - (batch_size - 1) / self.d)))

    @torch.no_grad()
    def fit(self, z: Tensor) -> Whitening:
        """Set the running statistics exactly from a sample ``z (M, d)``, ``M >= 2`` (no EMA, no
        grad; paper App. G); returns ``self``.

        Raises:
            ValueError: wrong shape/``d``, ``M < 2`` or non-finite entries.
        """
        _check_matrix(z, self.d, "z", min_rows=2)
        mu, cov = _mean_cov(z.detach())
        self.running_mean.copy_(mu.to(self.running_mean.dtype))
        self.running_cov.copy_(cov.to(self.running_cov.dtype))
        self._cache = None  # the eval-mode factor is stale
        return self

    def whitened_covariance_target(self) -> Tensor:
        """Covariance ``L^{-1} Sigma L^{-T} (d, d)`` of eval-mode whitened data whose covariance is
        the running ``Sigma`` (``~I`` for ``shrinkage = 0`` and a negligible floor), in
        ``running_cov``'s dtype; ValueError when the running statistics are non-finite."""
        chol = self._running_factor()[1]
        cov = self.running_cov.detach().to(_COMPUTE_DTYPE)
        half = torch.linalg.solve_triangular(chol, 0.5 * (cov + cov.mT), upper=False)  # L^{-1} S
        target = torch.linalg.solve_triangular(chol, half.mT, upper=False)  # L^{-1} S L^{-T}
        return (0.5 * (target + target.mT)).to(self.running_cov.dtype)

    def max_gain(self) -> float:
        """Bound ``1 / sqrt(eps * trace(Sigma) / d + 1e-8)`` on the eval-mode whitening's operator
        norm (notes/stability.md, s2.2)."""
        tr = float(torch.diagonal(self.running_cov.detach().to(_COMPUTE_DTYPE)).sum())
        return 1.0 / math.sqrt(self.eps * max(tr, 0.0) / self.d + ABS_FLOOR)

    def extra_repr(self) -> str:
        return f"d={self.d}, shrinkage={self.shrinkage}, eps={self.eps}, momentum={self.momentum}"


def _cholesky(mat: Tensor, check: bool = True) -> Tensor:
    """Cholesky factor; ValueError if not positive definite (``check=False``: no device sync)."""
    chol, info = torch.linalg.cholesky_ex(mat)
    if check and bool((info != 0).any()):
        raise ValueError(
            "regularised covariance is not positive definite (non-finite statistics?); "
            f"cholesky failed at minor {int(info)}"
        )
    return chol


class Colouring(nn.Module):
    """Exact left inverse of a :class:`Whitening` layer's eval-mode transform (paper Sec. 3: the
    head's colouring layer): ``z = zhat @ L^T + mu`` with the running statistics, in any mode.

    ``whitening`` is held by reference, not as a submodule (its buffers are stored once).

    Raises:
        TypeError: if ``whitening`` is not a :class:`Whitening`.
    """

    def __init__(self, whitening: Whitening) -> None:
        super().__init__()
        if not isinstance(whitening, Whitening):
            raise TypeError(f"whitening must be a Whitening layer, got {type(whitening).__name__}")
        self._whitening_ref = [whitening]  # plain list: not a submodule, no duplicate buffers

    @property
    def whitening(self) -> Whitening:
        """The referenced whitening layer."""
        return self._whitening_ref[0]

    @property
    def d(self) -> int:
        """Stalk dimension."""
        return self.whitening.d

    def forward(self, zhat: Tensor) -> Tensor:
        """Colour whitened latents ``zhat (B, d)`` to ``z (B, d)`` (``zhat``'s dtype, differentiable).

        Raises:
            ValueError: wrong shape/``d`` or non-finite entries.
        """
        w = self.whitening
        w._validate(zhat, "zhat", min_rows=0)
        mu, chol = w._running_factor()
        z = zhat.to(_COMPUTE_DTYPE) @ chol.mT + mu
        return z.to(zhat.dtype)

    def extra_repr(self) -> str:
        return f"d={self.d} (inverse of a shared Whitening layer)"


def low_variance_fraction(z: Tensor, threshold: float = 1e-3) -> float:
    """Fraction of latent dimensions with unbiased variance below ``threshold`` (latent collapse,
    notes/stability.md, s1 and s3) of ``z (M, d)``, ``M >= 2``: a float in ``[0, 1]``.

    Raises:
        ValueError: bad shape, ``M < 2``, non-finite entries or negative ``threshold``.
    """
    _check_matrix(z, None, "z", min_rows=2)
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0, got threshold={threshold}")
    var = z.detach().to(_COMPUTE_DTYPE).var(dim=0, unbiased=True)
    return float((var < threshold).to(_COMPUTE_DTYPE).mean())


def effective_rank(z: Tensor) -> float:
    """Participation-ratio effective rank ``trace(C)^2 / ||C||_F^2`` of the covariance of ``z``
    ``(M, d)``, ``M >= 2`` (dimensional collapse, notes/stability.md, s1 and s3): a float in
    ``[1, d]``, 0.0 for a constant sample.

    Raises:
        ValueError: bad shape, ``M < 2`` or non-finite entries.
    """
    _check_matrix(z, None, "z", min_rows=2)
    _, cov = _mean_cov(z.detach())
    fro2 = float((cov * cov).sum())
    if fro2 == 0.0:
        return 0.0
    return float(torch.diagonal(cov).sum()) ** 2 / fro2
