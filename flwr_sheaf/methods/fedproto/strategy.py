"""FedProto strategy (Tan et al., AAAI 2022; notes/baselines-prototypes.md, s3)."""

from __future__ import annotations

from typing import Any, Unpack

from flwr.app import Message

from ...config import FederationConfig, RunConfig
from ...paper import NUM_CLASSES as PAPER_NUM_CLASSES
from ...strategy.evaluation import GraphEvaluation
from ...strategy.graph import GraphStrategy
from .._shared.prototype_aggregation import PrototypeAggregator
from ..registry import GraphArgs, strategy_args
from . import ACTION
from .config import FedProtoConfig

__all__ = ["FedProto", "PROTOTYPE_HOOKS", "prototype_evaluation"]


def prototype_evaluation(federation: FederationConfig) -> GraphEvaluation:
    """The post-hoc protocol plus each node's nearest-global-prototype accuracy (FedProto, FedSAF)."""
    return GraphEvaluation.posthoc(
        federation, node_metric_names=("prototype-accuracy", "val-prototype-accuracy")
    )


def _on_discovered(s: Any) -> None:
    """Validate the graph, then resolve the common prototype dimension D (notes/baselines-prototypes.md, s3.5).

    Raises:
        ValueError: ``fedproto-dim = none`` and the nodes report different stalk dimensions.
    """
    GraphStrategy.on_discovered(s)
    s.prototypes.resolve_dim({p: n.d for p, n in s.nodes.items()}, type(s).__name__)


def _node_payload(s: Any, server_round: int, pid: int) -> tuple[dict, dict]:
    """The current global prototypes (none before the first aggregation)."""
    return s.prototypes.record(), {}


def _evaluate_payload(s: Any, server_round: int) -> tuple[dict, dict]:
    """Global prototypes and the dimension, for the nearest-prototype accuracy."""
    return s.prototypes.record(), s.prototypes.shared()


def _accept_train(
    s: Any, server_round: int, ok: dict[int, Message]
) -> tuple[dict[int, Message], dict]:
    """:meth:`PrototypeAggregator.accept`; the node's training still counts when its upload is refused."""
    return ok, s.prototypes.accept(s, server_round, ok)


#: FedProto's server hooks on a strategy holding a :class:`PrototypeAggregator` ``prototypes`` (FedSAF too)
PROTOTYPE_HOOKS = (_on_discovered, _node_payload, _evaluate_payload, _accept_train)


class FedProto(GraphStrategy):
    """FedProto on Flower messages.

    Discovery fixes the common prototype dimension D; every sampled node gets the global prototypes
    (record ``global-prototypes``); each upload is validated on its own in :attr:`prototypes`, a
    :class:`~flwr_sheaf.methods._shared.prototype_aggregation.PrototypeAggregator`. Evaluation: the
    post-hoc protocol plus each node's nearest-global-prototype accuracy.

    Args:
        num_nodes: agents.
        fedproto: prototype dimension, weight, reduction, aggregation, missing-class policy.
        num_classes: size of the label space (class ids ``0..num_classes-1``; the paper's 10).
        **common: federation, train (default: FedProto's authors', SGD lr 0.01, momentum 0.5, no
            weight decay; notes/baselines.md s0; a section passed is used as given), graph, action
            (pair with :func:`~flwr_sheaf.methods.fedproto.client.register_fedproto_handlers`),
            discovery_timeout (:class:`~flwr_sheaf.methods.registry.GraphArgs`).

    Raises:
        ValueError: bad config values (named); at discovery, ``fedproto-dim = none`` with different
            stalk dimensions (each d and its partition-ids named).
    """

    def __init__(
        self,
        num_nodes: int,
        *,
        fedproto: FedProtoConfig | None = None,
        num_classes: int = PAPER_NUM_CLASSES,
        **common: Unpack[GraphArgs],
    ) -> None:
        if common.get("train") is None:
            common["train"] = RunConfig.from_run_config({"method": "fedproto"}).train
        super().__init__(num_nodes, **strategy_args(ACTION, common, prototype_evaluation))
        self.prototypes = PrototypeAggregator(fedproto or FedProtoConfig(), num_classes)

    on_discovered, node_payload, evaluate_payload, accept_train = PROTOTYPE_HOOKS

    def method_config(self, server_round: int) -> dict:
        """FedProto's section plus the resolved dimension and the label-space size."""
        return self.prototypes.method_config()

    def results_extra(self) -> dict:
        """Prototype settings, the resolved dimension and the final global prototypes' classes."""
        return {**super().results_extra(), "prototypes": self.prototypes.describe()}
