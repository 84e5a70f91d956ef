"""Prototype aggregation as a component (FedProto and FedSAF hold one; notes/baselines-prototypes.md, s3)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import Message

from ...protocol import array_record
from ...strategy.records import positive_int
from ..fedproto.config import FedProtoConfig
from .protocol import (
    FEATURE_DIM,
    GLOBAL_PROTOTYPES,
    NUM_CLASSES,
    UPLOAD,
    pack_prototypes,
    unpack_prototypes,
)
from .prototypes import aggregate_prototypes

if TYPE_CHECKING:
    from ...strategy.graph import GraphStrategy

__all__ = ["PrototypeAggregator", "common_dimension"]

log = logging.getLogger("flwr_sheaf")


def common_dimension(spec: str | int, dims: dict[int, int], key: str) -> int:
    """The common dimension D of a ``<method>-dim`` setting (notes/baselines-prototypes.md, s3.5).

    Args:
        spec: ``"auto"`` (the smallest stalk dimension), ``"none"`` (all d_i must agree) or an int D.
        dims: ``{partition-id: d_i}`` as discovered (non-empty).
        key: the run-config key, for messages.

    Raises:
        ValueError: ``"none"`` with different stalk dimensions (each d and its partition-ids named).
    """
    if spec == "auto":
        return min(dims.values())
    if spec != "none":
        return int(spec)
    distinct = sorted(set(dims.values()))
    if len(distinct) > 1:
        groups = "; ".join(
            f"d={d}: partition-ids {sorted(p for p, v in dims.items() if v == d)}" for d in distinct
        )
        raise ValueError(
            f"{key}='none' needs one feature dim but the nodes have dims {distinct} ({groups}); "
            "use 'auto' or an integer D"
        )
    return distinct[0]


class PrototypeAggregator:
    """FedProto's server state: the common dimension D, the global prototypes and their per-class mean.

    Args:
        config: prototype dimension, weight, reduction, aggregation, missing-class policy.
        num_classes: size of the label space (class ids ``0..num_classes-1``).

    Raises:
        ValueError: ``num_classes`` is not a positive integer.
    """

    def __init__(self, config: FedProtoConfig, num_classes: int) -> None:
        self.config = config
        self.num_classes = positive_int("num_classes", num_classes)
        self.common_dim: int | None = None
        self.global_protos: dict[int, torch.Tensor] = {}

    def resolve_dim(self, dims: dict[int, int], owner: str) -> int:
        """Fix D from the discovered ``{partition-id: d_i}`` (:func:`common_dimension`)."""
        self.common_dim = common_dimension(self.config.dim, dims, "fedproto-dim")
        log.info(
            "%s: common prototype dimension D = %d (fedproto-dim=%r)",
            owner,
            self.common_dim,
            self.config.dim,
        )
        return self.common_dim

    def shared(self) -> dict[str, Any]:
        """Config entries of train and evaluation messages: D and the label-space size."""
        return {FEATURE_DIM: self.common_dim, NUM_CLASSES: self.num_classes}

    def method_config(self) -> dict[str, Any]:
        """The FedProto section plus :meth:`shared`."""
        return {**self.config.to_dict(), **self.shared()}

    def record(self) -> dict[str, Any]:
        """``{GLOBAL_PROTOTYPES: record}`` (empty before the first aggregation)."""
        protos = {c: p.numpy() for c, p in self.global_protos.items()}
        if not protos:
            return {}
        assert self.common_dim is not None  # set in on_discovered, before any aggregation
        return {GLOBAL_PROTOTYPES: pack_prototypes(protos, dim=self.common_dim)}

    def _upload(
        self, pid: int, reply: Message, weighted: bool
    ) -> tuple[dict[int, torch.Tensor], dict[int, int] | None]:
        """One node's prototypes and counts, validated on their own.

        Raises:
            ValueError: no upload, a wrong dimension, missing counts under weighted aggregation, NaN/inf
                or a class outside ``[0, num_classes)`` (partition-id named).
        """
        src = f"partition-id {pid}"
        if UPLOAD not in reply.content:
            raise ValueError(f"{src}: reply carries no prototypes")
        raw, counts = unpack_prototypes(array_record(reply.content, UPLOAD), src)
        protos = {c: torch.from_numpy(p) for c, p in raw.items()}
        dims = {p.shape[0] for p in protos.values()}
        if dims and dims != {self.common_dim}:
            raise ValueError(
                f"{src}: prototypes have d={sorted(dims)}, expected the common dimension "
                f"d={self.common_dim}"
            )
        aggregate_prototypes(
            [(protos, counts)], weighted=weighted, num_classes=self.num_classes, sources=[src]
        )
        return protos, counts

    def accept(self, s: GraphStrategy, server_round: int, ok: dict[int, Message]) -> dict[str, Any]:
        """Aggregate the valid uploads (s3.3); a bad one is ``s``'s recorded failure (phase ``prototypes``)."""
        uploads, sources, rejected = [], [], []
        weighted = self.config.aggregation == "weighted"
        for pid, r in sorted(ok.items()):
            try:
                uploads.append(self._upload(pid, r, weighted))
            except ValueError as exc:
                rejected.append(pid)
                s.record_failure(server_round, "prototypes", pid, str(exc))
                continue
            sources.append(f"partition-id {pid}")
        before = set(self.global_protos)
        self.global_protos = aggregate_prototypes(
            uploads,
            weighted=weighted,
            previous=self.global_protos,
            missing=self.config.missing,
            num_classes=self.num_classes,
            sources=sources,
        )
        return {
            "prototypes_rejected": rejected,
            "num_global_prototypes": len(self.global_protos),
            "new_global_classes": sorted(set(self.global_protos) - before),
        }

    def describe(self) -> dict[str, Any]:
        """``results.json``'s ``prototypes`` entry."""
        return {
            **self.config.to_dict(),
            "feature_dim": self.common_dim,
            "num_classes": self.num_classes,
            "classes": sorted(self.global_protos),
        }
