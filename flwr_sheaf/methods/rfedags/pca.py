"""Federated PCA on the Stiefel manifold (notes/baselines-rfedags.md, s5.5): the RFedAGS paper's synthetic
problem and a planted problem that exposes the participation bias (s5.6). Cost of the authors' code::

    f_i(X) = -tr(X^T A_i X),   A_i = (1/S) sum_s z_s z_s^T,   F(X) = (1/N) sum_i f_i(X),   X in St(d, r)
"""

from __future__ import annotations

import numpy as np

from ...participation import check_probabilities
from .manifolds import Stiefel

__all__ = [
    "PCAProblem",
    "subspace_distance",
    "synthetic_pca_problem",
    "planted_pca_problem",
    "batch_indices",
    "check_sizes",
    "client_weights",
]


def check_sizes(**sizes: int) -> None:
    """Raise ``ValueError`` naming the first of ``sizes`` that is not a positive integer."""
    for name, v in sizes.items():
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def client_weights(weights: np.ndarray, n: int) -> np.ndarray:
    """``weights`` as float64 ``(n,)``; ValueError unless non-negative with a positive sum."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or np.any(w < 0) or not w.sum() > 0:
        raise ValueError(f"weights must be ({n},), non-negative, with a positive sum")
    return w


def _batch_rows(samples: np.ndarray, clients, batch: np.ndarray) -> np.ndarray:
    """``samples[clients[:, None], batch]`` for ``batch (m, B)``; ValueError on another shape."""
    idx = np.asarray(clients, dtype=int)
    b = np.asarray(batch, dtype=int)
    if b.ndim != 2 or b.shape[0] != idx.size:
        raise ValueError(f"batch must have shape ({idx.size}, B), got {b.shape}")
    return samples[idx[:, None], b]


def _top_eigenvectors(a: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """``(U (d, r), lam (d,))``: top-``r`` eigenvectors of ``sym(a)`` and all eigenvalues, descending."""
    lam, vec = np.linalg.eigh(0.5 * (a + a.T))
    order = np.argsort(lam)[::-1]
    return vec[:, order[:r]], lam[order]


def subspace_distance(x: np.ndarray, u: np.ndarray) -> float:
    """Projection distance ``||X X^T - U U^T||_F / sqrt(2)`` of two ``(d, r)`` orthonormal bases, in ``[0, sqrt(r)]``.

    Raises:
        ValueError: shape mismatch.
    """
    x, u = np.asarray(x, dtype=np.float64), np.asarray(u, dtype=np.float64)
    if x.shape != u.shape or x.ndim != 2:
        raise ValueError(
            f"subspace_distance needs two (d, r) matrices, got {x.shape} and {u.shape}"
        )
    return float(np.linalg.norm(x @ x.T - u @ u.T) / np.sqrt(2.0))


class PCAProblem:
    """Federated PCA ``min_{X in St(d, r)} F(X)``.

    Args:
        covariances: ``(N, d, d)`` symmetric matrices ``A_i``.
        r: components, ``1 <= r <= d``.
        samples: optional ``(N, S, d)`` samples with ``A_i = Z_i^T Z_i / S`` (for mini-batch gradients).

    Raises:
        ValueError: bad shapes, non-symmetric ``A_i`` (relative asymmetry > 1e-10), NaN/inf, or
            ``samples`` inconsistent with ``covariances``.
    """

    def __init__(self, covariances: np.ndarray, r: int, samples: np.ndarray | None = None) -> None:
        a = np.asarray(covariances, dtype=np.float64)
        if a.ndim != 3 or a.shape[1] != a.shape[2]:
            raise ValueError(f"covariances must have shape (N, d, d), got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError("covariances contain NaN/inf")
        asym = np.abs(a - np.swapaxes(a, 1, 2)).max()
        if asym > 1e-10 * max(1.0, float(np.abs(a).max())):
            raise ValueError(f"covariances must be symmetric (max |A - A^T| = {asym:.3e})")
        self.num_clients, self.d = int(a.shape[0]), int(a.shape[1])
        if int(r) != r or not 1 <= r <= self.d:
            raise ValueError(f"r must be an integer in [1, d={self.d}], got {r!r}")
        self.r = int(r)
        self.covariances = 0.5 * (a + np.swapaxes(a, 1, 2))
        self.mean_covariance = self.covariances.mean(axis=0)
        self.samples = None
        if samples is not None:
            z = np.asarray(samples, dtype=np.float64)
            if z.ndim != 3 or z.shape[0] != self.num_clients or z.shape[2] != self.d:
                raise ValueError(
                    f"samples must have shape ({self.num_clients}, S, {self.d}), got {z.shape}"
                )
            self.samples = z
        self.manifold = Stiefel(self.d, self.r)
        self._opt: tuple[np.ndarray, float, np.ndarray] | None = None

    def local_costs(self, x: np.ndarray) -> np.ndarray:
        """``f_i(X)`` for all clients, ``(N,)``."""
        x = np.asarray(x, dtype=np.float64)
        return -np.einsum("dr,nde,er->n", x, self.covariances, x)

    def cost(self, x: np.ndarray) -> float:
        """``F(X) = -tr(X^T A X)``, ``A = mean_i A_i``."""
        x = np.asarray(x, dtype=np.float64)
        return float(-np.sum(x * (self.mean_covariance @ x)))

    def egrad(self, x: np.ndarray) -> np.ndarray:
        """Euclidean gradient ``-2 A X`` of ``F``."""
        return -2.0 * self.mean_covariance @ np.asarray(x, dtype=np.float64)

    def rgrad(self, x: np.ndarray) -> np.ndarray:
        """Riemannian gradient ``P_X(-2 A X)`` of ``F``."""
        return self.manifold.egrad2rgrad(x, self.egrad(x))

    def local_egrads(
        self, x: np.ndarray, clients: np.ndarray | list[int] | None = None
    ) -> np.ndarray:
        """Exact local gradients ``-2 A_i X`` at ``x`` (``(d, r)`` or one per client), ``(m, d, r)``; ``clients`` default all."""
        idx = np.arange(self.num_clients) if clients is None else np.asarray(clients, dtype=int)
        return -2.0 * (self.covariances[idx] @ np.asarray(x, dtype=np.float64))

    def minibatch_egrads(
        self, x: np.ndarray, clients: np.ndarray | list[int], batch: np.ndarray
    ) -> np.ndarray:
        """Mini-batch gradients ``-(2/B) Z_b^T (Z_b X)``, ``batch (m, B)`` sample indices per client -> ``(m, d, r)``.

        Raises:
            ValueError: no samples stored, or shape mismatch.
        """
        if self.samples is None:
            raise ValueError("this PCAProblem has no samples; mini-batch gradients are unavailable")
        zb = _batch_rows(self.samples, clients, batch)  # (m, B, d)
        return -(2.0 / zb.shape[1]) * (
            np.swapaxes(zb, 1, 2) @ (zb @ np.asarray(x, dtype=np.float64))
        )

    def optimum(self) -> tuple[np.ndarray, float]:
        """``(U (d, r), F*)``: the top-r eigenvectors of ``A`` and ``-sum`` of their eigenvalues (cached)."""
        if self._opt is None:
            u, lam = _top_eigenvectors(self.mean_covariance, self.r)
            self._opt = (u, float(-lam[: self.r].sum()), lam)
        return self._opt[0], self._opt[1]

    @property
    def eigengap(self) -> float:
        """``lambda_r - lambda_{r+1}`` of ``A`` (``inf`` if ``r = d``)."""
        self.optimum()
        assert self._opt is not None, "optimum() caches self._opt"
        lam = self._opt[2]
        return float("inf") if self.r == self.d else float(lam[self.r - 1] - lam[self.r])

    def gap(self, x: np.ndarray) -> float:
        """Optimality gap ``F(X) - F* >= 0``."""
        return self.cost(x) - self.optimum()[1]

    def reweighted_optimum(self, weights: np.ndarray) -> np.ndarray:
        """Minimiser ``(d, r)`` of ``sum_i w_i f_i``: where the uncorrected method converges with ``w = p~`` (Theorem 2.1).

        Raises:
            ValueError: ``weights`` not ``(N,)`` non-negative with a positive sum.
        """
        w = client_weights(weights, self.num_clients)
        return _top_eigenvectors(np.einsum("n,nde->de", w, self.covariances), self.r)[0]


def synthetic_pca_problem(
    num_clients: int = 40, d: int = 100, r: int = 5, samples_per_client: int = 100, seed: int = 0
) -> PCAProblem:
    """The paper's synthetic PCA data: client ``i = 1..N`` gets ``S`` samples ``(i/N) N(0, I_d)``.

    Args:
        num_clients, d, r, samples_per_client: ``N, d, r, S`` (paper: 40, 100, 5, 100).
        seed: numpy seed (the authors used MATLAB ``rng``; draws differ, statistics match).

    Raises:
        ValueError: non-positive sizes.
    """
    check_sizes(num_clients=num_clients, d=d, samples_per_client=samples_per_client)
    rng = np.random.default_rng([int(seed), 3])
    scale = (np.arange(1, num_clients + 1) / num_clients)[:, None, None]
    z = scale * rng.standard_normal((num_clients, samples_per_client, d))
    cov = np.swapaxes(z, 1, 2) @ z / samples_per_client
    return PCAProblem(cov, r, samples=z)


def planted_pca_problem(
    seed: int = 0,
    d: int = 20,
    num_frequent: int = 5,
    num_rare: int = 5,
    p_frequent: float = 0.9,
    p_rare: float = 0.2,
    spike_frequent: float = 2.0,
    spike_rare: float = 3.0,
    base: float = 0.1,
    noise: float = 0.005,
) -> tuple[PCAProblem, np.ndarray]:
    """Planted two-group PCA problem that exposes the participation bias (notes/baselines-rfedags.md, s5.5-s5.6).

    ``A_i = base * I + noise * sym(G_i) + spike_g (e_a e_a^T + e_b e_b^T)``, ``(a, b) = (0, 1)``
    (frequent) or ``(2, 3)`` (rare); ``r = 2``. With the defaults the optimum is ``span(e2, e3)``
    while the uncorrected method favours ``span(e0, e1)``.

    Args:
        seed: seed of the symmetric noise ``G_i``.
        base, noise: isotropic level and noise scale (``noise * ||sym(G)||`` below ``base`` keeps PSD).

    Returns:
        ``(problem, p)``: :class:`PCAProblem` (no samples) and ``(N,)`` probabilities.

    Raises:
        ValueError: ``d < 4`` or invalid probabilities.
    """
    if int(d) != d or d < 4:
        raise ValueError(f"d must be an integer >= 4, got {d!r}")
    rng = np.random.default_rng([int(seed), 5])
    n = num_frequent + num_rare
    g = rng.standard_normal((n, d, d))
    cov = base * np.eye(d) + noise * 0.5 * (g + np.swapaxes(g, 1, 2))
    cov[:num_frequent, 0, 0] += spike_frequent
    cov[:num_frequent, 1, 1] += spike_frequent
    cov[num_frequent:, 2, 2] += spike_rare
    cov[num_frequent:, 3, 3] += spike_rare
    p = check_probabilities([p_frequent] * num_frequent + [p_rare] * num_rare)
    return PCAProblem(cov, 2), p


def batch_indices(
    seed: int, server_round: int, client: int, num_steps: int, num_samples: int, batch_size: int
) -> np.ndarray:
    """Mini-batch indices of one client's local phase, deterministic in ``(seed, server_round, client)``.

    Args:
        seed, server_round, client: SeedSequence entropy ``[seed, 1, round, client]``.
        num_steps: ``K``, one batch per local step.
        batch_size: ``B`` in ``[1, S = num_samples]``.

    Returns:
        ``(K, B)`` int array: row ``k`` = first ``B`` of a fresh permutation of ``range(S)``.

    Raises:
        ValueError: ``batch_size`` not in ``[1, S]``.
    """
    if int(batch_size) != batch_size or not 1 <= batch_size <= num_samples:
        raise ValueError(f"batch_size must be in [1, S={num_samples}], got {batch_size!r}")
    rng = np.random.default_rng([int(seed), 1, int(server_round), int(client)])
    return np.stack([rng.permutation(num_samples)[:batch_size] for _ in range(int(num_steps))])
