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

Pilot selection (paper App. B, run-config ``pilot-strategy``; docs/variants.md): the strategy holds
every node's full pilot matrix ``(M, d_j)`` and each round decides one
:class:`~flwr_sheaf.sheaf.pilots.PilotSelection` (:class:`~flwr_sheaf.sheaf.pilots.PilotSampler`:
from ``(seed, server round)``; ``adaptive`` from the per-pilot mismatch of the matrices it holds). Every
trained node gets the same selection (record ``pilot-selection``, its digest in the config) and its
neighbours' matrices reduced by it, so a cached matrix from an older round is reduced with *this*
round's indices: rows always correspond. A reply echoing another digest is refused (recorded failure).
``*-class`` / ``*-cluster`` need the pilots' labels / public features: the first train round asks the
nodes for them (``pilot-describe``); until a node has answered, no pilots are relayed.

A round in which nobody is sampled sends no train message: every node keeps its weights and the
relay its pilots. A node with p_i = 0 never trains: its neighbours get no pilots of it.
"""

from __future__ import annotations

import logging

import networkx as nx
import numpy as np
import torch
from flwr.app import Message

from ..config import DEFAULTS, FederationConfig, LocalTrainConfig, SheafConfig
from ..protocol import (METRICS, OWN_PILOTS, PILOT_DESCRIBE, PILOT_FEATURES, PILOT_INDEX_DIGEST, PILOT_LABELS,
                        PILOT_PUBLIC, PILOT_SELECTION, PILOTS, index_digest, pack_neighbour_pilots, pack_pilot_selection)
from ..sheaf.pilots import PilotSampler, PilotSelection, apply_selection, parse_pilot_strategy, pilot_mismatch
from ..rfedags.participation import FrequencyEstimator
from .base import nanmean, record_bytes
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
        self._train_bytes = [0, 0]
        #: pilot selection (paper App. B): the parsed strategy, its sampler (built once the pilots'
        #: count and, if needed, their labels / public features are known) and this round's selection.
        self.pilot_spec = parse_pilot_strategy(self.sheaf.pilot_strategy)
        self.pilot_sampler: PilotSampler | None = None
        self.pilot_public: np.ndarray | None = None
        self.selection: PilotSelection | None = None
        self._selection_digest = 0

    def on_discovered(self) -> None:
        """:meth:`GraphStrategy.on_discovered`, then the pilot sampler when it needs no pilot description.

        Raises:
            ValueError: ``pilot-strategy``'s budget exceeds the shared pilots (named).
        """
        super().on_discovered()
        spec = self.pilot_spec
        if spec.kind != "prototype-class" and spec.k > self.num_pilots and spec.kind != "all":
            raise ValueError(f"pilot-strategy={self.sheaf.pilot_strategy!r}: budget {spec.k} exceeds the "
                             f"{self.num_pilots} shared pilots (num-pilots)")
        if spec.groups is None:
            self.pilot_sampler = PilotSampler(spec, self.num_pilots, self.seed)

    def _select(self, server_round: int) -> None:
        """This round's selection (None under ``all`` or while the pilot description is missing)."""
        self.selection, self._selection_digest = None, 0
        if self.pilot_sampler is None:
            return
        mismatch = None
        if self.pilot_spec.kind == "adaptive":
            mismatch = pilot_mismatch(self.bank, self.oriented_edges())
        self.selection = self.pilot_sampler.select(server_round, mismatch)
        if self.selection is not None:
            self._selection_digest = index_digest(self.selection.indices, self.selection.groups)

    # ------------------------------------------------------------------ train hooks
    def configure_train(self, server_round, arrays, config, grid):
        """:meth:`GraphStrategy.configure_train` after resetting this round's relay statistics (paper Alg. 1 line 3).

        Raises:
            ValueError: ``config`` names a key the strategy sends.
        """
        self.relayed, self._withheld = {}, 0
        self._select(server_round)
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        self._train_bytes = [sum(record_bytes(m.content) for m in msgs), 0]
        return msgs

    def aggregate_train(self, server_round, replies):
        """:meth:`GraphStrategy.aggregate_train`, after counting the train replies' payload bytes
        (``train_bytes_received``; with ``train_bytes_sent``: the train phase alone, evaluation excluded)."""
        replies = list(replies)
        self._train_bytes[1] = sum(record_bytes(r.content) for r in replies if r.has_content())
        return super().aggregate_train(server_round, replies)

    def method_config(self, server_round: int) -> dict:
        """:class:`SheafConfig` with this round's lambda (+ the selection digest, or the request for the
        pilots' description while the sampler waits for it)."""
        out = {**self.sheaf.to_dict(), "lambda": self.sheaf.lam_at(server_round)}
        if self.selection is not None:
            out[PILOT_INDEX_DIGEST] = self._selection_digest
        if self.pilot_spec.groups is not None and self.pilot_sampler is None:
            out[PILOT_DESCRIBE] = self.pilot_spec.groups
        return out

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """Neighbours' pilots under the absent policy, and the edges (with ``1/q_j`` weights for ``drop-reweighted``).

        Records ``(age, weight)`` per relayed edge in :attr:`relayed`; age = rounds since the
        neighbour produced the pilots (1 = the previous round). A neighbour without pilots gets weight 0.
        """
        policy = self.sheaf.absent_policy
        nbrs = sorted(self.graph.neighbors(pid))
        waiting = self.pilot_spec.kind != "all" and self.selection is None  # no description of the pilots yet
        pilots, weights = {}, []
        for j in nbrs:
            rj = self.bank_round.get(j)
            if rj is None or waiting or (policy != "cached" and rj != server_round - 1):
                self._withheld += rj is not None  # the neighbour had pilots, the policy withheld them
                weights.append(0.0)
                continue
            w = 1.0 / float(self._q_for_next[j]) if policy == "drop-reweighted" else 1.0
            pilots[j] = self._reduced(j)
            weights.append(w)
            self.relayed[(pid, j)] = (server_round - rj, w)
        edges = self.edge_config(pid, weights if policy == "drop-reweighted" else None)
        records = {PILOTS: pack_neighbour_pilots(pilots)}
        if self.selection is not None:
            records[PILOT_SELECTION] = pack_pilot_selection(self.selection.indices, self.selection.groups)
        return records, edges.to_config()

    def _reduced(self, j: int) -> np.ndarray:
        """Neighbour j's held matrix ``(M, d_j)`` reduced by this round's selection (``(rows, d_j)`` float32)."""
        if self.selection is None:
            return self.bank[j]
        return apply_selection(torch.tensor(self.bank[j]), self.selection).numpy().astype(np.float32)

    def _accept_description(self, server_round: int, pid: int, r: Message) -> bool:
        """Build the sampler from a node's pilot description (record ``pilot-public``); False (and a
        recorded failure) when it is missing, malformed, or differs from the one already accepted."""
        what = self.pilot_spec.groups
        key = PILOT_LABELS if what == "class" else PILOT_FEATURES
        rec = r.content[PILOT_PUBLIC] if PILOT_PUBLIC in r.content else None
        arr = rec[key].numpy() if rec is not None and key in rec else None
        if arr is None or arr.shape[0] != self.num_pilots:
            self.record_failure(server_round, "train", pid, f"reply lacks {PILOT_PUBLIC}/{key} with {self.num_pilots} "
                                f"rows (asked by {PILOT_DESCRIBE}={what!r})")
            return False
        if self.pilot_public is not None:
            if not np.array_equal(arr, self.pilot_public):
                self.record_failure(server_round, "train", pid, f"{PILOT_PUBLIC}/{key} differs from the other nodes'")
                return False
            return True
        self.pilot_public = arr
        labels, feats = (arr, None) if what == "class" else (None, arr)
        self.pilot_sampler = PilotSampler(self.pilot_spec, self.num_pilots, self.seed, labels=labels, features=feats)
        log.info("pilot-strategy %s: %d groups from partition-id %d's pilot description", self.sheaf.pilot_strategy,
                 self.pilot_sampler.num_groups, pid)
        return True

    def accept_train(self, server_round: int, ok: dict[int, Message]) -> tuple[dict[int, Message], dict]:
        """Validate and store the fresh pilots ``(K, d_i)``; update the arrival frequencies; relay statistics.

        A reply whose pilot matrix has the wrong shape or NaN/inf entries is that node's recorded
        failure and its cached pilots stay (docs/participation.md, s3); the frequency estimate used
        in round t+1 counts rounds 1..t-1 only (s3.3).
        """
        accepted = {}
        describe = self.pilot_spec.groups is not None and self.pilot_sampler is None
        for pid, r in ok.items():
            if self.selection is not None:
                used = r.content[METRICS].get(PILOT_INDEX_DIGEST) if PILOT_INDEX_DIGEST in r.content[METRICS] else None
                if used is None or int(used) != self._selection_digest:
                    self.record_failure(server_round, "train", pid, f"pilot index mismatch: reply metric "
                                        f"{PILOT_INDEX_DIGEST!r} = {used}, but this round's {PILOT_SELECTION!r} has "
                                        f"digest {self._selection_digest} (reply refused, cached pilots kept)")
                    continue
                del r.content[METRICS][PILOT_INDEX_DIGEST]  # checked; not a metric to average
            if describe and (self.pilot_public is None or PILOT_PUBLIC in r.content):
                if not self._accept_description(server_round, pid, r):
                    continue
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
            "train_bytes_sent": self._train_bytes[0], "train_bytes_received": self._train_bytes[1],
            "pilot_rows": self.selection.num_rows if self.selection is not None else
            (self.num_pilots if self.pilot_spec.kind == "all" else 0),
        }

    def results_extra(self) -> dict:
        """Graph, participation and evaluation extras plus the :class:`SheafConfig` in use."""
        pilots = {"strategy": self.sheaf.pilot_strategy, "normalisation": self.sheaf.pilot_normalisation,
                  "num_pilots": self.num_pilots,
                  "num_groups": self.pilot_sampler.num_groups if self.pilot_sampler is not None else 0}
        return {**super().results_extra(), "sheaf": self.sheaf.to_dict(), "pilot_selection": pilots}

