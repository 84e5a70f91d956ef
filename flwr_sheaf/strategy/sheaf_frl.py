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
from .graph import GraphStrategy, nanmean

__all__ = ["SheafFRL", "ABSENT_POLICIES"]

log = logging.getLogger("flwr_sheaf")
ABSENT_POLICIES = ("cached", "drop")


class SheafFRL(GraphStrategy):
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
        **kwargs: :class:`GraphStrategy` / :class:`PeerStrategy` options (evaluate_every, num_rounds,
            fraction_train, participation, seed, ...).

    Raises:
        ValueError: unknown absent policy; (at discovery) a graph that is not connected or names a
            missing partition-id; nodes reporting a different pilot count.
    """

    def __init__(self, num_nodes: int, graph: nx.Graph | str = "class-overlap", train_config: Mapping | None = None,
                 absent_policy: str = "cached", lambda_warmup_rounds: int = 0, action: str = "sheaf", **kwargs) -> None:
        super().__init__(num_nodes=num_nodes, graph=graph, action=action, **kwargs)
        if absent_policy not in ABSENT_POLICIES:
            raise ValueError(f"absent policy must be one of {ABSENT_POLICIES}, got {absent_policy!r}")
        self.train_config = dict(train_config or {})
        self.absent_policy = absent_policy
        self.lambda_warmup_rounds = int(lambda_warmup_rounds)
        self.bank: dict[int, np.ndarray] = {}
        self.bank_round: dict[int, int] = {}
        self._train_metrics: dict = {}

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
            "ce": nanmean(ce), "gluing_loss": nanmean(glue), "lambda": self.lam(server_round),
            "num_trained": len(ce), "pilot_age_mean": nanmean(ages), "pilot_age_max": max(ages) if ages else 0,
        }
        self._round.update(self._train_metrics)
        return None, MetricRecord({k: float(v) for k, v in self._train_metrics.items()})
