"""Graph-aware peer strategy: the agents' graph, the shared local-training round and the evaluation protocol.

Every method on the agents' graph (Sheaf-FRL, FedProto, FedSAF, non-cooperative) trains and
evaluates the same way; a method only fills in hooks:

- :meth:`GraphStrategy.method_config` (its config section, sent to every trained node),
  :meth:`GraphStrategy.node_payload` (per-node records and config: Sheaf-FRL's neighbour pilots
  and edges), :meth:`GraphStrategy.accept_train` (consume the replies: store pilots, aggregate
  prototypes) and :meth:`GraphStrategy.evaluate_payload` (extra evaluation records);
- evaluation (paper Eq. 22, Fig. 2) is two round trips inside :meth:`PeerStrategy.start`:
  ``evaluate.<action>`` collects each evaluator's private accuracy and whitened pilots and
  validation/test latents; :meth:`GraphStrategy.route_evaluate` builds ``evaluate.<action>_comm``,
  which routes to each node its neighbours' pilots and latents; :meth:`aggregate_evaluate` turns
  the per-edge communication accuracies into the mean over receivers and the degree-weighted mean
  (= mean over directed edges, the paper's Fig. 2). The evaluators are every node, or with
  ``fraction-evaluate = f < 1`` a seeded draw of ``max(1, floor(f N))`` nodes per evaluated round
  (:class:`~flwr_sheaf.participation.ParticipationSampler`, stream 1): communication accuracy is
  then measured only on edges whose two ends were both drawn (and answered).

Between the two phases (:meth:`GraphStrategy.sheaf_diagnostics`, docs/variants.md) the strategy
refits every edge's Procrustes map on the answering nodes' phase-1 pilots (the maps the receivers
fit in phase 2), records the per-edge total variation and the smallest eigenvalues of the sheaf
Laplacian (Eq. 6) with its near-kernel (approximate global sections), draws ``non-edge-pairs``
non-adjacent pairs from (seed, round) and routes to each receiver, besides its neighbours' arrays,
its non-edge sources' arrays with the maps composed along a shortest path (multi-hop transport).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

import networkx as nx
import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from ..config import DEFAULTS, FederationConfig, LocalTrainConfig
from ..hints import pilot_count_error
from ..participation import EVALUATE_STREAM, ParticipationSampler
from ..protocol import (PILOT_READING, PILOT_READING_ARRAYS, COMM_ACCURACY_PILOT_WHITENING,
                        VAL_COMM_ACCURACY_PILOT_WHITENING)
from ..protocol import (ARRAYS, COMM_ACCURACY, COMM_REPLY, COMM_SRC, CONFIG, EVAL_ARRAYS, EVAL_REPLY, EVALUATE,
                        LOW_VARIANCE_FRACTION, EVAL_TRANSPORTED,
                        DEVICE, METRICS, NUM_EXAMPLES, PRIVATE_ACCURACY, SEED, SERVER_ROUND, STALK_DIM, TORCH_THREADS, TRAIN,
                        TRAIN_REPLY, VAL_COMM_ACCURACY, VAL_PRIVATE_ACCURACY, WHITENING_FIT, EdgeConfig, comm_action,
                        route_evaluation)
from ..protocol import (NON_EDGE_ACCURACY, NON_EDGE_DIRECT_ACCURACY, NON_EDGE_REPLY, NON_EDGE_SRC, VAL_NON_EDGE_ACCURACY,
                        VAL_NON_EDGE_DIRECT_ACCURACY, NonEdgeConfig, route_non_edges)
from ..sheaf.diagnostics import graph_algebraic_connectivity, laplacian_spectrum, sample_non_edges
from ..sheaf.network import NetworkSheaf, orient_edge
from ..topology import build_graph, validate_graph
from .base import EvaluationSummary, PeerStrategy, RoundRecord, nanmean, weight_problem

__all__ = ["GraphStrategy", "summarise_accuracies"]

log = logging.getLogger("flwr_sheaf")


class GraphStrategy(PeerStrategy):
    """Peer strategy on an undirected agent graph with shared local training and evaluation.

    Args:
        num_nodes: agents (graph nodes = partition-ids ``0..num_nodes-1``).
        action: message action.
        federation: graph spec, participation and evaluation period.
        train: local-training settings sent to every trained node.
        graph: an explicit ``networkx.Graph`` on partition-ids (overrides ``federation.graph``).
        discovery_timeout: seconds to wait for SuperNodes.

    Class attributes:
        whitening_fit: where nodes fit their whitening for evaluation (``"pilots"``: Sheaf-FRL;
            ``"train"``: the post-hoc protocol of the baselines, docs/baselines.md).
        node_metric_names: phase-1 evaluation metrics copied per node into :attr:`node_results`
            and averaged into the round as ``<name>_mean``.

    Raises:
        ConfigError: (at construction) an unknown graph spec form.
        ValueError: (at discovery, naming ``graph``) a graph that is not connected or names a
            missing partition-id; nodes reporting different pilot counts or different pilots
            (:func:`~flwr_sheaf.protocol.pilot_digest`: other samples or another order).
    """

    whitening_fit = "pilots"
    #: whether phase-1 evaluation arrays are transported by the sender's map (config :data:`EVAL_TRANSPORTED`).
    eval_transported = False
    node_metric_names: tuple[str, ...] = ()
    #: extra phase-1 arrays routed to neighbours, and extra per-edge phase-2 metrics (ComFed's learned maps).
    routed_arrays: tuple[str, ...] = ()
    edge_metric_names: tuple[str, ...] = ()
    #: whether the phase-1 evaluation replies carry the nodes' raw (whitened) pilots to the server. A
    #: strategy under which they do not (stringent privacy) sets False: multi-hop transport and the
    #: sheaf diagnostics are then skipped with the reason recorded in the round.
    holds_raw_pilots: bool = True

    def __init__(self, num_nodes: int, *, action: str, federation: FederationConfig, train: LocalTrainConfig,
                 graph: nx.Graph | None, discovery_timeout: float = DEFAULTS["discovery-timeout"]) -> None:
        sampler = ParticipationSampler.from_spec(num_nodes, federation.fraction_train, federation.participation,
                                                 federation.seed)
        super().__init__(num_nodes, action=action, sampler=sampler, discovery_timeout=discovery_timeout)
        #: who is evaluated in an evaluated round (``fraction-evaluate``; its own uniform stream)
        self.eval_sampler = ParticipationSampler(num_nodes, federation.fraction_evaluate, seed=federation.seed,
                                                 stream=EVALUATE_STREAM, key="fraction-evaluate")
        self.federation = federation
        self.train = train
        self.graph_spec: nx.Graph | str = graph if graph is not None else federation.graph
        self.graph: nx.Graph | None = None
        self.num_pilots = -1
        self._phase1: dict[int, Message] = {}
        self._extra_eval: dict = {}
        self._receivers: list[int] = []
        self._routed_src: dict[int, tuple[int, ...]] = {}
        self._evaluators: list[int] = []
        self._nodes_out: dict[int, dict] = {}
        self._edges_out: list[dict] = []
        #: this round's non-edge plan ``{receiver: [(source, composed map (d_i, d_j), path), ...]}``
        self._non_edge_plan: dict[int, list[tuple[int, np.ndarray, list[int]]]] = {}
        self._non_edges_out: list[dict] = []
        #: whether evaluation also gives the strong post-hoc reading (whitening fitted on the pilots):
        #: post-hoc methods only (``whitening_fit = "train"``), run-config ``posthoc-readings = both``
        self.pilot_reading = self.whitening_fit == "train" and federation.posthoc_readings == "both"

    # ------------------------------------------------------------------ graph
    def query_config(self) -> dict:
        """Discovery reads the torch thread count and checks the device (run-config key ``device``)."""
        return {TORCH_THREADS: self.train.torch_threads, DEVICE: self.train.device}

    def on_discovered(self) -> None:
        """Build (from a spec, with the reported class sets) and validate the graph; check the pilot count."""
        classes = [self.nodes[p].info.classes for p in range(self.num_nodes)]
        try:
            if isinstance(self.graph_spec, str):
                self.graph = build_graph(self.graph_spec, self.num_nodes, class_sets=classes)
            else:
                self.graph = self.graph_spec
            validate_graph(self.graph, range(self.num_nodes))
        except ValueError as exc:
            name = f"graph={self.graph_spec!r}" if isinstance(self.graph_spec, str) else "graph (networkx.Graph)"
            raise ValueError(f"{name} on {self.num_nodes} nodes: {exc} (for a few nodes use 'ring' or "
                             f"'class-overlap:<density>')") from None
        ks = {n.info.num_pilots for n in self.nodes.values()}
        if len(ks) > 1:
            raise ValueError(pilot_count_error({p: n.info.num_pilots for p, n in self.nodes.items()}))
        groups: dict[int, list[int]] = {}
        for p in sorted(self.nodes):
            if self.nodes[p].info.pilot_digest:
                groups.setdefault(self.nodes[p].info.pilot_digest, []).append(p)
        if len(groups) > 1:
            parts = sorted(groups.values(), key=len, reverse=True)
            raise ValueError(f"nodes hold different pilots (partition-ids {parts[0]} agree; {parts[1:]} differ): the "
                             f"pilots must be the same samples in the same order on every node (same dataset, seed, "
                             f"shift and num-pilots)")
        self.num_pilots = ks.pop()
        log.info("%s graph: %d nodes, %d edges", type(self).__name__, self.graph.number_of_nodes(),
                 self.graph.number_of_edges())

    def oriented_edges(self) -> list[tuple[int, int]]:
        """All edges as (head, tail) pairs (larger d is head; ties: larger partition-id)."""
        return sorted(orient_edge(a, self.nodes[a].d, b, self.nodes[b].d) for a, b in self.graph.edges)

    def edge_config(self, pid: int, weights: list[float] | None = None) -> EdgeConfig:
        """Node ``pid``'s incident edges (neighbours sorted) with their orientation."""
        nbrs = tuple(sorted(self.graph.neighbors(pid)))
        d = self.nodes[pid].d
        heads = tuple(orient_edge(pid, d, j, self.nodes[j].d)[0] == pid for j in nbrs)
        return EdgeConfig(nbrs, tuple(self.nodes[j].d for j in nbrs), heads,
                          None if weights is None else tuple(weights))

    # ------------------------------------------------------------------ hooks
    def method_config(self, server_round: int) -> dict:
        """The method's config entries for every train message of this round (default: none).

        Returns:
            ``{key: value}`` merged into every ``train.<action>`` config (README, "Adding a method").
        """
        return {}

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """``(records, config entries)`` only node ``pid`` gets in its train message (default: none;
        Sheaf-FRL: its neighbours' pilots and its edges; README "Adding a method")."""
        return {}, {}

    def accept_train(self, server_round: int, ok: dict[int, Message]) -> tuple[dict[int, Message], dict]:
        """Consume the successful train replies ``{partition-id: reply}``; returns the accepted ones and
        extra round metrics (record a rejected reply with :meth:`record_failure`)."""
        return ok, {}

    def evaluate_payload(self, server_round: int) -> tuple[dict, dict]:
        """``(records, config entries)`` added to every phase-1 evaluation message (default: none)."""
        return {}, {}

    def evaluate_node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """``(records, config entries)`` only node ``pid`` gets in its phase-1 evaluation message (default:
        none; Sheaf-FRL under stringent privacy: its edges, docs/variants.md)."""
        return {}, {}

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        """One ``train.<action>`` message per sampled node: local-training config, method config, node payload.

        Raises:
            ValueError: ``config`` (``start``'s ``train_config``) names a key the strategy sends.
        """
        sampled = self.sampler.sample(server_round)
        self.current.sampled = sampled
        base = {**self.train.to_dict(), **self.method_config(server_round), SERVER_ROUND: server_round, SEED: self.seed}
        msgs = []
        for pid in sampled:
            records, node_cfg = self.node_payload(server_round, pid)
            cfg = self.merge_extra({**base, **node_cfg}, config, "train_config")
            msgs.append(self.message(pid, RecordDict({**records, CONFIG: ConfigRecord(cfg)}), TRAIN, server_round))
        if not sampled:
            log.info("round %d: no node sampled (nothing trains)", server_round)
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[None, MetricRecord]:
        """Means over the accepted nodes of their numeric train metrics (+ :meth:`accept_train`'s); no arrays
        (there is no global model). Error, silent and malformed replies, and replies whose
        ``num-examples`` is not a finite number > 0 or with an infinite metric, are recorded failures
        (not passed to :meth:`accept_train`)."""
        ok = self.split_replies(server_round, "train", replies, self.current.sampled, TRAIN_REPLY)
        for pid in sorted(ok):  # a reply claiming no (or NaN) training examples is that node's failure
            m = ok[pid].content[METRICS]
            why = weight_problem(NUM_EXAMPLES, m[NUM_EXAMPLES])
            infinite = [k for k, v in m.items() if isinstance(v, float) and math.isinf(v)]
            if why is None and infinite:  # NaN means "not measured" (skipped by the means); inf is never valid
                why = f"metric {infinite[0]} = {m[infinite[0]]} is infinite"
            if why is not None:
                self.record_failure(server_round, "train", pid, why)
                del ok[pid]
        accepted, extra = self.accept_train(server_round, ok)
        names = sorted({k for r in accepted.values() for k, v in r.content[METRICS].items()
                        if isinstance(v, (int, float)) and k != NUM_EXAMPLES})
        metrics = {k.replace("-", "_"): nanmean(r.content[METRICS][k] for r in accepted.values()
                                                 if k in r.content[METRICS]) for k in names}
        metrics["gluing_loss"] = metrics.pop("gluing", float("nan"))
        metrics.update(extra)
        self.current.num_trained = len(accepted)
        self.current.train.update(metrics)
        return None, MetricRecord(self.numeric({**metrics, "num_trained": len(accepted)}))

    # ------------------------------------------------------------------ evaluate
    def evaluates(self, server_round: int, num_rounds: int) -> bool:
        """Every ``evaluate-every`` rounds and always the last one (``evaluate-every = 0``: never)."""
        every = self.federation.evaluate_every
        return every > 0 and (server_round % every == 0 or server_round == num_rounds)

    def _eval_config(self, server_round: int) -> dict:
        return {SERVER_ROUND: server_round, WHITENING_FIT: self.whitening_fit, TORCH_THREADS: self.train.torch_threads,
                DEVICE: self.train.device, EVAL_TRANSPORTED: int(self.eval_transported),
                PILOT_READING: int(self.pilot_reading)}

    @property
    def evaluation_array_names(self) -> tuple[str, ...]:
        """Names of the phase-1 arrays every evaluated node sends and the server routes to neighbours:
        :data:`EVAL_ARRAYS`, the method's :attr:`routed_arrays` and, with the strong post-hoc reading,
        :data:`PILOT_READING_ARRAYS`."""
        return EVAL_ARRAYS + self.routed_arrays + (PILOT_READING_ARRAYS if self.pilot_reading else ())

    @property
    def edge_metric_keys(self) -> tuple[str, ...]:
        """Per-edge phase-2 metrics beyond :data:`COMM_ACCURACY`: the method's :attr:`edge_metric_names`
        and, with the strong post-hoc reading, its test and validation accuracies."""
        return self.edge_metric_names + ((COMM_ACCURACY_PILOT_WHITENING, VAL_COMM_ACCURACY_PILOT_WHITENING)
                                         if self.pilot_reading else ())

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        """Phase 1 (``evaluate.<action>``) to this round's evaluators: private accuracy, whitened pilots and latents.

        The evaluators are :attr:`eval_sampler`'s draw for ``server_round`` (every node at
        ``fraction-evaluate = 1``); they are recorded as the round's ``evaluated`` list.

        Raises:
            ValueError: ``config`` (``start``'s ``evaluate_config``) names a key the strategy sends.
        """
        records, cfg = self.evaluate_payload(server_round)
        self._extra_eval = dict(config)
        self._evaluators = [p for p in self.eval_sampler.sample(server_round) if p in self.nodes]
        self.current.evaluate["evaluated"] = list(self._evaluators)
        msgs = []
        for p in self._evaluators:
            node_records, node_cfg = self.evaluate_node_payload(server_round, p)
            content = self.merge_extra({**self._eval_config(server_round), **cfg, **node_cfg}, config, "evaluate_config")
            msgs.append(self.message(p, RecordDict({**records, **node_records, CONFIG: ConfigRecord(content)}), EVALUATE,
                                     server_round))
        return msgs

    def route_evaluate(self, server_round: int, replies: list[Message]) -> list[Message]:
        """Phase 2 (``evaluate.<action>_comm``): each answering node gets its answering neighbours' arrays.

        Malformed phase-1 replies (:data:`~flwr_sheaf.protocol.EVAL_REPLY` plus the method's
        :attr:`routed_arrays`) and replies with unusable values (:meth:`_phase1_problem`: wrong d or
        pilot shape, NaN/inf pilots or latents, accuracies outside [0, 1]) are failures of that node,
        and its edges are not measured.
        """
        required = {**EVAL_REPLY, ARRAYS: self.evaluation_array_names}
        self._phase1 = self.split_replies(server_round, "evaluate", replies, self._evaluators, required)
        for pid in sorted(self._phase1):
            why = self._phase1_problem(pid, self._phase1[pid])
            if why is not None:
                self.record_failure(server_round, "evaluate", pid, f"bad evaluation reply: {why}")
                del self._phase1[pid]
        arrays = {p: r.content[ARRAYS] for p, r in self._phase1.items()}
        self.sheaf_diagnostics(server_round)
        msgs = []
        self._routed_src = {}
        for pid in sorted(self._phase1):
            edges = self.edge_config(pid).keep(self._phase1)
            self._routed_src[pid] = tuple(edges.neighbours)
            routed = route_evaluation(arrays, edges.neighbours, self.evaluation_array_names)
            plan = self._non_edge_plan.get(pid, [])
            for key, value in route_non_edges(arrays, {j: t for j, t, _ in plan}).items():
                routed[key] = Array(np.ascontiguousarray(value))
            d = self.nodes[pid].d
            non_edges = NonEdgeConfig(tuple(j for j, _, _ in plan), tuple(self.nodes[j].d for j, _, _ in plan),
                                      tuple(orient_edge(pid, d, j, self.nodes[j].d)[0] == pid for j, _, _ in plan),
                                      tuple(len(path) - 1 for _, _, path in plan))
            content = RecordDict({ARRAYS: routed,
                                  CONFIG: ConfigRecord(self.merge_extra({**self._eval_config(server_round),
                                                                         **edges.to_config(), **non_edges.to_config()},
                                                                        self._extra_eval, "evaluate_config"))})
            msgs.append(self.message(pid, content, EVALUATE, server_round, action=comm_action(self.action)))
        self._receivers = [self.pid_of_node[m.metadata.dst_node_id] for m in msgs]
        return msgs

    def sheaf_diagnostics(self, server_round: int) -> None:
        """Sheaf diagnostics and the non-edge plan of this evaluated round (docs/variants.md).

        On the subgraph induced by the nodes whose phase-1 reply was accepted, every edge's map is
        refitted by Procrustes on their phase-1 pilots (Eq. 18; the maps the receivers fit for the
        edge communication accuracy). Recorded in the round (``results.json``):

        - ``sheaf_edge_tv``: ``[[head, tail, ||A_h - V A_t||_F^2 / K], ...]`` per oriented edge, and
          its mean ``sheaf_tv_mean`` and maximum ``sheaf_tv_max``;
        - with ``diagnostics-eigenvalues = k > 0``: ``sheaf_laplacian_eigenvalues`` (the k smallest
          of ``L = Delta^T Delta``, Eq. 6), ``sheaf_near_kernel_dim``, ``sheaf_near_kernel_tolerance``,
          ``sheaf_kernel_dim_bound`` (``min_i d_i`` per component), ``sheaf_laplacian_size``,
          ``sheaf_eigensolver``, ``sheaf_eigen_residual``, ``graph_algebraic_connectivity`` and
          ``sheaf_near_kernel_exact`` (:func:`~flwr_sheaf.sheaf.diagnostics.laplacian_spectrum`:
          exact up to 4096 stalk dimensions, 100 LOBPCG iterations above);
        - with ``non-edge-pairs = P > 0``: up to P non-adjacent pairs
          (:func:`~flwr_sheaf.sheaf.diagnostics.sample_non_edges`, from (seed, round)); each is
          measured in both directions with the maps composed along one shortest path of that subgraph
          (:meth:`~flwr_sheaf.sheaf.network.NetworkSheaf.transport_map`), stored in
          :attr:`_non_edge_plan` for :meth:`route_evaluate`.

        Without raw pilots (:attr:`holds_raw_pilots` False, or a phase-1 reply without a ``pilots``
        array) nothing is computed and ``sheaf_diagnostics_skipped`` / ``non_edges_skipped`` say why. The server computes with
        ``torch-threads`` threads (when > 0; restored afterwards): small products on more threads
        than free cores were 100x slower on a loaded machine.
        """
        threads = torch.get_num_threads()
        if self.train.torch_threads > 0:
            torch.set_num_threads(self.train.torch_threads)
        try:
            self._sheaf_diagnostics(server_round)
        finally:
            torch.set_num_threads(threads)

    def _sheaf_diagnostics(self, server_round: int) -> None:
        self._non_edge_plan = {}
        rec = self.current.evaluate
        fed = self.federation
        present = sorted(self._phase1)
        lacking = [p for p in present if "pilots" not in self._phase1[p].content[ARRAYS]]
        why = None
        if not self.holds_raw_pilots:
            why = (f"{type(self).__name__} does not hold the nodes' raw pilots (stringent privacy): the maps "
                   f"cannot be composed or refitted at the server")
        elif lacking:
            why = f"the phase-1 replies of partition-ids {lacking[:10]} carry no pilots: the maps cannot be refitted"
        if why is not None:
            rec["sheaf_diagnostics_skipped"] = why
            if fed.non_edge_pairs > 0:
                rec["non_edges_skipped"] = why
            return
        if not present:
            return
        pilots = {p: torch.from_numpy(np.asarray(self._phase1[p].content[ARRAYS]["pilots"].numpy(), dtype=np.float64))
                  for p in present}
        sub = self.graph.subgraph(present)
        sheaf = NetworkSheaf(sub, {p: self.nodes[p].d for p in present})
        sheaf.fit_maps(pilots)
        tv = sheaf.edge_total_variation(pilots)
        rec["sheaf_edge_tv"] = [[int(h), int(t), v] for (h, t), v in tv.items()]
        rec["sheaf_tv_mean"] = nanmean(tv.values())
        rec["sheaf_tv_max"] = max(tv.values()) if tv else float("nan")
        if fed.diagnostics_eigenvalues > 0:
            try:
                spec = laplacian_spectrum(sheaf.maps, sheaf.dims, sheaf.edges, fed.diagnostics_eigenvalues,
                                          seed=int(np.random.SeedSequence([self.seed, server_round]).generate_state(1)[0]))
            except torch.linalg.LinAlgError as exc:  # a numerical failure is recorded, never a crashed server
                rec["sheaf_diagnostics_skipped"] = f"eigensolver failed: {exc}"
                spec = None
        if fed.diagnostics_eigenvalues > 0 and spec is not None:
            rec.update({"sheaf_laplacian_eigenvalues": spec.eigenvalues, "sheaf_near_kernel_dim": spec.near_kernel_dim,
                        "sheaf_near_kernel_exact": spec.near_kernel_exact,
                        "sheaf_near_kernel_tolerance": spec.tolerance, "sheaf_kernel_dim_bound": spec.kernel_bound,
                        "sheaf_laplacian_size": spec.n, "sheaf_eigensolver": spec.solver,
                        "sheaf_eigen_residual": spec.max_residual,
                        "graph_algebraic_connectivity": graph_algebraic_connectivity(sub)})
        if fed.non_edge_pairs <= 0:
            return
        pairs = sample_non_edges(self.graph, present, fed.non_edge_pairs, self.seed, server_round)
        if not pairs:
            rec["non_edges_skipped"] = "no non-adjacent pair of evaluated nodes joined by a path of evaluated nodes"
        for a, b in pairs:
            path = [int(v) for v in nx.shortest_path(sub, a, b)]
            for src_path in (path, path[::-1]):  # source first
                dst = src_path[-1]
                self._non_edge_plan.setdefault(dst, []).append(
                    (src_path[0], sheaf.transport_map(src_path).numpy(), src_path))

    def _phase1_problem(self, pid: int, reply: Message) -> str | None:
        """Why a phase-1 evaluation reply cannot be used (or None): a stalk dimension other than the
        discovered d_i, an accuracy/fraction that is neither NaN nor in [0, 1], pilots not ``(K, d_i)``,
        latents not ``(M, d_i)`` with ``(M,)`` integer labels, or NaN/inf in pilots or latents."""
        m, a = reply.content[METRICS], reply.content[ARRAYS]
        d = self.nodes[pid].d
        if not _number(m[STALK_DIM]) or m[STALK_DIM] != d:
            return f"{STALK_DIM} = {m[STALK_DIM]!r}, but the node reported d={d} at discovery"
        for key in (PRIVATE_ACCURACY, VAL_PRIVATE_ACCURACY, LOW_VARIANCE_FRACTION):
            if not _fraction(m[key]):
                return f"{key} = {m[key]!r} is not in [0, 1] (or NaN)"
        pilots = a["pilots"].numpy()
        if pilots.shape != (self.num_pilots, d):
            return f"pilots of shape {pilots.shape}, expected ({self.num_pilots}, {d})"
        if not np.isfinite(pilots).all():
            return "NaN/inf pilots"
        for split in ("test", "val"):
            z, y = a[f"{split}-latents"].numpy(), a[f"{split}-labels"].numpy()
            if z.ndim != 2 or z.shape[1] != d or y.shape != (z.shape[0],) or not np.issubdtype(y.dtype, np.integer):
                return f"{split} latents {z.shape} / labels {y.shape} {y.dtype}: expected (M, {d}) and (M,) integers"
            if not np.isfinite(z).all():
                return f"NaN/inf {split} latents"
        if self.pilot_reading:  # the strong reading's arrays: same shapes as the paper reading's
            for name, like in zip(PILOT_READING_ARRAYS, ("pilots", "test-latents", "val-latents")):
                z = a[name].numpy()
                if z.shape != a[like].numpy().shape or not np.isfinite(z).all():
                    return f"{name} of shape {z.shape} (expected {a[like].numpy().shape}) or NaN/inf entries"
        return None

    def _comm_problem(self, pid: int, reply: Message) -> str | None:
        """Why a phase-2 reply cannot be used (or None): per-edge lists of different lengths, sources
        other than the neighbours routed to it, or an accuracy neither NaN nor in [0, 1]."""
        m = reply.content[METRICS]
        missing = [n for n in (COMM_ACCURACY_PILOT_WHITENING, VAL_COMM_ACCURACY_PILOT_WHITENING)
                   if self.pilot_reading and n not in m]
        if missing:
            return f"the strong post-hoc reading was asked for, but the reply lacks {missing}"
        lists = [COMM_SRC, COMM_ACCURACY, VAL_COMM_ACCURACY] + [n for n in self.edge_metric_keys if n in m]
        if any(not isinstance(m[k], list) for k in lists):
            return f"per-edge entries {lists} must be lists"
        if len({len(m[k]) for k in lists}) != 1:
            return f"per-edge lists of different lengths {[len(m[k]) for k in lists]}"
        expected = self._routed_src.get(pid, ())
        if sorted(int(x) for x in m[COMM_SRC]) != sorted(expected) or len(set(m[COMM_SRC])) != len(m[COMM_SRC]):
            return f"sources {list(m[COMM_SRC])}, but neighbours {list(expected)} were routed to it"
        for k in lists[1:]:
            bad = [v for v in m[k] if not _fraction(v)]
            if bad:
                return f"{k} = {bad[:5]} not in [0, 1] (or NaN)"
        plan = self._non_edge_plan.get(pid, [])
        if plan:
            names = NON_EDGE_REPLY[METRICS]
            missing = [k for k in names if k not in m]
            if missing:
                return f"non-edge sources were routed to it, but the reply lacks {missing}"
            if any(not isinstance(m[k], list) for k in names) or len({len(m[k]) for k in names}) != 1:
                return f"non-edge entries {list(names)} must be lists of one length"
            if sorted(int(x) for x in m[NON_EDGE_SRC]) != sorted(j for j, _, _ in plan):
                return f"non-edge sources {list(m[NON_EDGE_SRC])}, but {[j for j, _, _ in plan]} were routed to it"
            for k in names[1:]:
                bad = [v for v in m[k] if not _fraction(v)]
                if bad:
                    return f"{k} = {bad[:5]} not in [0, 1] (or NaN)"
        return None

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord:
        """Private and communication accuracy (per edge, per receiver, degree-weighted; paper Eq. 22, Fig. 2).

        Malformed phase-2 replies (:data:`~flwr_sheaf.protocol.COMM_REPLY`) and replies with unusable
        values (:meth:`_comm_problem`) are that node's failure.
        """
        ok = self.split_replies(server_round, "evaluate_comm", replies, self._receivers, COMM_REPLY)
        for pid in sorted(ok):
            why = self._comm_problem(pid, ok[pid])
            if why is not None:
                self.record_failure(server_round, "evaluate_comm", pid, f"bad evaluation reply: {why}")
                del ok[pid]
        nodes = {}
        for pid, r in self._phase1.items():
            m = r.content[METRICS]
            nodes[pid] = {"d": int(m[STALK_DIM]), "private_accuracy": float(m[PRIVATE_ACCURACY]),
                          "val_private_accuracy": float(m[VAL_PRIVATE_ACCURACY]),
                          "low_variance_fraction": float(m[LOW_VARIANCE_FRACTION])}
            for name in self.node_metric_names:
                nodes[pid][name.replace("-", "_")] = float(m[name]) if name in m else float("nan")
        edges = []
        for dst, r in ok.items():
            m = r.content[METRICS]
            for k, (src, acc, vacc) in enumerate(zip(m[COMM_SRC], m[COMM_ACCURACY], m[VAL_COMM_ACCURACY])):
                edges.append({"src": int(src), "dst": int(dst), "communication_accuracy": float(acc),
                              "val_communication_accuracy": float(vacc),
                              **{n.replace("-", "_"): float(m[n][k]) if n in m else float("nan")
                                 for n in self.edge_metric_keys}})
        non_edges = []
        for dst in sorted(ok):
            plan = {j: path for j, _, path in self._non_edge_plan.get(dst, [])}
            if not plan:
                continue
            m = ok[dst].content[METRICS]
            for k, src in enumerate(m[NON_EDGE_SRC]):
                path = plan[int(src)]
                non_edges.append({"src": int(src), "dst": int(dst), "hops": len(path) - 1, "path": list(path),
                                  "communication_accuracy": float(m[NON_EDGE_ACCURACY][k]),
                                  "val_communication_accuracy": float(m[VAL_NON_EDGE_ACCURACY][k]),
                                  "communication_accuracy_direct": float(m[NON_EDGE_DIRECT_ACCURACY][k]),
                                  "val_communication_accuracy_direct": float(m[VAL_NON_EDGE_DIRECT_ACCURACY][k])})
        summary = summarise_accuracies(nodes, edges)
        extra = {f"{name.replace('-', '_')}_mean": nanmean(n[name.replace("-", "_")] for n in nodes.values())
                 for name in self.node_metric_names}
        for name in self.edge_metric_keys:  # degree-weighted = mean over directed edges (Fig. 2)
            key = name.replace("-", "_")
            extra[f"{key}_degree_weighted"] = nanmean(e[key] for e in edges)
        if self.federation.non_edge_pairs > 0:  # mean over measured directed non-edge pairs (no degree weighting)
            for key, name in (("communication_accuracy", "communication_accuracy_non_edges"),
                              ("val_communication_accuracy", "val_communication_accuracy_non_edges"),
                              ("communication_accuracy_direct", "communication_accuracy_non_edges_direct"),
                              ("val_communication_accuracy_direct", "val_communication_accuracy_non_edges_direct")):
                extra[name] = nanmean(e[key] for e in non_edges)
            extra["non_edge_pairs_measured"] = len(non_edges)
            extra["non_edge_hops_mean"] = nanmean(e["hops"] for e in non_edges)
        self._nodes_out, self._edges_out, self._non_edges_out = nodes, edges, non_edges
        self.current.evaluation = summary
        self.current.evaluate.update(extra)
        return MetricRecord(self.numeric({**vars(summary), **extra}))

    def log_round(self, rec: RoundRecord) -> None:
        """Progress line: private and communication accuracy of an evaluated round."""
        e = rec.evaluation
        if e is None:
            return super().log_round(rec)
        log.info("round %3d | private %.3f | comm (deg.-weighted) %.3f | comm (receivers) %.3f | %.1f s", rec.round,
                 e.private_accuracy_mean, e.communication_accuracy_degree_weighted, e.communication_accuracy_mean,
                 rec.wall_seconds)

    @property
    def node_results(self) -> dict[int, dict]:
        """Per partition-id results of the last evaluation (``d``, private accuracy, ...)."""
        return self._nodes_out

    @property
    def edge_results(self) -> list[dict]:
        """Per directed edge (``src`` -> ``dst`` receiver) communication accuracy of the last evaluation."""
        return self._edges_out

    @property
    def non_edge_results(self) -> list[dict]:
        """Per directed non-edge pair of the last evaluation: ``src``, ``dst`` (receiver), ``hops``,
        ``path`` (source first), ``communication_accuracy`` (multi-hop), ``communication_accuracy_direct``
        (direct Procrustes) and their ``val_`` counterparts (docs/variants.md)."""
        return self._non_edges_out

    def results_extra(self) -> dict:
        """Participation, the evaluation protocol (``whitening-fit``), the graph's edges and the last
        evaluation's non-edge pairs (``non_edges``, :attr:`non_edge_results`)."""
        return {**super().results_extra(), "evaluation": {"whitening-fit": self.whitening_fit,
                                                          "pilot-whitening-reading": self.pilot_reading,
                                                          "fraction-evaluate": self.eval_sampler.fraction,
                                                          "non-edge-pairs": self.federation.non_edge_pairs,
                                                          "diagnostics-eigenvalues":
                                                              self.federation.diagnostics_eigenvalues},
                "graph": {"edges": sorted([int(a), int(b)] for a, b in self.graph.edges) if self.graph else []},
                "non_edges": self._non_edges_out}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fraction(v) -> bool:
    """A number that is NaN (not measured) or in [0, 1]."""
    return _number(v) and (math.isnan(v) or 0.0 <= v <= 1.0)


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
        "low_variance_fraction_mean": nanmean(n.get("low_variance_fraction", float("nan")) for n in nodes.values()),
    }
    for prefix, key in (("", "communication_accuracy"), ("val_", "val_communication_accuracy")):
        per_recv: dict[int, list[float]] = {}
        for e in edges:
            per_recv.setdefault(e["dst"], []).append(e[key])
        out[f"{prefix}communication_accuracy_mean"] = nanmean(nanmean(v) for v in per_recv.values())
        out[f"{prefix}communication_accuracy_degree_weighted"] = nanmean(e[key] for e in edges)
    return EvaluationSummary(**out)
