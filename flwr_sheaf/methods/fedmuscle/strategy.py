"""FedMuscle strategy: network averages of the agents' pilot representations (notes/baselines-alignment.md, s6.2)."""

from __future__ import annotations

import logging
from typing import Unpack

import numpy as np
import torch
from flwr.app import Message

from ...protocol import array_record, pack_arrays
from ...strategy.evaluation import GraphEvaluation
from ...strategy.graph import GraphStrategy
from .._shared.protocol import FEATURE_DIM, UPLOAD
from .._shared.prototype_aggregation import common_dimension
from ..registry import GraphArgs, strategy_args
from . import ACTION, MUSCLE_TARGETS, PILOT_REPS, TARGET_ALL, TARGET_OTHERS
from .config import FedMuscleConfig
from .maths import is_contrastive_epoch, leave_one_out_means

__all__ = ["FedMuscle"]

log = logging.getLogger("flwr_sheaf")


class FedMuscle(GraphStrategy):
    """FedMuscle on Flower messages (evaluation: post hoc).

    In rounds with a contrastive epoch, once two agents have uploaded, each sampled node gets
    ``others (K, D)`` (leave-one-out mean over all agents: FedMuscle is centralised) and ``all (K, D)``.
    A bad upload is that node's recorded failure (its previous representations stay).

    Args:
        num_nodes: agents.
        fedmuscle: weight, cycle length, temperature, common dimension, pilot batch.
        **common: federation, train, graph, action (pair with
            :func:`~flwr_sheaf.methods.fedmuscle.client.register_fedmuscle_handlers`),
            discovery_timeout (:class:`~flwr_sheaf.methods.registry.GraphArgs`).

    Raises:
        ValueError: bad config values (named); at discovery, ``fedmuscle-dim = none`` with different
            stalk dimensions.
    """

    def __init__(
        self,
        num_nodes: int,
        *,
        fedmuscle: FedMuscleConfig | None = None,
        **common: Unpack[GraphArgs],
    ) -> None:
        super().__init__(num_nodes, **strategy_args(ACTION, common, GraphEvaluation.posthoc))
        self.fedmuscle = fedmuscle or FedMuscleConfig()
        self.common_dim: int | None = None
        self.reps: dict[int, np.ndarray] = {}
        self._targets: tuple[dict[int, np.ndarray], np.ndarray] | None = None

    def on_discovered(self) -> None:
        """Validate the graph, then resolve the common representation dimension D."""
        super().on_discovered()
        self.common_dim = common_dimension(
            self.fedmuscle.dim, {p: n.d for p, n in self.nodes.items()}, "fedmuscle-dim"
        )

    def contrastive_round(self, server_round: int) -> bool:
        """Whether any local epoch of ``server_round`` is a contrastive epoch of the cycle."""
        e = self.train.local_epochs
        return any(
            is_contrastive_epoch((server_round - 1) * e + k, self.fedmuscle.task_epochs)
            for k in range(e)
        )

    def method_config(self, server_round: int) -> dict:
        """:class:`FedMuscleConfig` and the resolved dimension; computes this round's targets once."""
        self._targets = None
        if self.contrastive_round(server_round) and len(self.reps) >= 2:
            others, every = leave_one_out_means(
                {p: torch.from_numpy(r) for p, r in self.reps.items()}
            )
            self._targets = ({p: o.numpy() for p, o in others.items()}, every.numpy())
        return {**self.fedmuscle.to_dict(), FEATURE_DIM: self.common_dim}

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """The node's targets in contrastive rounds (for a node without uploads yet: the mean of all)."""
        if self._targets is None:
            return {}, {}
        others, every = self._targets
        return {
            MUSCLE_TARGETS: pack_arrays({TARGET_OTHERS: others.get(pid, every), TARGET_ALL: every})
        }, {}

    def accept_train(
        self, server_round: int, ok: dict[int, Message]
    ) -> tuple[dict[int, Message], dict]:
        """Store each node's pilot representations ``(K, D)`` (bad ones are recorded failures)."""
        shape = (self.num_pilots, self.common_dim)
        accepted = {}
        for pid, r in ok.items():
            rec = array_record(r.content, UPLOAD) if UPLOAD in r.content else None
            a = rec[PILOT_REPS].numpy() if rec is not None and PILOT_REPS in rec else None
            if a is None or a.shape != shape or not np.isfinite(a).all():
                why = (
                    "no pilot representations"
                    if a is None
                    else f"pilot representations of shape {a.shape} "
                    f"(expected {shape}) or with NaN/inf"
                )
                self.record_failure(server_round, "train", pid, why)
                continue
            self.reps[pid] = np.asarray(a, dtype=np.float32)
            accepted[pid] = r
        return accepted, {"contrastive_round": int(self._targets is not None)}

    def results_extra(self) -> dict:
        """FedMuscle's settings and the resolved dimension."""
        return {
            **super().results_extra(),
            "fedmuscle": {**self.fedmuscle.to_dict(), "feature_dim": self.common_dim},
        }
