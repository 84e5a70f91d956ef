"""FedSAF strategy: structural alignment on FedProto's global prototypes (notes/baselines-prototypes.md).

The server side is FedProto's; only the nodes' objective differs (``fedsaf.structure``: ``gcsa`` /
``rcsa``, or the coordinate ablations ``mse`` / ``cosine``). Pair with
:func:`flwr_sheaf.methods.fedsaf.client.register_fedsaf_handlers`.
"""

from __future__ import annotations

from typing import Unpack

from ...paper import NUM_CLASSES as PAPER_NUM_CLASSES
from ...strategy.graph import GraphStrategy
from .._shared.prototype_aggregation import PrototypeAggregator
from ..fedproto.config import FedProtoConfig
from ..fedproto.strategy import PROTOTYPE_HOOKS, prototype_evaluation
from ..registry import GraphArgs, strategy_args
from . import ACTION
from .config import FedSAFConfig

__all__ = ["FedSAF"]


class FedSAF(GraphStrategy):
    """FedSAF (``L_sup + lam L_proto + gamma L_inst``) over FedProto's protocol.

    Args:
        fedsaf: weights and structure; ``structure`` must be set (``gcsa``, ``rcsa``, ``mse`` or
            ``cosine``; the app's methods ``fedsaf-gcsa`` / ``fedsaf-rcsa`` fill it in).
        num_nodes: as in :class:`~flwr_sheaf.methods.fedproto.strategy.FedProto`.
        fedproto: as in :class:`~flwr_sheaf.methods.fedproto.strategy.FedProto`.
        num_classes: as in :class:`~flwr_sheaf.methods.fedproto.strategy.FedProto`.
        **common: federation, train, graph, action (default ``"fedsaf"``), discovery_timeout
            (:class:`~flwr_sheaf.methods.registry.GraphArgs`).

    Raises:
        ValueError: an empty structure (named), and FedProto's errors.
    """

    def __init__(
        self,
        num_nodes: int,
        *,
        fedsaf: FedSAFConfig,
        fedproto: FedProtoConfig | None = None,
        num_classes: int = PAPER_NUM_CLASSES,
        **common: Unpack[GraphArgs],
    ) -> None:
        if not fedsaf.structure:
            raise ValueError(
                "fedsaf-structure='' : FedSAF needs a structure ('gcsa', 'rcsa', 'mse' or 'cosine')"
            )
        super().__init__(num_nodes, **strategy_args(ACTION, common, prototype_evaluation))
        self.prototypes = PrototypeAggregator(fedproto or FedProtoConfig(), num_classes)
        self.fedsaf = fedsaf

    on_discovered, node_payload, evaluate_payload, accept_train = PROTOTYPE_HOOKS

    def method_config(self, server_round: int) -> dict:
        """FedProto's entries plus :class:`FedSAFConfig`."""
        return {**self.prototypes.method_config(), **self.fedsaf.to_dict()}

    def results_extra(self) -> dict:
        """Prototype settings, the structure and weights."""
        return {
            **super().results_extra(),
            "prototypes": self.prototypes.describe(),
            "fedsaf": self.fedsaf.to_dict(),
        }
