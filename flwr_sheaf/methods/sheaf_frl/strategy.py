"""Sheaf-FRL peer-routing strategy: relays each node only its graph neighbours' pilots (paper Alg. 1).

No global model: per round each sampled node gets its neighbours' latest whitened pilots
``(K, d_j)``, its incident edges and this round's lambda. Absent neighbours: notes/participation.md,
s3; pilot selection: notes/variants-pilots.md; variants and stringent privacy:
notes/variants-privacy.md.
"""

from __future__ import annotations

import logging
from typing import Unpack

import numpy as np
from flwr.app import Message

from ...participation import FrequencyEstimator
from ...protocol import METRICS, SEED
from ...sheaf.network import orient_edge
from ...sheaf.variants import edge_dim, receiver_sends_raw, resolve_variant
from ...strategy.discovery import edge_config, oriented_edges
from ...strategy.evaluation import GraphEvaluation, TransportedEvaluation
from ...strategy.graph import GraphStrategy
from ...strategy.records import nanmean, record_bytes
from ..registry import GraphArgs, strategy_args
from . import ACTION
from .config import SheafConfig
from .protocol import (
    PILOT_DESCRIBE,
    PILOT_INDEX_DIGEST,
    PILOT_PUBLIC,
    PILOT_SELECTION,
    PILOTS,
    SVDS,
    TRANSPORTED,
    pack_neighbour_pilots,
    pack_pilot_selection,
)
from .selection import PilotSelector, upload_problem

__all__ = ["SheafFRL"]

log = logging.getLogger("flwr_sheaf")


class SheafFRL(GraphStrategy):
    """Sheaf-FRL relay strategy (paper Alg. 1 over Flower messages; module docstring).

    Args:
        sheaf: lambda, warm-up, pilot batch, absent-neighbour policy and its q floor.
        **common: federation, train, graph, action (pair with
            :func:`~flwr_sheaf.methods.sheaf_frl.client.register_sheaf_handlers`), discovery_timeout
            (:class:`~flwr_sheaf.methods.registry.GraphArgs`).

    Raises:
        ValueError: bad config values (named); (at discovery) a disconnected graph, a graph naming
            a missing partition-id, nodes with different pilot counts.
    """

    def __init__(
        self,
        num_nodes: int,
        *,
        sheaf: SheafConfig | None = None,
        **common: Unpack[GraphArgs],
    ) -> None:
        sheaf = sheaf or SheafConfig()
        # stringent privacy: evaluation arrays transported by each node's own map
        evaluation = TransportedEvaluation if sheaf.privacy == "stringent" else GraphEvaluation
        super().__init__(num_nodes, **strategy_args(ACTION, common, evaluation))
        self.sheaf = sheaf
        self.bank: dict[int, np.ndarray] = {}
        self.bank_round: dict[int, int] = {}
        #: arrival frequency of each node's pilots (``drop-reweighted``; the plain ``c/t`` estimate of
        #: notes/participation.md, s3.3); round t uses the estimate of round t-1.
        self.frequency = FrequencyEstimator(
            num_nodes, q_min=self.sheaf.reweight_q_min, estimator="empirical"
        )
        self._q_for_next = self.frequency.estimate()
        #: ``{(receiver i, neighbour j): (age, weight)}`` of the pilots relayed in the last train round.
        self.relayed: dict[tuple[int, int], tuple[int, float]] = {}
        self._withheld = 0
        #: the resolved ``sheaf-variant`` (set at discovery).
        self.variant: str | None = None
        #: ``{(sender j, receiver i): (K, d_e)}`` transported pilots j produced for i, and the round.
        self.edge_bank: dict[tuple[int, int], np.ndarray] = {}
        self.edge_bank_round: dict[tuple[int, int], int] = {}
        self._relayed_bytes = 0
        self._train_bytes = [0, 0]
        #: pilot selection (paper App. B)
        self.pilots = PilotSelector(self.sheaf.pilot_strategy, self.seed)

    def configure_train(self, server_round, arrays, config, grid):
        """:meth:`GraphStrategy.configure_train` (its Raises) after resetting the relay statistics (Alg. 1 line 3)."""
        self.relayed, self._withheld, self._relayed_bytes = {}, 0, 0
        adaptive = self.pilots.spec.kind == "adaptive"
        edges = oriented_edges(self.graph, self.nodes) if adaptive and self.graph else []
        self.pilots.select(server_round, self.bank, edges)
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        self.pilots.end_messages()
        self._train_bytes = [sum(record_bytes(m.content) for m in msgs), 0]
        return msgs

    def aggregate_train(self, server_round, replies):
        """:meth:`GraphStrategy.aggregate_train`, after counting the train replies' bytes (``train_bytes_received``)."""
        replies = list(replies)
        self._train_bytes[1] = sum(record_bytes(r.content) for r in replies if r.has_content())
        return super().aggregate_train(server_round, replies)

    def on_discovered(self) -> None:
        """:meth:`GraphStrategy.on_discovered`, then resolve ``sheaf-variant`` from the d_i and build the
        pilot sampler when it needs no pilot description. ``adaptive:K`` needs the raw pilots (Alg. 1):
        with it ``sheaf-variant = auto`` resolves to ``heterogeneous``.

        Raises:
            ValueError: (besides the graph's) ``sheaf-variant='homogeneous'`` with unequal d_i;
                ``pilot-strategy``'s budget exceeds the pilots; ``adaptive`` with
                ``privacy='stringent'`` or ``sheaf-variant='homogeneous'``.
        """
        super().on_discovered()
        spec = self.pilots.spec
        variant = self.sheaf.sheaf_variant
        if spec.kind == "adaptive":
            if self.sheaf.privacy == "stringent" or variant == "homogeneous":
                bad = (
                    "privacy='stringent'"
                    if self.sheaf.privacy == "stringent"
                    else "sheaf-variant='homogeneous'"
                )
                raise ValueError(
                    f"pilot-strategy={self.sheaf.pilot_strategy!r} ranks pilots by the raw pilot matrices "
                    f"the strategy holds, which {bad} never sends: use another pilot-strategy"
                )
            variant = "heterogeneous" if variant == "auto" else variant
        self.variant = resolve_variant(variant, {p: n.d for p, n in self.nodes.items()})
        log.info(
            "Sheaf-FRL variant %s, privacy %s, pilot-strategy %s",
            self.variant,
            self.sheaf.privacy,
            self.sheaf.pilot_strategy,
        )
        self.pilots.on_discovered(self.num_pilots)

    def method_config(self, server_round: int) -> dict:
        """:class:`SheafConfig` with this round's lambda and the resolved variant (+ the selection
        digest, or the request for the pilots' description).
        """
        out = {
            **self.sheaf.to_dict(),
            "lambda": self.sheaf.lam_at(server_round),
            "sheaf-variant": self.variant,
        }
        if self.pilots.selection is not None:
            out[PILOT_INDEX_DIGEST] = self.pilots.digest
        if self.pilots.asks_description:
            out[PILOT_DESCRIBE] = self.pilots.spec.groups
        return out

    def _is_head(self, a: int, b: int) -> bool:
        return orient_edge(a, self.nodes[a].d, b, self.nodes[b].d)[0] == a

    def _sends_raw(self, sender: int, receiver: int) -> bool:
        assert self.variant is not None, "the variant is resolved in on_discovered"
        return receiver_sends_raw(self.variant, self.sheaf.privacy, self._is_head(sender, receiver))

    def _width(self, sender: int, receiver: int) -> int:
        """Width of what ``sender`` sends toward ``receiver``: d_sender, or d_e under stringent privacy."""
        d_s, d_r = self.nodes[sender].d, self.nodes[receiver].d
        return edge_dim(d_s, d_r) if self.sheaf.privacy == "stringent" else d_s

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """What each neighbour sent toward ``pid`` under the absent policy (raw pilots in ``pilots``,
        transported in ``transported``; no ``pilots`` record under stringent privacy) and the edges (with
        ``1/q_j`` weights for ``drop-reweighted``). Records ``(age, weight)`` per relayed edge in
        :attr:`relayed` (age 1 = the previous round).
        """
        policy = self.sheaf.absent_policy
        assert self.graph is not None  # built in on_discovered
        nbrs = sorted(self.graph.neighbors(pid))
        waiting = self.pilots.waiting  # no description of the pilots yet
        raw: dict[int, np.ndarray]
        moved: dict[int, np.ndarray]
        raw, moved, weights = {}, {}, []
        for j in nbrs:
            is_raw = self._sends_raw(j, pid)
            arr = self.bank.get(j) if is_raw else self.edge_bank.get((j, pid))
            rj = self.bank_round.get(j) if is_raw else self.edge_bank_round.get((j, pid))
            if arr is None or waiting or (policy != "cached" and rj != server_round - 1):
                # the neighbour had pilots, the policy withheld them
                self._withheld += arr is not None
                weights.append(0.0)
                continue
            w = 1.0 / float(self._q_for_next[j]) if policy == "drop-reweighted" else 1.0
            arr = self.pilots.reduced(arr)
            (raw if is_raw else moved)[j] = arr
            self._relayed_bytes += int(arr.nbytes)
            weights.append(w)
            assert rj is not None  # held with arr
            self.relayed[(pid, j)] = (server_round - rj, w)
        edges = edge_config(
            self.graph, self.nodes, pid, weights if policy == "drop-reweighted" else None
        )
        records = {} if self.sheaf.privacy == "stringent" else {PILOTS: pack_neighbour_pilots(raw)}
        if moved or self.sheaf.privacy == "stringent":
            records[TRANSPORTED] = pack_neighbour_pilots(moved)
        selection = self.pilots.selection
        if selection is not None:
            records[PILOT_SELECTION] = pack_pilot_selection(selection.indices, selection.groups)
        return records, edges.to_config()

    def _check_upload(
        self, pid: int, r: Message
    ) -> tuple[str | None, np.ndarray | None, dict[int, np.ndarray]]:
        """``(problem or None, raw pilots or None, {receiver j: transported})`` of one train reply."""
        assert self.graph is not None  # built in on_discovered
        nbrs = sorted(self.graph.neighbors(pid))
        want_raw = any(self._sends_raw(pid, j) for j in nbrs) or (
            not nbrs and self.sheaf.privacy == "standard"
        )
        want_moved = {j: self._width(pid, j) for j in nbrs if not self._sends_raw(pid, j)}
        stringent = self.sheaf.privacy == "stringent"
        return upload_problem(
            r, self.num_pilots, self.nodes[pid].d, want_raw, want_moved, stringent
        )

    def _accept_description(self, server_round: int, pid: int, r: Message) -> bool:
        """Build the sampler from a node's pilot description; False (a recorded failure) when it is bad."""
        why, built = self.pilots.description_problem(r, self.num_pilots)
        if why is not None:
            self.record_failure(server_round, "train", pid, why)
            return False
        if built:
            assert self.pilots.sampler is not None  # built from this description
            log.info(
                "pilot-strategy %s: %d groups from partition-id %d's pilot description",
                self.sheaf.pilot_strategy,
                self.pilots.sampler.num_groups,
                pid,
            )
        return True

    def accept_train(
        self, server_round: int, ok: dict[int, Message]
    ) -> tuple[dict[int, Message], dict]:
        """Validate and store the fresh pilots ``(K, d_i)`` (a bad matrix: that node's failure, its
        cached pilots stay); update the arrival frequencies (notes/participation.md, s3.3); relay statistics.
        """
        accepted = {}
        up = {"raw": 0, "to_heads": 0, "to_tails": 0}
        svds = 0
        describe = self.pilots.asks_description
        for pid, r in ok.items():
            why = self.pilots.digest_problem(r)  # removes the checked digest metric from the reply
            if why is not None:
                self.record_failure(server_round, "train", pid, why)
                continue
            if describe and (self.pilots.public is None or PILOT_PUBLIC in r.content):
                if not self._accept_description(server_round, pid, r):
                    continue
            why, a, moved = self._check_upload(pid, r)
            if why is not None:
                self.record_failure(server_round, "train", pid, why)
                continue
            if a is not None:
                self.bank[pid] = a
                up["raw"] += int(a.nbytes)
            self.bank_round[pid] = server_round
            for j, m in moved.items():
                self.edge_bank[(pid, j)], self.edge_bank_round[(pid, j)] = m, server_round
                up["to_tails" if self._is_head(pid, j) else "to_heads"] += int(m.nbytes)
            v = r.content[METRICS][SVDS] if SVDS in r.content[METRICS] else 0
            svds += int(v) if isinstance(v, (int, float)) and np.isfinite(v) else 0
            accepted[pid] = r
        arrived = np.zeros(self.num_nodes, dtype=bool)
        arrived[list(accepted)] = True
        self._q_for_next = self.frequency.estimate()
        self.frequency.observe(arrived)
        ages = [server_round - r for r in self.bank_round.values()]
        relayed_ages = [a for a, _ in self.relayed.values()]
        ws = [w for _, w in self.relayed.values()]
        return accepted, {
            "lambda": self.sheaf.lam_at(server_round),
            "pilot_age_mean": nanmean(ages),
            "pilot_age_max": max(ages) if ages else 0,
            "never_trained": self.num_nodes - len(self.bank_round),
            "edges_relayed": len(self.relayed),
            "edges_dropped": self._withheld,
            "relayed_pilot_age_mean": nanmean(relayed_ages),
            "relayed_pilot_age_max": max(relayed_ages) if relayed_ages else 0,
            "edge_weight_mean": nanmean(ws),
            "edge_weight_max": max(ws) if ws else float("nan"),
            "pilot_bytes_raw_up": up["raw"],
            "pilot_bytes_to_heads_up": up["to_heads"],
            "pilot_bytes_to_tails_up": up["to_tails"],
            "pilot_bytes_up": sum(up.values()),
            "pilot_bytes_relayed": self._relayed_bytes,
            "svds_total": svds,
            "train_bytes_sent": self._train_bytes[0],
            "train_bytes_received": self._train_bytes[1],
            "pilot_rows": self.pilots.rows(self.num_pilots),
        }

    def results_extra(self) -> dict:
        """GraphStrategy's extras plus the :class:`SheafConfig` (and resolved variant) and the pilot selection."""
        pilots = {
            "strategy": self.sheaf.pilot_strategy,
            "normalisation": self.sheaf.pilot_normalisation,
            "num_pilots": self.num_pilots,
            "num_groups": self.pilots.sampler.num_groups if self.pilots.sampler is not None else 0,
        }
        return {
            **super().results_extra(),
            "sheaf": {**self.sheaf.to_dict(), "sheaf-variant-resolved": self.variant},
            "pilot_selection": pilots,
        }

    def evaluate_node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """``privacy`` for every node; under ``stringent`` also its edges and the seed."""
        if self.sheaf.privacy != "stringent":
            return {}, {"privacy": self.sheaf.privacy}
        return {}, {
            "privacy": self.sheaf.privacy,
            SEED: self.seed,
            **edge_config(self.graph, self.nodes, pid).to_config(),
        }
