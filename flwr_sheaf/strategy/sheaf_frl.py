"""Sheaf-FRL peer-routing strategy: relays each node only its graph neighbours' pilots (paper Alg. 1).

No global model exists: the server emulates decentralised exchange. Per server round:

1. ``configure_train`` (:class:`GraphStrategy`): each sampled node gets its neighbours' latest
   whitened pilot matrices ``(K, d_j)`` (record ``pilots``), its incident edges (neighbours, d_j,
   orientation; :class:`flwr_sheaf.protocol.EdgeConfig`), the local-training config and
   :class:`flwr_sheaf.config.SheafConfig` with this round's lambda (warm-up applied).
2. ``aggregate_train``: each reply's pilots are validated (shape ``(K, d_i)``, finite) and stored;
   a bad matrix is that node's recorded failure and its cached pilots stay. Pilot age is tracked.
3. Evaluation: :class:`GraphStrategy`'s two phases, whitening fitted on the pilots.

Partial participation (docs/participation.md): who trains is the shared sampler's draw. What a
sampled node gets of a neighbour j that did not train in the previous round is the
*absent-neighbour policy*:

- ``cached`` (default): j's last pilots. They are exact (j's encoder has not changed since), so
  partial participation is block-coordinate descent with the full-participation stationary points;
  their age (rounds since j produced them) is reported.
- ``drop``: only pilots produced in the previous round are relayed; the expected penalty then weights
  edge (i, j) by j's participation probability (a biased objective).
- ``drop-reweighted``: as ``drop``, with each relayed edge term scaled by ``w_ij = 1/q_j``, q_j the
  frequency with which j's pilots arrived in rounds ``1..t-2`` (floored at ``reweight-q-min``), so
  ``E[1{j present}/q_j] = 1``; the weights travel in the edge config.

A round in which nobody is sampled sends no train message: every node keeps its weights and the
relay its pilots. A node with p_i = 0 never trains: its neighbours get no pilots of it.
"""

from __future__ import annotations

import logging

import networkx as nx
import numpy as np
from flwr.app import Message

from ..config import DEFAULTS, FederationConfig, LocalTrainConfig, SheafConfig
from ..protocol import OWN_PILOTS, PILOTS, pack_neighbour_pilots
from ..rfedags.participation import FrequencyEstimator
from .base import nanmean
from .graph import GraphStrategy

__all__ = ["SheafFRL"]

log = logging.getLogger("flwr_sheaf")


class SheafFRL(GraphStrategy):
    """Sheaf-FRL relay strategy (paper Alg. 1 over Flower messages; module docstring).

    Args:
        num_nodes: agents (partition-ids ``0..num_nodes-1``).
        federation: graph spec, participation (fraction or Bernoulli), evaluation period, seed.
        train: local SGD settings of every node.
        sheaf: lambda, warm-up, pilot batch, absent-neighbour policy and its q floor.
        graph: an explicit ``networkx.Graph`` on partition-ids (overrides ``federation.graph``).
        action: message action (pair with :func:`flwr_sheaf.client.sheaf.register_sheaf_handlers`).
        discovery_timeout: seconds to wait for SuperNodes.

    Every config defaults to :mod:`flwr_sheaf.config`'s defaults.

    Raises:
        ValueError: bad config values (named); (at discovery) a disconnected graph, a graph naming
            a missing partition-id, nodes with different pilot counts.
    """

    def __init__(self, num_nodes: int, *, federation: FederationConfig | None = None,
                 train: LocalTrainConfig | None = None, sheaf: SheafConfig | None = None,
                 graph: nx.Graph | None = None, action: str = "sheaf", discovery_timeout: float = DEFAULTS["discovery-timeout"]) -> None:
        super().__init__(num_nodes, action=action, federation=federation or FederationConfig(),
                         train=train or LocalTrainConfig(), graph=graph, discovery_timeout=discovery_timeout)
        self.sheaf = sheaf or SheafConfig()
        self.bank: dict[int, np.ndarray] = {}
        self.bank_round: dict[int, int] = {}
        #: arrival frequency of each node's pilots (``drop-reweighted``); the estimate used in round t
        #: is computed in round t-1 before observing it.
        #: (the plain ``c/t`` estimate of docs/participation.md, s3.3, not RFedAGS's Laplace default)
        self.frequency = FrequencyEstimator(num_nodes, q_min=self.sheaf.reweight_q_min, estimator="empirical")
        self._q_for_next = self.frequency.estimate()
        #: ``{(receiver i, neighbour j): (age, weight)}`` of the pilots relayed in the last train round.
        self.relayed: dict[tuple[int, int], tuple[int, float]] = {}
        self._withheld = 0

    # ------------------------------------------------------------------ train hooks
    def configure_train(self, server_round, arrays, config, grid):
        """:meth:`GraphStrategy.configure_train` after resetting this round's relay statistics (paper Alg. 1 line 3).

        Raises:
            ValueError: ``config`` names a key the strategy sends.
        """
        self.relayed, self._withheld = {}, 0
        return super().configure_train(server_round, arrays, config, grid)

    def method_config(self, server_round: int) -> dict:
        """:class:`SheafConfig` with this round's lambda."""
        return {**self.sheaf.to_dict(), "lambda": self.sheaf.lam_at(server_round)}

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """Neighbours' pilots under the absent policy, and the edges (with ``1/q_j`` weights for ``drop-reweighted``).

        Records ``(age, weight)`` per relayed edge in :attr:`relayed`; age = rounds since the
        neighbour produced the pilots (1 = the previous round). A neighbour without pilots gets weight 0.
        """
        policy = self.sheaf.absent_policy
        nbrs = sorted(self.graph.neighbors(pid))
        pilots, weights = {}, []
        for j in nbrs:
            rj = self.bank_round.get(j)
            if rj is None or (policy != "cached" and rj != server_round - 1):
                self._withheld += rj is not None  # the neighbour had pilots, the policy withheld them
                weights.append(0.0)
                continue
            w = 1.0 / float(self._q_for_next[j]) if policy == "drop-reweighted" else 1.0
            pilots[j] = self.bank[j]
            weights.append(w)
            self.relayed[(pid, j)] = (server_round - rj, w)
        edges = self.edge_config(pid, weights if policy == "drop-reweighted" else None)
        return {PILOTS: pack_neighbour_pilots(pilots)}, edges.to_config()

    def accept_train(self, server_round: int, ok: dict[int, Message]) -> tuple[dict[int, Message], dict]:
        """Validate and store the fresh pilots ``(K, d_i)``; update the arrival frequencies; relay statistics.

        A reply whose pilot matrix has the wrong shape or NaN/inf entries is that node's recorded
        failure and its cached pilots stay (docs/participation.md, s3); the frequency estimate used
        in round t+1 counts rounds 1..t-1 only (s3.3).
        """
        accepted = {}
        for pid, r in ok.items():
            a = r.content[PILOTS][OWN_PILOTS].numpy() if PILOTS in r.content and OWN_PILOTS in r.content[PILOTS] else None
            d = self.nodes[pid].d
            if a is None or a.shape != (self.num_pilots, d):
                shape = None if a is None else a.shape
                self.record_failure(server_round, "train", pid, f"pilot matrix shape {shape}, expected ({self.num_pilots}, {d})")
                continue
            if not np.isfinite(a).all():
                self.record_failure(server_round, "train", pid, "NaN/inf pilots (cached pilots kept)")
                continue
            self.bank[pid], self.bank_round[pid] = a, server_round
            accepted[pid] = r
        arrived = np.zeros(self.num_nodes, dtype=bool)
        arrived[list(accepted)] = True
        self._q_for_next = self.frequency.estimate()  # rounds 1..t-1: independent of round t's arrivals
        self.frequency.observe(arrived)
        ages = [server_round - r for r in self.bank_round.values()]
        relayed_ages = [a for a, _ in self.relayed.values()]
        ws = [w for _, w in self.relayed.values()]
        return accepted, {
            "lambda": self.sheaf.lam_at(server_round),
            "pilot_age_mean": nanmean(ages), "pilot_age_max": max(ages) if ages else 0,
            "never_trained": self.num_nodes - len(self.bank_round),
            "edges_relayed": len(self.relayed), "edges_dropped": self._withheld,
            "relayed_pilot_age_mean": nanmean(relayed_ages), "relayed_pilot_age_max": max(relayed_ages) if relayed_ages else 0,
            "edge_weight_mean": nanmean(ws), "edge_weight_max": max(ws) if ws else float("nan"),
        }

    def results_extra(self) -> dict:
        """Graph, participation and evaluation extras plus the :class:`SheafConfig` in use."""
        return {**super().results_extra(), "sheaf": self.sheaf.to_dict()}

