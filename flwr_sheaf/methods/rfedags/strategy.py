"""RFedAGS strategy (notes/baselines-rfedags.md): a global parameter on a manifold, Bernoulli participation.

The drawn nodes get ``x_t`` (key :data:`~flwr_sheaf.methods.rfedags.protocol.POINT`, float64); their
streams are combined by :class:`~flwr_sheaf.methods.rfedags.aggregation.RFedAGSServer`. No
client-side evaluation: use ``start(..., evaluate_fn=...)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypedDict, Unpack

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from ...config import DEFAULTS
from ...participation import DEFAULT_Q_MIN, ESTIMATORS, ParticipationSampler, parse_participation
from ...protocol import (
    ARRAYS,
    CONFIG,
    METRICS,
    NUM_EXAMPLES,
    SEED,
    SERVER_ROUND,
    TRAIN,
    array_record,
    as_float,
    metric_record,
    pack_arrays,
    weight_problem,
)
from ...strategy.exchange import merge_extra
from ...strategy.graph import GraphStrategy
from . import ACTION
from .aggregation import MODES, RFedAGSServer
from .local import step_size_schedule
from .manifolds import Manifold, Sphere, Stiefel
from .protocol import LOCAL_STEPS, MINIBATCH_SIZE, POINT, STEP_SIZE, STREAM, STREAM_RECORD

__all__ = [
    "RFedAGS",
    "RiemannianArgs",
    "close_train",
    "init_server",
    "log_rfed_round",
    "log_rfed_summary",
    "round_prologue",
    "setup_riemannian",
    "train_config",
    "train_messages",
    "usable_uploads",
]

log = logging.getLogger("flwr_sheaf")


class RiemannianArgs(TypedDict, total=False):
    """The ``**settings`` of :class:`RFedAGS` and
    :class:`~flwr_sheaf.methods.rfedags.baselines_strategy.RFedBaseline` (defaults: :func:`setup_riemannian`).

    Attributes:
        local_steps: ``K >= 1``.
        step_size: ``alpha_0 > 0``; ``alpha_t = alpha_0 / (1 + t/decay_rounds)`` with ``t = round - 1``.
        decay_rounds: ``>= 0`` (0 = fixed step).
        global_step: ``varpi > 0`` (paper and code: 1).
        q_min, estimate_includes_current, estimator: the frequency estimate of ``"corrected"``
            (:class:`~flwr_sheaf.methods.rfedags.aggregation.RFedAGSServer`; notes/participation.md, s4.1).
        manifold: default inferred from the initial array: ``(d, r)`` -> Stiefel, ``(d,)`` -> Sphere.
        minibatch_size: mini-batch size of the local gradients (0 = exact gradients).
        seed: participation and mini-batch seed.
        discovery_timeout: seconds to wait for SuperNodes.
        round_metrics: optional ``x -> {name: float}`` recorded each round after the server step.
    """

    local_steps: int
    step_size: float
    decay_rounds: float
    global_step: float
    q_min: float
    estimate_includes_current: bool
    estimator: str
    manifold: Manifold | None
    minibatch_size: int
    seed: int
    discovery_timeout: float
    round_metrics: Callable[[np.ndarray], Mapping[str, float]] | None


class RiemannianState:
    """The attributes of :func:`setup_riemannian` / :func:`init_server` that the strategies' own
    methods read (for type checkers; the settings: :class:`RiemannianArgs`)."""

    mode: str
    local_steps: int
    global_step: float
    manifold: Manifold
    server: RFedAGSServer
    _x_t: np.ndarray


def setup_riemannian(
    s: Any,
    num_nodes: int,
    participation: Mapping[int, float] | Sequence[float] | np.ndarray | str | None,
    *,
    mode: str,
    action: str,
    local_steps: int = 5,
    step_size: float = 0.02,
    decay_rounds: float = 0.0,
    global_step: float = 1.0,
    q_min: float = DEFAULT_Q_MIN,
    estimate_includes_current: bool = False,
    estimator: str = "plus-one",
    manifold: Manifold | None = None,
    minibatch_size: int = 0,
    seed: int = DEFAULTS["seed"],
    discovery_timeout: float = DEFAULTS["discovery-timeout"],
    round_metrics: Callable[[np.ndarray], Mapping[str, float]] | None = None,
) -> None:
    """Initialise ``s`` (a :class:`GraphStrategy` without a graph) with RFedAGS's validated settings
    (keyword arguments after ``action``: :class:`RiemannianArgs`).

    Raises:
        ValueError: invalid mode, probabilities, K, step sizes, estimator or mini-batch size.
        TypeError: an unknown keyword argument.
    """
    p = parse_participation(participation, num_nodes, seed)
    p = np.ones(num_nodes) if p is None else p
    GraphStrategy.__init__(
        s,
        num_nodes,
        action=action,
        sampler=ParticipationSampler(num_nodes, probabilities=p, seed=seed),
        discovery_timeout=discovery_timeout,
    )
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if int(local_steps) != local_steps or local_steps < 1:
        raise ValueError(f"local_steps (K) must be a positive integer, got {local_steps!r}")
    if not (np.isfinite(global_step) and global_step > 0):
        raise ValueError(f"global_step (varpi) must be positive, got {global_step!r}")
    if int(minibatch_size) != minibatch_size or minibatch_size < 0:
        raise ValueError(
            f"minibatch_size must be a non-negative integer (0 = exact gradients), got {minibatch_size!r}"
        )
    s.alpha = step_size_schedule(step_size, decay_rounds)  # validates step_size, decay_rounds
    s.p = p
    s.mode = mode
    s.local_steps = int(local_steps)
    s.step_size, s.decay_rounds = float(step_size), float(decay_rounds)
    s.global_step = float(global_step)
    s.q_min = float(q_min)
    s.estimate_includes_current = bool(estimate_includes_current)
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    s.estimator = estimator
    s.manifold = manifold
    s.minibatch_size = int(minibatch_size)
    s.server = None  # RFedAGSServer, built from the initial point (init_server)
    s._x_t = None  # (d, r) or (d,) point of the running round
    s.round_metrics = round_metrics


def init_server(s: Any, arrays: ArrayRecord) -> None:
    """Build ``s.server`` (and infer ``s.manifold``) from the initial point.

    Raises:
        ValueError: no key ``"x"``, an unsupported rank, or a point off the manifold.
    """
    if POINT not in arrays:
        raise ValueError(f"initial_arrays must hold the global parameter under key {POINT!r}")
    x0 = np.array(arrays[POINT].numpy(), dtype=np.float64)
    if s.manifold is None:
        if x0.ndim == 2:
            s.manifold = Stiefel(*x0.shape)
        elif x0.ndim == 1:
            s.manifold = Sphere(x0.shape[0])
        else:
            raise ValueError(f"cannot infer a manifold for a parameter of shape {x0.shape}")
    s.manifold.check_point(x0, atol=1e-8)
    s.server = RFedAGSServer(
        s.manifold,
        x0,
        s.num_nodes,
        mode=s.mode,
        p=s.p,
        q_min=s.q_min,
        global_step=s.global_step,
        estimate_includes_current=s.estimate_includes_current,
        estimator_kind=s.estimator,
    )


def round_prologue(
    s: Any, server_round: int, arrays: ArrayRecord, config: ConfigRecord, **entries: Any
) -> tuple[float, dict[str, Any]]:
    """The server (first round), ``x_t``, this round's Bernoulli draw and ``(alpha_t, train config)``
    (:func:`train_config`, then ``entries``, then ``config``); ``alpha_t`` is recorded.

    Raises:
        ValueError: ``config`` names a key the strategy sends.
    """
    if s.server is None:
        s._init_server(arrays)
    s._x_t = s.server.x.copy()
    s.ledger.current.sampled = s.sampler.sample(server_round)
    alpha_t = s.alpha(server_round - 1)
    s.ledger.current.train["step_size"] = alpha_t
    return alpha_t, train_config(s, server_round, alpha_t, config, **entries)


def train_config(
    s: Any, server_round: int, alpha_t: float, config: ConfigRecord, **entries: Any
) -> dict[str, Any]:
    """Config of a ``train.<action>`` message: ``server-round``, ``local-steps``, ``step-size``, ``minibatch-size``, ``seed``."""
    owned = {
        SERVER_ROUND: server_round,
        LOCAL_STEPS: s.local_steps,
        STEP_SIZE: alpha_t,
        MINIBATCH_SIZE: s.minibatch_size,
        SEED: s.seed,
        **entries,
    }
    return merge_extra(owned, config, "train_config")


def train_messages(
    s: Any, server_round: int, cfg: Mapping[str, Any], payloads: Mapping[int, dict[str, np.ndarray]]
) -> list[Message]:
    """One ``train.<action>`` message per partition-id of ``payloads`` (float64 arrays) with config ``cfg``."""
    return [
        s.exchange.message(
            pid,
            RecordDict({ARRAYS: pack_arrays(arrays), CONFIG: ConfigRecord(dict(cfg))}),
            TRAIN,
            server_round,
        )
        for pid, arrays in payloads.items()
    ]


def usable_uploads(
    s: Any,
    server_round: int,
    replies: Iterable[Message],
    recipients: Iterable[int],
    keys: tuple[str, ...],
    check: Callable[[ArrayRecord], tuple[Any, str | None]],
) -> tuple[dict[int, Any], np.ndarray, np.ndarray]:
    """The train replies with a finite ``num-examples > 0`` whose ``stream`` record (holding ``keys``)
    passes ``check`` (``record -> (upload, reason or None)``); any other reply, or silence, is a recorded failure.

    Returns:
        ``({partition-id: upload}, num_examples (N,), responded (N,) bool)``; ``num_examples`` is 1
        where no upload was used.
    """
    ok = s.exchange.split_replies(
        server_round, "train", replies, recipients, {STREAM_RECORD: keys, METRICS: (NUM_EXAMPLES,)}
    )
    uploads: dict[int, Any] = {}
    num_examples = np.ones(s.num_nodes)
    for pid, r in ok.items():
        n_i = metric_record(r.content, METRICS)[NUM_EXAMPLES]
        upload, reason = None, weight_problem(NUM_EXAMPLES, n_i)
        if reason is None:
            upload, reason = check(array_record(r.content, STREAM_RECORD))
        if reason is not None:
            s.record_failure(server_round, "train", pid, reason)
            continue
        uploads[pid] = upload
        num_examples[pid] = as_float(n_i, NUM_EXAMPLES)
    mask = np.isin(np.arange(s.num_nodes), list(uploads))  # (N,) bool: who is used
    return uploads, num_examples, mask


def close_train(
    s: Any,
    x_new: np.ndarray,
    direction: np.ndarray,
    weights: np.ndarray,
    estimates: np.ndarray,
    responders: Iterable[int],
    extra: Mapping[str, float],
    *,
    record_estimates: bool,
) -> tuple[ArrayRecord, MetricRecord]:
    """Record the round's train metrics and its drawn, responders, weights (and estimates) in the
    ledger; returns ``(arrays holding x_new under "x", round metrics)``."""
    rec, responders = s.ledger.current, sorted(responders)
    metrics = {
        "num_drawn": len(rec.sampled),
        "num_responders": len(responders),
        "weight_sum": float(weights.sum()),
        "step_size": float(rec.train["step_size"]),
        "direction_norm": float(np.linalg.norm(direction)),
        **extra,
        "feasibility": float(np.max(s.manifold.feasibility(x_new))),
    }
    if s.mode != "uncorrected":
        metrics["estimate_min"] = float(np.min(estimates))
    if s.round_metrics is not None:
        metrics.update(s.round_metrics(x_new))
    rec.num_trained = len(responders)
    rec.train.update(metrics)
    rec.train.update(
        {"drawn": list(rec.sampled), "responders": responders, "weights": weights.tolist()}
    )
    if record_estimates:
        rec.train["estimates"] = [None if np.isnan(e) else float(e) for e in estimates]
    return pack_arrays({POINT: x_new}), MetricRecord({k: float(v) for k, v in metrics.items()})


def log_rfed_round(s: Any, rec: Any) -> None:
    """One progress line per round of the RFedAGS family."""
    t = rec.train
    log.info(
        "round %4d | drawn %3d | responders %3d | |dir| %.3e | %.3f s",
        rec.round,
        t.get("num_drawn", 0),
        t.get("num_responders", 0),
        t.get("direction_norm", 0.0),
        rec.wall_seconds,
    )


def log_rfed_summary(s: Any) -> None:
    """The settings of a strategy of the RFedAGS family, logged once at its start."""
    log.info(
        "%s(mode=%s, N=%d, K=%d, alpha0=%g, decay=%g, varpi=%g, q_min=%g)",
        s.action,
        s.mode,
        s.num_nodes,
        s.local_steps,
        s.step_size,
        s.decay_rounds,
        s.global_step,
        s.q_min,
    )


class RFedAGS(GraphStrategy, RiemannianState):
    """RFedAGS (Riemannian FL via averaging gradient streams; notes/baselines-rfedags.md, s5).

    Args:
        num_nodes: number of partitions ``N`` (partition-ids ``0..N-1``).
        participation: per-partition probabilities ``p_i`` (sequence, mapping or a spec of
            :func:`flwr_sheaf.participation.parse_participation`; None = full). ``p_i = 0`` is allowed.
        mode: ``"corrected"`` (frequency estimates q), ``"known-p"`` or ``"uncorrected"``.
        **settings: :class:`RiemannianArgs`.

    Raises:
        ValueError: invalid mode, probabilities, K, step sizes; (in ``configure_train``) an initial
            array without key ``"x"``, of unsupported rank, or off the manifold.
        TypeError: a keyword that is not a setting (named).
    """

    def __init__(
        self,
        num_nodes: int,
        participation: Mapping[int, float] | Sequence[float] | np.ndarray | str | None = None,
        *,
        mode: str = "corrected",
        action: str = ACTION,
        **settings: Unpack[RiemannianArgs],
    ) -> None:
        setup_riemannian(self, num_nodes, participation, mode=mode, action=action, **settings)

    _init_server = init_server

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``train.rfedags`` message with ``x_t`` per drawn node (possibly none)."""
        _, cfg = round_prologue(self, server_round, arrays, config)
        payloads = {pid: {POINT: self._x_t} for pid in self.ledger.current.sampled}
        return train_messages(self, server_round, cfg, payloads)

    def _check_stream(self, stream: ArrayRecord) -> tuple[np.ndarray, str | None]:
        """A reply's stream ``zeta`` (float64) and why it is unusable (None = usable)."""
        z = np.array(stream[STREAM].numpy(), dtype=np.float64)
        shape = tuple(self.server.x.shape)
        if z.shape != shape:
            return z, f"stream of shape {z.shape}, expected {shape}"
        return z, None if np.all(np.isfinite(z)) else "NaN/inf stream"

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weight the arrived streams, average, retract; returns the new ``x`` and round metrics."""
        zetas, num_examples, mask = usable_uploads(
            self, server_round, replies, self.ledger.current.sampled, (STREAM,), self._check_stream
        )
        tangent = [float(np.max(self.manifold.tangent_error(self._x_t, z))) for z in zetas.values()]
        res = self.server.step(
            mask, zetas, num_examples=num_examples if self.mode == "uncorrected" else None
        )
        extra = {"tangent_error_max": max(tangent) if tangent else 0.0}
        args = (res.x, res.direction, res.weights, res.estimates, zetas, extra)
        return close_train(self, *args, record_estimates=True)

    log_round = log_rfed_round
    summary = log_rfed_summary
