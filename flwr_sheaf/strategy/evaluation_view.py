"""What an evaluated round sees of the strategy: a narrow, read-only :class:`EvaluationView` (built
per evaluated round by :func:`flwr_sheaf.strategy.graph.evaluation_view`); the evaluation never
receives the strategy itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import networkx as nx

from ..config import LocalTrainConfig
from ..protocol import EdgeConfig
from .agents import edge_config
from .exchange import Exchange
from .ledger import RunLedger
from .records import Node, RoundRecord

__all__ = ["EvaluationView"]


@dataclass(frozen=True)
class EvaluationView:
    """One evaluated round's view of the strategy (module docstring).

    Attributes:
        server_round: the evaluated round.
        nodes: the discovered nodes ``{partition-id: Node}`` (d_i = ``nodes[i].d``).
        graph: the agents' graph on partition-ids (None before discovery).
        num_nodes: N; num_pilots: the shared pilot count K (-1 before discovery).
        seed: the run's seed (diagnostics draws derive from (seed, round)).
        train: the local-training settings (``torch-threads``, ``device``).
        evaluators: this round's evaluated partition-ids (the ``fraction-evaluate`` draw).
        payload: ``(records, config entries)`` of every phase-1 message (the strategy's
            ``evaluate_payload``).
        node_payload: ``pid -> (records, config entries)`` only node ``pid`` gets in phase 1 (the
            strategy's ``evaluate_node_payload`` for this round).
        exchange: messages and checked replies (records failures in ``ledger``).
        ledger: the run's records; this round's is ``ledger.current``.
        owner: the strategy's class name (named in recorded reasons).
    """

    server_round: int
    nodes: Mapping[int, Node]
    graph: nx.Graph | None
    num_nodes: int
    num_pilots: int
    seed: int
    train: LocalTrainConfig
    evaluators: list[int]
    payload: tuple[dict, dict]
    node_payload: Callable[[int], tuple[dict, dict]]
    exchange: Exchange
    ledger: RunLedger
    owner: str

    @property
    def record(self) -> RoundRecord:
        """The evaluated round's record (``ledger.current``)."""
        return self.ledger.current

    def edge_config(self, pid: int) -> EdgeConfig:
        """Node ``pid``'s incident edges (:func:`~flwr_sheaf.strategy.agents.edge_config`)."""
        assert self.graph is not None, "the graph is built at discovery"
        return edge_config(self.graph, self.nodes, pid)

    def record_failure(self, phase: str, pid: int, reason: str) -> None:
        """Record node ``pid``'s failure in ``phase`` of this round (:meth:`RunLedger.record_failure`)."""
        self.ledger.record_failure(self.server_round, phase, pid, reason)
