"""RFedAGS strategy: a global parameter on a manifold, gradient-stream aggregation, Bernoulli participation.

Server part of RFedAGS on Flower's Message API (notes ``anchor-rfedags-fedsaf-fedproto.md`` A.2 step 4,
A.3, A.6). Per server round ``t``:

1. ``configure_train``: discovery once (``query.rfedags``: node id <-> partition-id), then the
   responding set ``S_t`` is drawn per partition-id as independent Bernoulli(p_i)
   (:func:`flwr_sheaf.rfedags.participation.bernoulli_participation`, seeded by ``(seed, t)``;
   Flower's own sampling is uniform, i.e. the paper's Scheme I, so it is not used). Each drawn node
   gets ``x_t`` (``ArrayRecord`` ``"arrays"`` key ``"x"``, float64) and a ``ConfigRecord`` with
   ``server-round``, ``local-steps`` (K), ``step-size`` (alpha_t) and ``train_config``.
2. ``aggregate_train``: the streams ``zeta_i in T_{x_t} M`` that arrived (shape-checked, finite) are
   combined by :class:`flwr_sheaf.rfedags.aggregation.RFedAGSServer` with weights
   ``1/(q_i^t N)`` (``"corrected"``), ``1/(p_i N)`` (``"known-p"``) or the mean over responders
   (``"uncorrected"``), followed by ``x_{t+1} = R_{x_t}(varpi * sum_i w_i zeta_i)``. Only streams that
   arrived count as participation (a drawn node that failed or stayed silent is a non-responder for
   the frequency estimate). A round without any stream keeps ``x_t`` exactly.
3. No client-side evaluation: ``configure_evaluate`` returns no messages; use ``start(...,
   evaluate_fn=...)`` for server-side metrics (optimality gap etc.). Per-round bookkeeping (drawn,
   responders, weights, estimates, bytes, wall time) is appended to ``history``.

``N`` in the weights is the number of partitions (graph nodes) of the scenario.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from ..rfedags.aggregation import MODES, RFedAGSServer
from ..rfedags.client import step_size_schedule
from ..rfedags.manifolds import Manifold, Sphere, Stiefel
from ..rfedags.participation import DEFAULT_Q_MIN, bernoulli_participation, check_probabilities
from .base import PeerStrategy

__all__ = ["RFedAGS", "PARAM_KEY", "participation_from_config"]

log = logging.getLogger("flwr_sheaf")

#: Key of the global parameter inside the ``ArrayRecord`` (``initial_arrays`` / ``Result.arrays``).
PARAM_KEY = "x"


def _probabilities(num_nodes: int, participation: Mapping[int, float] | Sequence[float] | None) -> np.ndarray:
    if participation is None:
        return np.ones(num_nodes)
    if isinstance(participation, Mapping):
        missing = sorted(set(range(num_nodes)) - {int(k) for k in participation})
        if missing:
            raise ValueError(f"participation has no probability for partition-id(s) {missing}")
        vec = [participation[k] for k in sorted(participation, key=int)][:num_nodes]
    else:
        vec = list(participation)
        if len(vec) != num_nodes:
            raise ValueError(f"participation has {len(vec)} entries, expected num_nodes={num_nodes}")
    return check_probabilities(vec, "participation")


def participation_from_config(spec: str | float | int, num_nodes: int) -> np.ndarray:
    """Participation probabilities from a run-config value (run configs cannot hold lists).

    Accepted forms: a number ``"0.5"`` (same p for every node); a comma-separated list
    ``"0.9,0.9,0.2"`` (one per partition-id); ``"uniform"`` or ``"uniform:<seed>"`` (``p_i ~ U(0, 1)``
    i.i.d., the paper's PCA setting, via :func:`flwr_sheaf.rfedags.pca.paper_participation`).

    Returns:
        ``(num_nodes,)`` float64 probabilities.

    Raises:
        ValueError: unparsable spec, wrong count, or a value outside ``[0, 1]`` (named).
    """
    from ..rfedags.pca import paper_participation

    text = str(spec).strip()
    if text.startswith("uniform"):
        _, _, seed = text.partition(":")
        try:
            return paper_participation(num_nodes, seed=int(seed) if seed else 0)
        except ValueError as exc:
            raise ValueError(f"participation spec {text!r}: {exc}") from None
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"participation spec {text!r} is neither a number, a comma-separated list nor 'uniform[:seed]'"
        ) from None
    if len(vals) == 1:
        vals = vals * num_nodes
    if len(vals) != num_nodes:
        raise ValueError(f"participation spec {text!r} has {len(vals)} values, expected {num_nodes}")
    return check_probabilities(vals, "participation")


class RFedAGS(PeerStrategy):
    """RFedAGS (Riemannian FL via averaging gradient streams; notes A.2) as a Flower strategy.

    Args:
        num_nodes: number of partitions ``N`` (partition-ids ``0..N-1``).
        participation: per-partition probabilities ``p_i`` (sequence or mapping; None = full
            participation). ``p_i = 0`` is allowed (the node never trains).
        mode: ``"corrected"`` (frequency estimates q), ``"known-p"`` or ``"uncorrected"``.
        local_steps: ``K >= 1``.
        step_size: ``alpha_0 > 0``; ``alpha_t = alpha_0 / (1 + t/decay_rounds)`` with ``t = round - 1``.
        decay_rounds: ``>= 0`` (0 = fixed step).
        global_step: ``varpi > 0`` (paper and code: 1).
        q_min: floor of the frequency estimate (see :class:`~flwr_sheaf.rfedags.participation.FrequencyEstimator`).
        estimate_includes_current: False = paper (``q^t`` from past rounds), True = authors' code.
        manifold: manifold of the parameter; default inferred from the initial array: 2-D ``(d, r)``
            -> :class:`~flwr_sheaf.rfedags.manifolds.Stiefel`, 1-D -> :class:`~flwr_sheaf.rfedags.manifolds.Sphere`.
        train_config: extra values forwarded in every ``train.rfedags`` config (e.g. ``batch-size``,
            ``seed``); the ``train_config`` of ``start()`` is merged on top.
        seed: participation seed.
        action: message action name (default ``"rfedags"``).
        discovery_timeout: see :class:`~flwr_sheaf.strategy.base.PeerStrategy`.

    Raises:
        ValueError: invalid mode, probabilities, K, step sizes; (in ``configure_train``) an initial
            array without key ``"x"``, of unsupported rank, or off the manifold.
    """

    def __init__(
        self,
        num_nodes: int,
        participation: Mapping[int, float] | Sequence[float] | None = None,
        mode: str = "corrected",
        local_steps: int = 5,
        step_size: float = 0.02,
        decay_rounds: float = 0.0,
        global_step: float = 1.0,
        q_min: float = DEFAULT_Q_MIN,
        estimate_includes_current: bool = False,
        manifold: Manifold | None = None,
        train_config: Mapping | None = None,
        seed: int = 0,
        action: str = "rfedags",
        discovery_timeout: float = 300.0,
    ) -> None:
        p = _probabilities(num_nodes, participation)
        super().__init__(num_nodes=num_nodes, action=action, participation=list(p), seed=seed,
                         discovery_timeout=discovery_timeout)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if int(local_steps) != local_steps or local_steps < 1:
            raise ValueError(f"local_steps (K) must be a positive integer, got {local_steps!r}")
        if not (np.isfinite(global_step) and global_step > 0):
            raise ValueError(f"global_step (varpi) must be positive, got {global_step!r}")
        self.alpha = step_size_schedule(step_size, decay_rounds)  # validates step_size, decay_rounds
        self.p = p
        self.mode = mode
        self.local_steps = int(local_steps)
        self.step_size, self.decay_rounds = float(step_size), float(decay_rounds)
        self.global_step = float(global_step)
        self.q_min = float(q_min)
        self.estimate_includes_current = bool(estimate_includes_current)
        self.manifold = manifold
        self.train_config = dict(train_config or {})
        self.seed = int(seed)
        self.server: RFedAGSServer | None = None
        self._drawn: list[int] = []
        self._x_t: np.ndarray | None = None

    # ------------------------------------------------------------------ helpers
    def _init_server(self, arrays: ArrayRecord) -> None:
        if PARAM_KEY not in arrays:
            raise ValueError(f"initial_arrays must hold the global parameter under key {PARAM_KEY!r}")
        x0 = np.array(arrays[PARAM_KEY].numpy(), dtype=np.float64)
        if self.manifold is None:
            if x0.ndim == 2:
                self.manifold = Stiefel(*x0.shape)
            elif x0.ndim == 1:
                self.manifold = Sphere(x0.shape[0])
            else:
                raise ValueError(f"cannot infer a manifold for a parameter of shape {x0.shape}")
        self.manifold.check_point(x0, atol=1e-8)
        self.server = RFedAGSServer(
            self.manifold, x0, self.num_nodes, mode=self.mode, p=self.p, q_min=self.q_min,
            global_step=self.global_step, estimate_includes_current=self.estimate_includes_current,
        )

    def sample(self, server_round: int) -> list[int]:
        """Partition-ids drawn in ``server_round``: independent Bernoulli(p_i), seeded by ``(seed, round)``."""
        return [int(i) for i in np.flatnonzero(bernoulli_participation(self.p, server_round, self.seed))]

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        """One ``train.rfedags`` message with ``x_t`` per drawn node (possibly none)."""
        self.ensure_discovered(grid)
        if self.server is None:
            self._init_server(arrays)
        self.begin_round(server_round)
        self._x_t = self.server.x.copy()
        self._drawn = self.sample(server_round)
        self._round["drawn"] = list(self._drawn)
        alpha_t = self.alpha(server_round - 1)
        self._round["step_size"] = alpha_t
        cfg = {**self.train_config, **dict(config), "server-round": server_round,
               "local-steps": self.local_steps, "step-size": alpha_t}
        msgs = []
        for pid in self._drawn:
            content = RecordDict({
                "arrays": ArrayRecord({PARAM_KEY: Array(np.ascontiguousarray(self._x_t))}),
                "config": ConfigRecord(dict(cfg)),
            })
            msgs.append(self.message(pid, content, "train", server_round))
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weight the arrived streams, average, retract; returns the new ``x`` and round metrics."""
        ok = self.split_replies(server_round, "train", replies, self._drawn)
        shape = tuple(self.server.x.shape)
        zetas: dict[int, np.ndarray] = {}
        num_examples = np.ones(self.num_nodes)
        tangent = []
        for pid, r in ok.items():
            try:
                z = np.array(r.content["stream"]["zeta"].numpy(), dtype=np.float64)
            except KeyError:
                z = None
            reason = None
            if z is None:
                reason = "reply has no stream/zeta array"
            elif z.shape != shape:
                reason = f"stream of shape {z.shape}, expected {shape}"
            elif not np.all(np.isfinite(z)):
                reason = "NaN/inf stream"
            if reason is not None:
                self.failures.append({"round": server_round, "phase": "train", "partition-id": pid, "reason": reason})
                log.warning("round %d: partition-id %d: %s (ignored)", server_round, pid, reason)
                continue
            zetas[pid] = z
            m = r.content["metrics"] if "metrics" in r.content else {}
            num_examples[pid] = float(m.get("num-examples", 1))
            tangent.append(float(np.max(self.manifold.tangent_error(self._x_t, z))))
        mask = np.zeros(self.num_nodes, dtype=bool)
        mask[list(zetas)] = True
        res = self.server.step(mask, zetas, num_examples=num_examples if self.mode == "uncorrected" else None)
        metrics = {
            "num_drawn": len(self._drawn),
            "num_responders": res.num_responders,
            "weight_sum": float(res.weights.sum()),
            "step_size": float(self._round["step_size"]),
            "direction_norm": float(np.linalg.norm(res.direction)),
            "tangent_error_max": max(tangent) if tangent else 0.0,
            "feasibility": float(np.max(self.manifold.feasibility(res.x))),
        }
        if self.mode != "uncorrected":
            metrics["estimate_min"] = float(np.min(res.estimates))
        self._round.update(metrics)
        self._round["responders"] = sorted(zetas)
        self._round["weights"] = res.weights.tolist()
        self._round["estimates"] = [None if np.isnan(e) else float(e) for e in res.estimates]
        return (ArrayRecord({PARAM_KEY: Array(np.ascontiguousarray(res.x))}),
                MetricRecord({k: float(v) for k, v in metrics.items()}))

    # ------------------------------------------------------------------ evaluate (none)
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                           ) -> Iterable[Message]:
        """No client-side evaluation (use ``start(evaluate_fn=...)``); returns no messages."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Closes the round's ``history`` entry; returns None."""
        rec = self.end_round()
        log.info("round %4d | drawn %3d | responders %3d | |dir| %.3e | %.3f s", server_round,
                 rec.get("num_drawn", 0), rec.get("num_responders", 0), rec.get("direction_norm", 0.0),
                 rec["wall_seconds"])
        return None

    def summary(self) -> None:  # noqa: D102 - Strategy API
        log.info("RFedAGS(mode=%s, N=%d, K=%d, alpha0=%g, decay=%g, varpi=%g, q_min=%g)", self.mode,
                 self.num_nodes, self.local_steps, self.step_size, self.decay_rounds, self.global_step, self.q_min)
