"""ClientApp handlers of the RFedAGS family (notes/baselines-rfedags.md, s5) and :class:`ProblemClient`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ...client.reference import travel_by_reference
from ...config import node_partition_id
from ...protocol import (
    ARRAYS,
    CONFIG,
    INFO,
    METRICS,
    NUM_EXAMPLES,
    SEED,
    SERVER_ROUND,
    NodeInfo,
    ProtocolError,
    array_record,
    as_float,
    as_int,
    config_record,
    pack_arrays,
)
from . import ACTION
from .baselines import BASELINES, projection_local_steps, svrg_local_steps
from .frechet import FrechetMeanProblem
from .local import local_gradient_stream
from .manifolds import Manifold
from .pca import PCAProblem, batch_indices
from .protocol import (
    CORRECTION,
    ENDPOINT,
    FULL_GRADIENT,
    LOCAL_STEPS,
    MEAN_GRADIENT,
    MINIBATCH_SIZE,
    PHASE,
    PHASE_GRADIENT,
    PHASE_LOCAL,
    POINT,
    STEP_SIZE,
    STREAM,
    STREAM_RECORD,
)

__all__ = [
    "RFedAGSLocalProblem",
    "ProblemClient",
    "problem_factory",
    "register_rfedags_handlers",
    "register_rfedags_baseline_handlers",
    "STATE_KEY",
]

STATE_KEY = "rfedags.meta"


class RFedAGSLocalProblem(Protocol):
    """What a node brings to the RFedAGS family's handlers (a researcher's own problem needs only these).

    Attributes:
        manifold: the manifold of the global parameter.
        num_examples: local sample count ``n_i`` (used by the uncorrected mean).

    Methods:
        gradient_oracle(server_round, num_steps, config) -> ``egrad(x, k)``: Euclidean (mini-batch)
            gradient of ``f_i`` at step ``k``, float64 of the point's shape, deterministic in
            ``(config, server_round)``.
        local_cost(x) -> float: ``f_i(x)``.
    """

    manifold: Manifold
    num_examples: int

    def gradient_oracle(
        self, server_round: int, num_steps: int, config: Mapping
    ) -> Callable[[np.ndarray, int], np.ndarray]: ...

    def local_cost(self, x: np.ndarray) -> float: ...


@dataclass
class ProblemClient:
    """Client ``client`` of a federated problem (PCA, Fréchet means): a :class:`RFedAGSLocalProblem`.

    Reads the config keys ``minibatch-size`` (0 = exact gradients) and ``seed`` and draws the batches of
    :func:`~flwr_sheaf.methods.rfedags.pca.batch_indices`, so a Flower run equals ``run_federated`` of
    ``tests/oracles/rfedags_runner.py``.

    Raises:
        ValueError: a partition-id without data.
    """

    problem: PCAProblem | FrechetMeanProblem
    client: int

    def __post_init__(self) -> None:
        if not 0 <= self.client < self.problem.num_clients:
            raise ValueError(
                f"partition-id {self.client} has no data (problem has {self.problem.num_clients} clients)"
            )
        self.manifold = self.problem.manifold
        s = getattr(self.problem, "samples", None)
        self.num_examples = int(s.shape[1]) if s is not None else 1

    def gradient_oracle(
        self, server_round: int, num_steps: int, config: Mapping
    ) -> Callable[[np.ndarray, int], np.ndarray]:
        """``egrad(x, k)``: exact local gradient (``minibatch-size`` 0) or the mini-batch of step ``k``.

        Raises:
            ValueError: a mini-batch requested on a problem without samples.
        """
        b = int(config[MINIBATCH_SIZE])
        c = [self.client]
        if b <= 0:
            return lambda x, k: self.problem.local_egrads(x, c)[0]
        samples = getattr(self.problem, "samples", None)
        if samples is None:
            raise ValueError(f"minibatch-size={b} requested but the problem has no samples")
        idx = batch_indices(
            int(config[SEED]), server_round, self.client, num_steps, samples.shape[1], b
        )
        return lambda x, k: self.problem.minibatch_egrads(x, c, idx[k : k + 1])[0]

    def local_cost(self, x: np.ndarray) -> float:
        """``f_i(x)`` (float)."""
        return float(self.problem.local_costs(x)[self.client])


def problem_factory(problem) -> Callable[[Context], ProblemClient]:
    """``factory(context)`` giving each node the :class:`ProblemClient` of its ``partition-id``."""

    def factory(context: Context) -> ProblemClient:
        return ProblemClient(problem, node_partition_id(context))

    return factory


def _register_query(
    app: ClientApp, problem_factory: Callable[[Context], RFedAGSLocalProblem], action: str
) -> None:
    """``query.<action>``: discovery reply (partition-id, num-partitions, point size, num-examples)."""
    travel_by_reference(app)  # pickled as its import path by Ray (flwr_sheaf.client.reference)

    @app.query(action)
    def _query(msg: Message, context: Context) -> Message:
        prob = problem_factory(context)
        info = NodeInfo(
            node_partition_id(context),
            int(context.node_config.get("num-partitions", 0)),
            int(np.prod(prob.manifold.point_shape)),
            num_examples=int(prob.num_examples),
        )
        return Message(RecordDict({INFO: info.to_record()}), reply_to=msg)


def _inputs(
    msg: Message,
    context: Context,
    problem_factory: Callable[[Context], RFedAGSLocalProblem],
    action: str,
    keys: tuple[str, ...],
) -> tuple[RFedAGSLocalProblem, np.ndarray, Mapping[str, object], int, float, int]:
    """A ``train.<action>`` message's problem, finite point ``x``, config (``ProtocolError`` when one of
    ``keys`` is missing) and ``(local-steps K, step-size alpha_t, server-round)``.
    """
    prob = problem_factory(context)
    cfg: Mapping[str, object] = config_record(msg.content, CONFIG) if CONFIG in msg.content else {}
    for key in keys:
        if key not in cfg:
            raise ProtocolError(f"train.{action} config lacks {key!r}")
    return (
        prob,
        _array(msg, POINT, tuple(prob.manifold.point_shape), action),
        cfg,
        as_int(cfg[LOCAL_STEPS], LOCAL_STEPS),
        as_float(cfg[STEP_SIZE], STEP_SIZE),
        as_int(cfg[SERVER_ROUND], SERVER_ROUND),
    )


def _reply(
    msg: Message, prob: RFedAGSLocalProblem, upload: dict[str, np.ndarray], **metrics: float
) -> Message:
    """The train reply: ``upload`` in record ``stream``; ``num-examples`` and ``metrics`` in ``metrics``."""
    reply = RecordDict(
        {
            STREAM_RECORD: pack_arrays(upload),
            METRICS: MetricRecord({NUM_EXAMPLES: int(prob.num_examples), **metrics}),
        }
    )
    return Message(reply, reply_to=msg)


_KEYS = (LOCAL_STEPS, STEP_SIZE, SERVER_ROUND, MINIBATCH_SIZE, SEED)


def register_rfedags_handlers(
    app: ClientApp,
    problem_factory: Callable[[Context], RFedAGSLocalProblem],
    action: str = ACTION,
) -> ClientApp:
    """Register ``query.<action>`` and ``train.<action>`` (RFedAGS client loop, notes/baselines-rfedags.md, s5).

    ``train.<action>`` reads ``x_t`` (:data:`~flwr_sheaf.methods.rfedags.protocol.POINT`) and the
    config ``server-round``, ``local-steps``, ``step-size``, ``minibatch-size``, ``seed``; replies with
    the stream ``zeta in T_{x_t} M`` of :func:`~flwr_sheaf.methods.rfedags.local.local_gradient_stream`
    and ``num-examples``, ``tangent-error``, ``local-cost-start``; keeps ``context.state[STATE_KEY]``.
    It raises (Flower error reply) on a bad point (shape, NaN/inf, off the manifold by > 1e-8), a
    missing/invalid config entry, or non-finite gradients. ``problem_factory`` builds the node's
    :class:`RFedAGSLocalProblem` per message. Returns ``app``.
    """
    _register_query(app, problem_factory, action)

    @app.train(action)
    def _train(msg: Message, context: Context) -> Message:
        prob, x, cfg, k_steps, alpha, rnd = _inputs(msg, context, problem_factory, action, _KEYS)
        man = prob.manifold
        man.check_point(x, atol=1e-8)
        oracle = prob.gradient_oracle(rnd, k_steps, cfg)
        zeta = local_gradient_stream(man, x, oracle, k_steps, alpha).zeta
        done = (
            as_int(context.state[STATE_KEY]["rounds-trained"], "rounds-trained")
            if STATE_KEY in context.state
            else 0
        )
        context.state[STATE_KEY] = MetricRecord({"rounds-trained": done + 1, "last-round": rnd})
        metrics = {
            "tangent-error": float(np.max(man.tangent_error(x, zeta))),
            "local-cost-start": float(prob.local_cost(x)),
        }
        return _reply(msg, prob, {STREAM: zeta}, **metrics)

    return app


def register_rfedags_baseline_handlers(
    app: ClientApp,
    problem_factory: Callable[[Context], RFedAGSLocalProblem],
    methods: tuple[str, ...] = BASELINES,
) -> ClientApp:
    """Register ``query.<m>`` and ``train.<m>`` for the baselines ``m`` in ``methods`` (notes/baselines-rfedags.md, s5).

    ``train.<m>`` reads RFedAGS's config plus ``phase`` and runs the method's client step (protocol:
    :mod:`~flwr_sheaf.methods.rfedags.baselines_strategy`); it raises as :func:`register_rfedags_handlers`
    and on a missing array, an unknown phase or a manifold RFedProj refuses (RFedProj's ambient point
    is not checked against the manifold). Returns ``app``.

    Raises:
        ValueError: a method not in :data:`~flwr_sheaf.methods.rfedags.baselines.BASELINES`.
    """
    for m in methods:
        if m not in BASELINES:
            raise ValueError(f"unknown RFedAGS baseline {m!r}; choose from {BASELINES}")
        _register_query(app, problem_factory, m)
        _register_baseline_train(app, problem_factory, m)
    return app


def _array(msg: Message, key: str, shape: tuple[int, ...], action: str) -> np.ndarray:
    if ARRAYS not in msg.content or key not in msg.content[ARRAYS]:
        raise ProtocolError(
            f"train.{action} message has no ArrayRecord {ARRAYS!r} with key {key!r}"
        )
    a = np.array(array_record(msg.content, ARRAYS)[key].numpy(), dtype=np.float64)
    if a.shape != shape:
        raise ValueError(f"train.{action}: array {key!r} has shape {a.shape}, expected {shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"train.{action}: array {key!r} has NaN/inf entries")
    return a


def _register_baseline_train(
    app: ClientApp, problem_factory: Callable[[Context], RFedAGSLocalProblem], action: str
) -> None:
    @app.train(action)
    def _train(msg: Message, context: Context) -> Message:
        prob, x, cfg, k_steps, alpha, rnd = _inputs(
            msg, context, problem_factory, action, (*_KEYS, PHASE)
        )
        man = prob.manifold
        phase = str(cfg[PHASE])
        if phase not in (PHASE_GRADIENT, PHASE_LOCAL) or (
            phase == PHASE_GRADIENT and action != "rfedsvrg"
        ):
            raise ProtocolError(f"train.{action}: unknown phase {phase!r}")
        if action != "rfedproj":
            man.check_point(x, atol=1e-8)
        if phase == PHASE_GRADIENT:
            exact = prob.gradient_oracle(rnd, 1, {MINIBATCH_SIZE: 0, SEED: cfg[SEED]})
            return _reply(msg, prob, {STREAM: man.egrad2rgrad(x, exact(x, 0))})
        oracle = prob.gradient_oracle(rnd, k_steps, cfg)
        if action == "rfedavg":
            end = local_gradient_stream(man, x, oracle, k_steps, alpha).endpoint
            return _reply(msg, prob, {ENDPOINT: end})
        if action == "rfedsvrg":
            g = _array(msg, FULL_GRADIENT, x.shape, action)
            return _reply(
                msg, prob, {ENDPOINT: svrg_local_steps(man, x, g, oracle, k_steps, alpha)}
            )
        c = _array(msg, CORRECTION, x.shape, action)
        end, mean_grad = projection_local_steps(man, x, c, oracle, k_steps, alpha)
        return _reply(msg, prob, {ENDPOINT: end, MEAN_GRADIENT: mean_grad})
