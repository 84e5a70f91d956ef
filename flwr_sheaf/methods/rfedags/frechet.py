"""Federated Fréchet (Karcher) means on SPD matrices and in the Poincaré ball (notes/baselines-rfedags.md, s5.7)::

    f_i(x) = (1/(2S)) sum_s d(x, a_{i,s})^2,   F(x) = (1/N) sum_i f_i(x),   x in M (Hadamard),

``grad f_i(x) = -(1/S) sum_s Log_x(a_{i,s})``; :func:`centralised_frechet_mean` is a geoopt reference.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from .manifolds import SPD, Manifold, PoincareBall
from .pca import _batch_rows, check_sizes, client_weights

__all__ = [
    "FrechetMeanProblem",
    "commuting_spd_problem",
    "symmetric_poincare_problem",
    "centralised_frechet_mean",
]


class FrechetMeanProblem:
    """Federated Fréchet mean ``min_x F(x)``.

    Args:
        manifold: a manifold with ``log`` and ``dist`` (SPD, Poincaré ball, sphere).
        points: ``(N, S, *point_shape)``, every entry on the manifold.
        optimum: the minimiser ``x*`` if known; else :meth:`optimum` raises until :meth:`set_optimum`.
        log_spectra: commuting SPD problems only: ``(Q (n, n), L (N, n))``, the shared eigenbasis and
            each client's mean log-eigenvalues (enables :meth:`weighted_optimum`).

    Raises:
        ValueError: a manifold without ``log``/``dist``; bad shapes; a point off the manifold.
    """

    def __init__(
        self,
        manifold: Manifold,
        points: np.ndarray,
        optimum: np.ndarray | None = None,
        log_spectra: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        if not (hasattr(manifold, "log") and hasattr(manifold, "dist")):
            raise ValueError(
                f"FrechetMeanProblem needs a manifold with log and dist, got {manifold!r}"
            )
        a = np.asarray(points, dtype=np.float64)
        k = len(manifold.point_shape)
        if a.ndim != 2 + k or a.shape[2:] != tuple(manifold.point_shape):
            raise ValueError(
                f"points must have shape (N, S, {', '.join(map(str, manifold.point_shape))}), got {a.shape}"
            )
        manifold.check_point(a.reshape(-1, *manifold.point_shape))
        self.manifold = manifold
        self.samples = a
        self.num_clients, self.num_samples = int(a.shape[0]), int(a.shape[1])
        self._opt: tuple[np.ndarray, float] | None = None
        if optimum is not None:
            self.set_optimum(optimum)
        self.log_spectra = log_spectra

    def set_optimum(self, x: np.ndarray) -> None:
        """Record the minimiser ``x*``; ValueError if it is off the manifold."""
        x = np.asarray(x, dtype=np.float64)
        self.manifold.check_point(x, atol=1e-6)
        self._opt = (x, self.cost(x))

    def local_costs(self, x: np.ndarray) -> np.ndarray:
        """``f_i(x)`` for all clients, ``(N,)``."""
        d = self.manifold.dist(np.asarray(x, dtype=np.float64), self.samples)
        return 0.5 * np.mean(d**2, axis=1)

    def cost(self, x: np.ndarray) -> float:
        """``F(x) = mean_i f_i(x)``."""
        return float(np.mean(self.local_costs(x)))

    def _egrads(self, x: np.ndarray, pts: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        k = len(self.manifold.point_shape)
        xb = x[:, None] if x.ndim > k else x  # (m, 1, *shape) against pts (m, S, *shape)
        rgrad = -np.mean(self.manifold.log(xb, pts), axis=1)
        return self.manifold.rgrad2egrad(x, rgrad)

    def local_egrads(
        self, x: np.ndarray, clients: np.ndarray | Sequence[int] | None = None
    ) -> np.ndarray:
        """Euclidean gradients of ``f_i`` at ``x`` (``point_shape`` or one point per client), ``(m, *point_shape)``; ``clients`` default all."""
        idx = np.arange(self.num_clients) if clients is None else np.asarray(clients, dtype=int)
        return self._egrads(x, self.samples[idx])

    def minibatch_egrads(
        self, x: np.ndarray, clients: np.ndarray | Sequence[int], batch: np.ndarray
    ) -> np.ndarray:
        """Mini-batch gradients over the points ``batch (m, B)`` of each listed client, ``(m, *point_shape)``; ValueError on a bad ``batch`` shape."""
        return self._egrads(x, _batch_rows(self.samples, clients, batch))

    def rgrad(self, x: np.ndarray) -> np.ndarray:
        """Riemannian gradient of ``F``: ``-(1/(NS)) sum Log_x(a)``."""
        x = np.asarray(x, dtype=np.float64)
        return -np.mean(self.manifold.log(x, self.samples), axis=(0, 1))

    def optimum(self) -> tuple[np.ndarray, float]:
        """``(x*, F(x*))``; ValueError if no optimum is known."""
        if self._opt is None:
            raise ValueError(
                "this FrechetMeanProblem has no known optimum; call set_optimum(centralised_frechet_mean(...))"
            )
        return self._opt

    def gap(self, x: np.ndarray) -> float:
        """Optimality gap ``F(x) - F(x*)``."""
        return self.cost(x) - self.optimum()[1]

    def distance_to_optimum(self, x: np.ndarray) -> float:
        """Geodesic distance ``d(x, x*)``."""
        return float(self.manifold.dist(np.asarray(x, dtype=np.float64), self.optimum()[0]))

    def weighted_optimum(self, weights: np.ndarray) -> np.ndarray:
        """Minimiser ``Q diag(exp(sum_i w_i L_i / sum_i w_i)) Q^T`` of ``sum_i w_i f_i``; ValueError
        without ``log_spectra`` (not a commuting SPD problem) or on bad weights."""
        if self.log_spectra is None:
            raise ValueError("weighted_optimum needs a commuting SPD problem (log_spectra)")
        w = client_weights(weights, self.num_clients)
        q, lspec = self.log_spectra
        return (q * np.exp(w @ lspec / w.sum())) @ q.T


def commuting_spd_problem(
    seed: int = 0,
    n: int = 3,
    num_frequent: int = 5,
    num_rare: int = 5,
    samples_per_client: int = 3,
    p_frequent: float = 0.9,
    p_rare: float = 0.4,
    spread: float = 1.0,
    noise: float = 0.3,
) -> tuple[FrechetMeanProblem, np.ndarray]:
    """Planted SPD Fréchet-mean problem with commuting matrices (closed-form optimum).

    Client ``i`` holds ``A_{i,s} = Q diag(exp(l_{i,s})) Q^T``, ``l_{i,s} = mu_g + noise * N(0, I_n)``,
    ``mu_g = +-spread * linspace(1, -1, n)`` (frequent: +, rare: -); ``x* = Q diag(exp(mean l)) Q^T``.

    Args:
        seed: numpy seed (entropy ``[seed, 6]``).
        p_frequent, p_rare: the groups' participation probabilities.
        spread, noise: log-spectrum offset of the groups and per-point noise.

    Returns:
        ``(problem, p)``: the problem (optimum and ``log_spectra`` set) and ``(N,)`` probabilities.

    Raises:
        ValueError: non-positive sizes.
    """
    check_sizes(n=n, samples_per_client=samples_per_client, num_frequent=num_frequent)
    rng = np.random.default_rng([int(seed), 6])
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    q = q * np.where(np.diag(r) < 0, -1.0, 1.0)
    mu = spread * np.linspace(1.0, -1.0, n)
    groups = np.array([1.0] * num_frequent + [-1.0] * num_rare)
    logs = groups[:, None, None] * mu + noise * rng.standard_normal(
        (groups.size, samples_per_client, n)
    )
    pts = np.einsum("ab,nsb,cb->nsac", q, np.exp(logs), q)
    pts = 0.5 * (pts + np.swapaxes(pts, -1, -2))
    lspec = logs.mean(axis=1)  # (N, n)
    x_star = (q * np.exp(lspec.mean(axis=0))) @ q.T
    p = np.array([p_frequent] * num_frequent + [p_rare] * num_rare)
    return FrechetMeanProblem(SPD(n), pts, optimum=x_star, log_spectra=(q, lspec)), p


def symmetric_poincare_problem(
    seed: int = 0,
    n: int = 2,
    num_pairs: int = 5,
    samples_per_client: int = 3,
    p_frequent: float = 0.9,
    p_rare: float = 0.4,
    centre: float = 0.5,
    noise: float = 0.15,
) -> tuple[FrechetMeanProblem, np.ndarray]:
    """Planted hyperbolic Fréchet-mean problem whose optimum is the origin.

    Clients ``0..P-1`` (frequent) hold ``S`` points ``Exp_0(centre e_0 + noise N(0, I))``, client
    ``i + P`` (rare) their negatives: the pooled set is symmetric under ``x -> -x``.

    Args:
        seed: numpy seed (entropy ``[seed, 7]``).
        num_pairs: ``P`` (``N = 2P``).
        centre, noise: tangent-space offset at the origin and noise scale.

    Raises:
        ValueError: non-positive sizes.
    """
    check_sizes(n=n, num_pairs=num_pairs, samples_per_client=samples_per_client)
    ball = PoincareBall(n)
    rng = np.random.default_rng([int(seed), 7])
    v = noise * rng.standard_normal((num_pairs, samples_per_client, n))
    v[..., 0] += centre
    half = ball.retr(np.zeros(n), v)
    pts = np.concatenate([half, -half])
    p = np.array([p_frequent] * num_pairs + [p_rare] * num_pairs)
    return FrechetMeanProblem(ball, pts, optimum=np.zeros(n)), p


def centralised_frechet_mean(
    manifold: Manifold,
    points: np.ndarray,
    weights: np.ndarray | None = None,
    steps: int = 100,
    lr: float = 0.5,
    x0: np.ndarray | None = None,
) -> np.ndarray:
    """Weighted Fréchet mean (float64, ``point_shape``) of ``points (N, S, *shape)`` by the centralised Karcher flow in geoopt (the reference).

    ``x <- Exp_x(lr * sum_i w_i (1/S) sum_s Log_x(a_{i,s}))`` with geoopt's torch maps. ``lr = 1``
    2-cycles in negative curvature (measured in the 3-ball); 0.5 converged there in 50 steps.

    Args:
        manifold: a manifold with a geoopt reference ``_geo`` (SPD, Poincaré ball).
        weights: ``(N,)`` non-negative client weights (default equal).
        x0: start point (default: the first point).

    Raises:
        ValueError: a manifold without a geoopt reference, bad weights.
    """
    import torch

    geo = getattr(manifold, "_geo", None)
    if geo is None:
        raise ValueError(
            f"centralised_frechet_mean needs a geoopt-backed manifold, got {manifold!r}"
        )
    a = np.asarray(points, dtype=np.float64)
    n_cl = a.shape[0]
    w = client_weights(np.ones(n_cl) if weights is None else weights, n_cl)
    k = len(manifold.point_shape)
    wt = torch.from_numpy(w / w.sum()).reshape((n_cl,) + (1,) * k)
    pts = torch.from_numpy(a.copy())
    x = torch.from_numpy((a[0, 0] if x0 is None else np.asarray(x0, dtype=np.float64)).copy())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        for _ in range(int(steps)):
            xb = x.reshape((1, 1) + tuple(manifold.point_shape)).expand_as(pts)
            g = (wt * geo.logmap(xb, pts).mean(dim=1)).sum(dim=0)
            x = geo.expmap(x, lr * g)
    return x.numpy().copy()
