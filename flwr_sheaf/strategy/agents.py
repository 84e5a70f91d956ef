"""The agents' graph on the discovered nodes (:func:`build_agents_graph`, once after discovery) and
its oriented edges (head = larger stalk dimension d, ties to the larger partition-id;
docs/reference.md). Functions of the nodes and the graph only: no state, no method.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx

from ..hints import pilot_count_error
from ..protocol import EdgeConfig
from ..sheaf.network import orient_edge
from ..topology import build_graph, validate_graph
from .records import Node

__all__ = ["build_agents_graph", "edge_config", "oriented_edges"]


def build_agents_graph(
    spec: nx.Graph | str, nodes: Mapping[int, Node], num_nodes: int
) -> tuple[nx.Graph, int]:
    """``(graph, K)``: the validated agents' graph from ``spec`` (a graph spec, built with the
    nodes' class sets, or an explicit ``networkx.Graph`` on partition-ids) and the shared pilot
    count K of the discovered ``nodes`` ``{partition-id: Node}`` (``0..num_nodes-1``).

    Raises:
        ValueError: naming ``graph``: a graph that is not connected or names a missing
            partition-id; nodes reporting different pilot counts or different pilots.
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
    d = nodes[pid].d
    heads = tuple(orient_edge(pid, d, j, nodes[j].d)[0] == pid for j in nbrs)
    return EdgeConfig(
        nbrs,
        tuple(nodes[j].d for j in nbrs),
        heads,
        None if weights is None else tuple(weights),
    )
