"""Shared base of the peer strategies: discovery, sampling, the round loop and per-round bookkeeping.

Every method (Sheaf-FRL, FedProto, FedSAF, non-cooperative, RFedAGS) needs the same server-side
plumbing on Flower's Message API, so it lives here once:

- **discovery**: a ``query.<action>`` round trip maps Flower's opaque node ids to partition-ids
  and collects each node's :class:`~flwr_sheaf.protocol.NodeInfo`. Nodes are queried as they
  register, so a federation that is too small (nodes report ``num-partitions`` < N) fails at once
  with the ``--federation-config`` to pass, instead of waiting;
- **sampling**: :class:`~flwr_sheaf.participation.ParticipationSampler` (a node's draw depends only
  on (seed, server round, partition-id), identically for every method);
- **the round loop** :meth:`PeerStrategy.start` (Flower's ``Strategy.start`` contract, returns
  Flower's ``Result``): discovery, then per round train (one round trip), and evaluation with an
  optional second round trip (:meth:`PeerStrategy.route_evaluate`, the documented override used by
  the two-phase graph evaluation). Every round trip honours the one ``timeout``: a node that does
  not answer in time is recorded as failed for that phase and the round goes on;
- **bookkeeping**: replies split into ok / failed / missing by partition-id, bytes on the wire,
  wall time, one typed :class:`RoundRecord` per server round.

It knows nothing of CNNs or of the sheaf maths, and nothing of ``flwr_sheaf.client``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..config import DEFAULTS, KEYS
from ..hints import handler_hint
from ..participation import ParticipationSampler
from ..protocol import CONFIG, INFO, QUERY, NodeInfo, ProtocolError, message_type, reply_problem
from .checkpoint import Checkpointer

__all__ = ["PeerStrategy", "RoundRecord", "EvaluationSummary", "Node", "record_bytes", "nanmean", "positive_int",
           "weight_problem"]

log = logging.getLogger("flwr_sheaf")


def nanmean(xs: Iterable[float | None]) -> float:
    """Mean ignoring None/NaN (NaN when nothing is left)."""
    vals = [float(x) for x in xs if x is not None and not math.isnan(float(x))]
    return sum(vals) / len(vals) if vals else float("nan")


def positive_int(name: str, value: int) -> int:
    """``value`` as an int, or a ``ValueError`` naming ``name`` and the value (non-integral or < 1)."""
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def weight_problem(name: str, value: Any) -> str | None:
    """Why a reply's weight (e.g. ``num-examples``) is unusable, or None when it is a finite number > 0.

    Strategies call it on every reply value that weights or counts in an aggregate, and record a
    non-None answer as that node's failure (:meth:`PeerStrategy.record_failure`) instead of aborting
    the ServerApp or averaging with a zero, negative or NaN weight.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} = {value!r} is not a number"
    if not (math.isfinite(value) and value > 0):
        return f"{name} = {value!r} must be a finite number > 0"
    return None


def record_bytes(content: RecordDict) -> int:
    """Payload size of a RecordDict in bytes: arrays' buffers plus metric/config values (8 B each, strings by length).

    This counts what the protocol sends (pilot matrices, latents, metrics), not Flower's framing.
    """
    total = 0
    for rec in content.values():
        if isinstance(rec, ArrayRecord):
            total += rec.count_bytes()
            continue
        for v in rec.values():
            if isinstance(v, (bytes, str)):
                total += len(v)
            elif isinstance(v, list):
                total += 8 * len(v)
            else:
                total += 8
    return total


@dataclass(frozen=True)
class Node:
    """A discovered node: Flower's node id and what it reported (:class:`~flwr_sheaf.protocol.NodeInfo`)."""

    node_id: int
    info: NodeInfo

    @property
    def d(self) -> int:
        """Stalk dimension d_i."""
        return self.info.d


@dataclass
class EvaluationSummary:
    """One evaluated round's accuracies (paper Eq. 22, Fig. 2); NaN where nothing was measured.

    Attributes:
        private_accuracy_mean: mean over nodes of the private test accuracy.
        communication_accuracy_mean: mean over receivers of their mean over incoming edges.
        communication_accuracy_degree_weighted: ``sum_i deg_i A_i / sum_i deg_i`` = mean over
            directed edges (the paper's Fig. 2).
        val_*: the same on the validation splits (for model and lambda selection).
        low_variance_fraction_mean: mean share of latent dimensions with variance < 1e-3 (collapse).
    """

    private_accuracy_mean: float = float("nan")
    val_private_accuracy_mean: float = float("nan")
    communication_accuracy_mean: float = float("nan")
    communication_accuracy_degree_weighted: float = float("nan")
    val_communication_accuracy_mean: float = float("nan")
    val_communication_accuracy_degree_weighted: float = float("nan")
    low_variance_fraction_mean: float = float("nan")


@dataclass
class RoundRecord:
    """What happened in one server round (typed; :meth:`as_dict` is the ``results.json`` entry).

    Attributes:
        round: server round (1-based).
        sampled: partition-ids sent a train message.
        num_trained: nodes whose train reply was accepted.
        bytes_sent, bytes_received: protocol payload bytes (:func:`record_bytes`) of all phases.
        failed: ``{phase: [partition-id, ...]}`` of nodes that failed or did not answer in time.
        evaluation: the accuracies of an evaluated round, None otherwise.
        train: the method's aggregated training metrics (names with ``_``; e.g. ``ce``, ``gluing_loss``).
        evaluate: the method's extra evaluation metrics (e.g. ``prototype_accuracy_mean``).
        wall_seconds: this round's wall time; elapsed_seconds: since the first round started.
    """

    round: int
    sampled: list[int] = field(default_factory=list)
    num_trained: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    failed: dict[str, list[int]] = field(default_factory=dict)
    evaluation: EvaluationSummary | None = None
    train: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = float("nan")
    elapsed_seconds: float = float("nan")

    def as_dict(self) -> dict[str, Any]:
        """Flat dict (the per-round entry of ``results.json``)."""
        return {"round": self.round, "sampled": list(self.sampled), "num_sampled": len(self.sampled),
                "num_trained": self.num_trained, "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "failed": {k: list(v) for k, v in self.failed.items()}, **self.train,
                **(asdict(self.evaluation) if self.evaluation is not None else {}), **self.evaluate,
                "wall_seconds": self.wall_seconds, "elapsed_seconds": self.elapsed_seconds}


def _numeric(d: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class PeerStrategy(Strategy):
    """Base of strategies that address nodes by partition-id (no global model is required).

    Args:
        num_nodes: partition-ids of the scenario (``0..num_nodes-1``); discovery waits for them.
        action: message action (``"sheaf"`` -> ``query.sheaf``, ``train.sheaf``, ...).
        sampler: who trains in each round.
        discovery_timeout: seconds to wait for enough SuperNodes to register.

    Raises:
        ValueError: ``num_nodes < 1``, a sampler for a different N, a non-positive timeout.
    """

    def __init__(self, num_nodes: int, *, action: str, sampler: ParticipationSampler,
                 discovery_timeout: float = DEFAULTS["discovery-timeout"]) -> None:
        if int(num_nodes) != num_nodes or num_nodes < 1:
            raise ValueError(f"num_nodes must be a positive integer, got {num_nodes!r}")
        if sampler.num_nodes != num_nodes:
            raise ValueError(f"the participation sampler is for {sampler.num_nodes} nodes, the strategy for {num_nodes}")
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
        self.current: RoundRecord | None = None
        self._t0: float | None = None
        #: writes checkpoints and restores one (:class:`flwr_sheaf.strategy.checkpoint.Checkpointer`;
        #: the ServerApp sets it; None = no checkpoints).
        self.checkpointer: Checkpointer | None = None

    # ------------------------------------------------------------------ discovery
    def query_config(self) -> dict:
        """Config of the discovery query (subclasses add what their query handler reads)."""
        return {}

    def discover(self, grid: Grid, timeout: float) -> None:
        """Map node ids to partition-ids (``query.<action>``), querying nodes as they register.

        SuperNodes beyond the scenario (partition-id >= ``num_nodes``, or whose discovery handler
        failed while more SuperNodes than agents registered) stay idle.

        Raises:
            RuntimeError: the SuperNodes report ``num-partitions`` smaller than ``num_nodes`` (at
                once, naming the ``--federation-config`` to pass), a discovery handler failed and
                no spare SuperNode exists (its reason quoted), duplicate partition-ids, or
                partition-ids still missing after ``discovery_timeout`` (named, with the reasons
                of failed nodes).
        """
        if len(self.nodes) == self.num_nodes:
            return
        fix = f'--federation-config "num-supernodes={self.num_nodes}"'
        deadline = time.monotonic() + self.discovery_timeout
        found: dict[int, Node] = {}
        asked: set[int] = set()
        errors: list[str] = []
        while True:
            new = [n for n in grid.get_node_ids() if n not in asked]
            if new:
                asked.update(new)
                msgs = [Message(RecordDict({CONFIG: ConfigRecord(self.query_config())}), dst_node_id=n,
                                message_type=message_type(QUERY, self.action)) for n in new]
                for r in grid.send_and_receive(msgs, timeout=max(1.0, min(timeout, deadline - time.monotonic()))):
                    problem = r.error.reason + handler_hint(r.error.reason) if r.has_error() else reply_problem(r.content, {INFO: ()})
                    info = None
                    if problem is None:
                        try:
                            info = NodeInfo.from_record(r.content[INFO])
                        except ProtocolError as exc:
                            problem = str(exc)
                    if info is None:
                        errors.append(f"node {r.metadata.src_node_id}: {problem[-300:]}")
                        if len(asked) <= self.num_nodes:  # no spare SuperNode can stand in
                            raise RuntimeError(f"discovery failed on {errors[-1]}")
                        log.warning("discovery: %s (idle)", errors[-1])
                        continue
                    if 0 < info.num_partitions < self.num_nodes:
                        raise RuntimeError(
                            f"this scenario has {self.num_nodes} agents but the federation has "
                            f"num-partitions={info.num_partitions} SuperNodes (Flower's default local simulation has 2); "
                            f"run: flwr run . --stream {fix} (in-process: LocalGrid(app, {self.num_nodes}))")
                    if info.partition_id in found:
                        raise RuntimeError(f"partition-id {info.partition_id} reported by two nodes")
                    found[info.partition_id] = Node(r.metadata.src_node_id, info)
            if all(p in found for p in range(self.num_nodes)):
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.num_nodes)) - set(found))
                raise RuntimeError(
                    f"the scenario has {self.num_nodes} agents but after {self.discovery_timeout:.0f} s no SuperNode "
                    f"answered for partition-id(s) {missing} ({len(asked)} registered; failed: {errors}); run with {fix}")
            time.sleep(0.5)
        # Extra SuperNodes (partition-id >= num_nodes) stay idle.
        self.nodes = {p: n for p, n in found.items() if p < self.num_nodes}
        self.pid_of_node = {n.node_id: p for p, n in self.nodes.items()}
        self.on_discovered()

    def on_discovered(self) -> None:
        """Hook run once after discovery (validate the graph, orient edges, fix a common dimension, ...)."""

    # ------------------------------------------------------------------ the round loop
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run discovery and ``num_rounds`` server rounds; Flower's ``Strategy.start`` contract.

        Per round: ``configure_train`` -> one round trip -> ``aggregate_train``; then, in evaluated
        rounds, ``configure_evaluate`` -> round trip -> ``route_evaluate`` (the optional second
        round trip) -> ``aggregate_evaluate``; then ``evaluate_fn``. Every round trip waits at
        most ``timeout`` seconds; nodes that did not answer are recorded as failed. With
        :attr:`checkpointer` set, a checkpoint is written after the rounds it is due and a resumed
        run puts the checkpointed state back after discovery and goes on with the next round
        (docs/resume.md).

        Args:
            grid: Flower's Grid.
            initial_arrays: the global parameter, for strategies that have one (RFedAGS); else None.
            num_rounds: server rounds (>= 1).
            timeout: seconds per round trip (also bounds discovery's round trips).
            train_config, evaluate_config: extra values merged into every train/evaluate config;
                keys that flwr-sheaf's typed configs own (run-config keys) are refused, so each
                value has one channel.
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
                raise ValueError(f"{name} keys {owned} are run-config keys: set them on the strategy's config "
                                 f"sections (flwr_sheaf.config), not per call")
        self.extra_train_config = dict(train_config or {})
        self.extra_evaluate_config = dict(evaluate_config or {})
        self.summary()
        arrays = initial_arrays if initial_arrays is not None else ArrayRecord()
        result = Result(arrays=arrays)
        if evaluate_fn is not None:
            res = evaluate_fn(0, arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        self.discover(grid, timeout)
        first, wall0 = 1, 0.0
        if self.checkpointer is not None:  # resume: the state after the checkpointed round (docs/resume.md)
            first, restored = self.checkpointer.restore(self, int(num_rounds))
            wall0 = self.checkpointer.previous_wall_seconds
            if restored is not None:
                arrays = result.arrays = restored
        self._t0 = time.monotonic() - wall0
        for rnd in range(first, int(num_rounds) + 1):
            t_round = time.monotonic()
            self.begin_round(rnd)
            msgs = list(self.configure_train(rnd, arrays, ConfigRecord(self.extra_train_config), grid))
            new_arrays, train_metrics = self.aggregate_train(rnd, self._round_trip(grid, msgs, timeout))
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            if self.evaluates(rnd, int(num_rounds)):
                msgs = list(self.configure_evaluate(rnd, arrays, ConfigRecord(self.extra_evaluate_config), grid))
                replies = self._round_trip(grid, msgs, timeout)
                second = self.route_evaluate(rnd, replies)
                if second is not None:
                    replies = self._round_trip(grid, list(second), timeout)
                metrics = self.aggregate_evaluate(rnd, replies)
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
        replies = list(grid.send_and_receive(msgs, timeout=timeout))
        self._dst_of_message = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs}
        return replies

    def evaluates(self, server_round: int, num_rounds: int) -> bool:
        """Whether ``server_round`` is evaluated (default: every round)."""
        return True

    def route_evaluate(self, server_round: int, replies: list[Message]) -> Iterable[Message] | None:
        """Second evaluation round trip: messages built from the first phase's replies, or None (one phase)."""
        return None

    def log_round(self, rec: RoundRecord) -> None:
        """One progress line per round (override for method-specific figures)."""
        log.info("round %3d | sampled %3d | failed %s | %.1f s", rec.round, len(rec.sampled), rec.failed, rec.wall_seconds)

    # ------------------------------------------------------------------ messages and replies
    def message(self, pid: int, content: RecordDict, category: str, server_round: int, action: str | None = None) -> Message:
        """Instruction message ``<category>.<action>`` to partition ``pid``; its payload counts as sent.

        Raises:
            KeyError: ``pid`` was not discovered.
        """
        self.current.bytes_sent += record_bytes(content)
        return Message(content, dst_node_id=self.nodes[pid].node_id,
                       message_type=message_type(category, action or self.action), group_id=str(server_round))

    @staticmethod
    def merge_extra(owned: Mapping[str, Any], extra: Mapping[str, Any], name: str) -> dict[str, Any]:
        """``owned`` plus the caller's ``extra`` config entries (from ``start``), which may not override it.

        Raises:
            ValueError: ``extra`` names keys the strategy sends itself (named).
        """
        clash = sorted(set(extra) & set(owned))
        if clash:
            raise ValueError(f"{name} keys {clash} are set by the strategy itself; pass other keys only")
        return {**owned, **extra}

    def record_failure(self, server_round: int, phase: str, pid: int, reason: str) -> None:
        """Record one node's failure in ``phase`` (its previous server-side state stays untouched)."""
        self.failures.append({"round": server_round, "phase": phase, "partition-id": pid, "reason": reason[-500:]})
        failed = self.current.failed.setdefault(phase, [])
        if pid not in failed:
            failed.append(pid)
            failed.sort()
        log.warning("round %d %s: partition-id %d failed: %s", server_round, phase, pid, reason[-300:])

    def split_replies(self, server_round: int, phase: str, replies: Iterable[Message], expected: Iterable[int],
                      required: Mapping[str, Iterable[str]] | None = None) -> dict[int, Message]:
        """Successful replies keyed by partition-id; error replies, malformed replies (lacking a record or
        key of ``required``, :func:`flwr_sheaf.protocol.reply_problem`) and missing nodes are recorded
        as that node's failure in ``phase``."""
        ok: dict[int, Message] = {}
        for r in replies:
            pid = self.pid_of_node.get(r.metadata.src_node_id)
            if pid is None:  # e.g. the SuperLink's "node unavailable" error reply: map it by what it answers
                pid = self.pid_of_node.get(getattr(self, "_dst_of_message", {}).get(r.metadata.reply_to_message_id))
            if pid is None:
                continue
            if r.has_error():
                self.record_failure(server_round, phase, pid, r.error.reason)
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

    @property
    def node_results(self) -> dict[int, dict]:
        """Per partition-id results of the last evaluation (none by default)."""
        return {}

    @property
    def edge_results(self) -> list[dict]:
        """Per directed edge results of the last evaluation (none by default)."""
        return []

    def results_extra(self) -> dict:
        """Method-specific top-level keys of ``results.json`` (subclasses extend it)."""
        return {"participation": self.sampler.describe(), "action": self.action}

    def summary(self) -> None:  # noqa: D102 - Strategy API
        log.info("%s: %d nodes, action %r, participation %s", type(self).__name__, self.num_nodes, self.action,
                 self.sampler.describe()["mode"])

    @staticmethod
    def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
        """The int/float entries of a metrics mapping, as floats (for MetricRecords)."""
        return _numeric(metrics)
