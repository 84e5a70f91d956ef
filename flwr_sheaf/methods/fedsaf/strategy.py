"""FedSAF strategy: structural alignment on FedProto's global prototypes (docs/baselines-prototypes.md).

The server side is FedProto's (prototype exchange, validation, aggregation, evaluation); only the
nodes' objective differs, chosen by ``fedsaf.structure``: ``gcsa`` / ``rcsa`` (FedSAF), or the
coordinate ablations ``mse`` / ``cosine``; weights ``fedsaf.lam`` (prototype level) and
``fedsaf.gamma`` (instance level). Pair with :func:`flwr_sheaf.methods.fedsaf.client.register_fedsaf_handlers`.
"""

from __future__ import annotations

import networkx as nx

from ...config import DEFAULTS, FederationConfig, LocalTrainConfig
from ...paper import NUM_CLASSES as PAPER_NUM_CLASSES
from ..fedproto.config import FedProtoConfig
from ..fedproto.strategy import FedProto
from . import ACTION
from .config import FedSAFConfig

__all__ = ["FedSAF"]


class FedSAF(FedProto):
    """FedSAF (``L_sup + lam L_proto + gamma L_inst``): FedProto's server with FedSAF's section in
    the nodes' config.

    Args:
        fedsaf: weights and structure; ``structure`` must be set (``gcsa``, ``rcsa``, ``mse`` or
            ``cosine``; the app's methods ``fedsaf-gcsa`` / ``fedsaf-rcsa`` fill it in).
        train: local SGD settings (default: :class:`~flwr_sheaf.config.LocalTrainConfig`'s).
        num_nodes: as in :class:`~flwr_sheaf.methods.fedproto.strategy.FedProto`.
        federation: as in :class:`~flwr_sheaf.methods.fedproto.strategy.FedProto`.
        fedproto: as in :class:`~flwr_sheaf.methods.fedproto.strategy.FedProto`.
        num_classes: as in :class:`~flwr_sheaf.methods.fedproto.strategy.FedProto`.
        graph: as in :class:`~flwr_sheaf.methods.fedproto.strategy.FedProto`.
        discovery_timeout: as in :class:`~flwr_sheaf.methods.fedproto.strategy.FedProto`.
        action: message action (default ``"fedsaf"``).

    Raises:
        ValueError: an empty structure (named), and FedProto's errors.
    """

    def __init__(
        self,
        num_nodes: int,
        *,
        fedsaf: FedSAFConfig,
        federation: FederationConfig | None = None,
        train: LocalTrainConfig | None = None,
        fedproto: FedProtoConfig | None = None,
        num_classes: int = PAPER_NUM_CLASSES,
        graph: nx.Graph | None = None,
        action: str = ACTION,
        discovery_timeout: float = DEFAULTS["discovery-timeout"],
    ) -> None:
        if not fedsaf.structure:
            raise ValueError(
                "fedsaf-structure='' : FedSAF needs a structure ('gcsa', 'rcsa', 'mse' or 'cosine')"
            )
        super().__init__(
            num_nodes,
            federation=federation,
            train=train or LocalTrainConfig(),
            fedproto=fedproto,
            num_classes=num_classes,
            graph=graph,
            action=action,
            discovery_timeout=discovery_timeout,
        )
        self.fedsaf = fedsaf

    def method_config(self, server_round: int) -> dict:
        """FedProto's entries plus :class:`FedSAFConfig`."""
        return {**super().method_config(server_round), **self.fedsaf.to_dict()}

    def results_extra(self) -> dict:
        """FedProto's, plus the structure and weights."""
        return {**super().results_extra(), "fedsaf": self.fedsaf.to_dict()}
