"""RFedAGS strategy: a global parameter on a manifold, gradient-stream aggregation, Bernoulli participation.

Server part of RFedAGS on Flower's Message API (docs/baselines-rfedags.md, s5). Per server round ``t``:
discovery once (``query.rfedags``), the responding set ``S_t`` drawn per partition-id as independent
Bernoulli(p_i) (:class:`flwr_sheaf.participation.ParticipationSampler`, seeded by ``(seed, t)``), one
``train.rfedags`` message with ``x_t`` to each drawn node; the streams ``zeta_i in T_{x_t} M`` that
arrive are weighted (``mode``) and retracted by
:class:`flwr_sheaf.methods.rfedags.aggregation.RFedAGSServer`. A reply that is malformed, non-finite or
has a bad ``num-examples`` is that node's recorded failure and a non-responder; a round without any
stream keeps ``x_t`` exactly. No client-side evaluation (use ``start(..., evaluate_fn=...)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

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

__all__ = ["RFedAGS"]

log = logging.getLogger("flwr_sheaf")


class RFedAGS(GraphStrategy):
    """RFedAGS (Riemannian FL via averaging gradient streams; docs/baselines-rfedags.md, s5) as a Flower strategy.

    Args:
        num_nodes: number of partitions ``N`` (partition-ids ``0..N-1``; the ``N`` of the weights).
        participation: per-partition probabilities ``p_i`` (sequence, mapping or a spec string of
            :func:`flwr_sheaf.participation.parse_participation`; None = full participation).
            ``p_i = 0`` is allowed (the node never trains).
        mode: ``"corrected"`` (weights ``1/(q_i^t N)``), ``"known-p"`` (``1/(p_i N)``) or
            ``"uncorrected"`` (mean over responders, weighted by ``num-examples``).
        local_steps: ``K >= 1``.
        step_size: ``alpha_0 > 0``; ``alpha_t = alpha_0 / (1 + t/decay_rounds)`` with ``t = round - 1``.
        decay_rounds: ``>= 0`` (0 = fixed step).
        global_step: ``varpi > 0`` (paper and code: 1).
        q_min: floor of the frequency estimate (see :class:`~flwr_sheaf.participation.FrequencyEstimator`).
        estimate_includes_current: False = paper (``q^t`` from past rounds), True = authors' code.
        estimator: frequency estimator of ``"corrected"``: ``"plus-one"`` (default, ``(c+1)/(t+1)``)
            or ``"empirical"`` (paper, ``c/t``); docs/participation.md, s4.1.
        manifold: manifold of the parameter; default inferred from the initial array: 2-D ``(d, r)``
            -> :class:`~flwr_sheaf.methods.rfedags.manifolds.Stiefel`, 1-D -> :class:`~flwr_sheaf.methods.rfedags.manifolds.Sphere`.
        minibatch_size: mini-batch size of the local gradients (0 = exact gradients).
        seed: participation and mini-batch seed.
        action: message action name (default ``"rfedags"``).
        round_metrics: optional ``x -> {name: float}`` recorded in each round after the server step
            (e.g. the planted problem's optimality gap and distance to the optimum).
        discovery_timeout: see :class:`~flwr_sheaf.strategy.graph.GraphStrategy`.

    Raises:
        ValueError: invalid mode, probabilities, K, step sizes, estimator or mini-batch size; (in
            ``configure_train``) an initial array without key ``"x"``, of unsupported rank, or off the manifold.
    """

    def __init__(
        self,
        num_nodes: int,
        participation: Mapping[int, float] | Sequence[float] | np.ndarray | str | None = None,
        *,
        mode: str = "corrected",
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
        action: str = ACTION,
        discovery_timeout: float = DEFAULTS["discovery-timeout"],
        round_metrics: Callable[[np.ndarray], Mapping[str, float]] | None = None,
    ) -> None:
        p = parse_participation(participation, num_nodes, seed)
        p = np.ones(num_nodes) if p is None else p
        super().__init__(
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
        self.alpha = step_size_schedule(step_size, decay_rounds)  # validates both
        self.p = p
        self.mode = mode
        self.local_steps = int(local_steps)
        self.step_size, self.decay_rounds = float(step_size), float(decay_rounds)
        self.global_step = float(global_step)
        self.q_min = float(q_min)
        self.estimate_includes_current = bool(estimate_includes_current)
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        self.estimator = estimator
        self.manifold: Manifold = manifold  # type: ignore[assignment]  # inferred in _init_server
        self.minibatch_size = int(minibatch_size)
        self.server: RFedAGSServer = None  # type: ignore[assignment]  # built in the first round
        self._x_t: np.ndarray = None  # type: ignore[assignment]  # the running round's point
        self.round_metrics = round_metrics

    def _init_server(self, arrays: ArrayRecord) -> None:
        """Build ``self.server`` (and infer ``self.manifold``) from the initial point.

        Raises:
            ValueError: no key ``"x"``, an unsupported rank, or a point off the manifold.
        """
        if POINT not in arrays:
            raise ValueError(f"initial_arrays must hold the global parameter under key {POINT!r}")
        x0 = np.array(arrays[POINT].numpy(), dtype=np.float64)
        if self.manifold is None:
            if x0.ndim == 2:
                self.manifold = Stiefel(*x0.shape)
            elif x0.ndim == 1:
                self.manifold = Sphere(x0.shape[0])
            else:
                raise ValueError(f"cannot infer a manifold for a parameter of shape {x0.shape}")
        self.manifold.check_point(x0, atol=1e-8)
        self.server = RFedAGSServer(
            self.manifold,
            x0,
            self.num_nodes,
            mode=self.mode,
            p=self.p,
            q_min=self.q_min,
            global_step=self.global_step,
            estimate_includes_current=self.estimate_includes_current,
            estimator_kind=self.estimator,
        )

    def _round_prologue(self, server_round: int, arrays: ArrayRecord) -> float:
        """The server (first round), ``x_t``, this round's Bernoulli draw and the step size ``alpha_t``
        (returned and recorded)."""
        if self.server is None:
            self._init_server(arrays)
        self._x_t = self.server.x.copy()
        self.ledger.current.sampled = self.sampler.sample(server_round)
        alpha_t = self.alpha(server_round - 1)
        self.ledger.current.train["step_size"] = alpha_t
        return alpha_t

    def _train_config(
        self, server_round: int, alpha_t: float, config: ConfigRecord, **extra: Any
    ) -> ConfigRecord:
        """The ``train`` message's config: round, ``K``, ``alpha_t``, mini-batch size, seed, ``extra``,
        then ``start``'s ``train_config`` (ValueError if it names one of these keys)."""
        cfg = merge_extra(
            {
                SERVER_ROUND: server_round,
                LOCAL_STEPS: self.local_steps,
                STEP_SIZE: alpha_t,
                MINIBATCH_SIZE: self.minibatch_size,
                SEED: self.seed,
                **extra,
            },
            config,
            "train_config",
        )
        return ConfigRecord(dict(cfg))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``train.rfedags`` message with ``x_t`` per drawn node (possibly none)."""
        cfg = self._train_config(server_round, self._round_prologue(server_round, arrays), config)
        return [
            self.exchange.message(
                pid,
                RecordDict({ARRAYS: pack_arrays({POINT: self._x_t}), CONFIG: cfg}),
                TRAIN,
                server_round,
            )
            for pid in self.ledger.current.sampled
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weight the arrived streams, average, retract; returns the new ``x`` and round metrics."""
        ok = self.exchange.split_replies(
            server_round,
            "train",
            replies,
            self.ledger.current.sampled,
            {STREAM_RECORD: (STREAM,), METRICS: (NUM_EXAMPLES,)},
        )
        shape = tuple(self.server.x.shape)
        zetas: dict[int, np.ndarray] = {}
        num_examples = np.ones(self.num_nodes)
        tangent = []
        for pid, r in ok.items():
            z = np.array(array_record(r.content, STREAM_RECORD)[STREAM].numpy(), dtype=np.float64)
            n_i = metric_record(r.content, METRICS)[NUM_EXAMPLES]
            reason = weight_problem(NUM_EXAMPLES, n_i)
            if reason is None and z.shape != shape:
                reason = f"stream of shape {z.shape}, expected {shape}"
            elif reason is None and not np.all(np.isfinite(z)):
                reason = "NaN/inf stream"
            if reason is not None:
                self.record_failure(server_round, "train", pid, reason)
                continue
            zetas[pid] = z
            num_examples[pid] = as_float(n_i, NUM_EXAMPLES)
            tangent.append(float(np.max(self.manifold.tangent_error(self._x_t, z))))
        mask = np.zeros(self.num_nodes, dtype=bool)
        mask[list(zetas)] = True
        res = self.server.step(
            mask, zetas, num_examples=num_examples if self.mode == "uncorrected" else None
        )
        return self._record_round(
            res.x,
            res.direction,
            sorted(zetas),
            res.weights,
            res.estimates,
            {"tangent_error_max": max(tangent) if tangent else 0.0},
            {"estimates": [None if np.isnan(e) else float(e) for e in res.estimates]},
        )

    def _record_round(
        self,
        x_new: np.ndarray,
        direction: np.ndarray,
        responders: list[int],
        w: np.ndarray,
        estimates: np.ndarray,
        extra_metrics: Mapping[str, float],
        extra_record: Mapping[str, Any],
    ) -> tuple[ArrayRecord, MetricRecord]:
        """Record the round (metrics, drawn, responders, weights ``(N,)``) in the ledger; returns the
        new point ``x_{t+1}`` and the round's metrics."""
        cur = self.ledger.current
        metrics = {
            "num_drawn": len(cur.sampled),
            "num_responders": len(responders),
            "weight_sum": float(w.sum()),
            "step_size": float(cur.train["step_size"]),
            "direction_norm": float(np.linalg.norm(direction)),
            **extra_metrics,
            "feasibility": float(np.max(self.manifold.feasibility(x_new))),
        }
        if self.mode != "uncorrected":
            metrics["estimate_min"] = float(np.min(estimates))
        if self.round_metrics is not None:
            metrics.update(self.round_metrics(x_new))
        cur.num_trained = len(responders)
        cur.train.update(metrics)
        cur.train.update(
            {"drawn": list(cur.sampled), "responders": responders, "weights": w.tolist()}
        )
        cur.train.update(extra_record)
        return pack_arrays({POINT: x_new}), MetricRecord({k: float(v) for k, v in metrics.items()})

    def log_round(self, rec) -> None:  # noqa: D102 - GraphStrategy hook
        t = rec.train
        log.info(
            "round %4d | drawn %3d | responders %3d | |dir| %.3e | %.3f s",
            rec.round,
            t.get("num_drawn", 0),
            t.get("num_responders", 0),
            t.get("direction_norm", 0.0),
            rec.wall_seconds,
        )

    def summary(self) -> None:  # noqa: D102 - Strategy API
        log.info(
            "%s(mode=%s, N=%d, K=%d, alpha0=%g, decay=%g, varpi=%g, q_min=%g)",
            self.action,
            self.mode,
            self.num_nodes,
            self.local_steps,
            self.step_size,
            self.decay_rounds,
            self.global_step,
            self.q_min,
        )
