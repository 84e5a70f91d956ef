"""Server side of RFedAGS (notes/baselines-rfedags.md, s5.3; authors' sign convention):
``x_{t+1} = R_{x_t}(varpi * sum_{i in S_t} w_i zeta_i)`` with the client streams ``zeta_i in T_{x_t} M``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ...participation import (
    DEFAULT_Q_MIN,
    FrequencyEstimator,
    check_probabilities,
    responded_mask,
)
from .manifolds import Manifold

__all__ = [
    "MODES",
    "participation_weights",
    "aggregate_streams",
    "weighted_uploads",
    "server_update",
    "effective_weights_uncorrected",
    "RoundResult",
    "RFedAGSServer",
]

#: Aggregation modes: frequency-corrected RFedAGS, RFedAGS with known p, uncorrected mean.
MODES = ("corrected", "known-p", "uncorrected")


def participation_weights(
    responded: np.ndarray | list[bool],
    mode: str,
    *,
    q: np.ndarray | None = None,
    p: np.ndarray | None = None,
    num_examples: np.ndarray | None = None,
) -> np.ndarray:
    """Aggregation weights ``w_i`` of one round (notes/baselines-rfedags.md, s5.3).

    Args:
        responded: ``(N,)`` bool mask of the responders ``S_t``.
        q: ``(N,)`` frequency estimates in ``(0, 1]`` (required for ``"corrected"``).
        p: ``(N,)`` true probabilities (required for ``"known-p"``).
        num_examples: optional ``(N,)`` positive sample counts ``n_i`` (``"uncorrected"`` only;
            default: the plain mean over responders).

    Returns:
        ``(N,)`` float64 weights, 0 for non-responders (all 0 when nobody responded). corrected:
        ``1/(q_i N)``; known-p: ``1/(p_i N)``; uncorrected: ``n_i / sum_{S_t} n_j``.

    Raises:
        ValueError: unknown ``mode``; missing/ill-shaped ``q``/``p``; a responder with ``q_i <= 0``,
            ``p_i <= 0`` or a non-positive ``num_examples`` entry.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if np.ndim(responded) != 1:
        raise ValueError(f"responded mask must be 1-D, got shape {np.shape(responded)}")
    n = int(np.shape(responded)[0])
    mask = responded_mask(responded, n)
    probs = np.empty(0)
    if mode in ("known-p", "corrected"):
        name = "p" if mode == "known-p" else "q"
        vec = p if mode == "known-p" else q
        if vec is None:
            raise ValueError(f"mode {mode!r} needs the vector {name}")
        probs = check_probabilities(vec, name)
        if probs.size != n:
            raise ValueError(f"{name} has {probs.size} entries but the responded mask has {n}")
    w = np.zeros(n, dtype=np.float64)
    if not mask.any():
        return w
    if mode in ("known-p", "corrected"):
        bad = np.flatnonzero(mask & (probs <= 0.0))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"client {i} responded but {name}[{i}] = {float(probs[i])}; weight 1/({name}_i N) undefined"
            )
        w[mask] = 1.0 / (probs[mask] * n)
        return w
    if num_examples is None:
        w[mask] = 1.0 / mask.sum()
        return w
    ne = np.asarray(num_examples, dtype=np.float64)
    if ne.shape != (n,):
        raise ValueError(f"num_examples must have shape ({n},), got {ne.shape}")
    bad = np.flatnonzero(mask & ~(ne > 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"num_examples[{i}] = {float(ne[i])} must be positive for a responder")
    w[mask] = ne[mask] / ne[mask].sum()
    return w


def weighted_uploads(
    vectors: np.ndarray | Mapping[int, np.ndarray],
    weights: np.ndarray,
    shape: tuple[int, ...],
    what: str,
) -> list[tuple[int, float, np.ndarray]]:
    """``(i, w_i, v_i)`` (``v_i`` float64) for the clients with ``w_i != 0``, in client order.

    Args:
        vectors: an ``(N, *shape)`` array (unweighted rows ignored) or ``{client: (*shape)}`` holding
            every weighted client.
        what: the vectors' name in error messages (``"stream"``, ...).

    Raises:
        ValueError: shape mismatch, a missing vector for a weighted client, or NaN/inf in a used one.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"weights must be 1-D, got shape {w.shape}")
    arr = None if isinstance(vectors, Mapping) else np.asarray(vectors)
    if arr is not None and arr.shape != (w.size, *shape):
        raise ValueError(f"{what}s must have shape {(w.size, *shape)}, got {arr.shape}")
    out: list[tuple[int, float, np.ndarray]] = []
    for i_np in np.flatnonzero(w != 0.0):
        i = int(i_np)
        if arr is None and i not in vectors:
            raise ValueError(f"weight of client {i} is {float(w[i])} but its {what} is missing")
        v = np.asarray(arr[i] if arr is not None else vectors[i], dtype=np.float64)
        if v.shape != tuple(shape):
            raise ValueError(f"{what} of client {i} has shape {v.shape}, expected {shape}")
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{what} of client {i} has NaN/inf entries")
        out.append((i, float(w[i]), v))
    return out


def aggregate_streams(
    zetas: np.ndarray | Mapping[int, np.ndarray],
    weights: np.ndarray,
    point_shape: tuple[int, ...],
    what: str = "stream",
) -> np.ndarray:
    """Weighted sum ``sum_i w_i zeta_i`` of tangent vectors in ``T_{x_t} M`` (notes/baselines-rfedags.md, s5.2-s5.3).

    Args:
        zetas: ``(N, *point_shape)`` array or ``{client: (*point_shape)}`` (:func:`weighted_uploads`).
        weights: ``(N,)`` weights from :func:`participation_weights`.
        point_shape: shape of one tangent vector, e.g. ``(d, r)``.

    Returns:
        ``(*point_shape)`` float64 direction (zeros if all weights vanish).

    Raises:
        ValueError: see :func:`weighted_uploads`.
    """
    out = np.zeros(point_shape, dtype=np.float64)
    for _, wi, z in weighted_uploads(zetas, weights, tuple(point_shape), what):
        out += wi * z
    return out


def server_update(
    manifold: Manifold, x: np.ndarray, direction: np.ndarray, global_step: float = 1.0
) -> np.ndarray:
    """Global step ``x_{t+1} = R_{x_t}(varpi * direction)`` (notes/baselines-rfedags.md, s5.3).

    Args:
        x: current point ``(*point_shape)``.
        direction: aggregated tangent vector at ``x``.
        global_step: ``varpi > 0`` (authors: 1).

    Returns:
        New float64 point; a copy of ``x`` when ``direction`` is exactly zero (empty round).

    Raises:
        ValueError: non-positive or non-finite ``global_step``, NaN/inf direction.
    """
    if not (np.isfinite(global_step) and global_step > 0):
        raise ValueError(
            f"global_step (varpi) must be a positive finite number, got {global_step!r}"
        )
    d = np.asarray(direction, dtype=np.float64)
    if not np.all(np.isfinite(d)):
        raise ValueError("aggregated direction has NaN/inf entries")
    if not np.any(d):
        return np.array(x, dtype=np.float64, copy=True)
    return manifold.retr(x, global_step * d)


def effective_weights_uncorrected(p: np.ndarray | list[float]) -> np.ndarray:
    """Expected weights of the uncorrected mean over responders (RFedAGS Theorem 2.1; notes/participation.md, s2).

    ``p~_i = p_i * Integral_0^1 prod_{j != i} (1 - p_j + p_j t) dt``, computed exactly by
    Gauss-Legendre quadrature (the integrand is a polynomial of degree ``N - 1``).

    Returns:
        ``(N,)`` float64 ``p~`` of ``p (N,)``; ``sum_i p~_i = 1 - prod_i (1 - p_i)``.

    Raises:
        ValueError: invalid ``p``.
    """
    probs = check_probabilities(p)
    n = probs.size
    nodes, wts = np.polynomial.legendre.leggauss(n // 2 + 2)
    t = 0.5 * (nodes + 1.0)
    wts = 0.5 * wts
    factors = 1.0 - probs[None, :] + probs[None, :] * t[:, None]  # (m, N)
    out = np.empty(n)
    for i in range(n):
        prod = np.prod(np.delete(factors, i, axis=1), axis=1)
        out[i] = probs[i] * np.dot(wts, prod)
    return out


@dataclass
class RoundResult:
    """Outcome of one server round of :class:`RFedAGSServer`.

    Attributes:
        x: new iterate ``x_{t+1}`` (float64, ``point_shape``).
        direction: aggregated tangent vector at ``x_t`` (before ``varpi``).
        weights: ``(N,)`` aggregation weights used.
        estimates: ``(N,)`` probabilities the weights were built from (``q`` / ``p``; NaN for uncorrected).
        num_responders: ``|S_t|``.
    """

    x: np.ndarray
    direction: np.ndarray
    weights: np.ndarray
    estimates: np.ndarray
    num_responders: int


@dataclass
class RFedAGSServer:
    """Stateful RFedAGS server (notes/baselines-rfedags.md, s5.3): iterate, frequency counts, one :meth:`step` per round.

    Args:
        x: initial point ``x_0``.
        num_clients: ``N`` (client indices are partition ids ``0..N-1``).
        p: true probabilities ``(N,)`` (required for ``"known-p"``, ignored otherwise).
        q_min: floor of the frequency estimate (``"corrected"``).
        estimate_includes_current: False (paper): ``q^t`` from rounds ``< t``; True (authors' code):
            round ``t`` counts before the weights are formed.
        estimator_kind: ``"plus-one"`` (``(c+1)/(t+1)``) or ``"empirical"`` (the paper's ``c/t``);
            :class:`~flwr_sheaf.participation.FrequencyEstimator`.

    Raises:
        ValueError: invalid mode, missing ``p`` for ``"known-p"``, size mismatch.
    """

    manifold: Manifold
    x: np.ndarray
    num_clients: int
    mode: str = "corrected"
    p: np.ndarray | None = None
    q_min: float = DEFAULT_Q_MIN
    global_step: float = 1.0
    estimate_includes_current: bool = False
    estimator_kind: str = "plus-one"
    estimator: FrequencyEstimator = field(init=False)
    round: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "known-p":
            if self.p is None:
                raise ValueError("mode 'known-p' needs p")
            self.p = check_probabilities(self.p)
            if self.p.size != self.num_clients:
                raise ValueError(
                    f"p has {self.p.size} entries, expected num_clients={self.num_clients}"
                )
        self.x = np.array(self.x, dtype=np.float64, copy=True)
        self.estimator = FrequencyEstimator(
            self.num_clients, q_min=self.q_min, estimator=self.estimator_kind
        )

    def weights(
        self, responded: np.ndarray | list[bool], num_examples: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(weights (N,), estimates (N,))`` of the current round (as in :class:`RoundResult`), state unchanged.

        Raises:
            ValueError: ill-shaped or non-boolean ``responded``; see :func:`participation_weights`.
        """
        mask = responded_mask(responded, self.num_clients)
        if self.mode == "corrected":
            q = self.estimator.estimate(mask if self.estimate_includes_current else None)
            return participation_weights(mask, "corrected", q=q), q
        if self.mode == "known-p":
            assert self.p is not None, "__post_init__ rejects mode 'known-p' without p"
            return participation_weights(mask, "known-p", p=self.p), self.p.copy()
        return (
            participation_weights(mask, "uncorrected", num_examples=num_examples),
            np.full(self.num_clients, np.nan),
        )

    def step(
        self,
        responded: np.ndarray | list[bool],
        zetas: np.ndarray | Mapping[int, np.ndarray],
        num_examples: np.ndarray | None = None,
    ) -> RoundResult:
        """One server round: weights, weighted stream sum, ``R_{x_t}(varpi * .)``, count.

        ``responded`` is the ``(N,)`` mask of arrived streams, ``zetas`` as in :func:`aggregate_streams`.
        Returns the :class:`RoundResult`; ``self.x`` is updated and the estimator observes ``responded``.

        Raises:
            ValueError: see :func:`participation_weights` and :func:`aggregate_streams`.
        """
        mask = responded_mask(responded, self.num_clients)
        w, est = self.weights(mask, num_examples)
        direction = aggregate_streams(zetas, w, tuple(self.x.shape))
        x_new = server_update(self.manifold, self.x, direction, self.global_step)
        self.advance(mask, x_new)
        return RoundResult(x_new, direction, w, est, int(mask.sum()))

    def advance(self, responded: np.ndarray, x_new: np.ndarray) -> None:
        """End the round: the estimator observes ``responded`` ``(N,)`` and the iterate becomes ``x_new``."""
        self.estimator.observe(responded)
        self.x = x_new
        self.round += 1
