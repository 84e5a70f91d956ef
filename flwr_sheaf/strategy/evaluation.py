"""Per-round graph evaluation as a component that returns a value (paper Eq. 22, Fig. 2).

:class:`GraphEvaluation` runs an evaluated round's two round trips for a
:class:`~flwr_sheaf.strategy.graph.GraphStrategy` and returns an :class:`EvaluationResult`;
what one phase hands the next (the accepted phase-1 replies, the sources routed to each receiver,
the non-edge plan) travels as a :class:`PhaseTwo` value, never as strategy attributes:

- phase 1 (``evaluate.<action>``): each evaluator's private accuracy, whitened pilots and
  validation/test latents (:meth:`GraphEvaluation.phase1_messages`);
- between the phases: the sheaf diagnostics and the non-edge plan
  (:meth:`GraphEvaluation.sheaf_diagnostics`, docs/variants-diagnostics.md);
- phase 2 (``evaluate.<action>_comm``): each answering node gets its answering neighbours' arrays
  (and its non-edge sources' arrays transported along a shortest path); the per-edge accuracies
  become the mean over receivers and the degree-weighted mean (:meth:`GraphEvaluation.aggregate`).

What differs between methods is set on the component: where nodes fit their whitening
(``whitening_fit``; ``"train"`` = the post-hoc protocol of the baselines, with the strong pilot
reading under ``posthoc-readings = both``), per-node and per-edge extra metrics, extra routed
arrays. :class:`TransportedEvaluation` (Sheaf-FRL under stringent privacy) routes what each
neighbour transported toward the receiver instead of raw arrays and never holds raw pilots.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import networkx as nx
import numpy as np
import torch
from flwr.app import Array, ConfigRecord, Message, RecordDict

from ..config import FederationConfig
from ..protocol import (
    ARRAYS,
    COMM_ACCURACY,
    COMM_ACCURACY_PILOT_WHITENING,
    COMM_REPLY,
    COMM_SRC,
    CONFIG,
    DEVICE,
    EVAL_ARRAYS,
    EVAL_REPLY,
    EVAL_TRANSPORTED,
    EVALUATE,
    LOW_VARIANCE_FRACTION,
    METRICS,
    NON_EDGE_ACCURACY,
    NON_EDGE_DIRECT_ACCURACY,
    NON_EDGE_REPLY,
    NON_EDGE_SRC,
    PILOT_READING,
    PILOT_READING_ARRAYS,
    PRIVATE_ACCURACY,
    SERVER_ROUND,
    STALK_DIM,
    STRINGENT_EVAL_ARRAYS,
    STRINGENT_EVAL_LABELS,
    TORCH_THREADS,
    VAL_COMM_ACCURACY,
    VAL_COMM_ACCURACY_PILOT_WHITENING,
    VAL_NON_EDGE_ACCURACY,
    VAL_NON_EDGE_DIRECT_ACCURACY,
    VAL_PRIVATE_ACCURACY,
    WHITENING_FIT,
    NonEdgeConfig,
    array_record,
    as_float,
    as_int,
    as_list,
    comm_action,
    metric_record,
    pack_arrays,
    route_evaluation,
    route_non_edges,
)
from ..sheaf.diagnostics import graph_algebraic_connectivity, laplacian_spectrum, sample_non_edges
from ..sheaf.network import NetworkSheaf, orient_edge
from ..sheaf.variants import edge_dim
from .base import EvaluationSummary, nanmean

if TYPE_CHECKING:
    from .graph import GraphStrategy

__all__ = [
    "EvaluationResult",
    "GraphEvaluation",
    "NonEdgePlan",
    "PhaseTwo",
    "TransportedEvaluation",
    "summarise_accuracies",
]

log = logging.getLogger("flwr_sheaf")

#: ``{receiver: [(source, composed map (d_i, d_j), path source first), ...]}``
NonEdgePlan = dict[int, list[tuple[int, np.ndarray, list[int]]]]


@dataclass(frozen=True)
class PhaseTwo:
    """What phase 1 hands phase 2 (a value; nothing is kept on the strategy).

    Attributes:
        phase1: accepted phase-1 replies ``{partition-id: reply}``.
        routed_src: ``{receiver: neighbours whose arrays were routed to it}``.
        non_edge_plan: this round's non-edge plan (:data:`NonEdgePlan`).
        messages: the phase-2 messages; receivers: their partition-ids, in order.
    """

    phase1: dict[int, Message]
    routed_src: dict[int, tuple[int, ...]]
    non_edge_plan: NonEdgePlan
    messages: list[Message]
    receivers: list[int]


@dataclass
class EvaluationResult:
    """One evaluated round's outcome.

    Attributes:
        summary: the accuracies (:class:`~flwr_sheaf.strategy.base.EvaluationSummary`).
        extra: the method's extra round metrics (``prototype_accuracy_mean``, non-edge means, ...).
        nodes: per partition-id results; edges: per directed edge; non_edges: per non-edge pair.
    """

    summary: EvaluationSummary = field(default_factory=EvaluationSummary)
    extra: dict[str, Any] = field(default_factory=dict)
    nodes: dict[int, dict] = field(default_factory=dict)
    edges: list[dict] = field(default_factory=list)
    non_edges: list[dict] = field(default_factory=list)

    def metrics(self) -> dict[str, Any]:
        """Summary and extra metrics in one flat dict (the round's evaluate MetricRecord before filtering)."""
        return {**vars(self.summary), **self.extra}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fraction(v: Any) -> bool:
    """A number that is NaN (not measured) or in [0, 1]."""
    return _number(v) and (math.isnan(v) or 0.0 <= v <= 1.0)


def _not_fractions(m: Mapping[str, Any], keys: tuple[str, ...] | list[str]) -> str | None:
    for k in keys:
        bad = [v for v in m[k] if not _fraction(v)]
        if bad:
            return f"{k} = {bad[:5]} not in [0, 1] (or NaN)"
    return None


class GraphEvaluation:
    """The two-phase graph evaluation a :class:`~flwr_sheaf.strategy.graph.GraphStrategy` holds.

    Args:
        federation: ``posthoc-readings``, ``non-edge-pairs`` and ``diagnostics-eigenvalues``.
        whitening_fit: where nodes fit their whitening (``"pilots"``: Sheaf-FRL; ``"train"``: the
            post-hoc protocol of the baselines, docs/baselines.md).
        node_metric_names: phase-1 metrics copied per node and averaged as ``<name>_mean``.
        routed_arrays: extra phase-1 arrays routed to neighbours (ComFed's learned maps).
        edge_metric_names: extra per-edge phase-2 metrics (averaged as ``<name>_degree_weighted``).
    """

    #: whether phase-1 arrays are transported by the sender's map (config :data:`EVAL_TRANSPORTED`).
    transported = False
    #: whether phase-1 replies carry raw pilots to the server (multi-hop and diagnostics need them).
    holds_raw_pilots = True

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
        #: the strong post-hoc reading (whitening fitted on the pilots): post-hoc protocol only,
        #: run-config ``posthoc-readings = both``
        self.pilot_reading = whitening_fit == "train" and federation.posthoc_readings == "both"

    @classmethod
    def posthoc(cls, federation: FederationConfig, **kwargs: tuple[str, ...]) -> GraphEvaluation:
        """The post-hoc protocol of the baselines (``whitening-fit = train``, docs/baselines.md)."""
        return cls(federation, whitening_fit="train", **kwargs)

    # ------------------------------------------------------------------ names and config
    @property
    def array_names(self) -> tuple[str, ...]:
        """Phase-1 arrays every evaluated node sends and the server routes to neighbours:
        :data:`EVAL_ARRAYS`, :attr:`routed_arrays` and, with the strong reading, :data:`PILOT_READING_ARRAYS`."""
        return (
            EVAL_ARRAYS + self.routed_arrays + (PILOT_READING_ARRAYS if self.pilot_reading else ())
        )

    @property
    def edge_metric_keys(self) -> tuple[str, ...]:
        """Per-edge phase-2 metrics beyond :data:`COMM_ACCURACY`: :attr:`edge_metric_names` and, with
        the strong reading, its test and validation accuracies."""
        return self.edge_metric_names + (
            (COMM_ACCURACY_PILOT_WHITENING, VAL_COMM_ACCURACY_PILOT_WHITENING)
            if self.pilot_reading
            else ()
        )

    def config(self, s: GraphStrategy, server_round: int) -> dict[str, Any]:
        """Config entries of both phases' messages."""
        return {
            SERVER_ROUND: server_round,
            WHITENING_FIT: self.whitening_fit,
            TORCH_THREADS: s.train.torch_threads,
            DEVICE: s.train.device,
            EVAL_TRANSPORTED: int(self.transported),
            PILOT_READING: int(self.pilot_reading),
        }

    def describe(self, s: GraphStrategy) -> dict[str, Any]:
        """``results.json``'s ``evaluation`` entry."""
        out: dict[str, Any] = {
            "whitening-fit": self.whitening_fit,
            "pilot-whitening-reading": self.pilot_reading,
            "fraction-evaluate": s.eval_sampler.fraction,
            "non-edge-pairs": self.federation.non_edge_pairs,
            "diagnostics-eigenvalues": self.federation.diagnostics_eigenvalues,
        }
        if self.whitening_fit == "train":
            out["protocol"] = "post-hoc alignment"
        return out

    # ------------------------------------------------------------------ the two phases
    def run(
        self,
        s: GraphStrategy,
        server_round: int,
        config: Mapping[str, Any],
        grid: Any,
        timeout: float,
    ) -> EvaluationResult:
        """Both round trips of ``server_round``; returns the result (the strategy records it)."""
        evaluators, msgs = self.phase1_messages(s, server_round, config)
        phase = self.route(s, server_round, s._round_trip(grid, msgs, timeout), evaluators, config)
        return self.aggregate(s, server_round, phase, s._round_trip(grid, phase.messages, timeout))

    def phase1_messages(
        self, s: GraphStrategy, server_round: int, config: Mapping[str, Any]
    ) -> tuple[list[int], list[Message]]:
        """``(evaluators, phase-1 messages)``: the evaluators are ``s.eval_sampler``'s draw (recorded
        in the round as ``evaluated``).

        Raises:
            ValueError: ``config`` names a key the strategy sends.
        """
        records, cfg = s.evaluate_payload(server_round)
        evaluators = [p for p in s.eval_sampler.sample(server_round) if p in s.nodes]
        s.current.evaluate["evaluated"] = list(evaluators)
        msgs = []
        for p in evaluators:
            node_records, node_cfg = s.evaluate_node_payload(server_round, p)
            content = s.merge_extra(
                {**self.config(s, server_round), **cfg, **node_cfg}, config, "evaluate_config"
            )
            msgs.append(
                s.message(
                    p,
                    RecordDict({**records, **node_records, CONFIG: ConfigRecord(content)}),
                    EVALUATE,
                    server_round,
                )
            )
        return evaluators, msgs

    def required_phase1(self) -> dict[str, tuple[str, ...]]:
        """Records and keys a phase-1 reply must carry."""
        return {**EVAL_REPLY, ARRAYS: self.array_names}

    def accept_phase1(
        self, s: GraphStrategy, server_round: int, replies: list[Message], evaluators: list[int]
    ) -> dict[int, Message]:
        """The usable phase-1 replies; malformed ones (:meth:`phase1_problem`) are that node's failure."""
        phase1 = s.split_replies(
            server_round, "evaluate", replies, evaluators, self.required_phase1()
        )
        for pid in sorted(phase1):
            why = self.phase1_problem(s, pid, phase1[pid])
            if why is not None:
                s.record_failure(server_round, "evaluate", pid, f"bad evaluation reply: {why}")
                del phase1[pid]
        return phase1

    def route(
        self,
        s: GraphStrategy,
        server_round: int,
        replies: list[Message],
        evaluators: list[int],
        config: Mapping[str, Any],
    ) -> PhaseTwo:
        """Phase 2's messages: each answering node gets its answering neighbours' arrays (and its
        non-edge sources', transported along a shortest path)."""
        phase1 = self.accept_phase1(s, server_round, replies, evaluators)
        plan = self.sheaf_diagnostics(s, server_round, phase1)
        msgs, routed_src = [], {}
        for pid in sorted(phase1):
            edges = s.edge_config(pid).keep(phase1)
            routed_src[pid] = tuple(edges.neighbours)
            arrays, cfg = self.routed_payload(s, pid, edges.neighbours, phase1, plan.get(pid, []))
            cfg = s.merge_extra(
                {**self.config(s, server_round), **edges.to_config(), **cfg},
                config,
                "evaluate_config",
            )
            content = RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord(cfg)})
            msgs.append(
                s.message(pid, content, EVALUATE, server_round, action=comm_action(s.action))
            )
        receivers = [s.pid_of_node[m.metadata.dst_node_id] for m in msgs]
        return PhaseTwo(phase1, routed_src, plan, msgs, receivers)

    def routed_payload(
        self,
        s: GraphStrategy,
        pid: int,
        neighbours: tuple[int, ...],
        phase1: dict[int, Message],
        plan: list[tuple[int, np.ndarray, list[int]]],
    ) -> tuple[Any, dict[str, Any]]:
        """``(ArrayRecord, config entries)`` routed to receiver ``pid``: its neighbours' arrays and its
        non-edge sources' arrays transported by the composed maps."""
        arrays = {p: array_record(r.content, ARRAYS) for p, r in phase1.items()}
        routed = route_evaluation(arrays, neighbours, self.array_names)
        for key, value in route_non_edges(arrays, {j: t for j, t, _ in plan}).items():
            routed[key] = Array(np.ascontiguousarray(value))
        d = s.nodes[pid].d
        non_edges = NonEdgeConfig(
            tuple(j for j, _, _ in plan),
            tuple(s.nodes[j].d for j, _, _ in plan),
            tuple(orient_edge(pid, d, j, s.nodes[j].d)[0] == pid for j, _, _ in plan),
            tuple(len(path) - 1 for _, _, path in plan),
        )
        return routed, non_edges.to_config()

    # ------------------------------------------------------------------ reply checks
    def phase1_metrics_problem(
        self, s: GraphStrategy, pid: int, m: Mapping[str, Any]
    ) -> str | None:
        """A stalk dimension other than the discovered d_i, a private accuracy that is NaN or outside
        [0, 1], or a low-variance fraction neither NaN nor in [0, 1]."""
        d = s.nodes[pid].d
        if not _number(m[STALK_DIM]) or m[STALK_DIM] != d:
            return f"{STALK_DIM} = {m[STALK_DIM]!r}, but the node reported d={d} at discovery"
        for key in (PRIVATE_ACCURACY, VAL_PRIVATE_ACCURACY):  # measured on non-empty splits
            if not _fraction(m[key]) or math.isnan(m[key]):
                return (
                    f"{key} = {m[key]!r} is not in [0, 1] (NaN: the node's test and validation "
                    f"splits are non-empty, so its accuracy is always measured)"
                )
        if not _fraction(m[LOW_VARIANCE_FRACTION]):
            return (
                f"{LOW_VARIANCE_FRACTION} = {m[LOW_VARIANCE_FRACTION]!r} is not in [0, 1] (or NaN)"
            )
        return None

    def phase1_problem(self, s: GraphStrategy, pid: int, reply: Message) -> str | None:
        """Why a phase-1 reply cannot be used (or None): :meth:`phase1_metrics_problem`, pilots not
        ``(K, d_i)``, latents not ``(M, d_i)`` with ``(M,)`` integer labels, or NaN/inf in them."""
        m, a = metric_record(reply.content, METRICS), array_record(reply.content, ARRAYS)
        why = self.phase1_metrics_problem(s, pid, m)
        if why is not None:
            return why
        d = s.nodes[pid].d
        pilots = a["pilots"].numpy()
        if pilots.shape != (s.num_pilots, d):
            return f"pilots of shape {pilots.shape}, expected ({s.num_pilots}, {d})"
        if not np.isfinite(pilots).all():
            return "NaN/inf pilots"
        for split in ("test", "val"):
            z, y = a[f"{split}-latents"].numpy(), a[f"{split}-labels"].numpy()
            if (
                z.ndim != 2
                or z.shape[1] != d
                or y.shape != (z.shape[0],)
                or not np.issubdtype(y.dtype, np.integer)
            ):
                return f"{split} latents {z.shape} / labels {y.shape} {y.dtype}: expected (M, {d}) and (M,) integers"
            if not np.isfinite(z).all():
                return f"NaN/inf {split} latents"
        if self.pilot_reading:  # the strong reading's arrays: same shapes as the paper reading's
            for name, like in zip(PILOT_READING_ARRAYS, ("pilots", "test-latents", "val-latents")):
                z = a[name].numpy()
                if z.shape != a[like].numpy().shape or not np.isfinite(z).all():
                    return f"{name} of shape {z.shape} (expected {a[like].numpy().shape}) or NaN/inf entries"
        return None

    def comm_problem(
        self,
        reply: Message,
        routed: tuple[int, ...] = (),
        plan: list[tuple[int, np.ndarray, list[int]]] | None = None,
    ) -> str | None:
        """Why a phase-2 reply cannot be used (or None): the strong reading missing, per-edge lists of
        different lengths, sources other than the ``routed`` neighbours, an accuracy neither NaN nor in
        [0, 1], or bad non-edge entries for the ``plan`` routed to it."""
        m = reply.content[METRICS]
        return (
            self._strong_reading_problem(m)
            or self._edge_problem(m, routed)
            or self._non_edge_problem(m, plan or [])
        )

    def _strong_reading_problem(self, m: Mapping[str, Any]) -> str | None:
        missing = [
            n
            for n in (COMM_ACCURACY_PILOT_WHITENING, VAL_COMM_ACCURACY_PILOT_WHITENING)
            if self.pilot_reading and n not in m
        ]
        return (
            f"the strong post-hoc reading was asked for, but the reply lacks {missing}"
            if missing
            else None
        )

    def _edge_problem(self, m: Mapping[str, Any], routed: tuple[int, ...]) -> str | None:
        lists = [COMM_SRC, COMM_ACCURACY, VAL_COMM_ACCURACY] + [
            n for n in self.edge_metric_keys if n in m
        ]
        if any(not isinstance(m[k], list) for k in lists):
            return f"per-edge entries {lists} must be lists"
        if len({len(m[k]) for k in lists}) != 1:
            return f"per-edge lists of different lengths {[len(m[k]) for k in lists]}"
        if sorted(int(x) for x in m[COMM_SRC]) != sorted(routed) or len(set(m[COMM_SRC])) != len(
            m[COMM_SRC]
        ):
            return f"sources {list(m[COMM_SRC])}, but neighbours {list(routed)} were routed to it"
        return _not_fractions(m, lists[1:])

    @staticmethod
    def _non_edge_problem(
        m: Mapping[str, Any], plan: list[tuple[int, np.ndarray, list[int]]]
    ) -> str | None:
        if not plan:
            return None
        names = NON_EDGE_REPLY[METRICS]
        missing = [k for k in names if k not in m]
        if missing:
            return f"non-edge sources were routed to it, but the reply lacks {missing}"
        if any(not isinstance(m[k], list) for k in names) or len({len(m[k]) for k in names}) != 1:
            return f"non-edge entries {list(names)} must be lists of one length"
        if sorted(int(x) for x in m[NON_EDGE_SRC]) != sorted(j for j, _, _ in plan):
            return f"non-edge sources {list(m[NON_EDGE_SRC])}, but {[j for j, _, _ in plan]} were routed to it"
        return _not_fractions(m, names[1:])

    # ------------------------------------------------------------------ diagnostics
    def sheaf_diagnostics(
        self, s: GraphStrategy, server_round: int, phase1: Mapping[int, Message]
    ) -> NonEdgePlan:
        """Sheaf diagnostics of this evaluated round; returns the non-edge plan (docs/variants-diagnostics.md).

        On the subgraph induced by the accepted phase-1 nodes every edge's map is refitted by
        Procrustes on their pilots (Eq. 18). Recorded in the round: ``sheaf_edge_tv`` (per oriented
        edge), ``sheaf_tv_mean``, ``sheaf_tv_max``; with ``diagnostics-eigenvalues = k > 0`` the k
        smallest eigenvalues of the sheaf Laplacian (Eq. 6) and its near-kernel
        (:func:`~flwr_sheaf.sheaf.diagnostics.laplacian_spectrum`); with ``non-edge-pairs = P > 0``
        up to P non-adjacent pairs, each planned in both directions with the maps composed along a
        shortest path (:meth:`~flwr_sheaf.sheaf.network.NetworkSheaf.transport_map`).

        Without raw pilots (:attr:`holds_raw_pilots` False, or a reply without ``pilots``) nothing is
        computed and ``sheaf_diagnostics_skipped`` / ``non_edges_skipped`` say why. The server
        computes with ``torch-threads`` threads (when > 0; restored afterwards).
        """
        threads = torch.get_num_threads()
        if s.train.torch_threads > 0:
            torch.set_num_threads(s.train.torch_threads)
        try:
            return self._sheaf_diagnostics(s, server_round, phase1)
        finally:
            torch.set_num_threads(threads)

    def _skip_reason(self, s: GraphStrategy, phase1: Mapping[int, Message]) -> str | None:
        lacking = [p for p in sorted(phase1) if "pilots" not in phase1[p].content[ARRAYS]]
        if not self.holds_raw_pilots:
            return (
                f"{type(s).__name__} does not hold the nodes' raw pilots (stringent privacy): the maps "
                f"cannot be composed or refitted at the server"
            )
        if lacking:
            return f"the phase-1 replies of partition-ids {lacking[:10]} carry no pilots: the maps cannot be refitted"
        return None

    def _sheaf_diagnostics(
        self, s: GraphStrategy, server_round: int, phase1: Mapping[int, Message]
    ) -> NonEdgePlan:
        rec = s.current.evaluate
        fed = self.federation
        present = sorted(phase1)
        why = self._skip_reason(s, phase1)
        if why is not None:
            rec["sheaf_diagnostics_skipped"] = why
            if fed.non_edge_pairs > 0:
                rec["non_edges_skipped"] = why
            return {}
        if not present:
            return {}
        pilots = {
            p: torch.from_numpy(
                np.asarray(
                    array_record(phase1[p].content, ARRAYS)["pilots"].numpy(), dtype=np.float64
                )
            )
            for p in present
        }
        assert s.graph is not None  # built before any evaluation
        sub = s.graph.subgraph(present)
        sheaf = NetworkSheaf(sub, {p: s.nodes[p].d for p in present})
        sheaf.fit_maps(pilots)
        tv = sheaf.edge_total_variation(pilots)
        rec["sheaf_edge_tv"] = [[int(h), int(t), v] for (h, t), v in tv.items()]
        rec["sheaf_tv_mean"] = nanmean(tv.values())
        rec["sheaf_tv_max"] = max(tv.values()) if tv else float("nan")
        if fed.diagnostics_eigenvalues > 0:
            self._spectrum(s, server_round, sheaf, sub, rec)
        if fed.non_edge_pairs <= 0:
            return {}
        return self._non_edge_plan(s, server_round, sheaf, sub, present, rec)

    def _spectrum(
        self,
        s: GraphStrategy,
        server_round: int,
        sheaf: NetworkSheaf,
        sub: nx.Graph,
        rec: dict[str, Any],
    ) -> None:
        try:
            spec = laplacian_spectrum(
                sheaf.maps,
                sheaf.dims,
                sheaf.edges,
                self.federation.diagnostics_eigenvalues,
                seed=int(np.random.SeedSequence([s.seed, server_round]).generate_state(1)[0]),
            )
        except (
            torch.linalg.LinAlgError
        ) as exc:  # a numerical failure is recorded, never a crashed server
            rec["sheaf_diagnostics_skipped"] = f"eigensolver failed: {exc}"
            return
        rec.update(
            {
                "sheaf_laplacian_eigenvalues": spec.eigenvalues,
                "sheaf_near_kernel_dim": spec.near_kernel_dim,
                "sheaf_near_kernel_exact": spec.near_kernel_exact,
                "sheaf_near_kernel_tolerance": spec.tolerance,
                "sheaf_kernel_dim_bound": spec.kernel_bound,
                "sheaf_laplacian_size": spec.n,
                "sheaf_eigensolver": spec.solver,
                "sheaf_eigen_residual": spec.max_residual,
                "graph_algebraic_connectivity": graph_algebraic_connectivity(sub),
            }
        )

    def _non_edge_plan(
        self,
        s: GraphStrategy,
        server_round: int,
        sheaf: NetworkSheaf,
        sub: nx.Graph,
        present: list[int],
        rec: dict[str, Any],
    ) -> NonEdgePlan:
        plan: NonEdgePlan = {}
        pairs = sample_non_edges(
            s.graph, present, self.federation.non_edge_pairs, s.seed, server_round
        )
        if not pairs:
            rec["non_edges_skipped"] = (
                "no non-adjacent pair of evaluated nodes joined by a path of evaluated nodes"
            )
        for a, b in pairs:
            path = [int(v) for v in nx.shortest_path(sub, a, b)]
            for src_path in (path, path[::-1]):  # source first
                plan.setdefault(src_path[-1], []).append(
                    (src_path[0], sheaf.transport_map(src_path).numpy(), src_path)
                )
        return plan

    # ------------------------------------------------------------------ aggregation
    def aggregate(
        self, s: GraphStrategy, server_round: int, phase: PhaseTwo, replies: list[Message]
    ) -> EvaluationResult:
        """Private and communication accuracy (per edge, per receiver, degree-weighted; Eq. 22, Fig. 2).

        Malformed phase-2 replies (:data:`~flwr_sheaf.protocol.COMM_REPLY`) and replies with unusable
        values (:meth:`comm_problem`) are that node's failure.
        """
        ok = s.split_replies(server_round, "evaluate_comm", replies, phase.receivers, COMM_REPLY)
        for pid in sorted(ok):
            why = self.comm_problem(
                ok[pid], phase.routed_src.get(pid, ()), phase.non_edge_plan.get(pid, [])
            )
            if why is not None:
                s.record_failure(server_round, "evaluate_comm", pid, f"bad evaluation reply: {why}")
                del ok[pid]
        nodes = self._node_rows(phase.phase1)
        edges = self._edge_rows(ok)
        non_edges = self._non_edge_rows(ok, phase.non_edge_plan)
        extra: dict[str, Any] = {
            f"{name.replace('-', '_')}_mean": nanmean(
                n[name.replace("-", "_")] for n in nodes.values()
            )
            for name in self.node_metric_names
        }
        for name in self.edge_metric_keys:  # degree-weighted = mean over directed edges (Fig. 2)
            key = name.replace("-", "_")
            extra[f"{key}_degree_weighted"] = nanmean(e[key] for e in edges)
        if self.federation.non_edge_pairs > 0:  # mean over measured directed non-edge pairs
            for key, name in (
                ("communication_accuracy", "communication_accuracy_non_edges"),
                ("val_communication_accuracy", "val_communication_accuracy_non_edges"),
                ("communication_accuracy_direct", "communication_accuracy_non_edges_direct"),
                (
                    "val_communication_accuracy_direct",
                    "val_communication_accuracy_non_edges_direct",
                ),
            ):
                extra[name] = nanmean(e[key] for e in non_edges)
            extra["non_edge_pairs_measured"] = len(non_edges)
            extra["non_edge_hops_mean"] = nanmean(e["hops"] for e in non_edges)
        if (
            not edges and s.graph is not None and s.graph.number_of_edges()
        ):  # null accuracies say why
            why = self._unmeasured_reason(s, server_round, phase)
            extra["communication_accuracy_reason"] = why
            log.warning(
                "round %d: communication accuracy not measured (null): %s", server_round, why
            )
        return EvaluationResult(summarise_accuracies(nodes, edges), extra, nodes, edges, non_edges)

    def _unmeasured_reason(self, s: GraphStrategy, server_round: int, phase: PhaseTwo) -> str:
        """Why no edge was measured in ``server_round`` (the round's ``communication_accuracy_reason``)."""
        assert s.graph is not None, "called only when s.graph has edges (evaluate_round)"
        evaluated = sorted(phase.phase1)
        if not any(a in phase.phase1 and b in phase.phase1 for a, b in s.graph.edges):
            asked = s.current.evaluate.get("evaluated", evaluated)
            return (
                f"no edge has both ends evaluated: fraction-evaluate={self.federation.fraction_evaluate} drew "
                f"partition-ids {asked} of {s.num_nodes}, usable replies from {evaluated} (failed: "
                f"{s.current.failed.get('evaluate', [])}); raise fraction-evaluate so that neighbours are "
                f"evaluated together"
            )
        return (
            f"no receiver's communication-accuracy reply was usable (evaluate_comm failed: "
            f"{s.current.failed.get('evaluate_comm', [])}; see failures)"
        )

    def _node_rows(self, phase1: Mapping[int, Message]) -> dict[int, dict]:
        nodes = {}
        for pid, r in phase1.items():
            m = metric_record(r.content, METRICS)
            nodes[pid] = {
                "d": as_int(m[STALK_DIM], STALK_DIM),
                "private_accuracy": as_float(m[PRIVATE_ACCURACY], PRIVATE_ACCURACY),
                "val_private_accuracy": as_float(m[VAL_PRIVATE_ACCURACY], VAL_PRIVATE_ACCURACY),
                "low_variance_fraction": as_float(m[LOW_VARIANCE_FRACTION], LOW_VARIANCE_FRACTION),
            }
            for name in self.node_metric_names:
                nodes[pid][name.replace("-", "_")] = (
                    as_float(m[name], name) if name in m else float("nan")
                )
        return nodes

    def _edge_rows(self, ok: Mapping[int, Message]) -> list[dict]:
        edges = []
        for dst, r in ok.items():
            m = metric_record(r.content, METRICS)
            for k, (src, acc, vacc) in enumerate(
                zip(
                    as_list(m[COMM_SRC], COMM_SRC),
                    as_list(m[COMM_ACCURACY], COMM_ACCURACY),
                    as_list(m[VAL_COMM_ACCURACY], VAL_COMM_ACCURACY),
                )
            ):
                edges.append(
                    {
                        "src": int(src),
                        "dst": int(dst),
                        "communication_accuracy": float(acc),
                        "val_communication_accuracy": float(vacc),
                        **{
                            n.replace("-", "_"): float(as_list(m[n], n)[k])
                            if n in m
                            else float("nan")
                            for n in self.edge_metric_keys
                        },
                    }
                )
        return edges

    @staticmethod
    def _non_edge_rows(ok: Mapping[int, Message], plan_of: NonEdgePlan) -> list[dict]:
        non_edges = []
        for dst in sorted(ok):
            plan = {j: path for j, _, path in plan_of.get(dst, [])}
            if not plan:
                continue
            m = metric_record(ok[dst].content, METRICS)
            col = {
                key: as_list(m[key], key)
                for key in (
                    NON_EDGE_ACCURACY,
                    VAL_NON_EDGE_ACCURACY,
                    NON_EDGE_DIRECT_ACCURACY,
                    VAL_NON_EDGE_DIRECT_ACCURACY,
                )
            }
            for k, src in enumerate(as_list(m[NON_EDGE_SRC], NON_EDGE_SRC)):
                path = plan[int(src)]
                non_edges.append(
                    {
                        "src": int(src),
                        "dst": int(dst),
                        "hops": len(path) - 1,
                        "path": list(path),
                        "communication_accuracy": float(col[NON_EDGE_ACCURACY][k]),
                        "val_communication_accuracy": float(col[VAL_NON_EDGE_ACCURACY][k]),
                        "communication_accuracy_direct": float(col[NON_EDGE_DIRECT_ACCURACY][k]),
                        "val_communication_accuracy_direct": float(
                            col[VAL_NON_EDGE_DIRECT_ACCURACY][k]
                        ),
                    }
                )
        return non_edges


class TransportedEvaluation(GraphEvaluation):
    """Evaluation under stringent privacy (Alg. 3/4): each node transports its evaluation arrays toward
    each neighbour with its own map; receiver i gets from each answering neighbour j what j
    transported toward i (``"<j>/pilots"`` etc., width d_e) and j's labels. No raw pilots reach the
    server, so multi-hop transport and the sheaf diagnostics are skipped with the reason recorded.
    """

    transported = True
    holds_raw_pilots = False

    def required_phase1(self) -> dict[str, tuple[str, ...]]:  # noqa: D102 - GraphEvaluation hook
        return {ARRAYS: STRINGENT_EVAL_LABELS, METRICS: EVAL_REPLY[METRICS]}

    def routed_payload(
        self,
        s: GraphStrategy,
        pid: int,
        neighbours: tuple[int, ...],
        phase1: dict[int, Message],
        plan: list[tuple[int, np.ndarray, list[int]]],
    ) -> tuple[Any, dict[str, Any]]:
        """What each answering neighbour j transported toward ``pid``, and j's labels."""
        arrays = {}
        for j in neighbours:
            rec = array_record(phase1[j].content, ARRAYS)
            arrays.update({f"{j}/{n}": rec[f"{pid}/{n}"].numpy() for n in STRINGENT_EVAL_ARRAYS})
            arrays.update({f"{j}/{n}": rec[n].numpy() for n in STRINGENT_EVAL_LABELS})
        return pack_arrays(arrays), {}

    def phase1_problem(self, s: GraphStrategy, pid: int, reply: Message) -> str | None:
        """:meth:`GraphEvaluation.phase1_metrics_problem`, raw ``pilots`` present, or per neighbour j
        transported pilots not ``(K, d_e)`` / latents not ``(M, d_e)`` matching the labels / NaN or inf."""
        m, a = metric_record(reply.content, METRICS), array_record(reply.content, ARRAYS)
        why = self.phase1_metrics_problem(s, pid, m)
        if why is not None:
            return why
        if "pilots" in a:
            return "raw pilots in a reply under privacy='stringent'"
        d = s.nodes[pid].d
        assert s.graph is not None  # built before any evaluation
        for j in sorted(s.graph.neighbors(pid)):
            width = edge_dim(d, s.nodes[j].d)
            shapes = {"pilots": (s.num_pilots, width)}
            for split in ("test", "val"):
                y = a[f"{split}-labels"].numpy()
                shapes[f"{split}-latents"] = (y.shape[0] if y.ndim == 1 else -1, width)
            for name, shape in shapes.items():
                key = f"{j}/{name}"
                if key not in a:
                    return f"no {key!r}"
                x = a[key].numpy()
                if x.shape != shape:
                    return f"{key} of shape {x.shape}, expected {shape}"
                if not np.isfinite(x).all():
                    return f"NaN/inf in {key}"
        return None


def summarise_accuracies(nodes: Mapping[int, dict], edges: list[dict]) -> EvaluationSummary:
    """Round summary of private and communication accuracy (paper Eq. 22, Fig. 2).

    Args:
        nodes: per partition-id ``{"private_accuracy", "val_private_accuracy", "low_variance_fraction"}``.
        edges: directed edges ``{"src", "dst", "communication_accuracy", "val_communication_accuracy"}``
            (``dst`` is the receiver).

    Returns:
        :class:`~flwr_sheaf.strategy.base.EvaluationSummary`: ``private_accuracy_mean``;
        ``communication_accuracy_mean`` (mean over receivers of their mean over incoming edges, the
        reference code's average); ``communication_accuracy_degree_weighted`` (sum_i deg_i A_i /
        sum_i deg_i = mean over directed edges, the paper's Fig. 2); the same for validation with a
        ``val_`` prefix; ``low_variance_fraction_mean``.
    """
    out = {
        "private_accuracy_mean": nanmean(n["private_accuracy"] for n in nodes.values()),
        "val_private_accuracy_mean": nanmean(n["val_private_accuracy"] for n in nodes.values()),
        "low_variance_fraction_mean": nanmean(
            n.get("low_variance_fraction", float("nan")) for n in nodes.values()
        ),
    }
    for prefix, key in (("", "communication_accuracy"), ("val_", "val_communication_accuracy")):
        per_recv: dict[int, list[float]] = {}
        for e in edges:
            per_recv.setdefault(e["dst"], []).append(e[key])
        out[f"{prefix}communication_accuracy_mean"] = nanmean(nanmean(v) for v in per_recv.values())
        out[f"{prefix}communication_accuracy_degree_weighted"] = nanmean(e[key] for e in edges)
    return EvaluationSummary(**out)
