"""FedProto strategy (Tan et al., AAAI 2022; notes ``anchor-rfedags-fedsaf-fedproto.md`` D, E).

Per server round:

1. ``configure_train``: discovery once; the common feature dimension D is fixed there (all nodes
   share ``d`` -> D = d; otherwise ``feature_dim`` must be given and each node pools its latents to
   it with the parameter-free :class:`~flwr_sheaf.baselines.fedproto.PoolingAdapter`; without it a
   mismatch raises ``ValueError`` naming the dimensions). Every sampled node gets the current
   global prototypes (``ArrayRecord`` ``"global-prototypes"``: ``classes (n,)``, ``prototypes (n, D)``)
   and the config (``fedproto-lambda``, ``feature-dim``, ``num-classes``, local-training keys).
2. ``aggregate_train``: each upload (``classes``, ``prototypes (n, D)``, ``counts``) is validated on
   its own; one with NaN/inf, a class id outside ``[0, num_classes)``, a wrong dimension, or a
   malformed layout is rejected (recorded in ``failures`` with its partition-id; the node's
   training still counted). The valid ones are aggregated by
   :func:`~flwr_sheaf.baselines.fedproto.aggregate_prototypes`: count-weighted mean per class
   (``aggregation="weighted"``, the paper) or unweighted mean over clients (``"unweighted"``,
   official code / HtFLlib); a class nobody uploaded is carried over (``missing="carry"``) or
   dropped (``"drop"``, HtFLlib).
3. Evaluation: the shared post-hoc protocol (:class:`NonCooperative`), plus the global prototypes
   in the phase-1 messages so each node also reports nearest-global-prototype accuracy, recorded
   apart from the head's accuracy as ``nodes[pid]["prototype_accuracy"]`` and the round key
   ``prototype_accuracy_mean``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from flwr.app import Message

from ..baselines.fedproto import aggregate_prototypes, check_common_dim
from ..client.fedproto import GLOBAL_RECORD, prototype_arrays, prototypes_from_arrays
from ..client.noncooperative import UPLOAD_RECORD
from ..client.task import numpy_record
from ..paper import NUM_CLASSES
from .noncooperative import NonCooperative

__all__ = ["FedProto", "AGGREGATIONS", "MISSING_POLICIES"]

log = logging.getLogger("flwr_sheaf")
AGGREGATIONS = ("weighted", "unweighted")
MISSING_POLICIES = ("carry", "drop")


class FedProto(NonCooperative):
    """FedProto on Flower messages (see the module docstring).

    Args:
        num_nodes: number of agents.
        graph: graph (or spec) of the communication-accuracy evaluation.
        train_config: local-training values (``local-epochs``, ``lr``, ...) and the method's
            ``fedproto-lambda`` / ``fedproto-reduction``.
        feature_dim: common prototype dimension D (pooling adapter on every node); ``None``
            requires all nodes to have the same stalk dimension.
        num_classes: size of the label space (class ids ``0..num_classes-1``).
        aggregation: ``"weighted"`` (default) or ``"unweighted"``.
        missing: ``"carry"`` (default) or ``"drop"``.
        action: message action (default ``"fedproto"``).
        **kwargs: :class:`NonCooperative` / :class:`GraphStrategy` options.

    Raises:
        ValueError: unknown aggregation / missing policy, non-positive ``feature_dim`` (named);
            at discovery, mismatched stalk dimensions without ``feature_dim`` (dims named).
    """

    node_metric_names = ("prototype-accuracy", "val-prototype-accuracy")

    def __init__(self, num_nodes: int, graph="class-overlap", train_config: Mapping | None = None,
                 feature_dim: int | None = None, num_classes: int = NUM_CLASSES, aggregation: str = "weighted",
                 missing: str = "carry", action: str = "fedproto", **kwargs) -> None:
        super().__init__(num_nodes=num_nodes, graph=graph, train_config=train_config, action=action, **kwargs)
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if missing not in MISSING_POLICIES:
            raise ValueError(f"missing-class policy must be one of {MISSING_POLICIES}, got {missing!r}")
        if feature_dim is not None and int(feature_dim) < 1:
            raise ValueError(f"feature dim must be a positive int (or None: no adapter), got {feature_dim}")
        self.feature_dim = int(feature_dim) if feature_dim is not None else None
        self.num_classes = int(num_classes)
        self.aggregation = aggregation
        self.missing = missing
        self.common_dim: int | None = None
        self.global_protos: dict[int, torch.Tensor] = {}

    def on_discovered(self) -> None:
        """Validate the graph, then fix the common feature dimension (or raise naming the dims)."""
        super().on_discovered()
        dims = {p: n.d for p, n in self.nodes.items()}
        try:
            common = check_common_dim(dims, adapter=self.feature_dim is not None)
        except ValueError as exc:
            raise ValueError(f"{exc} (run-config key fedproto-dim = D, or feature_dim=D)") from None
        self.common_dim = self.feature_dim or common
        shared = {"feature-dim": self.common_dim, "num-classes": self.num_classes}
        self.train_config.update(shared)
        self.evaluate_config.update(shared)

    # ------------------------------------------------------------------ train
    def _global_record(self) -> dict:
        return {GLOBAL_RECORD: numpy_record(prototype_arrays(self.global_protos))} if self.global_protos else {}

    def train_records(self, server_round: int) -> dict:
        """The current global prototypes (none before the first aggregation)."""
        return self._global_record()

    def accept_uploads(self, server_round: int, replies: Mapping[int, Message]) -> dict:
        """Validate each upload on its own, then aggregate the valid ones into the global prototypes."""
        uploads, sources, rejected = [], [], []
        for pid, r in sorted(replies.items()):
            src = f"partition-id {pid}"
            try:
                if UPLOAD_RECORD not in r.content:
                    raise ValueError(f"{src}: reply carries no prototypes")
                protos, counts = prototypes_from_arrays(r.content[UPLOAD_RECORD], src)
                dims = {p.shape[0] for p in protos.values()}
                if dims and dims != {self.common_dim}:
                    raise ValueError(f"{src}: prototypes have d={sorted(dims)}, expected the common feature dim "
                                     f"d={self.common_dim}")
                if self.aggregation == "weighted" and counts is None:
                    raise ValueError(f"{src}: weighted aggregation needs counts")
                # Validate this upload alone (NaN, class range, counts) so one bad node cannot sink the round.
                aggregate_prototypes([(protos, counts)], weighted=self.aggregation == "weighted",
                                     num_classes=self.num_classes, sources=[src])
            except ValueError as exc:
                rejected.append(pid)
                self.failures.append({"round": server_round, "phase": "prototypes", "partition-id": pid,
                                      "reason": str(exc)})
                log.warning("round %d: prototypes rejected: %s", server_round, exc)
                continue
            uploads.append((protos, counts))
            sources.append(src)
        before = set(self.global_protos)
        self.global_protos = aggregate_prototypes(
            uploads, weighted=self.aggregation == "weighted", previous=self.global_protos, missing=self.missing,
            num_classes=self.num_classes, sources=sources)
        return {"prototypes_rejected": rejected, "num_global_prototypes": len(self.global_protos),
                "new_global_classes": sorted(set(self.global_protos) - before)}

    # ------------------------------------------------------------------ evaluate
    def evaluate_records(self, server_round: int) -> dict:
        """Global prototypes for the nearest-prototype accuracy."""
        return self._global_record()

    def results_extra(self) -> dict:
        """Prototype settings and the final global prototypes' classes."""
        return {**super().results_extra(), "prototypes": {
            "feature_dim": self.common_dim, "adapter": self.feature_dim is not None, "num_classes": self.num_classes,
            "aggregation": self.aggregation, "missing": self.missing, "classes": sorted(self.global_protos)}}
