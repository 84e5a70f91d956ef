"""Client side of RFedAGS (notes/baselines-rfedags.md, s5.2): ``K`` local Riemannian SGD steps from the
server point and the transported gradient stream ``zeta = sum_k T_{x_{t,k} -> x_t}(-alpha_t eta_k)``
in ``T_{x_t} M``, uploaded instead of the end point (the authors' sign convention: the server adds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .manifolds import Manifold

__all__ = ["GradientStream", "check_local_steps", "local_gradient_stream", "step_size_schedule"]


@dataclass
class GradientStream:
    """Result of one client's local phase.

    Attributes:
        steps: ``(K, *batch, *point_shape)`` float64 transported vectors ``T_{x_{t,k} -> x_t}(-alpha_t eta_k)``.
        endpoint: ``(*batch, *point_shape)`` float64 local end point ``x_{t,K}`` (never uploaded by RFedAGS).
    """

    steps: np.ndarray
    endpoint: np.ndarray

    @property
    def zeta(self) -> np.ndarray:
        """Gradient stream ``zeta = sum_k steps[k]`` (notes/baselines-rfedags.md, s5.2)."""
        return self.steps.sum(axis=0)


def local_gradient_stream(
    manifold: Manifold,
    x: np.ndarray,
    egrad_fn: Callable[[np.ndarray, int], np.ndarray],
    num_steps: int,
    step_size: float,
) -> GradientStream:
    """``K`` local Riemannian SGD steps from ``x_t`` and their gradient stream (notes/baselines-rfedags.md, s5.2).

    Args:
        manifold: manifold with ``egrad2rgrad``, ``retr``, ``transp``.
        x: server point ``x_t``, ``point_shape``.
        egrad_fn: ``egrad_fn(point, k)``: Euclidean (mini-batch) gradient at step ``k``. It may return
            ``(B, *point_shape)`` for ``B`` clients sharing ``x``; from step 1 on it then gets the
            ``(B, *point_shape)`` iterates and must return that shape.
        num_steps: ``K >= 1``.
        step_size: ``alpha_t > 0``.

    Returns:
        :class:`GradientStream` (float64).

    Raises:
        ValueError: bad ``K`` or ``alpha_t``, a gradient of the wrong shape or with NaN/inf entries.
    """
    check_local_steps(num_steps, step_size)
    x_t = np.array(x, dtype=np.float64, copy=True)
    pshape = tuple(manifold.point_shape)
    if x_t.shape != pshape:
        raise ValueError(f"server point has shape {x_t.shape}, expected {pshape}")
    xk = x_t
    steps = []
    batch_shape: tuple[int, ...] | None = None
    for k in range(int(num_steps)):
        g = np.asarray(egrad_fn(xk, k), dtype=np.float64)
        if g.shape[len(g.shape) - len(pshape) :] != pshape:
            raise ValueError(
                f"egrad_fn returned shape {g.shape} at step {k}; expected (..., {pshape})"
            )
        if batch_shape is None:
            batch_shape = g.shape[: g.ndim - len(pshape)]
        elif g.shape != batch_shape + pshape:
            raise ValueError(
                f"egrad_fn returned shape {g.shape} at step {k}; expected {batch_shape + pshape}"
            )
        if not np.all(np.isfinite(g)):
            raise ValueError(f"egrad_fn returned NaN/inf entries at step {k}")
        v = -step_size * manifold.egrad2rgrad(xk, g)
        steps.append(v if k == 0 else manifold.transp(xk, x_t, v))
        xk = manifold.retr(xk, v)
    return GradientStream(np.stack(steps), np.asarray(xk))


def check_local_steps(num_steps: int, step_size: float) -> None:
    """Raise ``ValueError`` unless ``num_steps`` is a positive integer and ``step_size`` positive and finite."""
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps (K) must be a positive integer, got {num_steps!r}")
    if not (np.isfinite(step_size) and step_size > 0):
        raise ValueError(f"step_size (alpha_t) must be positive and finite, got {step_size!r}")


def step_size_schedule(alpha0: float, decay_rounds: float = 0.0) -> Callable[[int], float]:
    """Local step schedule ``alpha_t = alpha0 / (1 + t / decay_rounds)`` (``t = 0, 1, ...``).

    ``decay_rounds = 0``: the paper's fixed step; ``> 0``: its decaying-step theorem with ``p = 1``
    (notes/baselines-rfedags.md, s5.2 and s5.6).

    Raises:
        ValueError: invalid ``alpha0`` or ``decay_rounds``; the callable raises for ``t < 0``.
    """
    if not (np.isfinite(alpha0) and alpha0 > 0):
        raise ValueError(f"alpha0 must be positive and finite, got {alpha0!r}")
    if not (np.isfinite(decay_rounds) and decay_rounds >= 0):
        raise ValueError(f"decay_rounds must be >= 0, got {decay_rounds!r}")

    def alpha(t: int) -> float:
        if t < 0:
            raise ValueError(f"round index t must be >= 0, got {t}")
        return float(alpha0) if decay_rounds == 0 else float(alpha0) / (1.0 + t / decay_rounds)

    return alpha
