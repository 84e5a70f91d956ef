"""Sheaf-FRL peer-routing strategy: relays each node only its graph neighbours' pilots.

No global model exists (paper Sec. 4): the server emulates decentralised exchange. Per server
round (design.md s4):

1. ``configure_train``: discovery once (node_id <-> partition-id, d_i, C_i; graph validated and
   oriented), then each sampled node gets an ``ArrayRecord`` with its neighbours' latest whitened
   pilot matrices ``(K, d_j)`` (key = neighbour partition-id) and a ``ConfigRecord`` with lambda,
   local epochs and its incident edges (neighbour ids, dims, orientation).
2. ``aggregate_train``: validates and stores each reply's pilots (shape ``(K, d_i)``, finite).
   A node that did not train keeps its cached pilots, which are exact because its encoder did not
   change (policy ``cached``); ``drop`` omits neighbours whose pilots are older than this round.
   Pilot age per node is tracked.
3. ``configure_evaluate``: phase 1 (sent here, synchronously) collects private accuracy and the
   whitened validation/test latents of every node; the returned phase-2 messages route to each
   node its neighbours' pilots and latents.
4. ``aggregate_evaluate``: communication accuracy per directed edge, mean over receivers and the
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

from ..sheaf.network import orient_edge
from ..topology import build_graph, validate_graph
from ..client.task import numpy_record
from .base import PeerStrategy

__all__ = ["SheafFRL", "ABSENT_POLICIES"]

log = logging.getLogger("flwr_sheaf")
ABSENT_POLICIES = ("cached", "drop")


def _nanmean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return float(np.mean(xs)) if xs else float("nan")


class SheafFRL(PeerStrategy):
    """Sheaf-FRL relay strategy (paper Alg. 1 over Flower messages).

    Args:
        num_nodes: number of agents (graph nodes = partition-ids ``0..num_nodes-1``).
        graph: a ``networkx.Graph`` on partition-ids or a spec string for
            :func:`flwr_sheaf.topology.build_graph` (``"class-overlap"``, ``"ring"``, ``"0-1,1-2"``);
            class-overlap graphs are built from the class sets the nodes report.
        train_config: values forwarded to every ``train.sheaf`` message (``lambda``,
            ``local-epochs``, ``lr``, ...; see :class:`flwr_sheaf.client.sheaf.SheafTrainConfig`).
        absent_policy: ``"cached"`` (default) or ``"drop"``.
        lambda_warmup_rounds: lambda ramps linearly from lambda/W to lambda over the first W rounds.
        action: message action name (default ``"sheaf"``).
        **kwargs: sampling options of :class:`PeerStrategy` (fraction_train, participation, seed, ...).

    Raises:
        ValueError: unknown absent policy; (at discovery) a graph that is not connected or names a
            missing partition-id; nodes reporting a different pilot count.
    """

    def __init__(self, num_nodes: int, graph: nx.Graph | str = "class-overlap", train_config: Mapping | None = None,
                 absent_policy: str = "cached", lambda_warmup_rounds: int = 0, action: str = "sheaf", **kwargs) -> None:
        super().__init__(num_nodes=num_nodes, action=action, **kwargs)
        if absent_policy not in ABSENT_POLICIES:
            raise ValueError(f"absent policy must be one of {ABSENT_POLICIES}, got {absent_policy!r}")
        self.graph_spec = graph
        self.graph: nx.Graph | None = None
        self.train_config = dict(train_config or {})
        self.absent_policy = absent_policy
        self.lambda_warmup_rounds = int(lambda_warmup_rounds)
        self.bank: dict[int, np.ndarray] = {}
        self.bank_round: dict[int, int] = {}
        self.eval_phase1: dict[int, Message] = {}
        self.edge_results: list[dict] = []
        self.node_results: dict[int, dict] = {}
        self._train_metrics: dict = {}

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

    def lam(self, server_round: int) -> float:
        """Lambda used in ``server_round`` (linear warm-up over ``lambda_warmup_rounds``)."""
        lam = float(self.train_config.get("lambda", 0.1))
        w = self.lambda_warmup_rounds
        return lam * min(1.0, server_round / w) if w > 0 else lam

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """One ``train.sheaf`` message per sampled node, carrying only its neighbours' pilots."""
        self.ensure_discovered(grid)
        self.begin_round(server_round)
        sampled = self.sample(server_round)
        self._round["sampled"] = sampled
        msgs = []
        for pid in sampled:
            ec = self._edge_config(pid)
            pilots = {}
            for j in ec["neighbours"]:
                if j not in self.bank:
                    continue
                if self.absent_policy == "drop" and self.bank_round.get(j) != server_round - 1:
                    continue
                pilots[str(j)] = self.bank[j]
            cfg = ConfigRecord({**{k: v for k, v in self.train_config.items()}, **dict(config), **ec,
                                "lambda": self.lam(server_round), "server-round": server_round})
            content = RecordDict({"pilots": numpy_record(pilots), "config": cfg})
            msgs.append(self.message(pid, content, "train", server_round))
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate and cache the fresh pilots; returns no arrays (there is no global model)."""
        ok = self.split_replies(server_round, "train", replies, self._round.get("sampled", []))
        ce, glue, lvf = [], [], []
        for pid, r in ok.items():
            a = r.content["pilots"]["pilots"].numpy()
            d = self.nodes[pid].d
            if a.ndim != 2 or a.shape != (self.num_pilots, d):
                self.failures.append({"round": server_round, "phase": "train", "partition-id": pid,
                                      "reason": f"pilot matrix shape {a.shape}, expected ({self.num_pilots}, {d})"})
                log.warning("partition-id %d sent pilots of shape %s, expected (%d, %d): ignored", pid, a.shape, self.num_pilots, d)
                continue
            if not np.isfinite(a).all():
                self.failures.append({"round": server_round, "phase": "train", "partition-id": pid, "reason": "NaN/inf pilots"})
                log.warning("partition-id %d sent NaN/inf pilots: ignored, cached pilots kept", pid)
                continue
            self.bank[pid] = a
            self.bank_round[pid] = server_round
            m = r.content["metrics"]
            ce.append(float(m["ce"]))
            glue.append(float(m["gluing"]))
            lvf.append(float(m["low-variance-fraction"]))
        ages = [server_round - self.bank_round[p] for p in self.bank_round]
        self._train_metrics = {
            "ce": _nanmean(ce), "gluing_loss": _nanmean(glue), "lambda": self.lam(server_round),
            "num_trained": len(ce), "pilot_age_mean": _nanmean(ages), "pilot_age_max": max(ages) if ages else 0,
        }
        self._round.update(self._train_metrics)
        return None, MetricRecord({k: float(v) for k, v in self._train_metrics.items()})

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Phase 1 (private accuracy, latents) runs here; returns the phase-2 routing messages."""
        self.ensure_discovered(grid)
        pids = sorted(self.nodes)
        p1 = [self.message(p, RecordDict({"config": ConfigRecord({"server-round": server_round})}), "evaluate", server_round) for p in pids]
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
            content = RecordDict({"arrays": numpy_record(arrs), "config": ConfigRecord({**ec, "server-round": server_round})})
            msgs.append(self.message(pid, content, "evaluate", server_round, action=f"{self.action}_comm"))
        self._round["comm_receivers"] = [self.pid_of_node[m.metadata.dst_node_id] for m in msgs]
        return msgs

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Private and communication accuracy (per edge, per receiver, degree-weighted; Eq. 22)."""
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
            "round %3d | private %.3f | comm (deg.-weighted) %.3f | comm (receivers) %.3f | gluing %.4f | %.1f s",
            server_round, rec["private_accuracy_mean"], rec["communication_accuracy_degree_weighted"],
            rec["communication_accuracy_mean"], rec.get("gluing_loss", float("nan")), rec["wall_seconds"],
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
        "private_accuracy_mean": _nanmean(n["private_accuracy"] for n in nodes.values()),
        "val_private_accuracy_mean": _nanmean(n["val_private_accuracy"] for n in nodes.values()),
        "low_variance_fraction_mean": _nanmean(n.get("low_variance_fraction", float("nan")) for n in nodes.values()),
    }
    for prefix, key in (("", "communication_accuracy"), ("val_", "val_communication_accuracy")):
        per_recv: dict[int, list[float]] = {}
        for e in edges:
            per_recv.setdefault(e["dst"], []).append(e[key])
        out[f"{prefix}communication_accuracy_mean"] = _nanmean(_nanmean(v) for v in per_recv.values())
        out[f"{prefix}communication_accuracy_degree_weighted"] = _nanmean(e[key] for e in edges)
    return out
