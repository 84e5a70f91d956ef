"""Federated PCA on the Stiefel manifold: the RFedAGS paper's synthetic problem and a planted bias problem.

Cost convention (authors' code ``ConstructRFLPCAProb_St_.m``; docs/baselines-rfedags.md, s5.5)::

    f_i(X) = -tr(X^T A_i X),   A_i = (1/S) sum_s z_s z_s^T,   F(X) = (1/N) sum_i f_i(X),   X in St(d, r)

(no factor 1/2: the paper's step sizes 6e-3 / 2e-2 and the gap thresholds of check R4, docs/baselines-rfedags.md, s5.6, are in this
convention). Euclidean gradient ``-2 A_i X`` (mini-batch: ``-(2/B) Z_b^T Z_b X``), Riemannian gradient
its tangent projection. ``F* = -(sum of the top-r eigenvalues of A = mean_i A_i)``, attained by the
top-r eigenvectors ``U``.

Problems:

* :func:`synthetic_pca_problem`: the paper's synthetic PCA experiment / ``PCAStief_Syn_40.m`` (docs/baselines-rfedags.md, s5.5): client ``i = 1..N`` holds ``S``
  samples ``z ~ (i/N) N(0, I_d)``; ``(d, r, N, S) = (100, 5, 40, 100)``; ``p_i ~ U(0, 1)``.
  The pooled covariance is near-isotropic (top-r eigengap ~ 4e-3), so use the optimality gap, not the
  subspace distance, on this problem.
* :func:`planted_pca_problem`: check R3 of docs/baselines-rfedags.md, s5.5-s5.6 (the participation bias): 5 frequent
  clients (``p = 0.9``) with a spike 2.0 on ``e0, e1`` and 5 rare clients (``p = 0.2``) with a spike 3.0 on
  ``e2, e3``. ``F`` is minimised by ``span(e2, e3)``; the uncorrected mean over responders minimises
  ``F~ = sum_i p~_i f_i`` whose minimiser is ``span(e0, e1)`` (subspace distance sqrt(2) apart).

:func:`run_pca_reference` is the pure-numpy RFedAGS loop (participation -> K local steps -> server
step) that the Flower strategy is tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...participation import DEFAULT_Q_MIN, bernoulli_participation, check_probabilities
from .aggregation import (
    MODES,
    RFedAGSServer,
    effective_weights_uncorrected,
)
from .local import local_gradient_stream
from .manifolds import Stiefel

__all__ = [
    "PCAProblem",
    "subspace_distance",
    "top_eigenvectors",
    "synthetic_pca_problem",
    "planted_pca_problem",
    "batch_indices",
    "run_pca_reference",
]


def top_eigenvectors(a: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``r`` eigenpairs of a symmetric ``(d, d)`` matrix by ``numpy.linalg.eigh``.

    Args:
        a: ``(d, d)`` symmetric array-like (symmetrised as ``(a + a^T)/2`` first).
        r: number of leading eigenvectors, ``1 <= r <= d``.

    Returns:
        ``(U (d, r), lam (d,))``: orthonormal eigenvectors of the ``r`` largest eigenvalues (descending)
        and all eigenvalues in descending order, float64.

    Raises:
        ValueError: ``a`` not square or ``r`` not in ``[1, d]``.
    """
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"expected a square (d, d) matrix, got shape {a.shape}")
    if not 1 <= r <= a.shape[0]:
        raise ValueError(f"r must be in [1, {a.shape[0]}], got {r}")
    lam, vec = np.linalg.eigh(0.5 * (a + a.T))
    order = np.argsort(lam)[::-1]
    return vec[:, order[:r]], lam[order]


def subspace_distance(x: np.ndarray, u: np.ndarray) -> float:
    """Projection distance ``||X X^T - U U^T||_F / sqrt(2)`` between ``span(X)`` and ``span(U)``.

    Args:
        x, u: ``(d, r)`` matrices with orthonormal columns.

    Returns:
        float in ``[0, sqrt(r)]`` (= the 2-norm of the sines of the principal angles).

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
    """Federated PCA ``min_{X in St(d, r)} F(X) = (1/N) sum_i -tr(X^T A_i X)`` (docs/baselines-rfedags.md, s5.5).

    Args:
        covariances: ``(N, d, d)`` symmetric matrices ``A_i``.
        r: number of components, ``1 <= r <= d``.
        samples: optional ``(N, S, d)`` local samples with ``A_i = Z_i^T Z_i / S`` (needed only for
            mini-batch gradients).

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

    # --- costs and gradients -------------------------------------------------------------------
    def local_costs(self, x: np.ndarray) -> np.ndarray:
        """``f_i(X) = -tr(X^T A_i X)`` for all clients; ``X (d, r)`` -> ``(N,)`` float64."""
        x = np.asarray(x, dtype=np.float64)
        return -np.einsum("dr,nde,er->n", x, self.covariances, x)

    def cost(self, x: np.ndarray) -> float:
        """``F(X) = -tr(X^T A X)``, ``A = mean_i A_i``; ``X (d, r)`` -> float."""
        x = np.asarray(x, dtype=np.float64)
        return float(-np.sum(x * (self.mean_covariance @ x)))

    def egrad(self, x: np.ndarray) -> np.ndarray:
        """Euclidean gradient ``-2 A X`` of ``F``; ``(d, r)`` float64."""
        return -2.0 * self.mean_covariance @ np.asarray(x, dtype=np.float64)

    def rgrad(self, x: np.ndarray) -> np.ndarray:
        """Riemannian gradient ``P_X(-2 A X)`` of ``F``; ``(d, r)`` float64."""
        return self.manifold.egrad2rgrad(x, self.egrad(x))

    def local_egrads(
        self, x: np.ndarray, clients: np.ndarray | list[int] | None = None
    ) -> np.ndarray:
        """Exact local Euclidean gradients ``-2 A_i X_i``.

        Args:
            x: ``(d, r)`` (shared point) or ``(m, d, r)`` (one point per listed client).
            clients: ``m`` client indices (default all ``N``).

        Returns:
            ``(m, d, r)`` float64.

        Raises:
            IndexError: a client index outside ``[0, N)``.
        """
        idx = np.arange(self.num_clients) if clients is None else np.asarray(clients, dtype=int)
        return -2.0 * (self.covariances[idx] @ np.asarray(x, dtype=np.float64))

    def minibatch_egrads(
        self, x: np.ndarray, clients: np.ndarray | list[int], batch: np.ndarray
    ) -> np.ndarray:
        """Mini-batch Euclidean gradients ``-(2/B) Z_b^T (Z_b X)`` (docs/baselines-rfedags.md, s5.5; batch without replacement).

        Args:
            x: ``(d, r)`` or ``(m, d, r)``.
            clients: ``m`` client indices.
            batch: ``(m, B)`` sample indices per client.

        Returns:
            ``(m, d, r)`` float64.

        Raises:
            ValueError: no samples stored, or shape mismatch.
        """
        if self.samples is None:
            raise ValueError("this PCAProblem has no samples; mini-batch gradients are unavailable")
        idx = np.asarray(clients, dtype=int)
        b = np.asarray(batch, dtype=int)
        if b.ndim != 2 or b.shape[0] != idx.size:
            raise ValueError(f"batch must have shape ({idx.size}, B), got {b.shape}")
        zb = self.samples[idx[:, None], b]  # (m, B, d)
        return -(2.0 / b.shape[1]) * (
            np.swapaxes(zb, 1, 2) @ (zb @ np.asarray(x, dtype=np.float64))
        )

    # --- optimum -------------------------------------------------------------------------------
    def optimum(self) -> tuple[np.ndarray, float]:
        """Exact minimiser and minimum: ``(U (d, r) float64, F* float)`` from ``eigh(A)``;
        ``F* = -sum of the top-r eigenvalues`` of ``A = mean_i A_i`` (cached)."""
        if self._opt is None:
            u, lam = top_eigenvectors(self.mean_covariance, self.r)
            self._opt = (u, float(-lam[: self.r].sum()), lam)
        return self._opt[0], self._opt[1]

    @property
    def eigengap(self) -> float:
        """``lambda_r - lambda_{r+1}`` of ``A`` (``inf`` if ``r = d``): how well ``U`` is determined."""
        self.optimum()
        assert self._opt is not None, "optimum() caches self._opt"
        lam = self._opt[2]
        return float("inf") if self.r == self.d else float(lam[self.r - 1] - lam[self.r])

    def gap(self, x: np.ndarray) -> float:
        """Optimality gap ``F(X) - F* >= 0`` (float) of a point ``X (d, r)``: the metric of
        docs/baselines-rfedags.md, s5.5."""
        return self.cost(x) - self.optimum()[1]

    def reweighted_optimum(self, weights: np.ndarray) -> np.ndarray:
        """Minimiser ``U~ (d, r)`` of ``F~ = sum_i w_i f_i`` (top-r eigenvectors of ``sum_i w_i A_i``).

        With ``w = p~`` (:func:`~flwr_sheaf.methods.rfedags.aggregation.effective_weights_uncorrected`) this is
        where the uncorrected method converges (paper Theorem 2.1).

        Raises:
            ValueError: ``weights`` not ``(N,)`` or not non-negative with a positive sum.
        """
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (self.num_clients,) or np.any(w < 0) or not w.sum() > 0:
            raise ValueError(f"weights must be ({self.num_clients},), non-negative, positive sum")
        return top_eigenvectors(np.einsum("n,nde->de", w, self.covariances), self.r)[0]


def synthetic_pca_problem(
    num_clients: int = 40, d: int = 100, r: int = 5, samples_per_client: int = 100, seed: int = 0
) -> PCAProblem:
    """The paper's synthetic PCA data (docs/baselines-rfedags.md, s5.5): client ``i = 1..N`` gets ``S`` samples ``(i/N) N(0, I_d)``.

    Args:
        num_clients, d, r, samples_per_client: ``N, d, r, S`` (paper: 40, 100, 5, 100).
        seed: numpy seed (the authors used MATLAB ``rng``; draws differ, statistics match).

    Returns:
        :class:`PCAProblem` with ``samples`` ``(N, S, d)`` and ``A_i = Z_i^T Z_i / S``.

    Raises:
        ValueError: non-positive sizes.
    """
    for name, v in (
        ("num_clients", num_clients),
        ("d", d),
        ("samples_per_client", samples_per_client),
    ):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
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
    """Planted two-group PCA problem that exposes the participation bias (docs/baselines-rfedags.md, s5.5-s5.6, check R3).

    ``A_i = base * I + noise * sym(G_i) + spike_g (e_a e_a^T + e_b e_b^T)`` with ``(a, b) = (0, 1)`` for the
    frequent group and ``(2, 3)`` for the rare group; ``r = 2``. With the defaults the true optimum is
    ``span(e2, e3)`` (1.5 > 1.0 on average) while the uncorrected method's ``F~`` favours ``span(e0, e1)``.

    Args:
        seed: seed of the symmetric noise ``G_i`` (standard normal).
        d: dimension (>= 4).
        num_frequent, num_rare: group sizes.
        p_frequent, p_rare: participation probabilities of the groups.
        spike_frequent, spike_rare: spike strengths.
        base, noise: isotropic level and noise scale (``noise * ||sym(G)||`` must stay below ``base``
            for PSD covariances; the defaults give ``||.|| ~ 0.03``).

    Returns:
        ``(problem, p)``: :class:`PCAProblem` (no samples; exact gradients) and ``(N,)`` probabilities.

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
    """Mini-batch indices of one client's local phase (without replacement within each step).

    Deterministic in ``(seed, server_round, client)`` (SeedSequence entropy ``[seed, 1, round, client]``)
    so the Flower client and :func:`run_pca_reference` draw the same batches.

    Args:
        seed, server_round, client: the three seed components (non-negative ints).
        num_steps: ``K``, one batch per local step.
        num_samples: ``S``, the client's sample count.
        batch_size: ``B`` in ``[1, S]``.

    Returns:
        ``(K, B)`` int array, row ``k`` = first ``B`` entries of a fresh permutation of ``range(S)``.

    Raises:
        ValueError: ``batch_size`` not in ``[1, S]``.
    """
    if int(batch_size) != batch_size or not 1 <= batch_size <= num_samples:
        raise ValueError(f"batch_size must be in [1, S={num_samples}], got {batch_size!r}")
    rng = np.random.default_rng([int(seed), 1, int(server_round), int(client)])
    return np.stack([rng.permutation(num_samples)[:batch_size] for _ in range(int(num_steps))])


def run_pca_reference(
    problem: PCAProblem,
    p: np.ndarray,
    *,
    mode: str,
    num_rounds: int,
    local_steps: int,
    step_size: float | Callable[[int], float],
    x0: np.ndarray | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    q_min: float = DEFAULT_Q_MIN,
    global_step: float = 1.0,
    estimate_includes_current: bool = False,
    estimator: str = "plus-one",
    force_one_if_empty: bool = False,
    record_every: int = 1,
) -> dict:
    """Pure-numpy RFedAGS run on a PCA problem (docs/baselines-rfedags.md, s5, with the Bernoulli(p_i) participation of docs/participation.md, s1).

    Round ``t = 1..T``: ``S_t = bernoulli_participation(p, t, seed)``; every responder runs
    :func:`~flwr_sheaf.methods.rfedags.local.local_gradient_stream` from ``x_t`` with ``alpha_{t-1}`` (exact local
    gradients if ``batch_size`` is None, else mini-batches from :func:`batch_indices`); the server
    (:class:`~flwr_sheaf.methods.rfedags.aggregation.RFedAGSServer`) aggregates with the ``mode`` weights.
    Responders' local phases are batched into one call (identical maths, faster).

    Args:
        problem: the PCA problem.
        p: ``(N,)`` participation probabilities.
        mode: ``"corrected" | "known-p" | "uncorrected"``.
        num_rounds: ``T >= 1``.
        local_steps: ``K >= 1``.
        step_size: fixed ``alpha`` or callable ``t -> alpha_t`` (``t = round - 1``).
        x0: initial point ``(d, r)``; default a random Stiefel point seeded by ``seed``.
        seed: participation, mini-batch and default-``x0`` seed.
        batch_size: mini-batch size ``B`` (requires ``problem.samples``), None = exact gradients.
        q_min, global_step, estimate_includes_current: see ``RFedAGSServer``.
        estimator: ``"plus-one"`` or ``"empirical"`` (``RFedAGSServer``'s ``estimator_kind``).
        force_one_if_empty: see :func:`~flwr_sheaf.participation.bernoulli_participation`.
        record_every: record metrics at round 0, every ``record_every`` rounds and at ``T``.

    Returns:
        dict with lists ``rounds``, ``gap`` (``F(x_t) - F*``), ``dist`` (to ``U``), ``dist_reweighted`` (to the
        ``p~``-optimum ``U~``), ``num_responders``; scalars ``max_feasibility`` (max over *all* rounds of
        ``||X^T X - I||_F``), ``empty_rounds``; arrays ``x`` (final point), ``q`` (final frequency
        estimates), ``p_tilde``.

    Raises:
        ValueError: invalid arguments (mode, sizes, probabilities, step sizes).
    """
    probs = _check_reference_args(problem, p, mode, num_rounds, record_every)
    alpha = step_size if callable(step_size) else (lambda t, a=float(step_size): a)
    man = problem.manifold
    server = _reference_server(
        problem, probs, x0, seed, mode, q_min, global_step, estimate_includes_current, estimator
    )
    u_star, u_tilde, p_tilde = _targets(problem, probs)
    hist: dict = {"rounds": [], "gap": [], "dist": [], "dist_reweighted": [], "num_responders": []}
    _record(hist, problem, server.x, u_star, u_tilde, 0, 0)
    max_feas, empty = float(man.feasibility(server.x)), 0
    for t in range(1, int(num_rounds) + 1):
        mask = bernoulli_participation(probs, t, seed, force_one_if_empty)
        clients = np.flatnonzero(mask)
        zetas = np.zeros((problem.num_clients, problem.d, problem.r))
        if clients.size:
            zetas[clients] = _local_phase(
                problem, server.x, clients, t, alpha(t - 1), local_steps, seed, batch_size
            )
        else:
            empty += 1
        server.step(mask, zetas)
        max_feas = max(max_feas, float(man.feasibility(server.x)))
        if t % record_every == 0 or t == num_rounds:
            _record(hist, problem, server.x, u_star, u_tilde, t, int(clients.size))
    final = {"x": server.x.copy(), "q": server.estimator.estimate(), "p_tilde": p_tilde}
    return {**hist, "max_feasibility": max_feas, "empty_rounds": empty, **final}


def _targets(problem: PCAProblem, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distances' targets: the optimum ``U`` ``(d, r)``, the ``p~``-reweighted optimum ``U~``
    (``U`` when every ``p~`` is 0) and ``p~`` ``(N,)`` (uncorrected aggregation's effective weights)."""
    u_star, _ = problem.optimum()
    p_tilde = effective_weights_uncorrected(probs)
    u_tilde = problem.reweighted_optimum(p_tilde) if p_tilde.sum() > 0 else u_star
    return u_star, u_tilde, p_tilde


def _reference_server(
    problem: PCAProblem,
    probs: np.ndarray,
    x0: np.ndarray | None,
    seed: int,
    mode: str,
    q_min: float,
    global_step: float,
    estimate_includes_current: bool,
    estimator: str,
) -> RFedAGSServer:
    """The reference run's server at ``x0`` (checked on the manifold; default a random Stiefel
    point seeded by ``(seed, 2)``), with the arguments of :func:`run_pca_reference`."""
    man = problem.manifold
    if x0 is None:
        x0 = man.random_point(np.random.default_rng([int(seed), 2]))
    man.check_point(x0)
    return RFedAGSServer(
        man,
        x0,
        problem.num_clients,
        mode=mode,
        p=probs,
        q_min=q_min,
        global_step=global_step,
        estimate_includes_current=estimate_includes_current,
        estimator_kind=estimator,
    )


def _check_reference_args(
    problem: PCAProblem, p: np.ndarray, mode: str, num_rounds: int, record_every: int
) -> np.ndarray:
    """The checked participation probabilities ``(N,)`` of :func:`run_pca_reference`.

    Raises:
        ValueError: an unknown ``mode``, bad probabilities or not one per client, or
            ``num_rounds`` / ``record_every`` not a positive integer (value named).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    probs = check_probabilities(p)
    if probs.size != problem.num_clients:
        raise ValueError(f"p has {probs.size} entries, problem has {problem.num_clients} clients")
    if int(num_rounds) != num_rounds or num_rounds < 1:
        raise ValueError(f"num_rounds must be a positive integer, got {num_rounds!r}")
    if int(record_every) != record_every or record_every < 1:
        raise ValueError(f"record_every must be a positive integer, got {record_every!r}")
    return probs


def _local_phase(
    problem: PCAProblem,
    x: np.ndarray,
    clients: np.ndarray,
    t: int,
    a_t: float,
    local_steps: int,
    seed: int,
    batch_size: int | None,
) -> np.ndarray:
    """The responders' ``clients`` local phases of round ``t`` from ``x`` with step ``a_t``, batched
    into one :func:`~flwr_sheaf.methods.rfedags.local.local_gradient_stream` call (exact local
    gradients, or mini-batches from :func:`batch_indices`); returns their ``zeta`` ``(m, d, r)``."""
    if batch_size is None:

        def egrad(x, k, c=clients, b=None):  # b: same signature as the minibatch variant
            return problem.local_egrads(x, c)
    else:
        s = problem.samples.shape[1] if problem.samples is not None else 0
        bidx = np.stack(
            [batch_indices(seed, t, int(c), local_steps, s, batch_size) for c in clients]
        )  # (m, K, B)

        def egrad(x, k, c=clients, b=bidx):
            return problem.minibatch_egrads(x, c, b[:, k])

    return local_gradient_stream(problem.manifold, x, egrad, local_steps, a_t).zeta


def _record(
    hist: dict,
    problem: PCAProblem,
    x: np.ndarray,
    u_star: np.ndarray,
    u_tilde: np.ndarray,
    t: int,
    m: int,
) -> None:
    """Append round ``t``'s gap, distances to ``U`` and ``U~`` and responder count ``m`` to ``hist``."""
    hist["rounds"].append(t)
    hist["gap"].append(problem.gap(x))
    hist["dist"].append(subspace_distance(x, u_star))
    hist["dist_reweighted"].append(subspace_distance(x, u_tilde))
    hist["num_responders"].append(m)
