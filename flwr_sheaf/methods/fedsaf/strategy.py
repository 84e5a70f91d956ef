"""FedSAF strategy: structural alignment on FedProto's global prototypes (notes/baselines-prototypes.md).

The server side is FedProto's (prototype exchange, validation, aggregation, evaluation), held as
the same components (:class:`~flwr_sheaf.methods._shared.prototype_aggregation.PrototypeAggregator`); only the
nodes' objective differs, chosen by ``fedsaf.structure``: ``gcsa`` / ``rcsa`` (FedSAF), or the
coordinate ablations ``mse`` / ``cosine``; weights ``fedsaf.lam`` (prototype level) and
``fedsaf.gamma`` (instance level). Pair with :func:`flwr_sheaf.methods.fedsaf.client.register_fedsaf_handlers`.
"""

from __future__ import annotations

from typing import Unpack

from flwr.app import Message

from ...paper import NUM_CLASSES as PAPER_NUM_CLASSES
from ...strategy.graph import GraphStrategy
from .._shared.prototype_aggregation import PrototypeAggregator
from ..fedproto.config import FedProtoConfig
from ..fedproto.strategy import prototype_evaluation
from ..registry import GraphArgs, strategy_args
from . import ACTION
from .config import FedSAFConfig

__all__ = ["FedSAF"]


class FedSAF(GraphStrategy):
    """FedSAF (``L_sup + lam L_proto + gamma L_inst``) over FedProto's protocol (a held
    :class:`~flwr_sheaf.methods._shared.prototype_aggregation.PrototypeAggregator`, :attr:`prototypes`).

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

    def on_discovered(self) -> None:
        """Validate the graph, then resolve the common prototype dimension D."""
        super().on_discovered()
        self.prototypes.resolve_dim({p: n.d for p, n in self.nodes.items()}, type(self).__name__)

    def method_config(self, server_round: int) -> dict:
        """FedProto's entries plus :class:`FedSAFConfig`."""
        return {**self.prototypes.method_config(), **self.fedsaf.to_dict()}

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """The current global prototypes (none before the first aggregation)."""
        return self.prototypes.record(), {}

    def evaluate_payload(self, server_round: int) -> tuple[dict, dict]:
        """Global prototypes and the dimension, for the nearest-prototype accuracy."""
        return self.prototypes.record(), self.prototypes.shared()

    def accept_train(
        self, server_round: int, ok: dict[int, Message]
    ) -> tuple[dict[int, Message], dict]:
        """:meth:`PrototypeAggregator.accept`; the node's training still counts when its upload is refused."""
        return ok, self.prototypes.accept(self, server_round, ok)

    def results_extra(self) -> dict:
        """Prototype settings, the structure and weights."""
        return {
            **super().results_extra(),
            "prototypes": self.prototypes.describe(),
            "fedsaf": self.fedsaf.to_dict(),
        }
