"""Non-cooperative strategy with post-hoc alignment: the paper's lower bound (notes/baselines.md).

Nodes train on cross-entropy only. Evaluation is :class:`~flwr_sheaf.strategy.graph.GraphStrategy`'s
with ``whitening-fit = "train"`` and a Procrustes map per edge on the shared pilots.
"""

from __future__ import annotations

from typing import Unpack

from ...strategy.evaluation import GraphEvaluation
from ...strategy.graph import GraphStrategy
from ..registry import GraphArgs, strategy_args
from . import ACTION

__all__ = ["NonCooperative"]


class NonCooperative(GraphStrategy):
    """Local training only; communication accuracy by post-hoc alignment.

    Args:
        num_nodes: agents (partition-ids ``0..num_nodes-1``).
        **common: federation (its graph is where communication accuracy is measured), train, graph,
            action (pair with :func:`~flwr_sheaf.methods.noncooperative.client.register_noncooperative_handlers`),
            discovery_timeout (:class:`~flwr_sheaf.methods.registry.GraphArgs`).

    Raises:
        ValueError: as :class:`~flwr_sheaf.strategy.graph.GraphStrategy`.
    """

    def __init__(self, num_nodes: int, **common: Unpack[GraphArgs]) -> None:
        super().__init__(num_nodes, **strategy_args(ACTION, common, GraphEvaluation.posthoc))
