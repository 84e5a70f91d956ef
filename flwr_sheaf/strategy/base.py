"""Shared base of the peer strategies: discovery, sampling, per-round bookkeeping.

Every method in flwr-sheaf (Sheaf-FRL, FedProto, FedSAF, non-cooperative, RFedAGS) needs the
same server-side plumbing on Flower's Message API, so it lives here once:

- **discovery** (design.md s4.1): a ``query.<action>`` round trip maps Flower's opaque node ids
  to partition-ids and collects what each node reports (stalk dimension ``d``, class set);
- **sampling**: Flower-style ``fraction_train`` (uniform, seeded) or per-node Bernoulli(p_i)
  participation (Flower's own sampling is uniform, so arbitrary participation is simulated here);
- **bookkeeping**: replies split into ok / failed / missing by partition-id, bytes on the wire,
  wall time, one ``history`` entry per server round.

It knows nothing of CNNs or of the sheaf maths.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

__all__ = ["NodeInfo", "PeerStrategy", "record_bytes"]

log = logging.getLogger("flwr_sheaf")


def record_bytes(content: RecordDict) -> int:
    """Payload size of a RecordDict in bytes: arrays' buffers plus metric/config values (8 B each).

    This counts what the protocol sends (pilot matrices, latents, metrics), not Flower's framing.
    """
    total = 0
    for rec in content.values():
        if isinstance(rec, ArrayRecord):
            total += rec.count_bytes()
        else:
            for v in rec.values():
                if isinstance(v, (bytes, str)):
                    total += len(v)
                elif isinstance(v, list):
                    total += 8 * len(v)
                else:
                    total += 8
    return total


@dataclass
class NodeInfo:
    """What discovery learned about one node.

    Attributes:
        node_id: Flower's node id (opaque 64-bit integer).
        partition_id: the node's partition-id (its index in the scenario).
        d: stalk (latent) dimension d_i reported by the node.
        classes: target class set C_i reported by the node (may be empty if unknown).
        num_partitions: total partitions the node believes exist (``node_config``).
    """

    node_id: int
    partition_id: int
    d: int
    classes: tuple[int, ...] = ()
    num_partitions: int = 0
    extra: dict = field(default_factory=dict)


class PeerStrategy(Strategy):
    """Base for strategies that address nodes by partition-id (no global model is required).

    Args:
        num_nodes: how many partition-ids the scenario has (graph nodes); discovery waits for
            this many SuperNodes and fails with a clear error if fewer exist.
        action: message action name, e.g. ``"sheaf"`` -> ``query.sheaf``/``train.sheaf``.
        fraction_train: fraction of nodes sampled per server round (uniform, seeded), as FedAvg.
        participation: optional per-partition Bernoulli probabilities p_i (overrides
            ``fraction_train``; arbitrary participation as in RFedAGS). p_i = 0 is allowed.
        min_train_nodes: lower bound on sampled nodes under ``fraction_train``.
        seed: seed of the sampling RNG.
        discovery_timeout: seconds to wait for SuperNodes to register.

    Raises:
        ValueError: on invalid fractions/probabilities (the value is named).
    """

    def __init__(
        self,
        num_nodes: int,
        action: str,
        fraction_train: float = 1.0,
        participation: Mapping[int, float] | Sequence[float] | None = None,
        min_train_nodes: int = 1,
        seed: int = 0,
        discovery_timeout: float = 300.0,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction-train must be in (0, 1], got {fraction_train}")
        if participation is not None:
            items = participation.items() if isinstance(participation, Mapping) else enumerate(participation)
            participation = {int(k): float(v) for k, v in items}
            bad = {k: v for k, v in participation.items() if not 0.0 <= v <= 1.0}
            if bad:
                raise ValueError(f"participation probabilities must be in [0, 1], got {bad}")
        self.num_nodes = num_nodes
        self.action = action
        self.fraction_train = fraction_train
        self.participation = participation
        self.min_train_nodes = min_train_nodes
        self.rng = random.Random(seed)
        self.discovery_timeout = discovery_timeout
        self.nodes: dict[int, NodeInfo] = {}
        self.pid_of_node: dict[int, int] = {}
        self.history: list[dict] = []
        self.failures: list[dict] = []
        self._round: dict = {}
        self._t0: float | None = None

    # ------------------------------------------------------------------ discovery
    def discovery_content(self) -> RecordDict:
        """Content of the discovery query (subclasses may add a config)."""
        return RecordDict({"config": ConfigRecord({"action": self.action})})

    def ensure_discovered(self, grid: Grid) -> None:
        """Map node ids to partition-ids once (``query.<action>``), waiting for SuperNodes.

        Raises:
            RuntimeError: fewer SuperNodes than graph nodes (after waiting, or as reported by the
                nodes' ``num-partitions``), duplicate or out-of-range partition-ids, or a node
                whose discovery handler failed.
        """
        if len(self.nodes) == self.num_nodes:
            return
        deadline = time.monotonic() + self.discovery_timeout
        node_ids = list(grid.get_node_ids())
        while len(node_ids) < self.num_nodes and time.monotonic() < deadline:
            time.sleep(1.0)
            node_ids = list(grid.get_node_ids())
        if len(node_ids) < self.num_nodes:
            raise RuntimeError(
                f"the scenario has {self.num_nodes} graph nodes but only {len(node_ids)} SuperNodes "
                f"registered within {self.discovery_timeout:.0f} s; run with "
                f"--federation-config \"num-supernodes={self.num_nodes}\""
            )
        msgs = [
            Message(self.discovery_content(), dst_node_id=n, message_type=f"query.{self.action}")
            for n in node_ids
        ]
        replies = list(grid.send_and_receive(msgs, timeout=self.discovery_timeout))
        nodes: dict[int, NodeInfo] = {}
        for r in replies:
            if r.has_error():
                raise RuntimeError(f"discovery failed on node {r.metadata.src_node_id}: {r.error.reason}")
            m = r.content["info"]
            pid = int(m["partition-id"])
            nparts = int(m["num-partitions"])
            if nparts < self.num_nodes:
                raise RuntimeError(
                    f"the scenario has {self.num_nodes} graph nodes but the SuperNodes report "
                    f"num-partitions={nparts}; run with --federation-config \"num-supernodes={self.num_nodes}\""
                )
            if pid in nodes:
                raise RuntimeError(f"partition-id {pid} reported by two nodes")
            extra = {k: v for k, v in m.items() if k not in ("partition-id", "num-partitions", "d", "classes")}
            nodes[pid] = NodeInfo(
                node_id=r.metadata.src_node_id,
                partition_id=pid,
                d=int(m.get("d", 0)),
                classes=tuple(int(c) for c in m.get("classes", [])),
                num_partitions=nparts,
                extra=extra,
            )
        missing = sorted(set(range(self.num_nodes)) - set(nodes))
        if missing:
            raise RuntimeError(f"no SuperNode answered for partition-id(s) {missing}")
        # Extra SuperNodes (partition-id >= num_nodes) are left idle.
        self.nodes = {p: n for p, n in nodes.items() if p < self.num_nodes}
        self.pid_of_node = {n.node_id: p for p, n in self.nodes.items()}
        self.on_discovered()

    def on_discovered(self) -> None:
        """Hook run once after discovery (validate the graph, orient edges, ...)."""

    # ------------------------------------------------------------------ sampling
    def sample(self, server_round: int) -> list[int]:
        """Partition-ids that train in this server round (sorted).

        Bernoulli(p_i) per node when ``participation`` is set (possibly empty), else
        ``max(min_train_nodes, int(N * fraction_train))`` nodes uniformly without replacement.
        """
        pids = sorted(self.nodes)
        if self.participation is not None:
            return [p for p in pids if self.rng.random() < self.participation.get(p, 0.0)]
        n = max(min(self.min_train_nodes, len(pids)), int(len(pids) * self.fraction_train))
        return sorted(self.rng.sample(pids, n))

    # ------------------------------------------------------------------ messages
    def message(self, pid: int, content: RecordDict, category: str, server_round: int, action: str | None = None) -> Message:
        """Instruction message to partition ``pid``; its payload bytes count as sent."""
        self._round["bytes_sent"] = self._round.get("bytes_sent", 0) + record_bytes(content)
        return Message(
            content,
            dst_node_id=self.nodes[pid].node_id,
            message_type=f"{category}.{action or self.action}",
            group_id=str(server_round),
        )

    def split_replies(self, server_round: int, phase: str, replies: Iterable[Message], expected: Iterable[int]) -> dict[int, Message]:
        """Sort replies into ok (returned, keyed by partition-id), failed and missing (recorded).

        Failed and missing nodes are logged and kept in ``self.failures``; their previous state
        (cached pilots, prototypes) stays untouched.
        """
        ok: dict[int, Message] = {}
        for r in replies:
            pid = self.pid_of_node.get(r.metadata.src_node_id)
            if pid is None:
                continue
            if r.has_error():
                self.failures.append({"round": server_round, "phase": phase, "partition-id": pid, "reason": r.error.reason[-500:]})
                log.warning("round %d %s: partition-id %d failed: %s", server_round, phase, pid, r.error.reason[-300:])
                continue
            self._round["bytes_received"] = self._round.get("bytes_received", 0) + record_bytes(r.content)
            ok[pid] = r
        for pid in sorted(set(expected) - set(ok)):
            if not any(f["round"] == server_round and f["phase"] == phase and f["partition-id"] == pid for f in self.failures):
                self.failures.append({"round": server_round, "phase": phase, "partition-id": pid, "reason": "no reply"})
        self._round.setdefault("failed", {})[phase] = sorted(set(expected) - set(ok))
        return ok

    # ------------------------------------------------------------------ bookkeeping
    def begin_round(self, server_round: int) -> None:
        """Start the per-round record (called from ``configure_train``)."""
        if self._t0 is None:
            self._t0 = time.monotonic()
        self._round = {"round": server_round, "bytes_sent": 0, "bytes_received": 0, "_start": time.monotonic()}

    def end_round(self, **metrics) -> dict:
        """Close the per-round record (called from ``aggregate_evaluate``) and append it to history."""
        rec = dict(self._round)
        start = rec.pop("_start", time.monotonic())
        rec.update(metrics)
        rec["wall_seconds"] = time.monotonic() - start
        rec["elapsed_seconds"] = time.monotonic() - (self._t0 or start)
        self.history.append(rec)
        return rec

    def summary(self) -> None:  # noqa: D102 - Strategy API
        log.info("%s: %d nodes, action %r", type(self).__name__, self.num_nodes, self.action)
