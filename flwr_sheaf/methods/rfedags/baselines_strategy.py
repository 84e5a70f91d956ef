"""RFedAvg, RFedSVRG, RFedProj as Flower strategies (notes/baselines-rfedags.md, s5).

:class:`RFedBaseline` shares all of :class:`~flwr_sheaf.methods.rfedags.strategy.RFedAGS` (discovery,
the Bernoulli(p_i) sampler: all four methods train the same nodes in the same rounds, weights,
failures, metrics) but the round's messages and the server step (:mod:`flwr_sheaf.methods.rfedags.baselines`).

Per server round ``t`` (action ``a`` = the method name; notes/baselines-rfedags.md, s5.8):

- ``rfedavg``: ``train.a`` with ``x_t`` to the drawn nodes; replies: end points.
- ``rfedsvrg``: first a ``train.a`` round trip in phase ``"gradient"`` (bounded by ``start``'s
  timeout) gives ``g_t`` over the nodes that answered; then phase ``"local"`` with ``x_t`` and
  ``g_t`` to those nodes; replies: end points.
- ``rfedproj``: ``train.a`` with the ambient point ``x^mid`` and the node's correction ``c_i``
  (nonzero when its upload arrived in the previous round); replies: ambient end points and mean
  gradients. A manifold RFedProj refuses (SPD, Poincaré ball) fails the first round (``ValueError``).

An upload that is malformed, non-finite, off the manifold (RFedAvg/RFedSVRG, tolerance 1e-8) or
unreachable by the inverse retraction is that node's recorded failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Unpack

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from ...protocol import array_record
from ...strategy.graph import GraphStrategy
from .aggregation import aggregate_streams
from .baselines import (
    BASELINES,
    average_ambient,
    average_endpoints,
    projection_correction,
    require_projection,
)
from .protocol import (
    CORRECTION,
    ENDPOINT,
    FULL_GRADIENT,
    MEAN_GRADIENT,
    PHASE,
    PHASE_GRADIENT,
    PHASE_LOCAL,
    POINT,
    STREAM,
    STREAM_RECORD,
)
from .strategy import (
    RiemannianArgs,
    RiemannianState,
    close_train,
    init_server,
    log_rfed_round,
    log_rfed_summary,
    round_prologue,
    setup_riemannian,
    train_config,
    train_messages,
    usable_uploads,
)

__all__ = ["RFedBaseline"]


class RFedBaseline(GraphStrategy, RiemannianState):
    """RFedAvg / RFedSVRG / RFedProj under arbitrary participation (module docstring).

    Args:
        num_nodes, participation: as :class:`~flwr_sheaf.methods.rfedags.strategy.RFedAGS`.
        method: one of :data:`~flwr_sheaf.methods.rfedags.baselines.BASELINES` (also the message action).
        mode: aggregation weights (default ``"uncorrected"``: ``1/|S_t|``).
        **settings: :class:`~flwr_sheaf.methods.rfedags.strategy.RiemannianArgs` (``global_step``: varpi / eta_g).

    Raises:
        ValueError: an unknown method; ``action=``; the arguments RFedAGS refuses; (first round)
            RFedProj on a manifold that is not compact and embedded.
        TypeError: an unknown keyword argument.
    """

    def __init__(
        self,
        num_nodes: int,
        participation: Mapping[int, float] | Sequence[float] | np.ndarray | str | None = None,
        *,
        method: str,
        mode: str = "uncorrected",
        **settings: Unpack[RiemannianArgs],
    ) -> None:
        if method not in BASELINES:
            raise ValueError(f"method must be one of {BASELINES}, got {method!r}")
        if "action" in settings:
            raise ValueError("RFedBaseline's action is its method name; do not pass action=")
        setup_riemannian(self, num_nodes, participation, mode=mode, action=method, **settings)
        self.method = method
        self._timeout = 3600.0
        self._x_mid: np.ndarray | None = None
        self._x_mid_prev: np.ndarray | None = None
        self._zeta_prev: dict[int, np.ndarray] = {}
        self._prev_responders: set[int] = set()
        self._recipients: list[int] = []
        self._g_t: np.ndarray | None = None  # RFedSVRG's server gradient of the current round

    def discover(self, grid: Grid, timeout: float) -> None:
        """:meth:`GraphStrategy.discover`; remembers ``start``'s ``timeout`` for RFedSVRG's gradient round trip."""
        self._timeout = float(timeout)
        super().discover(grid, timeout)

    log_round = log_rfed_round
    summary = log_rfed_summary

    def _init_server(self, arrays: ArrayRecord) -> None:
        init_server(self, arrays)
        if self.method == "rfedproj":
            require_projection(self.manifold)
        self._x_mid = self.server.x.copy()
        self._x_mid_prev = self._x_mid.copy()

    def _gradient_phase(
        self, server_round: int, alpha_t: float, config: ConfigRecord, grid: Grid
    ) -> list[int]:
        """RFedSVRG phase 1: gradients at ``x_t`` from the drawn nodes; sets ``g_t``; returns who answered."""
        shape = tuple(self.server.x.shape)
        cfg = train_config(self, server_round, alpha_t, config, **{PHASE: PHASE_GRADIENT})
        sampled = self.ledger.current.sampled
        msgs = train_messages(self, server_round, cfg, {pid: {POINT: self._x_t} for pid in sampled})
        ok = self.exchange.split_replies(
            server_round,
            "gradient",
            self.exchange.round_trip(grid, msgs, self._timeout),
            sampled,
            {STREAM_RECORD: (STREAM,)},
        )
        grads: dict[int, np.ndarray] = {}
        for pid, r in ok.items():
            g = np.array(array_record(r.content, STREAM_RECORD)[STREAM].numpy(), dtype=np.float64)
            if g.shape != shape or not np.all(np.isfinite(g)):
                self.record_failure(
                    server_round, "gradient", pid, f"unusable gradient of shape {g.shape}"
                )
                continue
            grads[pid] = g
        mask = np.isin(np.arange(self.num_nodes), list(grads))  # (N,) bool: who is used
        w, _ = self.server.weights(mask)
        self._g_t = aggregate_streams(grads, w, shape, "gradient")
        return sorted(grads)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The method's ``train.<method>`` messages to the drawn nodes (RFedSVRG: after its gradient phase)."""
        alpha_t, cfg = round_prologue(self, server_round, arrays, config, **{PHASE: PHASE_LOCAL})
        self._recipients = list(self.ledger.current.sampled)
        if self.method == "rfedsvrg" and self._recipients:
            self._recipients = self._gradient_phase(server_round, alpha_t, config, grid)
        payloads = {pid: self._payload(pid, alpha_t) for pid in self._recipients}
        return train_messages(self, server_round, cfg, payloads)

    def _payload(self, pid: int, alpha_t: float) -> dict[str, np.ndarray]:
        """Node ``pid``'s arrays: RFedProj ``x^mid`` and ``c_i``, RFedSVRG ``x_t`` and ``g_t``, RFedAvg ``x_t``."""
        if self.method == "rfedsvrg":
            assert self._g_t is not None  # set by _gradient_phase
            return {POINT: self._x_t, FULL_GRADIENT: self._g_t}
        if self.method != "rfedproj":
            return {POINT: self._x_t}
        assert self._x_mid is not None and self._x_mid_prev is not None  # set in _init_server
        c = np.zeros_like(self._x_mid)
        if pid in self._prev_responders and pid in self._zeta_prev:
            c = projection_correction(
                self.manifold,
                self._x_mid_prev,
                self._x_mid,
                self._zeta_prev[pid],
                self.local_steps,
                alpha_t,
                self.global_step,
            )
        return {POINT: self._x_mid, CORRECTION: c}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check the uploads, weight them (``mode``), run the method's server step; new point + round metrics."""
        keys = (ENDPOINT, MEAN_GRADIENT) if self.method == "rfedproj" else (ENDPOINT,)
        used, num_examples, mask = usable_uploads(
            self, server_round, replies, self._recipients, keys, self._check_upload
        )
        uploads = {pid: z for pid, (z, _) in used.items()}
        zetas = {pid: zeta for pid, (_, zeta) in used.items() if zeta is not None}
        w, est = self.server.weights(mask, num_examples if self.mode == "uncorrected" else None)
        x_new, direction = self._server_step(uploads, zetas, w)
        self.server.advance(mask, x_new)
        return close_train(self, x_new, direction, w, est, uploads, {}, record_estimates=False)

    def _check_upload(
        self, stream: ArrayRecord
    ) -> tuple[tuple[np.ndarray, np.ndarray | None], str | None]:
        """``((end point, RFedProj's mean gradient or None), why unusable or None)``."""
        shape = tuple(self.server.x.shape)
        z = np.array(stream[ENDPOINT].numpy(), dtype=np.float64)
        if z.shape != shape or not np.all(np.isfinite(z)):
            return (z, None), f"unusable end point of shape {z.shape} (expected {shape}, finite)"
        if self.method == "rfedproj":
            zeta = np.array(stream[MEAN_GRADIENT].numpy(), dtype=np.float64)
            if zeta.shape != shape or not np.all(np.isfinite(zeta)):
                return (z, None), f"unusable mean gradient of shape {zeta.shape}"
            return (z, zeta), None
        feas = float(np.max(self.manifold.feasibility(z)))
        if not feas <= 1e-8:
            return (z, None), f"end point off {self.manifold!r} (constraint violation {feas:.3e})"
        try:
            self.manifold.invretr(self._x_t, z)
        except ValueError as exc:
            return (z, None), str(exc)
        return (z, None), None

    def _server_step(
        self, uploads: dict[int, np.ndarray], zetas: dict[int, np.ndarray], w: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(new point, direction moved)`` with weights ``w`` ``(N,)``; RFedProj keeps its next-round state."""
        if self.method != "rfedproj":
            return average_endpoints(self.manifold, self._x_t, uploads, w, self.global_step)
        assert self._x_mid is not None  # set in _init_server
        x_mid_new, x_new = average_ambient(self.manifold, self._x_mid, uploads, w, self.global_step)
        self._x_mid_prev, self._x_mid = self._x_mid, x_mid_new
        self._zeta_prev.update(zetas)
        self._prev_responders = set(uploads)
        return x_new, x_new - self._x_t
