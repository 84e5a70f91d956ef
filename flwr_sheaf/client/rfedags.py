"""RFedAGS ClientApp handlers: K local Riemannian SGD steps, upload the transported gradient stream.

``register_rfedags_handlers(app, problem_factory)`` adds, under their own action names so they sit
beside a user's default ``train``/``evaluate``:

- ``query.rfedags``: discovery reply (partition-id, num-partitions, point size, num-examples);
- ``train.rfedags``: receive the server point ``x_t`` (record ``arrays``, key
  :data:`flwr_sheaf.protocol.POINT`, float64) and a ``ConfigRecord`` (``server-round``,
  ``local-steps`` K, ``step-size`` alpha_t, ``minibatch-size``, ``seed``; all required), run the
  RFedAGS client loop (docs/baselines.md, "RFedAGS") (:func:`flwr_sheaf.rfedags.client.local_gradient_stream`)
  and reply with the gradient stream ``zeta in T_{x_t} M`` (record ``stream``, key
  :data:`flwr_sheaf.protocol.STREAM`, float64, same shape as ``x``) and a ``MetricRecord``
  (``num-examples``, ``tangent-error``, ``local-cost-start``).

The client never uploads its end point. It keeps no module-level state: the only per-node state is a
small ``MetricRecord`` ``"rfedags.meta"`` in ``context.state`` (rounds trained, last round).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..protocol import (ARRAYS, CONFIG, INFO, LOCAL_STEPS, METRICS, MINIBATCH_SIZE, NUM_EXAMPLES, POINT, SEED,
                        SERVER_ROUND, STEP_SIZE, STREAM, STREAM_RECORD, NodeInfo, ProtocolError, pack_arrays)
from ..rfedags.client import local_gradient_stream
from ..rfedags.manifolds import Manifold
from ..rfedags.pca import PCAProblem, batch_indices

__all__ = [
    "RFedAGSLocalProblem",
    "PCAClientProblem",
    "pca_problem_factory",
    "register_rfedags_handlers",
    "STATE_KEY",
]

STATE_KEY = "rfedags.meta"


class RFedAGSLocalProblem(Protocol):
    """What a node brings to the RFedAGS handlers.

    Attributes:
        manifold: the manifold of the global parameter (``proj``/``retr``/``transp``/``egrad2rgrad``).
        num_examples: local sample count ``n_i`` (reported; used by the uncorrected mean).

    Methods:
        gradient_oracle(server_round, num_steps, config) -> ``egrad(x, k)``: Euclidean (mini-batch)
            gradient of ``f_i`` at local step ``k`` of this round; must be deterministic in
            ``(config, server_round)`` for reproducibility.
        local_cost(x) -> float: ``f_i(x)`` (diagnostics).
    """

    manifold: Manifold
    num_examples: int

    def gradient_oracle(self, server_round: int, num_steps: int, config: Mapping
                        ) -> Callable[[np.ndarray, int], np.ndarray]: ...

    def local_cost(self, x: np.ndarray) -> float: ...


@dataclass
class PCAClientProblem:
    """Client ``client`` of a :class:`~flwr_sheaf.rfedags.pca.PCAProblem` (``f_i(X) = -tr(X^T A_i X)``).

    Config keys read by :meth:`gradient_oracle` (both required): ``minibatch-size`` (0 = exact
    gradient ``-2 A_i X``) and ``seed`` (mini-batch seed); batches come from
    :func:`~flwr_sheaf.rfedags.pca.batch_indices` so they match :func:`~flwr_sheaf.rfedags.pca.run_pca_reference`.
    """

    problem: PCAProblem
    client: int

    def __post_init__(self) -> None:
        if not 0 <= self.client < self.problem.num_clients:
            raise ValueError(
                f"partition-id {self.client} has no PCA data (problem has {self.problem.num_clients} clients)"
            )
        self.manifold = self.problem.manifold
        s = self.problem.samples
        self.num_examples = int(s.shape[1]) if s is not None else 1

    def gradient_oracle(self, server_round: int, num_steps: int, config: Mapping
                        ) -> Callable[[np.ndarray, int], np.ndarray]:
        """``egrad(X, k)`` for one round: exact ``-2 A_i X`` or mini-batch ``-(2/B) Z_b^T Z_b X``.

        Raises:
            ValueError: ``minibatch-size`` > 0 on a problem without samples, or out of range.
        """
        b = int(config[MINIBATCH_SIZE])
        c = [self.client]
        if b <= 0:
            return lambda x, k: self.problem.local_egrads(x, c)[0]
        if self.problem.samples is None:
            raise ValueError(f"minibatch-size={b} requested but the PCA problem has no samples")
        idx = batch_indices(int(config[SEED]), server_round, self.client, num_steps,
                            self.problem.samples.shape[1], b)
        return lambda x, k: self.problem.minibatch_egrads(x, c, idx[k : k + 1])[0]

    def local_cost(self, x: np.ndarray) -> float:
        """``f_i(X) = -tr(X^T A_i X)``."""
        a = self.problem.covariances[self.client]
        return float(-np.sum(x * (a @ x)))


def pca_problem_factory(problem: PCAProblem) -> Callable[[Context], PCAClientProblem]:
    """``factory(context)`` giving each node the PCA client of its ``partition-id`` (shared read-only data)."""

    def factory(context: Context) -> PCAClientProblem:
        return PCAClientProblem(problem, int(context.node_config["partition-id"]))

    return factory


def register_rfedags_handlers(
    app: ClientApp,
    problem_factory: Callable[[Context], RFedAGSLocalProblem],
    action: str = "rfedags",
) -> ClientApp:
    """Register the RFedAGS handlers on a (possibly existing) ``ClientApp`` (client loop, docs/baselines.md).

    Args:
        app: the ClientApp to extend; its own handlers are untouched.
        problem_factory: builds the node's :class:`RFedAGSLocalProblem` from its ``Context`` (called
            per message; cache heavy data outside the node state, read-only).
        action: action name; ``query.<action>`` and ``train.<action>`` are routed here.

    Returns:
        ``app`` (for chaining).

    The train handler raises (-> Flower error reply, state rolled back) on: a missing ``"x"`` array,
    a point of the wrong shape or off the manifold (``||X^T X - I|| > 1e-8``), missing/invalid
    ``local-steps`` / ``step-size``, or non-finite gradients.
    """

    @app.query(action)
    def _query(msg: Message, context: Context) -> Message:
        prob = problem_factory(context)
        info = NodeInfo(int(context.node_config["partition-id"]), int(context.node_config.get("num-partitions", 0)),
                        int(np.prod(prob.manifold.point_shape)), num_examples=int(prob.num_examples))
        return Message(RecordDict({INFO: info.to_record()}), reply_to=msg)

    @app.train(action)
    def _train(msg: Message, context: Context) -> Message:
        prob = problem_factory(context)
        if ARRAYS not in msg.content or POINT not in msg.content[ARRAYS]:
            raise ProtocolError(f"train.{action} message has no ArrayRecord {ARRAYS!r} with key {POINT!r}")
        x = np.array(msg.content[ARRAYS][POINT].numpy(), dtype=np.float64)
        man = prob.manifold
        if x.shape != tuple(man.point_shape):
            raise ValueError(f"server point has shape {x.shape}, expected {tuple(man.point_shape)}")
        man.check_point(x, atol=1e-8)
        cfg = msg.content[CONFIG] if CONFIG in msg.content else {}
        for key in (LOCAL_STEPS, STEP_SIZE, SERVER_ROUND, MINIBATCH_SIZE, SEED):
            if key not in cfg:
                raise ProtocolError(f"train.{action} config lacks {key!r}")
        k_steps, alpha, rnd = int(cfg[LOCAL_STEPS]), float(cfg[STEP_SIZE]), int(cfg[SERVER_ROUND])
        oracle = prob.gradient_oracle(rnd, k_steps, cfg)
        stream = local_gradient_stream(man, x, oracle, k_steps, alpha)
        zeta = stream.zeta
        meta = context.state[STATE_KEY] if STATE_KEY in context.state else MetricRecord(
            {"rounds-trained": 0, "last-round": 0})
        context.state[STATE_KEY] = MetricRecord({
            "rounds-trained": int(meta["rounds-trained"]) + 1, "last-round": rnd})
        reply = RecordDict({
            STREAM_RECORD: pack_arrays({STREAM: zeta}),
            METRICS: MetricRecord({
                NUM_EXAMPLES: int(prob.num_examples),
                "tangent-error": float(np.max(man.tangent_error(x, zeta))),
                "local-cost-start": float(prob.local_cost(x)),
            }),
        })
        return Message(reply, reply_to=msg)

    return app
