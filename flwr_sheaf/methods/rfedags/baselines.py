"""RFedAvg, RFedSVRG and RFedProj maths, after the authors' ``RFed*_.m`` (notes/baselines-rfedags.md, s5.8).

Aggregations take the weights of :func:`~flwr_sheaf.methods.rfedags.aggregation.participation_weights`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

import numpy as np

from .aggregation import server_update, weighted_uploads
from .local import check_local_steps
from .manifolds import Manifold, ProjectionManifold

__all__ = [
    "BASELINES",
    "require_projection",
    "average_endpoints",
    "svrg_local_steps",
    "projection_local_steps",
    "projection_correction",
    "average_ambient",
]

#: Baseline method names (``rfedags`` itself lives in :mod:`~flwr_sheaf.methods.rfedags.aggregation`).
BASELINES = ("rfedavg", "rfedsvrg", "rfedproj")


def require_projection(manifold: Manifold) -> ProjectionManifold:
    """``manifold`` typed as a :class:`ProjectionManifold`; ``ValueError`` unless it is compact,
    embedded, with a metric projection (Stiefel, sphere; not SPD, Poincaré ball).
    """
    if not getattr(manifold, "compact_embedded", False) or not hasattr(
        manifold, "ambient_projection"
    ):
        raise ValueError(
            f"RFedProj needs a compact embedded submanifold with a metric projection (Stiefel, sphere); "
            f"{manifold!r} is not one: use rfedags, rfedavg or rfedsvrg on it"
        )
    return cast(ProjectionManifold, manifold)


def average_endpoints(
    manifold: Manifold,
    x: np.ndarray,
    endpoints: np.ndarray | Mapping[int, np.ndarray],
    weights: np.ndarray,
    global_step: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """RFedAvg / RFedSVRG server step ``x_{t+1} = R_{x_t}(varpi sum_i w_i R^{-1}_{x_t}(x_i))``.

    Args:
        manifold: the manifold.
        x: server point ``x_t``, ``point_shape``.
        endpoints: ``(N, *point_shape)`` or ``{client: point}``.
        weights: ``(N,)``.
        global_step: ``varpi > 0``.

    Returns:
        ``(x_{t+1}, direction)`` float64; an empty round keeps ``x_t`` exactly.

    Raises:
        ValueError: a missing/ill-shaped/non-finite or unreachable end point of a weighted client, a
            bad ``global_step``.
    """
    x = np.asarray(x, dtype=np.float64)
    direction = np.zeros_like(x)
    used = weighted_uploads(endpoints, weights, x.shape, "end point")
    if used:  # one batched inverse retraction for all responders
        tangents = manifold.invretr(x, np.stack([xi for _, _, xi in used]))
        direction = np.tensordot(np.array([wi for _, wi, _ in used]), tangents, axes=1)
    return server_update(manifold, x, direction, global_step), direction


def _egrad(egrad_fn: Callable[[np.ndarray, int], np.ndarray], x: np.ndarray, k: int) -> np.ndarray:
    """``egrad_fn(x, k)`` as float64; ValueError on NaN/inf entries."""
    e = np.asarray(egrad_fn(x, k), dtype=np.float64)
    if not np.all(np.isfinite(e)):
        raise ValueError(f"egrad_fn returned NaN/inf entries at step {k}")
    return e


def svrg_local_steps(
    manifold: Manifold,
    x: np.ndarray,
    full_grad: np.ndarray,
    egrad_fn: Callable[[np.ndarray, int], np.ndarray],
    num_steps: int,
    step_size: float,
) -> np.ndarray:
    """RFedSVRG client: ``K`` variance-reduced steps from ``x_t`` (``localSVRG`` of ``RFedSVRG_.m``).

    ``eta_k = grad f_i(x_k; B_k) - T_{x_t -> x_k}(grad f_i(x_t; B_k) - g_t)``,
    ``x_{k+1} = R_{x_k}(-alpha eta_k)``.

    Args:
        manifold: the manifold.
        x: server point ``x_t``.
        full_grad: ``g_t in T_{x_t} M``.
        egrad_fn: as in :func:`~flwr_sheaf.methods.rfedags.local.local_gradient_stream`.
        num_steps: ``K >= 1``.
        step_size: ``alpha > 0``.

    Returns:
        float64 end point(s) ``x_K``, ``(*batch, *point_shape)``.

    Raises:
        ValueError: bad ``K``/``alpha``, non-finite gradients.
    """
    check_local_steps(num_steps, step_size)
    x_t = np.asarray(x, dtype=np.float64)
    g_t = np.asarray(full_grad, dtype=np.float64)
    xk = x_t
    for k in range(int(num_steps)):
        e1, e0 = _egrad(egrad_fn, xk, k), _egrad(egrad_fn, x_t, k)
        eta = manifold.egrad2rgrad(xk, e1) - manifold.transp(
            x_t, xk, manifold.egrad2rgrad(x_t, e0) - g_t
        )
        xk = manifold.retr(xk, -step_size * eta)
    return np.asarray(xk)


def projection_local_steps(
    manifold: Manifold,
    x_mid: np.ndarray,
    correction: np.ndarray | float,
    egrad_fn: Callable[[np.ndarray, int], np.ndarray],
    num_steps: int,
    step_size: float,
) -> tuple[np.ndarray, np.ndarray]:
    """RFedProj client: ``K`` projected steps from ``P_M(x^mid)`` (``localUpdate`` of ``RFedProj_.m``).

    ``z^_0 = z_0 = P_M(x^mid)``; ``eta_k = grad f_i(z_k; B_k)``; ``z^_{k+1} = z^_k - alpha (eta_k + c)``;
    ``z_{k+1} = P_M(z^_{k+1})``.

    Args:
        manifold: compact embedded manifold (:func:`require_projection`).
        x_mid: server ambient point ``x^mid``, ``point_shape``.
        correction: ``c_i`` (``point_shape``, a ``(B, *point_shape)`` stack, or 0).
        egrad_fn, num_steps, step_size: as :func:`svrg_local_steps`.

    Returns:
        ``(z^_K, zeta)``: ambient end point(s) and mean Riemannian gradient ``(1/K) sum_k eta_k``.

    Raises:
        ValueError: a manifold RFedProj refuses, bad ``K``/``alpha``, non-finite gradients.
    """
    proj_manifold = require_projection(manifold)
    check_local_steps(num_steps, step_size)
    c = np.asarray(correction, dtype=np.float64)
    z = proj_manifold.ambient_projection(np.asarray(x_mid, dtype=np.float64))
    z_hat = z
    zeta: np.ndarray | float = 0.0
    for k in range(int(num_steps)):
        eta = manifold.egrad2rgrad(z, _egrad(egrad_fn, z, k))
        z_hat = z_hat - step_size * (eta + c)
        z = proj_manifold.ambient_projection(z_hat)
        zeta = zeta + eta
    return np.asarray(z_hat), np.asarray(zeta) / int(num_steps)


def projection_correction(
    manifold: Manifold,
    x_mid_prev: np.ndarray,
    x_mid: np.ndarray,
    zeta_prev: np.ndarray,
    num_steps: int,
    step_size: float,
    global_step: float = 1.0,
) -> np.ndarray:
    """RFedProj's ``c_i = (P_M(x^mid_{t-1}) - x^mid_t)/(K alpha eta_g) - zeta_i^{t-1}`` (previous round's responders; others 0).

    Raises:
        ValueError: a manifold RFedProj refuses; non-positive ``K``, ``alpha`` or ``eta_g``.
    """
    proj_manifold = require_projection(manifold)
    if not (num_steps >= 1 and step_size > 0 and global_step > 0):
        raise ValueError(
            f"need K >= 1, alpha > 0, eta_g > 0; got {num_steps!r}, {step_size!r}, {global_step!r}"
        )
    common = (
        proj_manifold.ambient_projection(x_mid_prev) - np.asarray(x_mid, dtype=np.float64)
    ) / (num_steps * step_size * global_step)
    return common - np.asarray(zeta_prev, dtype=np.float64)


def average_ambient(
    manifold: Manifold,
    x_mid: np.ndarray,
    z_hats: np.ndarray | Mapping[int, np.ndarray],
    weights: np.ndarray,
    global_step: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """RFedProj server step ``x^mid_{t+1} = P_M(x^mid_t) + eta_g sum_i w_i (z^_i - P_M(x^mid_t))``.

    ``z_hats``: ``(N, *shape)`` or ``{client: z^}``; ``weights`` ``(N,)``; ``global_step`` ``eta_g > 0``
    (authors: 1). Returns ``(x^mid_{t+1}, P_M(x^mid_{t+1}))`` float64; an empty round keeps ``x^mid``.

    Raises:
        ValueError: a manifold RFedProj refuses, bad uploads, bad ``global_step``.
    """
    proj_manifold = require_projection(manifold)
    if not (np.isfinite(global_step) and global_step > 0):
        raise ValueError(f"global_step (eta_g) must be positive, got {global_step!r}")
    x_mid = np.asarray(x_mid, dtype=np.float64)
    used = weighted_uploads(z_hats, weights, x_mid.shape, "ambient end point")
    if not used:
        return x_mid.copy(), proj_manifold.ambient_projection(x_mid)
    base = proj_manifold.ambient_projection(x_mid)
    new = base + global_step * sum(wi * (zi - base) for _, wi, zi in used)
    return new, proj_manifold.ambient_projection(new)
