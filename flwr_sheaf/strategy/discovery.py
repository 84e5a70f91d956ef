"""Discovery: map Flower's opaque node ids to partition-ids with one ``query.<action>`` round trip.

A reply that is an error, a malformed :class:`~flwr_sheaf.protocol.NodeInfo` or an agent described
as a spare (``d = 0``) is that node's failure; SuperNodes beyond the scenario stay idle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container, Mapping
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from ..hints import handler_hint, pilot_count_error
from ..protocol import (
    CONFIG,
    INFO,
    QUERY,
    EdgeConfig,
    NodeInfo,
    ProtocolError,
    message_type,
    reply_problem,
)
from ..sheaf.network import orient_edge
from ..topology import build_graph, validate_graph
from . import messaging
from .records import Node

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "Discovery",
    "build_agents_graph",
    "edge_config",
    "federation_fix",
    "oriented_edges",
    "parse_reply",
]

log = logging.getLogger("flwr_sheaf")

#: seconds between two looks at the SuperLink's registered nodes while partition-ids are missing
POLL_SECONDS = 0.5


def _first(items: list[str], n: int, sep: str) -> str:
    """The first ``n`` of ``items`` joined by ``sep`` (`` ...`` after them when there are more)."""
    return sep.join(items[:n]) + (" ..." if len(items) > n else "")


def federation_fix(num_nodes: int) -> str:
    """The ``flwr run`` option that gives the federation ``num_nodes`` SuperNodes."""
    return f'--federation-config "num-supernodes={num_nodes}"'


def parse_reply(
    r: Message | None, num_nodes: int, claimed: Container[int]
) -> tuple[NodeInfo | None, str | None]:
    """``(NodeInfo, None)`` of a usable ``query.<action>`` reply, else ``(None, why)``.

    Raises:
        RuntimeError: ``num-partitions`` < ``num_nodes``; a partition-id >= ``num_nodes`` describing
            itself as an agent (``d > 0``); or a partition-id in ``claimed``.
    """
    if r is None:
        return None, "no reply within the timeout"
    if r.has_error():
        return None, (r.error.reason or "") + handler_hint(r.error.reason)
    problem = reply_problem(r.content, {INFO: ()})
    if problem is not None:
        return None, problem
    try:
        info = NodeInfo.from_record(r.content[INFO])
    except ProtocolError as exc:
        return None, str(exc)
    if 0 < info.num_partitions < num_nodes:
        raise RuntimeError(
            f"this scenario has {num_nodes} agents but the federation has "
            f"num-partitions={info.num_partitions} SuperNodes (Flower's default local simulation has 2); "
            f"run: flwr run . --stream {federation_fix(num_nodes)} (in-process: LocalGrid(app, {num_nodes}))"
        )
    if info.partition_id >= num_nodes and info.d > 0:
        raise RuntimeError(
            f"this scenario has {num_nodes} agents but the federation has num-partitions="
            f"{info.num_partitions} SuperNodes, and partition-id {info.partition_id} describes itself "
            f"as an agent (d={info.d}, {info.num_examples} training examples): the task factory "
            f"splits the data by num-partitions, so each of the {num_nodes} agents would train on "
            f"its 1/{info.num_partitions} share; run: flwr run . --stream {federation_fix(num_nodes)}"
            f" (or let the task factory raise OutsideScenarioError for partition-id >= {num_nodes}:"
            f" the extra SuperNodes then stay idle)"
        )
    if info.partition_id in claimed:
        raise RuntimeError(
            f"partition-id {info.partition_id} reported by two nodes (node "
            f"{r.metadata.src_node_id} the second)"
        )
    return info, None


class Discovery:
    """One discovery of ``num_nodes`` agents (module docstring).

    Args:
        action: message action (``"sheaf"`` -> ``query.sheaf``).
        config: entries of every query message's config record.
        discovery_timeout: seconds to wait for enough SuperNodes to register and answer.

    Attributes:
        found: ``{partition-id: Node}`` answered so far (partition-ids >= ``num_nodes`` included).
        asked: Flower node ids queried so far.
        answered: Flower node ids whose reply came (usable or not).
        errors: ``"node <id>: <reason>"`` of the nodes whose reply could not be used.
        num_partitions: the largest ``num-partitions`` the replies reported (0: none did).
    """

    def __init__(
        self, num_nodes: int, action: str, config: Mapping[str, Any], discovery_timeout: float
    ) -> None:
        self.num_nodes = int(num_nodes)
        self.action = action
        self.config = dict(config)
        self.discovery_timeout = float(discovery_timeout)
        self.found: dict[int, Node] = {}
        self.asked: set[int] = set()
        self.answered: set[int] = set()
        self.errors: list[str] = []
        self.num_partitions = 0

    def run(self, grid: Grid, timeout: float) -> dict[int, Node]:
        """Query nodes as they register until partition-ids ``0..num_nodes-1`` all answered.

        ``timeout``: seconds per query round trip (within [1 s, what is left of the timeout]).
        Returns ``{partition-id: Node}`` for ``0..num_nodes-1``.

        Raises:
            RuntimeError: too few SuperNodes, a failed handler without spare, duplicate or (once all
                answered, or after ``discovery_timeout``) missing partition-ids; cause, fix named.
        """
        deadline = time.monotonic() + self.discovery_timeout
        while True:
            ids = list(grid.get_node_ids())
            registered = set(ids)
            new = [n for n in ids if n not in self.asked]
            if new:
                self.asked.update(new)
                msgs = [self.query(n) for n in new]
                wait = max(1.0, min(timeout, deadline - time.monotonic()))
                for r in messaging.send_and_receive(
                    grid, msgs, wait, messaging.in_flight_limit(grid)
                ):
                    self.accept(r)
                self.check_errors()
            if all(p in self.found for p in range(self.num_nodes)):
                break
            if (
                self.errors
                and registered <= self.answered
                and len(registered) >= max(self.num_nodes, self.num_partitions)
            ):  # every SuperNode there is answered: nothing more can come
                raise self.broken_error(len(registered))
            if time.monotonic() > deadline:
                raise self.timeout_error()
            time.sleep(POLL_SECONDS)
        return {p: n for p, n in self.found.items() if p < self.num_nodes}

    def query(self, node_id: int) -> Message:
        """The ``query.<action>`` message to Flower node ``node_id``."""
        return Message(
            RecordDict({CONFIG: ConfigRecord(dict(self.config))}),
            dst_node_id=node_id,
            message_type=message_type(QUERY, self.action),
        )

    def accept(self, r: Message) -> None:
        """Record one query reply: its node, or its failure in :attr:`errors` (raises: :func:`parse_reply`)."""
        self.answered.add(int(r.metadata.src_node_id))
        info, problem = parse_reply(r, self.num_nodes, self.found)
        if info is not None and info.d <= 0 and info.partition_id < self.num_nodes:
            problem = (
                f"partition-id {info.partition_id} reports d {info.d}, the description of a spare "
                f"SuperNode, but the scenario has {self.num_nodes} agents (partition-ids 0.."
                f"{self.num_nodes - 1}); that node's task factory raised OutsideScenarioError for "
                f"an agent (check its run config and zoo)"
            )
            info = None
        if info is None:
            self.errors.append(f"node {r.metadata.src_node_id}: {str(problem)[-600:]}")
            if len(self.asked) > self.num_nodes:  # a spare SuperNode can stand in
                log.warning(
                    "discovery: %s: a spare SuperNode whose query handler fails, or a broken agent "
                    "(then its partition-id stays missing and discovery fails once every "
                    "registered SuperNode has answered, naming it)",
                    self.errors[-1],
                )
            return
        self.num_partitions = max(self.num_partitions, info.num_partitions)
        self.found[info.partition_id] = Node(r.metadata.src_node_id, info)

    def check_errors(self) -> None:
        """RuntimeError when a node's reply was unusable and no spare SuperNode can stand in."""
        errors = self.errors
        if not errors or len(self.asked) > self.num_nodes:
            return
        reason = errors[0].split(": ", 1)[-1]  # "node <id>: <reason>": one reason said once
        same = [e.split(":", 1)[0] for e in errors[1:] if e.split(": ", 1)[-1] == reason]
        others = [e[:160] for e in errors[1:] if e.split(": ", 1)[-1] != reason]
        more, asked = "", len(self.asked)
        if same:
            more = f" (the same on {len(same)} more of the {asked} nodes: {_first(same, 5, ', ')})"
        if others:
            more += f" (and {len(others)} more failed otherwise: {_first(others, 3, '; ')})"
        raise RuntimeError(f"discovery failed on {errors[0]}{more}")

    def broken_error(self, registered: int) -> RuntimeError:
        """The error when all ``registered`` SuperNodes answered, some failed, partition-ids missing."""
        missing = sorted(set(range(self.num_nodes)) - set(self.found))
        errors = self.errors
        shown = _first([e[:300] for e in errors], 4, "; ")
        return RuntimeError(
            f"discovery: no SuperNode described partition-id(s) {missing} of the "
            f"{self.num_nodes} agents, and all {registered} registered SuperNodes answered "
            f"({registered - len(errors)} described themselves, {len(errors)} failed), so the "
            f"missing agent(s) are among the failed node(s): {shown}; fix that node's query handler or "
            f"task factory (the error above; its SuperNode's log) or its partition-id"
        )

    def timeout_error(self) -> RuntimeError:
        """The error after ``discovery_timeout``: too slow (the timeout to set) or too few nodes."""
        missing = sorted(set(range(self.num_nodes)) - set(self.found))
        found, timeout = len(self.found), self.discovery_timeout
        if len(self.asked) >= self.num_nodes and found and not self.errors:
            rate = found / timeout
            need = self.num_nodes / max(rate, 1e-9)
            return RuntimeError(
                f"discovery answered {found} of {self.num_nodes} nodes in "
                f"discovery-timeout={timeout:.0f} s ({rate:.1f} nodes/s; "
                f"{len(missing)} still missing, from partition-id {missing[0]}): every "
                f"SuperNode is registered and none failed, so they are slow (many nodes "
                f"on few cores: set discovery-timeout to at least {1.5 * need:.0f}, 1.5x the "
                f"{need:.0f} s this rate needs) or stuck (see those SuperNodes' logs)"
            )
        return RuntimeError(
            f"the scenario has {self.num_nodes} agents but after {timeout:.0f} s no SuperNode "
            f"answered for partition-id(s) {missing} ({len(self.asked)} registered; failed: "
            f"{self.errors}); run with {federation_fix(self.num_nodes)}"
        )


def build_agents_graph(
    spec: nx.Graph | str, nodes: Mapping[int, Node], num_nodes: int
) -> tuple[nx.Graph, int]:
    """``(graph, K)``: the validated agents' graph from ``spec`` (a spec, built with the nodes'
    class sets, or a ``networkx.Graph``) and the shared pilot count K of ``nodes``.

    Raises:
        ValueError: a graph not connected or naming a missing partition-id; different pilots.
    """
    classes = [nodes[p].info.classes for p in range(num_nodes)]
    try:
        graph = build_graph(spec, num_nodes, class_sets=classes) if isinstance(spec, str) else spec
        validate_graph(graph, range(num_nodes))
    except ValueError as exc:
        name = f"graph={spec!r}" if isinstance(spec, str) else "graph (networkx.Graph)"
        raise ValueError(
            f"{name} on {num_nodes} nodes: {exc} (for a few nodes use 'ring' or "
            f"'class-overlap:<density>')"
        ) from None
    ks = {n.info.num_pilots for n in nodes.values()}
    if len(ks) > 1:
        raise ValueError(pilot_count_error({p: n.info.num_pilots for p, n in nodes.items()}))
    groups: dict[int, list[int]] = {}
    for p in sorted(nodes):
        if nodes[p].info.pilot_digest:
            groups.setdefault(nodes[p].info.pilot_digest, []).append(p)
    if len(groups) > 1:
        parts = sorted(groups.values(), key=len, reverse=True)
        raise ValueError(
            f"nodes hold different pilots (partition-ids {parts[0]} agree; {parts[1:]} differ): the "
            f"pilots must be the same samples in the same order on every node (same dataset, seed, "
            f"shift and num-pilots)"
        )
    return graph, ks.pop()


def oriented_edges(graph: nx.Graph, nodes: Mapping[int, Node]) -> list[tuple[int, int]]:
    """All edges of ``graph`` as sorted (head, tail) pairs (larger d is head; ties: larger partition-id)."""
    return sorted(orient_edge(a, nodes[a].d, b, nodes[b].d) for a, b in graph.edges)


def edge_config(
    graph: nx.Graph, nodes: Mapping[int, Node], pid: int, weights: list[float] | None = None
) -> EdgeConfig:
    """Node ``pid``'s incident edges (neighbours sorted) with their d_j, orientation and optional weights."""
    nbrs = tuple(sorted(graph.neighbors(pid)))
    dims = tuple(nodes[j].d for j in nbrs)
    heads = tuple(orient_edge(pid, nodes[pid].d, j, dj)[0] == pid for j, dj in zip(nbrs, dims))
    return EdgeConfig(nbrs, dims, heads, None if weights is None else tuple(weights))
