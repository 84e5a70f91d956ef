"""FedProto on the client (Tan et al., AAAI 2022; notes/baselines-prototypes.md, s3): loss plug-in and handlers."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ...client.common import eval_latents, from_numpy, to_numpy
from ...client.handlers import ClientMethod, register_method_handlers
from ...client.loop import LossPlugin
from ...client.task import LocalTask, StalkModel, TaskFactory
from ...protocol import CONFIG, EVALUATE, TRAIN, array_record, message_type, required
from .._shared.protocol import (
    FEATURE_DIM,
    GLOBAL_PROTOTYPES,
    NUM_CLASSES,
    UPLOAD,
    pack_prototypes,
    unpack_prototypes,
)
from .._shared.prototypes import (
    PoolingAdapter,
    class_prototypes,
    fedproto_loss,
    nearest_prototype_predict,
)
from . import ACTION
from .config import FedProtoConfig

__all__ = [
    "FedProtoLoss",
    "FedProtoClient",
    "register_fedproto_handlers",
    "received_prototypes",
    "latent_and_logits",
    "feature_pool",
]


def received_prototypes(msg: Message) -> dict[int, torch.Tensor]:
    """Global prototypes ``{class: (D,)}`` carried by a train/evaluate message (empty before the first aggregation)."""
    if GLOBAL_PROTOTYPES not in msg.content:
        return {}
    protos, _ = unpack_prototypes(array_record(msg.content, GLOBAL_PROTOTYPES), "global prototypes")
    return {c: from_numpy(p) for c, p in protos.items()}  # CPU: the losses cast to z's device


def latent_and_logits(model: StalkModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw latents ``(B, d)`` and private logits ``(B, C)``: one forward pass (same dropout mask)
    when the model has ``head.mlp`` (the CNN zoo), else ``model.private_logits(x)`` separately."""
    z = model.latent(x)
    mlp = getattr(getattr(model, "head", None), "mlp", None)
    return z, (mlp(z) if mlp is not None else model.private_logits(x))


def feature_pool(model: StalkModel, cfg: Mapping, where: str) -> PoolingAdapter:
    """Pooling adapter from ``model.d`` to the message's ``feature-dim`` D; ProtocolError without it."""
    return PoolingAdapter(int(model.d), int(required(cfg, FEATURE_DIM, where)))


class FedProtoLoss(LossPlugin):
    """``CE + lam * L_R(pool(z), y; P_g)`` (FedProto's local objective).

    Args:
        pool: adapter ``(B, d_i) -> (B, D)``.
        protos: global prototypes ``{class: (D,)}`` (empty: ``L_R = 0``).
        lam: weight >= 0.
        reduction: ``"mse"`` or ``"per_sample"``.
    """

    def __init__(
        self, pool: PoolingAdapter, protos: Mapping[int, torch.Tensor], lam: float, reduction: str
    ) -> None:
        self.pool, self.protos, self.lam, self.reduction = pool, protos, float(lam), reduction

    def loss(self, model, x, y, gen):
        """``(CE + lam L_R, parts)`` of a batch ``x (B, ...)``, ``y (B,)`` int64; ``proto-covered`` = share
        of samples whose class has a global prototype."""
        z, logits = latent_and_logits(model, x)
        ce = F.cross_entropy(logits, y)
        reg, covered = fedproto_loss(self.pool(z), y, self.protos, reduction=self.reduction)
        return ce + self.lam * reg, {
            "ce": float(ce.detach()),
            "proto-loss": float(reg.detach()),
            "proto-covered": covered / max(len(y), 1),
        }


class FedProtoClient(ClientMethod):
    """FedProto's hooks: prototype plug-in, local-prototype upload, nearest-prototype accuracy."""

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:
        """:class:`FedProtoLoss` from the message's config, ``feature-dim`` and global prototypes.

        Raises:
            ConfigError / ProtocolError: a key missing from the config, malformed prototypes (named).
        """
        cfg = msg.content[CONFIG]
        proto = FedProtoConfig.from_record(cfg)
        return FedProtoLoss(
            feature_pool(task.model, cfg, message_type(TRAIN, self.action)),
            received_prototypes(msg),
            proto.lam,
            proto.reduction,
        )

    @torch.no_grad()
    def after_train(
        self, msg: Message, context: Context, task: LocalTask, plugin: LossPlugin
    ) -> tuple[dict, dict]:
        """Per-class means and counts of the pooled eval-mode latents of the node's training set."""
        cfg = msg.content[CONFIG]
        feats = feature_pool(task.model, cfg, message_type(TRAIN, self.action))(
            eval_latents(task.model, task.x_train)
        )
        protos, counts = class_prototypes(
            feats, task.y_train, int(required(cfg, NUM_CLASSES, message_type(TRAIN, self.action)))
        )
        rec = pack_prototypes(
            {c: to_numpy(p) for c, p in protos.items()}, counts, dim=feats.shape[1]
        )
        return {UPLOAD: rec}, {"num-prototypes": len(protos)}

    @torch.no_grad()
    def evaluation_metrics(self, msg: Message, task: LocalTask) -> dict[str, float]:
        """Nearest-global-prototype accuracy on the test and validation splits (NaN without prototypes)."""
        protos = received_prototypes(msg)
        pool = feature_pool(task.model, msg.content[CONFIG], message_type(EVALUATE, self.action))
        out = {}
        for prefix, x, y in (("", task.x_test, task.y_test), ("val-", task.x_val, task.y_val)):
            if not protos or not len(y):
                out[f"{prefix}prototype-accuracy"] = float("nan")
                continue
            pred = nearest_prototype_predict(pool(eval_latents(task.model, x)), protos)
            out[f"{prefix}prototype-accuracy"] = float((pred == y).float().mean())
        return out


def register_fedproto_handlers(
    app: ClientApp, factory: TaskFactory, action: str = ACTION
) -> ClientApp:
    """Add FedProto's handlers under ``action`` (pair with :class:`flwr_sheaf.methods.fedproto.strategy.FedProto`)."""
    return register_method_handlers(app, factory, FedProtoClient(action))
