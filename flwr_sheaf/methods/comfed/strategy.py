"""ComFed strategy: relays the neighbours' projected class prototypes (notes/baselines-alignment.md, s7)."""

from __future__ import annotations

from functools import partial
from typing import Unpack

import numpy as np
from flwr.app import Message

from ...paper import NUM_CLASSES as PAPER_NUM_CLASSES
from ...protocol import ProtocolError, array_record
from ...strategy.evaluation import GraphEvaluation
from ...strategy.graph import GraphStrategy
from ...strategy.records import positive_int
from .._shared.protocol import FEATURE_DIM, NUM_CLASSES, UPLOAD, pack_prototypes, unpack_prototypes
from .._shared.prototype_aggregation import common_dimension
from ..registry import GraphArgs, strategy_args
from . import ACTION, COMFED_ROUTED, COMFED_TARGETS
from .config import ComFedConfig

__all__ = ["ComFed"]

#: per-edge phase-2 metrics of ComFed's learned maps (besides the post-hoc reading)
EDGE_METRICS = ("comfed-communication-accuracy", "val-comfed-communication-accuracy")


class ComFed(GraphStrategy):
    """ComFed on Flower messages; evaluation: post-hoc plus the learned maps' communication accuracy.

    Args:
        num_nodes: as in :class:`~flwr_sheaf.methods.noncooperative.strategy.NonCooperative`.
        comfed: alignment weight and shared dimension.
        num_classes: label-space size (the paper's 10).
        **common: federation, train, graph, action (pair with
            :func:`~flwr_sheaf.methods.comfed.client.register_comfed_handlers`), discovery_timeout
            (:class:`~flwr_sheaf.methods.registry.GraphArgs`).

    Raises:
        ValueError: bad config values (named); at discovery, ``comfed-dim = none`` with different d_i.
    """

    def __init__(
        self,
        num_nodes: int,
        *,
        comfed: ComFedConfig | None = None,
        num_classes: int = PAPER_NUM_CLASSES,
        **common: Unpack[GraphArgs],
    ) -> None:
        evaluation = partial(
            GraphEvaluation.posthoc, routed_arrays=COMFED_ROUTED, edge_metric_names=EDGE_METRICS
        )
        super().__init__(num_nodes, **strategy_args(ACTION, common, evaluation))
        self.comfed = comfed or ComFedConfig()
        self.num_classes = positive_int("num_classes", num_classes)
        self.r: int | None = None
        self.bank: dict[int, dict[int, np.ndarray]] = {}

    def on_discovered(self) -> None:
        """Validate the graph, then resolve the shared dimension r."""
        super().on_discovered()
        self.r = common_dimension(
            self.comfed.dim, {p: n.d for p, n in self.nodes.items()}, "comfed-dim"
        )

    def method_config(self, server_round: int) -> dict:
        """:class:`ComFedConfig`, r and the label-space size."""
        return {**self.comfed.to_dict(), FEATURE_DIM: self.r, NUM_CLASSES: self.num_classes}

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """Per class, the mean of the neighbours' latest projected prototypes (none before any upload)."""
        per_class: dict[int, list[np.ndarray]] = {}
        assert self.graph is not None  # built in on_discovered
        for j in self.graph.neighbors(pid):
            for m, v in self.bank.get(j, {}).items():
                per_class.setdefault(m, []).append(v)
        if not per_class:
            return {}, {}
        means = {m: np.mean(vs, axis=0).astype(np.float32) for m, vs in per_class.items()}
        assert self.r is not None  # set in on_discovered
        return {COMFED_TARGETS: pack_prototypes(means, dim=self.r)}, {}

    def accept_train(
        self, server_round: int, ok: dict[int, Message]
    ) -> tuple[dict[int, Message], dict]:
        """Store each node's projected prototypes ``{class: (r,)}`` (bad uploads are recorded failures)."""
        accepted = {}
        for pid, r in ok.items():
            try:
                if UPLOAD not in r.content:
                    raise ProtocolError("reply carries no projected prototypes")
                protos, _ = unpack_prototypes(
                    array_record(r.content, UPLOAD), f"partition-id {pid}"
                )
                bad = [
                    m
                    for m, v in protos.items()
                    if v.shape != (self.r,)
                    or not np.isfinite(v).all()
                    or not 0 <= m < self.num_classes
                ]
                if bad:
                    raise ProtocolError(
                        f"projected prototypes of classes {bad} have the wrong dimension (r={self.r}), "
                        f"NaN/inf or a class outside [0, {self.num_classes})"
                    )
            except ProtocolError as exc:
                self.record_failure(server_round, "train", pid, str(exc))
                continue
            self.bank[pid] = protos
            accepted[pid] = r
        return accepted, {}

    def results_extra(self) -> dict:
        """ComFed's settings and the resolved r."""
        return {**super().results_extra(), "comfed": {**self.comfed.to_dict(), "r": self.r}}
