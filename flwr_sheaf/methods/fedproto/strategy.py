"""FedProto strategy (Tan et al., AAAI 2022; docs/baselines.md).

Per server round:

1. Discovery fixes the common prototype dimension D (``fedproto-dim``): ``auto`` = the smallest
   stalk dimension, ``none`` = all d_i must agree (else ``ValueError`` naming every d and
   partition-id), or an explicit D. Each node pools its latents to D with the parameter-free
   :class:`~flwr_sheaf.baselines.fedproto.PoolingAdapter`. Every sampled node gets the global
   prototypes (record ``global-prototypes``) and the config (:class:`~flwr_sheaf.config.FedProtoConfig`,
   ``feature-dim``, ``num-classes``, local training).
2. ``accept_train``: each upload is validated on its own; one with NaN/inf, a class id outside
   ``[0, num_classes)``, a wrong dimension or a malformed layout is rejected (a recorded failure
   with its partition-id; the node's training still counts). The valid ones are aggregated
   (count-weighted or unweighted mean per class; a class nobody uploaded is carried or dropped).
3. Evaluation: the post-hoc protocol (:class:`NonCooperative`), plus the global prototypes in the
   phase-1 messages so each node also reports nearest-global-prototype accuracy
   (``prototype_accuracy`` per node, ``prototype_accuracy_mean`` per round).
"""

from __future__ import annotations

import logging

import networkx as nx
import torch
from flwr.app import Message

from ...baselines.fedproto import aggregate_prototypes, check_common_dim
from ...config import DEFAULTS, FederationConfig, FedProtoConfig, LocalTrainConfig
from ...paper import NUM_CLASSES as PAPER_NUM_CLASSES
from ...protocol import FEATURE_DIM, GLOBAL_PROTOTYPES, NUM_CLASSES, UPLOAD, pack_prototypes, unpack_prototypes
from ...strategy.base import positive_int
from ..noncooperative.strategy import NonCooperative
from . import ACTION

__all__ = ["FedProto", "common_dimension"]

log = logging.getLogger("flwr_sheaf")


def common_dimension(spec: str | int, dims: dict[int, int], key: str) -> int:
    """The common dimension D of a ``<method>-dim`` setting (docs/baselines.md, s3.5).

    Args:
        spec: ``"auto"`` (the smallest stalk dimension), ``"none"`` (all d_i must agree) or an int D.
        dims: ``{partition-id: d_i}`` as discovered.
        key: the run-config key, for messages.

    Raises:
        ValueError: ``"none"`` with different stalk dimensions (each d and its partition-ids named).
    """
    if spec == "auto":
        return min(dims.values())
    if spec == "none":
        try:
            return check_common_dim(dims, adapter=False)
        except ValueError as exc:
            raise ValueError(f"{exc} ({key}='none'; use 'auto' or an integer D)") from None
    return int(spec)


class FedProto(NonCooperative):
    """FedProto on Flower messages (module docstring).

    Args:
        num_nodes: agents.
        federation: graph of the communication-accuracy evaluation, participation, evaluation period.
        train: local SGD settings.
        fedproto: prototype dimension, weight, reduction, aggregation, missing-class policy.
        num_classes: size of the label space (class ids ``0..num_classes-1``; the paper's 10).
        graph: an explicit ``networkx.Graph`` (overrides ``federation.graph``).
        action: message action (pair with :func:`flwr_sheaf.client.fedproto.register_fedproto_handlers`).
        discovery_timeout: seconds to wait for SuperNodes.

    Raises:
        ValueError: bad config values (named); at discovery, ``fedproto-dim = none`` with different
            stalk dimensions (each d and its partition-ids named).
    """

    node_metric_names = ("prototype-accuracy", "val-prototype-accuracy")

    def __init__(self, num_nodes: int, *, federation: FederationConfig | None = None,
                 train: LocalTrainConfig | None = None, fedproto: FedProtoConfig | None = None,
                 num_classes: int = PAPER_NUM_CLASSES, graph: nx.Graph | None = None, action: str = ACTION,
                 discovery_timeout: float = DEFAULTS["discovery-timeout"]) -> None:
        super().__init__(num_nodes, federation=federation, train=train, graph=graph, action=action,
                         discovery_timeout=discovery_timeout)
        self.fedproto = fedproto or FedProtoConfig()
        self.num_classes = positive_int("num_classes", num_classes)
        self.common_dim: int | None = None
        self.global_protos: dict[int, torch.Tensor] = {}

    def on_discovered(self) -> None:
        """Validate the graph, then resolve the common prototype dimension D (docs/baselines.md, s3.5).

        Raises:
            ValueError: ``fedproto-dim = none`` and the nodes report different stalk dimensions
                (every d with its partition-ids named).
        """
        super().on_discovered()
        spec = self.fedproto.dim
        self.common_dim = common_dimension(spec, {p: n.d for p, n in self.nodes.items()}, "fedproto-dim")
        log.info("%s: common prototype dimension D = %d (fedproto-dim=%r)", type(self).__name__, self.common_dim, spec)

    # ------------------------------------------------------------------ hooks
    def _shared(self) -> dict:
        return {FEATURE_DIM: self.common_dim, NUM_CLASSES: self.num_classes}

    def _global_record(self) -> dict:
        protos = {c: p.numpy() for c, p in self.global_protos.items()}
        return {GLOBAL_PROTOTYPES: pack_prototypes(protos, dim=self.common_dim)} if protos else {}

    def method_config(self, server_round: int) -> dict:
        """FedProto's section plus the resolved dimension and the label-space size."""
        return {**self.fedproto.to_dict(), **self._shared()}

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """The current global prototypes (none before the first aggregation)."""
        return self._global_record(), {}

    def evaluate_payload(self, server_round: int) -> tuple[dict, dict]:
        """Global prototypes and the dimension, for the nearest-prototype accuracy."""
        return self._global_record(), self._shared()

    def accept_train(self, server_round: int, ok: dict[int, Message]) -> tuple[dict[int, Message], dict]:
        """Validate each upload on its own, then aggregate the valid ones into the global prototypes
        (count-weighted or unweighted mean per class, docs/baselines.md s3.3).

        A malformed upload, NaN/inf, a class outside ``[0, num_classes)`` or a wrong dimension is that
        node's recorded failure (phase ``prototypes``); the node's training still counts.
        """
        uploads, sources, rejected = [], [], []
        weighted = self.fedproto.aggregation == "weighted"
        for pid, r in sorted(ok.items()):
            src = f"partition-id {pid}"
            try:
                if UPLOAD not in r.content:
                    raise ValueError(f"{src}: reply carries no prototypes")
                raw, counts = unpack_prototypes(r.content[UPLOAD], src)
                protos = {c: torch.from_numpy(p) for c, p in raw.items()}
                dims = {p.shape[0] for p in protos.values()}
                if dims and dims != {self.common_dim}:
                    raise ValueError(f"{src}: prototypes have d={sorted(dims)}, expected the common dimension "
                                     f"d={self.common_dim}")
                if weighted and counts is None:
                    raise ValueError(f"{src}: weighted aggregation needs counts")
                # Validate this upload alone (NaN, class range, counts) so one bad node cannot sink the round.
                aggregate_prototypes([(protos, counts)], weighted=weighted, num_classes=self.num_classes, sources=[src])
            except ValueError as exc:
                rejected.append(pid)
                self.record_failure(server_round, "prototypes", pid, str(exc))
                continue
            uploads.append((protos, counts))
            sources.append(src)
        before = set(self.global_protos)
        self.global_protos = aggregate_prototypes(uploads, weighted=weighted, previous=self.global_protos,
                                                  missing=self.fedproto.missing, num_classes=self.num_classes,
                                                  sources=sources)
        return ok, {"prototypes_rejected": rejected, "num_global_prototypes": len(self.global_protos),
                    "new_global_classes": sorted(set(self.global_protos) - before)}

    def results_extra(self) -> dict:
        """Prototype settings, the resolved dimension and the final global prototypes' classes."""
        return {**super().results_extra(), "prototypes": {
            **self.fedproto.to_dict(), "feature_dim": self.common_dim, "num_classes": self.num_classes,
            "classes": sorted(self.global_protos)}}
