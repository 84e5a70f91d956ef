"""Graph-aware peer strategy: graph validation/orientation and the shared evaluation protocol.

Every method on the agents' graph (Sheaf-FRL, FedProto, FedSAF, non-cooperative) evaluates the
same way (paper Eq. 22, Fig. 2), so it lives here once:

- ``configure_evaluate``: phase 1 (``evaluate.<action>``, sent synchronously here) collects
  private accuracy and the whitened pilots and validation/test latents of every node; the
  returned phase-2 messages (``evaluate.<action>_comm``) route to each node its neighbours' pilots
  and latents;
- ``aggregate_evaluate``: communication accuracy per directed edge, mean over receivers and the
  degree-weighted mean (= mean over directed edges, paper Fig. 2), recorded in ``history``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

import networkx as nx
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from ..client.task import numpy_record
from ..sheaf.network import orient_edge
from ..topology import build_graph, validate_graph
from .base import PeerStrategy

__all__ = ["GraphStrategy", "summarise_accuracies", "nanmean"]

log = logging.getLogger("flwr_sheaf")


def nanmean(xs: Iterable[float]) -> float:
    """Mean ignoring None/NaN (NaN when nothing is left)."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return float(np.mean(xs)) if xs else float("nan")


class GraphStrategy(PeerStrategy):
    """Peer strategy on an undirected agent graph with the shared evaluation protocol.

    Args:
        num_nodes: number of agents (graph nodes = partition-ids ``0..num_nodes-1``).
        graph: a ``networkx.Graph`` on partition-ids or a spec string for
            :func:`flwr_sheaf.topology.build_graph` (``"class-overlap"``, ``"ring"``, ``"0-1,1-2"``);
            class-overlap graphs are built from the class sets the nodes report.
        evaluate_every: evaluate every this many server rounds (and always at ``num_rounds``).
        num_rounds: total server rounds (only used to always evaluate the last one).
        evaluate_config: extra values for the evaluate messages (e.g. ``whitening-fit``).
        **kwargs: :class:`PeerStrategy` options (action, fraction_train, participation, seed, ...).

    Raises:
        ValueError: ``evaluate_every < 1``; (at discovery) a graph that is not connected or names a
            missing partition-id; nodes reporting different pilot counts.
    """

    def __init__(self, num_nodes: int, graph: nx.Graph | str = "class-overlap", evaluate_every: int = 1,
                 num_rounds: int | None = None, evaluate_config: Mapping | None = None, **kwargs) -> None:
        super().__init__(num_nodes=num_nodes, **kwargs)
        if evaluate_every < 1:
            raise ValueError(f"evaluate-every must be >= 1, got {evaluate_every}")
        self.graph_spec = graph
        self.graph: nx.Graph | None = None
        self.evaluate_every = int(evaluate_every)
        self.num_rounds = num_rounds
        self.evaluate_config = dict(evaluate_config or {})
        self.num_pilots = -1
        self.eval_phase1: dict[int, Message] = {}
        self.edge_results: list[dict] = []
        self.node_results: dict[int, dict] = {}

    # ------------------------------------------------------------------ graph
    def on_discovered(self) -> None:
        """Build (if a spec), validate and orient the graph from the discovered nodes."""
        classes = [self.nodes[p].classes for p in range(self.num_nodes)]
        if isinstance(self.graph_spec, str):
            self.graph = build_graph(self.graph_spec, self.num_nodes, class_sets=classes)
        else:
            self.graph = self.graph_spec
        validate_graph(self.graph, range(self.num_nodes))
        ks = {int(n.extra.get("num-pilots", -1)) for n in self.nodes.values()}
        if len(ks) > 1:
            raise ValueError(f"nodes report different pilot counts {sorted(ks)}: pilots must be shared")
        self.num_pilots = ks.pop()
        log.info("Sheaf-FRL graph: %d nodes, %d edges", self.graph.number_of_nodes(), self.graph.number_of_edges())

    def oriented_edges(self) -> list[tuple[int, int]]:
        """All edges as (head, tail) pairs (larger d is head; ties: larger partition-id)."""
        d = {p: n.d for p, n in self.nodes.items()}
        return sorted(orient_edge(a, d[a], b, d[b]) for a, b in self.graph.edges)

    def _edge_config(self, pid: int) -> dict:
        nbrs = sorted(self.graph.neighbors(pid))
        d = {p: n.d for p, n in self.nodes.items()}
        return {
            "neighbours": nbrs,
            "neighbour-dims": [d[j] for j in nbrs],
            "i-is-head": [int(orient_edge(pid, d[pid], j, d[j])[0] == pid) for j in nbrs],
        }

    # ------------------------------------------------------------------ evaluate
    def evaluate_records(self, server_round: int) -> dict:
        """Extra records of the phase-1 evaluate messages (e.g. FedProto's global prototypes)."""
        return {}

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Phase 1 (private accuracy, latents) runs here; returns the phase-2 routing messages."""
        self.ensure_discovered(grid)
        if server_round % self.evaluate_every and server_round != self.num_rounds:
            self.eval_phase1 = {}
            self._round["comm_receivers"] = []
            return []
        pids = sorted(self.nodes)
        cfg = ConfigRecord({**self.evaluate_config, "server-round": server_round})
        extra = self.evaluate_records(server_round)
        p1 = [self.message(p, RecordDict({"config": cfg, **extra}), "evaluate", server_round) for p in pids]
        self.eval_phase1 = self.split_replies(server_round, "evaluate", grid.send_and_receive(p1), pids)
        msgs = []
        for pid in pids:
            if pid not in self.eval_phase1:
                continue
            ec = self._edge_config(pid)
            keep = [i for i, j in enumerate(ec["neighbours"]) if j in self.eval_phase1]
            ec = {k: [v[i] for i in keep] for k, v in ec.items()}
            arrs = {}
            for j in ec["neighbours"]:
                src = self.eval_phase1[j].content["arrays"]
                for key in ("pilots", "test-latents", "test-labels", "val-latents", "val-labels"):
                    arrs[f"{j}/{key}"] = src[key].numpy()
            content = RecordDict({"arrays": numpy_record(arrs), "config": ConfigRecord({**self.evaluate_config, **ec, "server-round": server_round})})
            msgs.append(self.message(pid, content, "evaluate", server_round, action=f"{self.action}_comm"))
        self._round["comm_receivers"] = [self.pid_of_node[m.metadata.dst_node_id] for m in msgs]
        return msgs

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Private and communication accuracy (per edge, per receiver, degree-weighted; Eq. 22)."""
        if not self.eval_phase1:
            self.end_round()
            return None
        ok = self.split_replies(server_round, "evaluate_comm", replies, self._round.get("comm_receivers", []))
        nodes = {}
        for pid, r in self.eval_phase1.items():
            m = r.content["metrics"]
            nodes[pid] = {"d": int(m["d"]), "private_accuracy": float(m["private-accuracy"]),
                          "val_private_accuracy": float(m["val-private-accuracy"]),
                          "low_variance_fraction": float(m["low-variance-fraction"])}
        edges = []
        for dst, r in ok.items():
            m = r.content["metrics"]
            for src, acc, vacc in zip(m["src"], m["communication-accuracy"], m["val-communication-accuracy"]):
                edges.append({"src": int(src), "dst": int(dst), "communication_accuracy": float(acc),
                              "val_communication_accuracy": float(vacc)})
        summary = summarise_accuracies(nodes, edges)
        self.node_results, self.edge_results = nodes, edges
        rec = self.end_round(**summary)
        log.info(
            "round %3d | private %.3f | comm (deg.-weighted) %.3f | comm (receivers) %.3f | %.1f s",
            server_round, rec["private_accuracy_mean"], rec["communication_accuracy_degree_weighted"],
            rec["communication_accuracy_mean"], rec["wall_seconds"],
        )
        return MetricRecord({k: float(v) for k, v in summary.items() if isinstance(v, (int, float))})



def summarise_accuracies(nodes: Mapping[int, dict], edges: list[dict]) -> dict:
    """Round summary of private and communication accuracy (paper Eq. 22, Fig. 2).

    Args:
        nodes: per partition-id ``{"private_accuracy", "val_private_accuracy", "low_variance_fraction"}``.
        edges: directed edges ``{"src", "dst", "communication_accuracy", "val_communication_accuracy"}``
            (``dst`` is the receiver).

    Returns:
        ``private_accuracy_mean``; ``communication_accuracy_mean`` (mean over receivers of their
        mean over incoming edges, the reference code's average); ``communication_accuracy_degree_weighted``
        (sum_i deg_i A_i / sum_i deg_i = mean over directed edges, the paper's Fig. 2); the same for
        validation with a ``val_`` prefix; ``low_variance_fraction_mean``.
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
    return out
