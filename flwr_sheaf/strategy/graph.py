"""The one strategy base: the hooks a method fills in, and the parts it holds (docs/design.md)."""

from __future__ import annotations

import logging
from collections import Counter
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
    """The one base of flwr-sheaf's strategies: hooks to fill in; discovery, sampling, the round
    loop, messages, the ledger, evaluation and checkpoints are parts it holds. No global model is
    required; without an agents' graph (RFedAGS) pass ``federation=None`` and a ``sampler``.

    Args:
        num_nodes: agents (partition-ids ``0..num_nodes-1``).
        action: message action (``"sheaf"`` -> ``query.sheaf``, ``train.sheaf``, ...).
        federation: graph spec, participation and evaluation period; None = no agents' graph.
        train: local-training settings sent to every trained node.
        graph: an explicit ``networkx.Graph`` on partition-ids (overrides ``federation.graph``).
        evaluation: the per-round evaluation (default with a federation: :class:`GraphEvaluation`).
        sampler: who trains in each round (default: from ``federation``).
        discovery_timeout: seconds to wait for enough SuperNodes to register.

    Class attributes:
        train_metric_columns: ``{reply metric: round column}`` every round reports (NaN if unmeasured).

    Raises:
        ValueError: ``num_nodes < 1``, a sampler for a different N, a non-positive timeout, neither
            a federation nor a sampler; at discovery, a bad graph or differing pilots.
        ConfigError: an unknown graph spec form.
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
        self.nodes: dict[int, Node] = {}  #: ``{partition-id: Node}`` (set by :meth:`discover`)
        self.ledger = RunLedger()
        self.exchange = Exchange(action, self.ledger)
        self.extra_train_config: dict[str, Any] = {}
        self.extra_evaluate_config: dict[str, Any] = {}
        #: discovery config entries of a resumed run (set by the ServerApp; client/state.py checks them)
        self.resume_check: dict[str, Any] = {}
        self.checkpointer: Checkpointer | None = None  #: set by the ServerApp (None: none)
        #: called after every completed round with its ``results.json`` entry; not checkpointed
        self.round_callbacks: list[Callable[[dict[str, Any]], None]] = []
        #: ``num_rounds`` of the last :meth:`start`: results with fewer rounds are ``failed``
        self.requested_rounds: int | None = None
        self.federation = federation
        self.train = train or LocalTrainConfig()
        if federation is not None and evaluation is None:
            evaluation = GraphEvaluation(federation)
        self.evaluation = evaluation
        self.evaluate_nodes = evaluate_nodes_mode(federation, sampler)
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
        """Map node ids to partition-ids (:meth:`~flwr_sheaf.strategy.discovery.Discovery.run`, its
        Raises), then :meth:`on_discovered` (nothing if already known)."""
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
        """Build and validate the graph, check the pilots (:func:`build_agents_graph`), given a spec."""
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
        """Entries merged into every ``train.<action>`` config of this round (docs/own-method.md)."""
        return {}

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """``(records, config entries)`` only node ``pid`` gets in its train message (default: none)."""
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
        """``(records, config entries)`` only node ``pid`` gets in its phase-1 evaluation message."""
        return {}, {}

    def record_failure(self, server_round: int, phase: str, pid: int, reason: str) -> None:
        """One node's failure in ``phase`` (:meth:`RunLedger.record_failure`)."""
        self.ledger.record_failure(server_round, phase, pid, reason)

    def results_extra(self) -> dict:
        """``results.json`` extras: participation, action; with a graph evaluation, edges, non-edges."""
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
        """Run discovery and ``num_rounds`` server rounds (Flower's ``Strategy.start``; the loop:
        :func:`flwr_sheaf.strategy.rounds.run_rounds`, resume: docs/resume.md).

        Args:
            initial_arrays: the global parameter, for strategies that have one (RFedAGS); else None.
            num_rounds: server rounds (>= 1).
            timeout: seconds per round trip (also bounds discovery's round trips).
            train_config: extra values merged into every train config (run-config keys refused).
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
        """One ``train.<action>`` message per sampled node (a raising ``node_payload``: its failure).

        Raises:
            ValueError: ``config`` (``start``'s ``train_config``) names a key the strategy sends.
        """
        sampled = sample_phase(self, self.sampler, server_round, TRAIN)
        self.ledger.current.sampled = sampled
        base = {**self.train.to_dict(), **self.method_config(server_round)}
        base.update({SERVER_ROUND: server_round, SEED: self.seed})
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
        """Means over the accepted nodes of their numeric train metrics (+ :meth:`accept_train`'s);
        no arrays. Bad replies (:func:`~flwr_sheaf.protocol.train_reply_problem`) are failures."""
        rec = self.ledger.current
        ok = self.exchange.split_replies(server_round, "train", replies, rec.sampled, TRAIN_REPLY)
        for pid in sorted(ok):
            why = train_reply_problem(ok[pid].content)  # the node applies it too (client/state.py)
            if why is not None:
                self.record_failure(server_round, "train", pid, why)
                del ok[pid]
        accepted, extra = accept_each_failure_its_nodes(self, server_round, ok)
        reported = [r.content[METRICS] for r in accepted.values()]
        names = {k for m in reported for k, v in m.items() if isinstance(v, (int, float))}
        metrics = {
            k.replace("-", "_"): nanmean(as_float(m[k], k) for m in reported if k in m)
            for k in sorted(names - {NUM_EXAMPLES})
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
        """Phase-1 messages to this round's evaluators (Flower's API; the loop uses :meth:`evaluate_round`).

        Raises:
            ValueError: ``config`` (``start``'s ``evaluate_config``) names a key the strategy sends.
        """
        if self.evaluation is None:
            return []
        return self.evaluation.phase1_messages(evaluation_view(self, server_round), config)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Flower's API; a one-phase evaluation of a subclass overrides this (default: None)."""
        return None

    def evaluate_round(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        timeout: float,
    ) -> MetricRecord | None:
        """One evaluated round's MetricRecord: :class:`GraphEvaluation`'s result recorded (and kept
        as the ledger's ``last_evaluation``); without one, Flower's one-phase evaluation."""
        if self.evaluation is None:
            msgs = list(self.configure_evaluate(server_round, arrays, config, grid))
            replies = self.exchange.round_trip(grid, msgs, timeout)
            return self.aggregate_evaluate(server_round, replies)
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
    """The :class:`EvaluationView` of ``s``'s round ``server_round`` (evaluators drawn, payloads)."""
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
    payloads = {}
    for pid in (p for p in drawn if p in s.nodes and p not in refused):
        try:
            payloads[pid] = s.evaluate_node_payload(server_round, pid)
        except Exception as e:  # a method's hook failing for one node: that node's failure
            reason = hook_failure(s, "evaluate_node_payload", pid, e)
            s.record_failure(server_round, "evaluate", pid, reason)
    cur = s.ledger.current
    past = [r for r in s.ledger.rounds if r is not cur]
    ever = Counter(p for r in [*past, cur] for p in trained_in(r))  # rounds trained, this one too
    return EvaluationView(
        server_round=server_round,
        nodes=s.nodes,
        graph=s.graph,
        num_nodes=s.num_nodes,
        num_pilots=s.num_pilots,
        seed=s.seed,
        train=s.train,
        evaluators=list(payloads),
        payload=payload,
        node_payload=payloads.__getitem__,
        exchange=s.exchange,
        ledger=s.ledger,
        owner=type(s).__name__,
        trained=ever,
        mode=s.evaluate_nodes,
    )


def evaluate_nodes_mode(federation: FederationConfig | None, sampler: ParticipationSampler) -> str:
    """Run-config ``evaluate-nodes`` resolved: ``auto`` is ``trained`` when a round's trainers are
    a sample (fraction or some participation probability below 1), else ``drawn`` (also without a
    federation)."""
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
    """``results.json``'s ``evaluate-nodes``, and ``evaluated`` / ``evaluated_trained`` counts of
    the last evaluated round in ``rounds`` (None before any)."""
    last = next((r for r in reversed(list(rounds)) if "evaluated" in r.evaluate), None)
    return {
        "evaluate-nodes": mode,
        "evaluated": None if last is None else len(last.evaluate["evaluated"]),
        "evaluated_trained": None if last is None else last.evaluate.get("evaluated_trained"),
    }


def hook_failure(s: GraphStrategy, hook: str, pid: int, e: Exception) -> str:
    """Node ``pid``'s failure reason when ``s``'s ``hook`` raised ``e`` on it (a KeyError's field named)."""
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
    """``s.accept_train`` on the checked replies; when it raises, it is called once per reply (in
    partition-id order, the raising call's failures undone), each reply it raises on is that node's
    failure, and one last call takes the rest (docs/own-method.md).

    Raises:
        RuntimeError: the hook takes each reply alone but raises on them together.
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
    """The evaluators' draw of ``fraction-evaluate`` (``panel``: one fixed draw; no federation: all)."""
    return ParticipationSampler(
        num_nodes,
        1.0 if federation is None else federation.fraction_evaluate,
        seed=seed,
        stream=PANEL_STREAM if mode == "panel" else EVALUATE_STREAM,
        key="fraction-evaluate",
        fixed_round=0 if mode == "panel" else None,
    )
