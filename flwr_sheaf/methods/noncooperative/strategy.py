"""Non-cooperative strategy with post-hoc alignment: the paper's lower bound (docs/baselines.md).

Nodes train on cross-entropy only; nothing but the config travels during training. Evaluation is
:class:`~flwr_sheaf.strategy.graph.GraphStrategy`'s with ``whitening-fit = "train"``: each node
fits its whitening on its private training latents, every edge gets a Procrustes map on the shared
pilots, and communication accuracy follows the same transport as Sheaf-FRL.
"""

from __future__ import annotations

import networkx as nx

from ...config import DEFAULTS, FederationConfig, LocalTrainConfig
from ...strategy.evaluation import GraphEvaluation
from ...strategy.graph import GraphStrategy
from . import ACTION

__all__ = ["NonCooperative"]


class NonCooperative(GraphStrategy):
    """Local training only; communication accuracy by post-hoc alignment.

    Args:
        num_nodes: agents (partition-ids ``0..num_nodes-1``).
        federation: graph (on which communication accuracy is measured), participation, evaluation period.
        train: local SGD settings.
        graph: an explicit ``networkx.Graph`` (overrides ``federation.graph``).
        action: message action (pair with
            :func:`flwr_sheaf.methods.noncooperative.client.register_noncooperative_handlers`).
        discovery_timeout: seconds to wait for SuperNodes.

    Raises:
        ValueError: as :class:`~flwr_sheaf.strategy.graph.GraphStrategy`.
    """

    def __init__(
        self,
        num_nodes: int,
        *,
        federation: FederationConfig | None = None,
        train: LocalTrainConfig | None = None,
        graph: nx.Graph | None = None,
        action: str = ACTION,
        discovery_timeout: float = DEFAULTS["discovery-timeout"],
    ) -> None:
        federation = federation or FederationConfig()
        super().__init__(
            num_nodes,
            action=action,
            federation=federation,
            train=train,
            graph=graph,
            evaluation=GraphEvaluation.posthoc(federation),
            discovery_timeout=discovery_timeout,
        )
