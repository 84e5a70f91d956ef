"""The one strategy base: the hooks a method fills in, and the parts it is made of (docs/design.md).

Every method's strategy subclasses :class:`GraphStrategy` directly and fills in hooks
(:meth:`~GraphStrategy.method_config`, :meth:`~GraphStrategy.node_payload`,
:meth:`~GraphStrategy.accept_train`, :meth:`~GraphStrategy.evaluate_payload`); what methods share
comes from components they hold, not from parents. The parts it holds, each in its own module:
discovery and the agents' graph, sampling, the round loop (behind Flower's ``Strategy.start``),
messages, the ledger, evaluation on a narrow view, checkpoints. A strategy without an agents'
graph (the RFedAGS family) passes ``federation=None`` and its own ``sampler``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..config import DEFAULTS, FederationConfig, LocalTrainConfig
from ..participation import EVALUATE_STREAM, PANEL_STREAM, ParticipationSampler
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
    as_float,
    train_reply_problem,
)
from ..rundir import Checkpointer
from .discovery import Discovery, build_agents_graph
from .evaluation import EvaluationView, GraphEvaluation
from .exchange import Exchange, merge_extra
from .ledger import RunLedger
from .records import Node, RoundRecord, nanmean, numeric_metrics, positive_int
from .rounds import EvaluateFn, run_rounds
from .sampled import SampledDiscovery, sample_phase

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "GraphStrategy",
    "evaluated_summary",
    "evaluate_nodes_mode",
    "evaluation_view",
    "trained_in",
]

log = logging.getLogger("flwr_sheaf")


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
        num_nodes = positive_int("num_nodes", num_nodes)
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
        self.num_nodes = num_nodes
        self.action = action
        self.sampler = sampler
        self.seed = sampler.seed
        self.discovery_timeout = float(discovery_timeout)
        #: the discovered nodes ``{partition-id: Node}`` (set by :meth:`discover`).
        self.nodes: dict[int, Node] = {}
        self.ledger = RunLedger()  #: records, failures, status (:class:`RunLedger`)
        #: messages to partition-ids and their checked replies (:class:`Exchange`; writes into the ledger).
        self.exchange = Exchange(action, self.ledger)
        self.extra_train_config: dict[str, Any] = {}
        self.extra_evaluate_config: dict[str, Any] = {}
        #: entries added to the discovery config of a resumed run (the ServerApp sets them from the
        #: checkpoint: which partition-ids trained up to which round; client/state.py checks them).
        self.resume_check: dict[str, Any] = {}
        #: writes checkpoints and restores one (:class:`flwr_sheaf.rundir.Checkpointer`;
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
        self.evaluation = evaluation  #: the per-round evaluation component (None: none).
        #: who is evaluated (``evaluate-nodes`` resolved: :func:`evaluate_nodes_mode`)
        self.evaluate_nodes = evaluate_nodes_mode(federation, sampler)
        #: the evaluators' draw of ``fraction-evaluate`` (:func:`evaluator_sampler`)
        self.eval_sampler = evaluator_sampler(num_nodes, federation, self.seed, self.evaluate_nodes)
        self.graph_spec: nx.Graph | str | None = (
            graph if graph is not None else (None if federation is None else federation.graph)
        )
        self.graph: nx.Graph | None = None
        self.num_pilots = -1
        self.sampled_discovery: SampledDiscovery | None = None  #: ``discovery = "sampled"``

    # ------------------------------------------------------------------ discovery and the graph
    def query_config(self) -> dict:
        """Discovery reads the torch thread count and checks the device (run-config key ``device``)."""
        if self.federation is None:
            return {}
        return {TORCH_THREADS: self.train.torch_threads, DEVICE: self.train.device}

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
        if self.sampled_discovery is not None:  # nodes describe themselves when first sampled
            self.nodes = self.sampled_discovery.run(
                grid, self.action, config, self.discovery_timeout, timeout
            )
        else:
            self.nodes = Discovery(self.num_nodes, self.action, config, self.discovery_timeout).run(
                grid, timeout
            )
            self.exchange.connect(self.nodes)
        self.on_discovered()

    def on_discovered(self) -> None:
        """Build (from a spec, with the reported class sets) and validate the graph; check the pilot
        count (:func:`~flwr_sheaf.strategy.discovery.build_agents_graph`). Without a federation (no
        agents' graph) nothing is built."""
        if self.graph_spec is None:
            return
        self.graph, self.num_pilots = build_agents_graph(
            self.graph_spec, self.nodes, self.num_nodes
        )
        log.info(
            "%s graph: %d nodes, %d edges",
            type(self).__name__,
            self.graph.number_of_nodes(),
            self.graph.number_of_edges(),
        )

    # ------------------------------------------------------------------ hooks
    def method_config(self, server_round: int) -> dict:
        """The method's config entries for every train message of this round (default: none).

        Returns:
            ``{key: value}`` merged into every ``train.<action>`` config (docs/own-method.md).
        """
        return {}

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """``(records, config entries)`` only node ``pid`` gets in its train message (default: none;
        Sheaf-FRL: its neighbours' pilots and its edges; docs/own-method.md)."""
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
        none; Sheaf-FRL under stringent privacy: its edges, notes/variants-privacy.md)."""
        return {}, {}

    def record_failure(self, server_round: int, phase: str, pid: int, reason: str) -> None:
        """One node's failure in ``phase`` (:meth:`~flwr_sheaf.strategy.ledger.RunLedger.record_failure`)."""
        self.ledger.record_failure(server_round, phase, pid, reason)

    def results_extra(self) -> dict:
        """Participation and action; with a graph also the evaluation protocol, the graph's edges and the
        last evaluation's non-edge pairs (``non_edges``, the ledger's ``non_edge_results``)."""
        out: dict[str, Any] = {"participation": self.sampler.describe(), "action": self.action}
        if self.federation is None:
            return out
        if self.evaluation is not None:
            out["evaluation"] = {
                **self.evaluation.describe(self.eval_sampler.fraction),
                **evaluated_summary(self.evaluate_nodes, self.ledger.rounds),
            }
        out["graph"] = {
            "edges": sorted([int(a), int(b)] for a, b in self.graph.edges) if self.graph else []
        }
        out["non_edges"] = self.ledger.last_evaluation.non_edges
        if self.sampled_discovery is not None:
            out["discovery"] = self.sampled_discovery.describe_run()
        return out

    # ------------------------------------------------------------------ the round loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """Run discovery and ``num_rounds`` server rounds; Flower's ``Strategy.start`` contract
        (:func:`flwr_sheaf.strategy.rounds.run_rounds`).

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
        return run_rounds(
            self,
            grid,
            initial_arrays,
            num_rounds,
            timeout,
            train_config,
            evaluate_config,
            evaluate_fn,
        )

    @property
    def history(self) -> list[dict]:
        """Per-round records as flat dicts (``results.json``'s ``rounds``; the ledger's rounds)."""
        return [r.as_dict() for r in self.ledger.rounds]

    def summary(self) -> None:  # noqa: D102 - Strategy API
        log.info(
            "%s: %d nodes, action %r, participation %s",
            type(self).__name__,
            self.num_nodes,
            self.action,
            self.sampler.describe()["mode"],
        )

    # ------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid
    ) -> Iterable[Message]:
        """One ``train.<action>`` message per sampled node: local-training config, method config, node payload.

        Raises:
            ValueError: ``config`` (``start``'s ``train_config``) names a key the strategy sends.
        """
        sampled = sample_phase(self, self.sampler, server_round, TRAIN)
        self.ledger.current.sampled = sampled
        base = {
            **self.train.to_dict(),
            **self.method_config(server_round),
            SERVER_ROUND: server_round,
            SEED: self.seed,
        }
        msgs, refused = [], set(self.ledger.current.failed.get(TRAIN, ()))
        for pid in (p for p in sampled if p not in refused):
            try:
                records, node_cfg = self.node_payload(server_round, pid)
            except Exception as e:  # a method's hook failing for one node: that node's failure
                self.record_failure(
                    server_round, TRAIN, pid, hook_failure(self, "node_payload", pid, e)
                )
                continue
            cfg = merge_extra({**base, **node_cfg}, config, "train_config")
            content = RecordDict({**records, CONFIG: ConfigRecord(cfg)})
            msgs.append(self.exchange.message(pid, content, TRAIN, server_round))
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
        rec = self.ledger.current
        ok = self.exchange.split_replies(server_round, "train", replies, rec.sampled, TRAIN_REPLY)
        # a reply claiming no (or NaN) training examples is that node's failure
        for pid in sorted(ok):
            why = train_reply_problem(ok[pid].content)  # the node applies it too (client/state.py)
            if why is not None:
                self.record_failure(server_round, "train", pid, why)
                del ok[pid]
        accepted, extra = accept_each_failure_its_nodes(self, server_round, ok)
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
        rec.num_trained = len(accepted)
        rec.train.update(metrics)
        return None, MetricRecord(numeric_metrics({**metrics, "num_trained": len(accepted)}))

    # ------------------------------------------------------------------ evaluate
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
        return self.evaluation.phase1_messages(evaluation_view(self, server_round), config)

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
        """One evaluated round: the held :class:`GraphEvaluation` returns an
        :class:`~flwr_sheaf.strategy.records.EvaluationResult`, which is recorded in the round (and
        kept as the ledger's ``last_evaluation``); without one, Flower's one-phase
        ``configure_evaluate`` -> round trip -> ``aggregate_evaluate``.

        Returns:
            The round's evaluate MetricRecord (numeric entries), or None.
        """
        if self.evaluation is None:
            msgs = list(self.configure_evaluate(server_round, arrays, config, grid))
            return self.aggregate_evaluate(
                server_round, self.exchange.round_trip(grid, msgs, timeout)
            )
        result = self.evaluation.run(evaluation_view(self, server_round), config, grid, timeout)
        self.ledger.last_evaluation = result
        self.ledger.current.evaluation = result.summary
        self.ledger.current.evaluate.update(result.extra)
        return MetricRecord(numeric_metrics(result.metrics()))

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


def evaluation_view(s: GraphStrategy, server_round: int) -> EvaluationView:
    """What ``s``'s evaluation sees of round ``server_round``: nodes, graph, pilots' count, seed,
    local-training settings, the evaluators (``s.eval_sampler``'s draw among the discovered nodes),
    the evaluation payloads (:meth:`GraphStrategy.evaluate_payload` now,
    :meth:`GraphStrategy.evaluate_node_payload` per node), the exchange and the ledger."""
    try:
        payload = s.evaluate_payload(server_round)
    except Exception as e:  # every evaluator's message needs it: the run's error, the hook named
        e.add_note(
            f"flwr-sheaf: {type(s).__name__}.evaluate_payload raised in server round {server_round}"
        )
        raise
    if s.evaluate_nodes == "trained":
        drawn = trained_in(s.ledger.current)
    else:
        drawn = sample_phase(s, s.eval_sampler, server_round, "evaluate")
    refused = s.ledger.current.failed.get("evaluate", ()) if s.sampled_discovery else ()
    payloads = evaluate_node_payloads(
        s, server_round, [p for p in drawn if p in s.nodes and p not in refused]
    )
    evaluators = list(payloads)
    cur = s.ledger.current
    ever: dict[int, int] = {}  # partition-id -> rounds it trained in, this one included
    for r in [*(r for r in s.ledger.rounds if r is not cur), cur]:
        for p in trained_in(r):
            ever[p] = ever.get(p, 0) + 1
    return EvaluationView(
        server_round=server_round,
        nodes=s.nodes,
        graph=s.graph,
        num_nodes=s.num_nodes,
        num_pilots=s.num_pilots,
        seed=s.seed,
        train=s.train,
        evaluators=evaluators,
        payload=payload,
        node_payload=payloads.__getitem__,
        exchange=s.exchange,
        ledger=s.ledger,
        owner=type(s).__name__,
        trained=ever,
        mode=s.evaluate_nodes,
    )


def evaluate_node_payloads(
    s: GraphStrategy, server_round: int, evaluators: list[int]
) -> dict[int, tuple[dict, dict]]:
    """``{partition-id: s.evaluate_node_payload(server_round, pid)}`` for ``evaluators`` (in their
    order); a node whose payload hook raises is that node's ``evaluate`` failure
    (:func:`hook_failure`) and is left out, the others are evaluated."""
    payloads = {}
    for pid in evaluators:
        try:
            payloads[pid] = s.evaluate_node_payload(server_round, pid)
        except Exception as e:  # a method's hook failing for one node: that node's failure
            reason = hook_failure(s, "evaluate_node_payload", pid, e)
            s.record_failure(server_round, "evaluate", pid, reason)
    return payloads


def evaluate_nodes_mode(federation: FederationConfig | None, sampler: ParticipationSampler) -> str:
    """Run-config ``evaluate-nodes`` resolved: ``auto`` is ``trained`` when a round's trainers are
    a sample (``sampler`` draws a fraction below 1 of the nodes, or Bernoulli ``participation``
    with some probability below 1), else ``drawn``: under full participation every node trains and
    ``fraction-evaluate`` draws the evaluators as before. Without a federation ``drawn``."""
    mode = "drawn" if federation is None else federation.evaluate_nodes
    if mode != "auto":
        return mode
    p = sampler.probabilities
    sampled = sampler.fraction < 1.0 if p is None else bool((p < 1.0).any())
    return "trained" if sampled else "drawn"


def trained_in(rec: RoundRecord) -> list[int]:
    """Sorted partition-ids whose train reply was accepted in round ``rec`` (sampled, not failed)."""
    if rec.num_trained == 0:
        return []
    failed = set(rec.failed.get("train", ()))
    return sorted(p for p in rec.sampled if p not in failed)


def evaluated_summary(mode: str, rounds: Iterable[RoundRecord]) -> dict[str, Any]:
    """``results.json``'s ``evaluation`` entries on who was evaluated: ``evaluate-nodes`` (``mode``,
    resolved) and, of the last evaluated round in ``rounds``, ``evaluated`` (how many nodes) and
    ``evaluated_trained`` (how many of them had trained in that round or before; None before any
    evaluated round)."""
    last = next((r for r in reversed(list(rounds)) if "evaluated" in r.evaluate), None)
    return {
        "evaluate-nodes": mode,
        "evaluated": None if last is None else len(last.evaluate["evaluated"]),
        "evaluated_trained": None if last is None else last.evaluate.get("evaluated_trained"),
    }


def hook_failure(s: GraphStrategy, hook: str, pid: int, e: Exception) -> str:
    """The failure reason of node ``pid`` when the method (strategy ``s``)'s ``hook`` raised ``e`` on it (its reply
    or its payload): hook, partition-id, Flower node id, and for a ``KeyError`` the missing field."""
    node = s.nodes.get(pid)
    where = f"partition-id {pid}, node_id {node.node_id if node is not None else '?'}"
    what = (
        f"field {e.args[0]!r} is missing (KeyError)"
        if isinstance(e, KeyError) and e.args
        else f"{type(e).__name__}: {e}"
    )
    return f"{type(s).__name__}.{hook} raised on this node ({where}): {what}"


def accept_each_failure_its_nodes(
    s: GraphStrategy, server_round: int, ok: dict[int, Message]
) -> tuple[dict[int, Message], dict]:
    """:meth:`GraphStrategy.accept_train` of ``s`` on the round's checked replies; when it raises, the replies it cannot
    take are found by calling it once per reply (in partition-id order): each one it raises on is
    that node's failure (:func:`hook_failure`: hook, partition-id, node_id, the missing field),
    and the result is that of one last call with the replies it took. The failures the raising
    call had recorded are undone first (the per-reply calls record them again); other state the
    hook changed before raising is the hook's (docs/own-method.md).

    Raises:
        RuntimeError: the hook takes each reply alone but raises on them together (a fault of
            the hook, not of one node's reply), chained to its exception.
    """
    ledger = s.ledger
    mark = len(ledger.failures)
    failed_before = {k: list(v) for k, v in ledger.current.failed.items()}
    try:
        return s.accept_train(server_round, dict(ok))
    except Exception as e:
        if not ok:
            raise
        log.warning(
            "round %d: %s.accept_train raised %s: %s on %d train replies; calling it once per "
            "reply to find the node(s) whose reply it cannot take",
            server_round,
            type(s).__name__,
            type(e).__name__,
            e,
            len(ok),
            exc_info=e,
        )
    del ledger.failures[mark:]
    ledger.current.failed.clear()
    ledger.current.failed.update(failed_before)
    good: dict[int, Message] = {}
    for pid in sorted(ok):
        try:
            taken, _ = s.accept_train(server_round, {pid: ok[pid]})
        except Exception as e:
            s.record_failure(server_round, TRAIN, pid, hook_failure(s, "accept_train", pid, e))
            continue
        good.update({p: r for p, r in taken.items() if p == pid})
    if not good:
        return {}, {}
    try:
        return s.accept_train(server_round, good)
    except Exception as e:
        raise RuntimeError(
            f"{type(s).__name__}.accept_train takes each train reply of round {server_round} "
            f"alone but raises {type(e).__name__}: {e} on partition-ids {sorted(good)} together: a "
            "fault of the hook, not of one node's reply (docs/own-method.md)"
        ) from e


def evaluator_sampler(
    num_nodes: int, federation: FederationConfig | None, seed: int, mode: str
) -> ParticipationSampler:
    """The evaluators' draw of ``fraction-evaluate`` over ``num_nodes`` partition-ids: its own
    uniform stream (:data:`~flwr_sheaf.participation.EVALUATE_STREAM`), or for ``mode == "panel"``
    one fixed draw on :data:`~flwr_sheaf.participation.PANEL_STREAM` (the same nodes every round);
    unused under ``trained``. No federation: every node."""
    return ParticipationSampler(
        num_nodes,
        1.0 if federation is None else federation.fraction_evaluate,
        seed=seed,
        stream=PANEL_STREAM if mode == "panel" else EVALUATE_STREAM,
        key="fraction-evaluate",
        fixed_round=0 if mode == "panel" else None,
    )
