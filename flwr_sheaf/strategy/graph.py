"""The one strategy base: discovery, sampling, the round loop, bookkeeping and the agents' graph.

Every method's strategy subclasses :class:`GraphStrategy` directly (one level below Flower's
``Strategy``) and fills in hooks; what methods share comes from components they hold, not from
parents (e.g. the prototype aggregation of ``flwr_sheaf/methods/_shared/``; evaluation: :class:`~flwr_sheaf.strategy.evaluation.GraphEvaluation`; checkpoints:
:class:`~flwr_sheaf.strategy.checkpoint.Checkpointer`).

- **discovery** (:class:`~flwr_sheaf.strategy.discovery.Discovery`): a ``query.<action>`` round
  trip maps Flower's opaque node ids to partition-ids and collects each node's
  :class:`~flwr_sheaf.protocol.NodeInfo`; the strategy then builds its graph (:meth:`GraphStrategy.on_discovered`);
- **sampling**: :class:`~flwr_sheaf.participation.ParticipationSampler` (a node's draw depends only
  on (seed, server round, partition-id), identically for every method);
- **the round loop** :meth:`GraphStrategy.start` (Flower's ``Strategy.start`` contract, returns
  Flower's ``Result``): discovery, then per round train (one round trip) and, in evaluated rounds,
  :meth:`GraphStrategy.evaluate_round` (the held evaluation's value). Every round trip honours the
  one ``timeout``: a node that does not answer in time is recorded as failed and the round goes on;
- **bookkeeping**: replies split into ok / failed / missing by partition-id, bytes on the wire,
  wall time, one typed :class:`~flwr_sheaf.strategy.base.RoundRecord` per server round;
- **the graph and the shared local-training round**: a method fills in
  :meth:`GraphStrategy.method_config` (its config section, sent to every trained node),
  :meth:`GraphStrategy.node_payload` (per-node records and config: Sheaf-FRL's neighbour pilots
  and edges), :meth:`GraphStrategy.accept_train` (consume the replies) and
  :meth:`GraphStrategy.evaluate_payload` (extra evaluation records).

A strategy without an agents' graph (the RFedAGS family) passes ``federation=None`` and its own
``sampler``: no graph is built, nothing is evaluated, and it overrides the train hooks.
It knows nothing of CNNs, of the sheaf maths or of ``flwr_sheaf.client``, and nothing of its subclasses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import networkx as nx
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..config import DEFAULTS, KEYS, FederationConfig, LocalTrainConfig
from ..hints import pilot_count_error
from ..logs import default_progress_handler
from ..participation import EVALUATE_STREAM, ParticipationSampler
from ..protocol import (
    CONFIG,
    DEVICE,
    METRICS,
    NUM_EXAMPLES,
    SEED,
    SERVER_ROUND,
    TORCH_THREADS,
    TRAIN,
    TRAIN_REPLY,
    EdgeConfig,
    as_float,
    message_type,
    reply_problem,
    train_reply_problem,
)
from ..sheaf.network import orient_edge
from ..topology import build_graph, validate_graph
from . import messaging
from .base import MetricValues, Node, RoundRecord, _numeric, nanmean, record_bytes
from .checkpoint import Checkpointer
from .discovery import Discovery
from .evaluation import EvaluationResult, GraphEvaluation, summarise_accuracies

__all__ = ["GraphStrategy", "RunFailedError", "summarise_accuracies"]

log = logging.getLogger("flwr_sheaf")


class RunFailedError(RuntimeError):
    """A run past its ``max-failed-fraction`` (:meth:`GraphStrategy.run_status`): the ServerApp raises it
    after ``results.json`` is written, so Flower records the run as failed (docs/reliability-failures.md)."""


class GraphStrategy(Strategy):
    """The one base of flwr-sheaf's strategies (module docstring); no global model is required.

    Args:
        num_nodes: agents (graph nodes = partition-ids ``0..num_nodes-1``); discovery waits for them.
        action: message action (``"sheaf"`` -> ``query.sheaf``, ``train.sheaf``, ...).
        federation: graph spec, participation and evaluation period; None = no agents' graph (then
            ``sampler`` is required).
        train: local-training settings sent to every trained node (default: the defaults).
        graph: an explicit ``networkx.Graph`` on partition-ids (overrides ``federation.graph``).
        evaluation: the per-round evaluation component (default with a federation: the graph
            evaluation with whitening fitted on the pilots; None without one).
        sampler: who trains in each round (default: from ``federation``).
        discovery_timeout: seconds to wait for enough SuperNodes to register.

    Class attributes:
        train_metric_columns: ``{reply metric: round column}`` every round reports, NaN when no node
            measured it (the common results schema: ``gluing`` -> ``gluing_loss``).

    Raises:
        ValueError: ``num_nodes < 1``, a sampler for a different N, a non-positive timeout, neither
            a federation nor a sampler; (at discovery, naming ``graph``) a graph that is not
            connected or names a missing partition-id; nodes reporting different pilot counts or
            different pilots (:func:`~flwr_sheaf.protocol.pilot_digest`).
        ConfigError: (at construction) an unknown graph spec form.
    """

    train_metric_columns: ClassVar[Mapping[str, str]] = {"gluing": "gluing_loss"}

    def __init__(
        self,
        num_nodes: int,
        *,
        action: str,
        federation: FederationConfig | None = None,
        train: LocalTrainConfig | None = None,
        graph: nx.Graph | None = None,
        evaluation: GraphEvaluation | None = None,
        sampler: ParticipationSampler | None = None,
        discovery_timeout: float = DEFAULTS["discovery-timeout"],
    ) -> None:
        if int(num_nodes) != num_nodes or num_nodes < 1:
            raise ValueError(f"num_nodes must be a positive integer, got {num_nodes!r}")
        if sampler is None:
            if federation is None:
                raise ValueError("a strategy needs a federation config or a participation sampler")
            sampler = ParticipationSampler.from_spec(
                num_nodes, federation.fraction_train, federation.participation, federation.seed
            )
        if sampler.num_nodes != num_nodes:
            raise ValueError(
                f"the participation sampler is for {sampler.num_nodes} nodes, the strategy for {num_nodes}"
            )
        if not discovery_timeout > 0:
            raise ValueError(f"discovery_timeout must be > 0 seconds, got {discovery_timeout!r}")
        self.num_nodes = int(num_nodes)
        self.action = action
        self.sampler = sampler
        self.seed = sampler.seed
        self.discovery_timeout = float(discovery_timeout)
        self.nodes: dict[int, Node] = {}
        self.pid_of_node: dict[int, int] = {}
        self.rounds: list[RoundRecord] = []
        self.failures: list[dict] = []
        # None until begin_round; every reader runs inside a round (declared non-Optional for type checkers)
        self.current: RoundRecord = None  # type: ignore[assignment]
        self._t0: float | None = None
        self._dst_of_message: dict[str, int] = {}
        self.extra_train_config: dict[str, Any] = {}
        self.extra_evaluate_config: dict[str, Any] = {}
        #: entries added to the discovery config of a resumed run (the ServerApp sets them from the
        #: checkpoint: which partition-ids trained up to which round; client/state.py checks them).
        self.resume_check: dict[str, Any] = {}
        #: writes checkpoints and restores one (:class:`flwr_sheaf.strategy.checkpoint.Checkpointer`;
        #: the ServerApp sets it; None = no checkpoints).
        self.checkpointer: Checkpointer | None = None
        #: called after every completed server round with its record's ``as_dict()`` (the round's
        #: ``results.json`` entry), e.g. :meth:`flwr_sheaf.tracking.Tracker.log_round`; not checkpointed.
        self.round_callbacks: list[Callable[[dict[str, Any]], None]] = []
        #: ``num_rounds`` of the last :meth:`start` (None before): results with fewer rounds are
        #: ``failed`` (:func:`flwr_sheaf.results.run_status`); not checkpointed.
        self.requested_rounds: int | None = None
        self.federation = federation
        self.train = train or LocalTrainConfig()
        if federation is not None and evaluation is None:
            evaluation = GraphEvaluation(federation)
        #: the per-round evaluation component (None: nothing is evaluated).
        self.evaluation = evaluation
        #: who is evaluated in an evaluated round (``fraction-evaluate``; its own uniform stream)
        self.eval_sampler = ParticipationSampler(
            num_nodes,
            1.0 if federation is None else federation.fraction_evaluate,
            seed=self.seed,
            stream=EVALUATE_STREAM,
            key="fraction-evaluate",
        )
        self.graph_spec: nx.Graph | str | None = (
            graph if graph is not None else (None if federation is None else federation.graph)
        )
        self.graph: nx.Graph | None = None
        self.num_pilots = -1
        #: the last evaluated round's result (``node_results``, ``edge_results``, ``non_edge_results``).
        self.last_evaluation = EvaluationResult()

    # ------------------------------------------------------------------ graph
    def query_config(self) -> dict:
        """Discovery reads the torch thread count and checks the device (run-config key ``device``)."""
        if self.federation is None:
            return {}
        return {TORCH_THREADS: self.train.torch_threads, DEVICE: self.train.device}

    def on_discovered(self) -> None:
        """Build (from a spec, with the reported class sets) and validate the graph; check the pilot count.

        Without a federation (no agents' graph) nothing is built.
        """
        if self.graph_spec is None:
            return
        classes = [self.nodes[p].info.classes for p in range(self.num_nodes)]
        try:
            if isinstance(self.graph_spec, str):
                self.graph = build_graph(self.graph_spec, self.num_nodes, class_sets=classes)
            else:
                self.graph = self.graph_spec
            validate_graph(self.graph, range(self.num_nodes))
        except ValueError as exc:
            name = (
                f"graph={self.graph_spec!r}"
                if isinstance(self.graph_spec, str)
                else "graph (networkx.Graph)"
            )
            raise ValueError(
                f"{name} on {self.num_nodes} nodes: {exc} (for a few nodes use 'ring' or "
                f"'class-overlap:<density>')"
            ) from None
        ks = {n.info.num_pilots for n in self.nodes.values()}
        if len(ks) > 1:
            raise ValueError(
                pilot_count_error({p: n.info.num_pilots for p, n in self.nodes.items()})
            )
        groups: dict[int, list[int]] = {}
        for p in sorted(self.nodes):
            if self.nodes[p].info.pilot_digest:
                groups.setdefault(self.nodes[p].info.pilot_digest, []).append(p)
        if len(groups) > 1:
            parts = sorted(groups.values(), key=len, reverse=True)
            raise ValueError(
                f"nodes hold different pilots (partition-ids {parts[0]} agree; {parts[1:]} differ): the "
                f"pilots must be the same samples in the same order on every node (same dataset, seed, "
                f"shift and num-pilots)"
            )
        self.num_pilots = ks.pop()
        log.info(
            "%s graph: %d nodes, %d edges",
            type(self).__name__,
            self.graph.number_of_nodes(),
            self.graph.number_of_edges(),
        )

    def oriented_edges(self) -> list[tuple[int, int]]:
        """All edges as (head, tail) pairs (larger d is head; ties: larger partition-id)."""
        assert self.graph is not None, "graph is built in on_discovered"
        return sorted(
            orient_edge(a, self.nodes[a].d, b, self.nodes[b].d) for a, b in self.graph.edges
        )

    def edge_config(self, pid: int, weights: list[float] | None = None) -> EdgeConfig:
        """Node ``pid``'s incident edges (neighbours sorted) with their orientation."""
        assert self.graph is not None, "graph is built in on_discovered"
        nbrs = tuple(sorted(self.graph.neighbors(pid)))
        d = self.nodes[pid].d
        heads = tuple(orient_edge(pid, d, j, self.nodes[j].d)[0] == pid for j in nbrs)
        return EdgeConfig(
            nbrs,
            tuple(self.nodes[j].d for j in nbrs),
            heads,
            None if weights is None else tuple(weights),
        )

    # ------------------------------------------------------------------ hooks
    def method_config(self, server_round: int) -> dict:
        """The method's config entries for every train message of this round (default: none).

        Returns:
            ``{key: value}`` merged into every ``train.<action>`` config (docs/methods.md, "Adding a method").
        """
        return {}

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """``(records, config entries)`` only node ``pid`` gets in its train message (default: none;
        Sheaf-FRL: its neighbours' pilots and its edges; docs/methods.md, "Adding a method")."""
        return {}, {}

    def accept_train(
        self, server_round: int, ok: dict[int, Message]
    ) -> tuple[dict[int, Message], dict]:
        """Consume the successful train replies ``{partition-id: reply}``; returns the accepted ones and
        extra round metrics (record a rejected reply with :meth:`record_failure`)."""
        return ok, {}

    def evaluate_payload(self, server_round: int) -> tuple[dict, dict]:
        """``(records, config entries)`` added to every phase-1 evaluation message (default: none)."""
        return {}, {}

    def evaluate_node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """``(records, config entries)`` only node ``pid`` gets in its phase-1 evaluation message (default:
        none; Sheaf-FRL under stringent privacy: its edges, docs/variants-privacy.md)."""
        return {}, {}

    # ------------------------------------------------------------------ discovery
    def discover(self, grid: Grid, timeout: float) -> None:
        """Map node ids to partition-ids (:class:`~flwr_sheaf.strategy.discovery.Discovery`, queried
        with :meth:`query_config` and :attr:`resume_check`), then :meth:`on_discovered`; nothing
        when the nodes are known already.

        Raises:
            RuntimeError: see :meth:`flwr_sheaf.strategy.discovery.Discovery.run` (too few
                SuperNodes, a failed discovery handler, partition-ids missing after
                ``discovery_timeout``).
        """
        if len(self.nodes) == self.num_nodes:
            return
        config = {**self.query_config(), **self.resume_check}
        self.nodes = Discovery(self.num_nodes, self.action, config, self.discovery_timeout).run(
            grid, timeout
        )
        self.pid_of_node = {n.node_id: p for p, n in self.nodes.items()}
        self.on_discovered()

    # ------------------------------------------------------------------ the round loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run discovery and ``num_rounds`` server rounds; Flower's ``Strategy.start`` contract.

        Per round: ``configure_train`` -> one round trip -> ``aggregate_train``; then, in evaluated
        rounds, :meth:`evaluate_round` (the held :class:`GraphEvaluation`'s two round trips, or
        ``configure_evaluate`` -> round trip -> ``aggregate_evaluate``); then ``evaluate_fn``. Every round trip waits at
        most ``timeout`` seconds; nodes that did not answer are recorded as failed. With
        :attr:`checkpointer` set, a checkpoint is written after the rounds it is due and a resumed
        run puts the checkpointed state back after discovery and goes on with the next round
        (docs/resume.md). After each round, every callable in :attr:`round_callbacks` gets the round's
        ``results.json`` dict (experiment tracking, :class:`flwr_sheaf.tracking.Tracker`), after
        the round's checkpoint; a callback that raises ends the run (the Tracker never raises).

        Args:
            grid: Flower's Grid.
            initial_arrays: the global parameter, for strategies that have one (RFedAGS); else None.
            num_rounds: server rounds (>= 1).
            timeout: seconds per round trip (also bounds discovery's round trips).
            train_config: extra values merged into every train config; keys that flwr-sheaf's
                typed configs own (run-config keys) are refused, so each value has one channel.
            evaluate_config: the same for every evaluate config.
            evaluate_fn: optional centralised evaluation ``(round, arrays) -> MetricRecord``.

        Returns:
            ``Result`` with the final arrays and per-round train/evaluate MetricRecords.

        Raises:
            ValueError: ``num_rounds < 1`` or a refused config key (named).
        """
        if int(num_rounds) != num_rounds or num_rounds < 1:
            raise ValueError(f"num_rounds must be a positive integer, got {num_rounds!r}")
        for name, cfg in (("train_config", train_config), ("evaluate_config", evaluate_config)):
            owned = sorted(set(cfg or {}) & set(KEYS))
            if owned:
                raise ValueError(
                    f"{name} keys {owned} are run-config keys: set them on the strategy's config "
                    f"sections (flwr_sheaf.config), not per call"
                )
        self.extra_train_config = dict(train_config or {})
        self.extra_evaluate_config = dict(evaluate_config or {})
        self.requested_rounds = int(num_rounds)  # a run whose rounds fall short of it is failed
        default_progress_handler()  # progress lines of one's own app, unless logging is configured
        self.summary()
        arrays = initial_arrays if initial_arrays is not None else ArrayRecord()
        result = Result(arrays=arrays)
        if evaluate_fn is not None:
            res = evaluate_fn(0, arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        self.discover(grid, timeout)
        first, wall0 = 1, 0.0
        if (
            self.checkpointer is not None
        ):  # resume: the state after the checkpointed round (docs/resume.md)
            first, restored = self.checkpointer.restore(self, int(num_rounds))
            wall0 = self.checkpointer.previous_wall_seconds
            if restored is not None:
                arrays = result.arrays = restored
        self._t0 = time.monotonic() - wall0
        for rnd in range(first, int(num_rounds) + 1):
            t_round = time.monotonic()
            self.begin_round(rnd)
            msgs = list(
                self.configure_train(rnd, arrays, ConfigRecord(self.extra_train_config), grid)
            )
            new_arrays, train_metrics = self.aggregate_train(
                rnd, self._round_trip(grid, msgs, timeout)
            )
            if self.current.sampled and self.current.num_trained == 0:
                log.warning(
                    "round %d: none of the %d sampled node(s) trained (failed: %s)",
                    rnd,
                    len(self.current.sampled),
                    self.current.failed.get("train", []),
                )
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            if self.evaluates(rnd, int(num_rounds)):
                metrics = self.evaluate_round(
                    rnd, arrays, ConfigRecord(self.extra_evaluate_config), grid, timeout
                )
                if metrics is not None:
                    result.evaluate_metrics_clientapp[rnd] = metrics
            if evaluate_fn is not None:
                res = evaluate_fn(rnd, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
            self.current.wall_seconds = time.monotonic() - t_round
            self.current.elapsed_seconds = time.monotonic() - self._t0
            self.rounds.append(self.current)
            self.log_round(self.current)
            if self.checkpointer is not None and self.checkpointer.due(rnd, int(num_rounds)):
                self.checkpointer.save(self, rnd, arrays, time.monotonic() - self._t0)
            # after the checkpoint: a callback that raises ends the run, with this round saved
            for callback in self.round_callbacks:
                callback(self.current.as_dict())
        return result

    def begin_round(self, server_round: int) -> RoundRecord:
        """Open the record of ``server_round`` (``start`` does it; tests that step rounds by hand too)."""
        self.current = RoundRecord(round=server_round)
        return self.current

    def _round_trip(self, grid: Grid, msgs: list[Message], timeout: float) -> list[Message]:
        """Send ``msgs`` and wait up to ``timeout``; remembers each sent message's destination by its
        message id (set by the grid on sending), so a reply that the SuperLink itself writes for a
        node it considers gone (its sender is not that node) still names the right node."""
        if not msgs:
            return []
        replies = messaging.send_and_receive(grid, msgs, timeout, messaging.in_flight_limit(grid))
        self._dst_of_message = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs}
        return replies

    # ------------------------------------------------------------------ messages and replies
    def message(
        self,
        pid: int,
        content: RecordDict,
        category: str,
        server_round: int,
        action: str | None = None,
    ) -> Message:
        """Instruction message ``<category>.<action>`` to partition ``pid``; its payload counts as sent.

        Raises:
            KeyError: ``pid`` was not discovered.
        """
        self.current.bytes_sent += record_bytes(content)
        return Message(
            content,
            dst_node_id=self.nodes[pid].node_id,
            message_type=message_type(category, action or self.action),
            group_id=str(server_round),
        )

    @staticmethod
    def merge_extra(
        owned: Mapping[str, Any], extra: Mapping[str, Any], name: str
    ) -> dict[str, Any]:
        """``owned`` plus the caller's ``extra`` config entries (from ``start``), which may not override it.

        Raises:
            ValueError: ``extra`` names keys the strategy sends itself (named).
        """
        clash = sorted(set(extra) & set(owned))
        if clash:
            raise ValueError(
                f"{name} keys {clash} are set by the strategy itself; pass other keys only"
            )
        return {**owned, **extra}

    def record_failure(self, server_round: int, phase: str, pid: int, reason: str) -> None:
        """Record one node's failure in ``phase`` (its previous server-side state stays untouched)."""
        self.failures.append(
            {"round": server_round, "phase": phase, "partition-id": pid, "reason": reason[-500:]}
        )
        failed = self.current.failed.setdefault(phase, [])
        if pid not in failed:
            failed.append(pid)
            failed.sort()
        log.warning(
            "round %d %s: partition-id %d failed: %s", server_round, phase, pid, reason[-300:]
        )

    def split_replies(
        self,
        server_round: int,
        phase: str,
        replies: Iterable[Message],
        expected: Iterable[int],
        required: Mapping[str, Iterable[str]] | None = None,
    ) -> dict[int, Message]:
        """Successful replies keyed by partition-id; error replies, malformed replies (lacking a record or
        key of ``required``, :func:`flwr_sheaf.protocol.reply_problem`) and missing nodes are recorded
        as that node's failure in ``phase``."""
        ok: dict[int, Message] = {}
        for r in replies:
            pid = self.pid_of_node.get(r.metadata.src_node_id)
            if (
                pid is None
            ):  # e.g. the SuperLink's "node unavailable" error reply: map it by what it answers
                dst = self._dst_of_message.get(r.metadata.reply_to_message_id)
                pid = None if dst is None else self.pid_of_node.get(dst)
            if pid is None:
                continue
            if r.has_error():
                self.record_failure(server_round, phase, pid, r.error.reason or "")
                continue
            self.current.bytes_received += record_bytes(r.content)
            problem = reply_problem(r.content, required or {})
            if problem is not None:
                self.record_failure(server_round, phase, pid, f"malformed reply: {problem}")
                continue
            ok[pid] = r
        errored = set(self.current.failed.get(phase, []))
        for pid in sorted(set(expected) - set(ok) - errored):
            self.record_failure(server_round, phase, pid, "no reply within the timeout")
        self.current.failed.setdefault(phase, [])
        return ok

    # ------------------------------------------------------------------ results
    @property
    def history(self) -> list[dict]:
        """Per-round records as flat dicts (``results.json``'s ``rounds``)."""
        return [r.as_dict() for r in self.rounds]

    def summary(self) -> None:  # noqa: D102 - Strategy API
        log.info(
            "%s: %d nodes, action %r, participation %s",
            type(self).__name__,
            self.num_nodes,
            self.action,
            self.sampler.describe()["mode"],
        )

    @staticmethod
    def numeric(metrics: Mapping[str, Any]) -> MetricValues:
        """The int/float entries of a metrics mapping, as floats (for MetricRecords)."""
        return _numeric(metrics)

    # ------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid
    ) -> Iterable[Message]:
        """One ``train.<action>`` message per sampled node: local-training config, method config, node payload.

        Raises:
            ValueError: ``config`` (``start``'s ``train_config``) names a key the strategy sends.
        """
        sampled = self.sampler.sample(server_round)
        self.current.sampled = sampled
        base = {
            **self.train.to_dict(),
            **self.method_config(server_round),
            SERVER_ROUND: server_round,
            SEED: self.seed,
        }
        msgs = []
        for pid in sampled:
            records, node_cfg = self.node_payload(server_round, pid)
            cfg = self.merge_extra({**base, **node_cfg}, config, "train_config")
            msgs.append(
                self.message(
                    pid, RecordDict({**records, CONFIG: ConfigRecord(cfg)}), TRAIN, server_round
                )
            )
        if not sampled:
            log.info("round %d: no node sampled (nothing trains)", server_round)
        return msgs

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Means over the accepted nodes of their numeric train metrics (+ :meth:`accept_train`'s); no arrays
        (there is no global model). Error, silent and malformed replies, and replies whose
        ``num-examples`` is not a finite number > 0 or with an infinite metric, are recorded failures
        (not passed to :meth:`accept_train`)."""
        ok = self.split_replies(server_round, "train", replies, self.current.sampled, TRAIN_REPLY)
        for pid in sorted(
            ok
        ):  # a reply claiming no (or NaN) training examples is that node's failure
            why = train_reply_problem(ok[pid].content)  # the node applies it too (client/checks.py)
            if why is not None:
                self.record_failure(server_round, "train", pid, why)
                del ok[pid]
        accepted, extra = self.accept_train(server_round, ok)
        names = sorted(
            {
                k
                for r in accepted.values()
                for k, v in r.content[METRICS].items()
                if isinstance(v, (int, float)) and k != NUM_EXAMPLES
            }
        )
        metrics = {
            k.replace("-", "_"): nanmean(
                as_float(r.content[METRICS][k], k)
                for r in accepted.values()
                if k in r.content[METRICS]
            )
            for k in names
        }
        for name, column in self.train_metric_columns.items():
            metrics[column] = metrics.pop(name, float("nan"))
        metrics.update(extra)
        self.current.num_trained = len(accepted)
        self.current.train.update(metrics)
        return None, MetricRecord(self.numeric({**metrics, "num_trained": len(accepted)}))

    # ------------------------------------------------------------------ evaluate
    def evaluates(self, server_round: int, num_rounds: int) -> bool:
        """Every ``evaluate-every`` rounds and always the last one (``evaluate-every = 0`` or no
        evaluation component: never)."""
        if self.evaluation is None or self.federation is None:
            return False
        every = self.federation.evaluate_every
        return every > 0 and (server_round % every == 0 or server_round == num_rounds)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid
    ) -> Iterable[Message]:
        """Phase 1 (``evaluate.<action>``) to this round's evaluators (Flower's ``Strategy`` API; the round
        loop runs both phases through :meth:`evaluate_round`). None without an evaluation component.

        Raises:
            ValueError: ``config`` (``start``'s ``evaluate_config``) names a key the strategy sends.
        """
        if self.evaluation is None:
            return []
        return self.evaluation.phase1_messages(self, server_round, config)[1]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Flower's ``Strategy`` API: the graph evaluation has two phases and runs in :meth:`evaluate_round`;
        a one-phase evaluation of a subclass overrides this (default: None)."""
        return None

    def evaluate_round(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        timeout: float,
    ) -> MetricRecord | None:
        """One evaluated round: the held :class:`GraphEvaluation` returns an :class:`EvaluationResult`, which is
        recorded in the round (and kept as :attr:`last_evaluation`); without one, Flower's one-phase
        ``configure_evaluate`` -> round trip -> ``aggregate_evaluate``.

        Returns:
            The round's evaluate MetricRecord (numeric entries), or None.
        """
        if self.evaluation is None:
            msgs = list(self.configure_evaluate(server_round, arrays, config, grid))
            return self.aggregate_evaluate(server_round, self._round_trip(grid, msgs, timeout))
        result = self.evaluation.run(self, server_round, config, grid, timeout)
        self.last_evaluation = result
        self.current.evaluation = result.summary
        self.current.evaluate.update(result.extra)
        return MetricRecord(self.numeric(result.metrics()))

    def log_round(self, rec: RoundRecord) -> None:
        """Progress line: private and communication accuracy of an evaluated round."""
        e = rec.evaluation
        if e is None:
            log.info(
                "round %3d | sampled %3d | failed %s | %.1f s",
                rec.round,
                len(rec.sampled),
                rec.failed,
                rec.wall_seconds,
            )
            return
        log.info(
            "round %3d | private %.3f | comm (deg.-weighted) %.3f | comm (receivers) %.3f | %.1f s",
            rec.round,
            e.private_accuracy_mean,
            e.communication_accuracy_degree_weighted,
            e.communication_accuracy_mean,
            rec.wall_seconds,
        )

    # ------------------------------------------------------------------ results
    @property
    def node_results(self) -> dict[int, dict]:
        """Per partition-id results of the last evaluation (``d``, private accuracy, ...)."""
        return self.last_evaluation.nodes

    @property
    def edge_results(self) -> list[dict]:
        """Per directed edge (``src`` -> ``dst`` receiver) communication accuracy of the last evaluation."""
        return self.last_evaluation.edges

    @property
    def non_edge_results(self) -> list[dict]:
        """Per directed non-edge pair of the last evaluation: ``src``, ``dst`` (receiver), ``hops``,
        ``path`` (source first), ``communication_accuracy`` (multi-hop), ``communication_accuracy_direct``
        (direct Procrustes) and their ``val_`` counterparts (docs/variants-diagnostics.md)."""
        return self.last_evaluation.non_edges

    def run_status(
        self, max_failed_fraction: float = DEFAULTS["max-failed-fraction"]
    ) -> dict[str, Any]:
        """Whether the run so far (restored rounds included) is clean, degraded or failed (docs/reliability-failures.md).

        A train reply fails when its node errs, does not answer, or the reply is refused. The run is
        ``failed`` when more than ``max_failed_fraction`` of the sampled train replies failed, or (for
        ``max_failed_fraction < 1``) when some round in which nodes were sampled trained nobody;
        ``degraded`` when anything failed (any phase) short of that; ``completed`` otherwise.

        Returns:
            ``status``; ``reasons`` (why failed, empty otherwise); the counts (``train_sampled``,
            ``train_failed``, ``failed_fraction``, ``max_failed_fraction``, ``failures_by_phase``);
            ``rounds_without_training`` (rounds whose sampled nodes all failed) and
            ``all_rounds_trained_nobody``; ``nodes_failed_every_round`` (partition-ids that failed every
            round they were sampled in); ``nodes`` (per failing partition-id: rounds sampled, failed
            train rounds, failures by phase, up to three distinct reasons).
        """
        sampled = failed = 0
        idle: list[int] = []
        per_node: dict[int, dict[str, Any]] = {}
        for r in self.rounds:
            bad = set(r.failed.get("train", [])) & set(r.sampled)
            n_failed = max(len(bad), len(r.sampled) - r.num_trained)
            sampled, failed = sampled + len(r.sampled), failed + n_failed
            if r.sampled and r.num_trained == 0:
                idle.append(r.round)
            for pid in r.sampled:
                row = per_node.setdefault(pid, {"rounds_sampled": 0, "train_failed_rounds": []})
                row["rounds_sampled"] += 1
                if pid in bad or (r.num_trained == 0 and not bad):
                    row["train_failed_rounds"].append(r.round)
        by_phase: dict[str, int] = {}
        nodes: dict[int, dict] = {}
        for f in self.failures:
            by_phase[f["phase"]] = by_phase.get(f["phase"], 0) + 1
            row = nodes.setdefault(f["partition-id"], {"failures": {}, "reasons": []})
            row["failures"][f["phase"]] = row["failures"].get(f["phase"], 0) + 1
            if f["reason"] not in row["reasons"] and len(row["reasons"]) < 3:
                row["reasons"].append(f["reason"])
        for pid, row in nodes.items():
            row.update(per_node.get(pid, {"rounds_sampled": 0, "train_failed_rounds": []}))
        every = sorted(
            p
            for p, row in per_node.items()
            if row["train_failed_rounds"]
            and len(row["train_failed_rounds"]) == row["rounds_sampled"]
        )
        fraction = failed / sampled if sampled else 0.0
        reasons = []
        if fraction > max_failed_fraction:
            reasons.append(
                f"{failed} of {sampled} sampled train replies failed ({fraction:.0%} > max-failed-fraction="
                f"{max_failed_fraction})"
            )
        if idle and max_failed_fraction < 1.0:
            reasons.append(f"round(s) {idle} trained nobody (every sampled node failed)")
        status = "failed" if reasons else ("degraded" if self.failures or failed else "completed")
        return {
            "status": status,
            "reasons": reasons,
            "max_failed_fraction": float(max_failed_fraction),
            "train_sampled": sampled,
            "train_failed": failed,
            "failed_fraction": fraction,
            "failures_by_phase": by_phase,
            "rounds_without_training": idle,
            "all_rounds_trained_nobody": bool(idle)
            and len(idle) == sum(1 for r in self.rounds if r.sampled),
            "nodes_failed_every_round": every,
            "nodes": {p: nodes[p] for p in sorted(nodes)},
        }

    def results_extra(self) -> dict:
        """Participation and action; with a graph also the evaluation protocol, the graph's edges and the
        last evaluation's non-edge pairs (``non_edges``, :attr:`non_edge_results`)."""
        out: dict[str, Any] = {"participation": self.sampler.describe(), "action": self.action}
        if self.federation is None:
            return out
        if self.evaluation is not None:
            out["evaluation"] = self.evaluation.describe(self)
        out["graph"] = {
            "edges": sorted([int(a), int(b)] for a, b in self.graph.edges) if self.graph else []
        }
        out["non_edges"] = self.last_evaluation.non_edges
        return out
