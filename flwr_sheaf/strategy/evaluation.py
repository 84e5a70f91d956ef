"""Per-round graph evaluation (paper Eq. 22, Fig. 2) on an :class:`EvaluationView`.

Phase 1 (``evaluate.<action>``) gathers private accuracies, whitened pilots and latents; then the
sheaf diagnostics and the non-edge plan; phase 2 (``evaluate.<action>_comm``) routes each answering
node its answering neighbours' arrays and averages the per-edge accuracies (checks and rows:
:mod:`~flwr_sheaf.strategy.evaluation_steps`). :class:`TransportedEvaluation`: stringent privacy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ConfigRecord, Message, RecordDict

from ..config import FederationConfig, LocalTrainConfig
from ..protocol import (
    ARRAYS,
    COMM_REPLY,
    CONFIG,
    DEVICE,
    EVAL_ARRAYS,
    EVAL_REPLY,
    EVAL_TRANSPORTED,
    EVALUATE,
    METRICS,
    PILOT_READING,
    SECOND_READING,
    SERVER_ROUND,
    STRINGENT_EVAL_ARRAYS,
    STRINGENT_EVAL_LABELS,
    TORCH_THREADS,
    WHITENING_FIT,
    NonEdgeConfig,
    array_record,
    comm_action,
    metric_record,
    pack_arrays,
    route_evaluation,
    route_non_edges,
)
from ..sheaf.network import orient_edge
from . import evaluation_steps as steps
from .evaluation_steps import EvaluationView, NonEdgePlan, Plan
from .exchange import merge_extra
from .records import EvaluationResult

__all__ = ["EvaluationView", "GraphEvaluation", "PhaseTwo", "TransportedEvaluation"]

log = logging.getLogger("flwr_sheaf")


@dataclass(frozen=True)
class PhaseTwo:
    """What phase 1 hands phase 2.

    Attributes:
        phase1: accepted phase-1 replies ``{partition-id: reply}``.
        routed_src: ``{receiver: neighbours whose arrays were routed to it}``.
        receivers: the phase-2 messages' partition-ids, in order.
    """

    phase1: dict[int, Message]
    routed_src: dict[int, tuple[int, ...]]
    non_edge_plan: NonEdgePlan
    messages: list[Message]
    receivers: list[int]


class GraphEvaluation:
    """The two-phase graph evaluation a :class:`~flwr_sheaf.strategy.graph.GraphStrategy` holds.

    Args:
        federation: ``posthoc-readings``, ``non-edge-pairs`` and ``diagnostics-eigenvalues``.
        whitening_fit: where nodes fit their whitening (``"pilots"``: Sheaf-FRL; ``"train"``: the
            post-hoc protocol of the baselines, notes/baselines.md).
        node_metric_names: phase-1 metrics copied per node and averaged as ``<name>_mean``.
        routed_arrays: extra phase-1 arrays routed to neighbours (ComFed's learned maps).
        edge_metric_names: extra per-edge phase-2 metrics (averaged as ``<name>_degree_weighted``).
    """

    transported = False  #: phase-1 arrays moved by the sender's map (:data:`EVAL_TRANSPORTED`)
    holds_raw_pilots = True  #: phase-1 replies carry raw pilots (diagnostics, multi-hop need them)

    def __init__(
        self,
        federation: FederationConfig,
        *,
        whitening_fit: str = "pilots",
        node_metric_names: tuple[str, ...] = (),
        routed_arrays: tuple[str, ...] = (),
        edge_metric_names: tuple[str, ...] = (),
    ) -> None:
        self.federation = federation
        self.whitening_fit = whitening_fit
        self.node_metric_names = tuple(node_metric_names)
        self.routed_arrays = tuple(routed_arrays)
        self.edge_metric_names = tuple(edge_metric_names)
        #: :data:`SECOND_READING` (``posthoc-readings = both``): the whitening fitted the other way
        self.second_reading = federation.posthoc_readings == "both" and not self.transported
        self.pilot_reading = self.second_reading and whitening_fit == "train"  #: the strong one

    @classmethod
    def posthoc(cls, federation: FederationConfig, **kwargs: tuple[str, ...]) -> GraphEvaluation:
        """The post-hoc protocol of the baselines (``whitening-fit = train``, notes/baselines.md)."""
        return cls(federation, whitening_fit="train", **kwargs)

    # ------------------------------------------------------------------ names and config
    @property
    def array_names(self) -> tuple[str, ...]:
        """Phase-1 arrays routed to neighbours (:data:`EVAL_ARRAYS`, routed, second reading's)."""
        return EVAL_ARRAYS + self.routed_arrays + self.second_reading_names[0]

    @property
    def second_reading_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The second reading's phase-1 arrays and test / validation metrics (empty without it)."""
        return SECOND_READING[self.whitening_fit] if self.second_reading else ((), ())

    @property
    def edge_metric_keys(self) -> tuple[str, ...]:
        """Per-edge phase-2 metrics beyond :data:`COMM_ACCURACY` (the method's, second reading's)."""
        return self.edge_metric_names + self.second_reading_names[1]

    def config(self, server_round: int, train: LocalTrainConfig) -> dict[str, Any]:
        """Config entries of both phases' messages (``train``: the threads and device nodes use)."""
        return {
            SERVER_ROUND: server_round,
            WHITENING_FIT: self.whitening_fit,
            TORCH_THREADS: train.torch_threads,
            DEVICE: train.device,
            EVAL_TRANSPORTED: int(self.transported),
            PILOT_READING: int(self.second_reading),
        }

    def describe(self, fraction_evaluate: float) -> dict[str, Any]:
        """``results.json``'s ``evaluation`` entry (``fraction_evaluate``: the evaluators' sampler's)."""
        out: dict[str, Any] = {
            "whitening-fit": self.whitening_fit,
            "pilot-whitening-reading": self.pilot_reading,
            "train-whitening-reading": self.second_reading and not self.pilot_reading,
            "fraction-evaluate": fraction_evaluate,
            "non-edge-pairs": self.federation.non_edge_pairs,
            "diagnostics-eigenvalues": self.federation.diagnostics_eigenvalues,
        }
        if self.whitening_fit == "train":
            out["protocol"] = "post-hoc alignment"
        return out

    # ------------------------------------------------------------------ the two phases
    def run(
        self, view: EvaluationView, config: Mapping[str, Any], grid: Any, timeout: float
    ) -> EvaluationResult:
        """Both round trips of ``view``'s round; returns the result (the strategy records it)."""
        round_trip = view.exchange.round_trip
        msgs = self.phase1_messages(view, config)
        phase = self.route(view, round_trip(grid, msgs, timeout), config)
        return self.aggregate(view, phase, round_trip(grid, phase.messages, timeout))

    def phase1_messages(self, view: EvaluationView, config: Mapping[str, Any]) -> list[Message]:
        """The phase-1 messages to ``view.evaluators`` (recorded as ``evaluated``, ``evaluated_trained``).

        Raises:
            ValueError: ``config`` names a key the strategy sends.
        """
        shared_records, cfg = view.payload
        view.record.evaluate["evaluated"] = list(view.evaluators)
        never = [p for p in view.evaluators if p not in view.trained]
        view.record.evaluate["evaluated_trained"] = len(view.evaluators) - len(never)
        if never:
            log.warning(
                "round %d: %d of %d evaluated node(s) never trained (evaluate-nodes=%s; their "
                "accuracies are those of untrained models): partition-ids %s%s",
                view.server_round,
                len(never),
                len(view.evaluators),
                view.mode,
                never[:10],
                " ..." if len(never) > 10 else "",
            )
        msgs = []
        for p in view.evaluators:
            records, node_cfg = view.node_payload(p)
            msgs.append(
                self._message(view, p, {**shared_records, **records}, {**cfg, **node_cfg}, config)
            )
        return msgs

    def _message(
        self,
        view: EvaluationView,
        pid: int,
        records: dict,
        entries: dict,
        config: Mapping[str, Any],
        action: str | None = None,
    ) -> Message:
        """Evaluation message to ``pid``: ``records``, :meth:`config` + ``entries`` + ``config``."""
        own = {**self.config(view.server_round, view.train), **entries}
        cfg = ConfigRecord(merge_extra(own, config, "evaluate_config"))
        content = RecordDict({**records, CONFIG: cfg})
        return view.exchange.message(pid, content, EVALUATE, view.server_round, action=action)

    def required_phase1(self) -> dict[str, tuple[str, ...]]:
        """Records and keys a phase-1 reply must carry."""
        return {**EVAL_REPLY, ARRAYS: self.array_names}

    def accept_phase1(self, view: EvaluationView, replies: list[Message]) -> dict[int, Message]:
        """The usable phase-1 replies; malformed ones (:meth:`phase1_problem`) are that node's failure."""
        phase1 = view.exchange.split_replies(
            view.server_round, "evaluate", replies, view.evaluators, self.required_phase1()
        )
        for pid in sorted(phase1):
            why = self.phase1_problem(view, pid, phase1[pid])
            if why is not None:
                view.record_failure("evaluate", pid, f"bad evaluation reply: {why}")
                del phase1[pid]
        return phase1

    def route(
        self, view: EvaluationView, replies: list[Message], config: Mapping[str, Any]
    ) -> PhaseTwo:
        """Phase 2's messages: each answering node gets its answering neighbours' (and non-edge) arrays."""
        phase1 = self.accept_phase1(view, replies)
        plan = self.sheaf_diagnostics(view, phase1)
        msgs, routed_src = [], {}
        action = comm_action(view.exchange.action)
        for pid in sorted(phase1):
            edges = view.edge_config(pid).keep(phase1)
            routed_src[pid] = tuple(edges.neighbours)
            arrays, cfg = self.routed_payload(
                view, pid, edges.neighbours, phase1, plan.get(pid, [])
            )
            entries = {**edges.to_config(), **cfg}
            msgs.append(self._message(view, pid, {ARRAYS: arrays}, entries, config, action))
        receivers = sorted(phase1)  # one message per accepted node, in this order
        return PhaseTwo(phase1, routed_src, plan, msgs, receivers)

    def routed_payload(
        self,
        view: EvaluationView,
        pid: int,
        neighbours: tuple[int, ...],
        phase1: dict[int, Message],
        plan: Plan,
    ) -> tuple[Any, dict[str, Any]]:
        """``(ArrayRecord, config)`` for receiver ``pid``: neighbours' and non-edge sources' arrays."""
        arrays = {p: array_record(r.content, ARRAYS) for p, r in phase1.items()}
        routed = route_evaluation(arrays, neighbours, self.array_names)
        for key, value in route_non_edges(arrays, {j: t for j, t, _ in plan}).items():
            routed[key] = Array(np.ascontiguousarray(value))
        nodes, d, sources = view.nodes, view.nodes[pid].d, tuple(j for j, _, _ in plan)
        dims = tuple(nodes[j].d for j in sources)
        heads = tuple(orient_edge(pid, d, j, dj)[0] == pid for j, dj in zip(sources, dims))
        hops = tuple(len(path) - 1 for _, _, path in plan)
        return routed, NonEdgeConfig(sources, dims, heads, hops).to_config()

    # ------------------------------------------------------------------ reply checks
    def phase1_problem(self, view: EvaluationView, pid: int, reply: Message) -> str | None:
        """Why a phase-1 reply cannot be used (or None)."""
        m, a = metric_record(reply.content, METRICS), array_record(reply.content, ARRAYS)
        d = view.nodes[pid].d
        return steps.phase1_metrics_problem(m, d) or steps.phase1_arrays_problem(
            a, d, view.num_pilots, self.second_reading_names[0]
        )

    def comm_problem(
        self, reply: Message, routed: tuple[int, ...] = (), plan: Plan | None = None
    ) -> str | None:
        """Why a phase-2 reply cannot be used (or None), ``routed`` and ``plan`` routed to it."""
        m, second = reply.content[METRICS], self.second_reading_names[1]
        return steps.comm_problem(m, routed, plan or [], self.edge_metric_keys, second)

    def sheaf_diagnostics(self, view: EvaluationView, phase1: Mapping[int, Message]) -> NonEdgePlan:
        """:func:`~flwr_sheaf.strategy.evaluation_steps.sheaf_diagnostics`; the non-edge plan."""
        return steps.sheaf_diagnostics(view, self.federation, phase1, self.holds_raw_pilots)

    # ------------------------------------------------------------------ aggregation
    def aggregate(
        self, view: EvaluationView, phase: PhaseTwo, replies: list[Message]
    ) -> EvaluationResult:
        """Private and communication accuracy (Eq. 22, Fig. 2); bad phase-2 replies are failures."""
        rnd = view.server_round
        ok = view.exchange.split_replies(rnd, "evaluate_comm", replies, phase.receivers, COMM_REPLY)
        for pid in sorted(ok):
            routed, plan = phase.routed_src.get(pid, ()), phase.non_edge_plan.get(pid, [])
            why = self.comm_problem(ok[pid], routed, plan)
            if why is not None:
                view.record_failure("evaluate_comm", pid, f"bad evaluation reply: {why}")
                del ok[pid]
        nodes = steps.node_rows(phase.phase1, self.node_metric_names)
        for pid, row in nodes.items():  # an untrained node's latents say nothing of the method
            row["trained"], row["trained_rounds"] = pid in view.trained, view.trained.get(pid, 0)
        edges = steps.edge_rows(ok, self.edge_metric_keys)
        non_edges = steps.non_edge_rows(ok, phase.non_edge_plan)
        asked = non_edges if self.federation.non_edge_pairs > 0 else None
        extra = steps.extra_means(
            nodes, edges, asked, self.node_metric_names, self.edge_metric_keys
        )
        if not edges and view.graph is not None and view.graph.number_of_edges():
            why = self.unmeasured_reason(view, phase)  # null accuracies say why
            extra["communication_accuracy_reason"] = why
            log.warning("round %d: communication accuracy not measured (null): %s", rnd, why)
        summary = steps.summarise_accuracies(nodes, edges)
        return EvaluationResult(summary, extra, nodes, edges, non_edges)

    def unmeasured_reason(self, view: EvaluationView, phase: PhaseTwo) -> str:
        """The round's ``communication_accuracy_reason``: why no edge was measured."""
        assert view.graph is not None, "called only when the graph has edges (aggregate)"
        evaluated, failed = sorted(phase.phase1), view.record.failed
        if not any(a in phase.phase1 and b in phase.phase1 for a, b in view.graph.edges):
            asked = view.record.evaluate.get("evaluated", evaluated)
            if view.mode == "trained":
                return (
                    f"no edge has both ends evaluated: evaluate-nodes=trained evaluated this round's "
                    f"trainers, partition-ids {asked} of {view.num_nodes}, usable replies from {evaluated} "
                    f"(failed: {failed.get('evaluate', [])}); raise fraction-train, or set "
                    f"evaluate-nodes=panel with a fraction-evaluate that evaluates neighbours together"
                )
            return (
                f"no edge has both ends evaluated: fraction-evaluate={self.federation.fraction_evaluate} drew "
                f"partition-ids {asked} of {view.num_nodes}, usable replies from {evaluated} (failed: "
                f"{failed.get('evaluate', [])}); raise fraction-evaluate so that neighbours are "
                f"evaluated together"
            )
        return (
            f"no receiver's communication-accuracy reply was usable (evaluate_comm failed: "
            f"{failed.get('evaluate_comm', [])}; see failures)"
        )


class TransportedEvaluation(GraphEvaluation):
    """Evaluation under stringent privacy (Alg. 3/4): receiver i gets what each answering neighbour j
    transported toward i (``"<j>/pilots"`` etc., width d_e) and j's labels; no raw pilots reach the
    server, so diagnostics and multi-hop are skipped (reason recorded)."""

    transported = True
    holds_raw_pilots = False

    def required_phase1(self) -> dict[str, tuple[str, ...]]:  # noqa: D102 - GraphEvaluation hook
        return {ARRAYS: STRINGENT_EVAL_LABELS, METRICS: EVAL_REPLY[METRICS]}

    def routed_payload(
        self,
        view: EvaluationView,
        pid: int,
        neighbours: tuple[int, ...],
        phase1: dict[int, Message],
        plan: Plan,
    ) -> tuple[Any, dict[str, Any]]:
        """What each answering neighbour j transported toward ``pid``, and j's labels."""
        arrays = {}
        for j in neighbours:
            rec = array_record(phase1[j].content, ARRAYS)
            arrays.update({f"{j}/{n}": rec[f"{pid}/{n}"].numpy() for n in STRINGENT_EVAL_ARRAYS})
            arrays.update({f"{j}/{n}": rec[n].numpy() for n in STRINGENT_EVAL_LABELS})
        return pack_arrays(arrays), {}

    def phase1_problem(self, view: EvaluationView, pid: int, reply: Message) -> str | None:
        """Why a phase-1 reply (transported arrays) cannot be used (or None)."""
        m, a = metric_record(reply.content, METRICS), array_record(reply.content, ARRAYS)
        d = view.nodes[pid].d
        assert view.graph is not None  # built before any evaluation
        dims = {j: view.nodes[j].d for j in view.graph.neighbors(pid)}
        return steps.phase1_metrics_problem(m, d) or steps.transported_arrays_problem(
            a, d, dims, view.num_pilots
        )
