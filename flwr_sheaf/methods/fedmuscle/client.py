"""FedMuscle on the client: task epochs, then a contrastive epoch on the shared pilots (notes/baselines-alignment.md, s6)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ...client.common import eval_latents, from_numpy, task_device, to_numpy
from ...client.handlers import ClientMethod, register_method_handlers
from ...client.loop import LossPlugin
from ...client.task import LocalTask, StalkModel, TaskFactory
from ...config import LocalTrainConfig
from ...protocol import (
    CONFIG,
    SERVER_ROUND,
    TRAIN,
    ProtocolError,
    array_record,
    as_int,
    message_type,
    pack_arrays,
)
from .._shared.protocol import UPLOAD
from .._shared.prototypes import PoolingAdapter
from ..fedproto.client import feature_pool, latent_and_logits
from . import ACTION, MUSCLE_TARGETS, PILOT_REPS, TARGET_ALL, TARGET_OTHERS
from .config import FedMuscleConfig
from .maths import is_contrastive_epoch, muscle_loss

__all__ = ["FedMuscleLoss", "FedMuscleClient", "register_fedmuscle_handlers"]


class FedMuscleLoss(LossPlugin):
    """CE, plus ``lam * L_muscle`` on a pilot minibatch in contrastive epochs.

    Args:
        pool: adapter ``(B, d_i) -> (B, D)``.
        x_pilot: the node's pilot inputs ``(K, ...)`` (same rows, same order on every node).
        targets: ``(others (K, D), all (K, D))`` float32, or None (no contrastive term this round).
        contrastive: the local epochs (0-based, of this round) that add the contrastive term.
        lam, temperature: loss weight and tau.
        pilot_batch_size: pilot rows per step.
    """

    def __init__(
        self,
        pool: PoolingAdapter,
        x_pilot: torch.Tensor,
        targets: tuple[torch.Tensor, torch.Tensor] | None,
        contrastive: set[int],
        lam: float,
        temperature: float,
        pilot_batch_size: int,
    ) -> None:
        self.pool, self.x_pilot, self.targets = pool, x_pilot, targets
        self.contrastive, self.lam, self.tau = contrastive, float(lam), float(temperature)
        self.batch = int(pilot_batch_size)
        self.active = False
        self.epochs_contrastive = 0

    def begin_epoch(self, model: StalkModel, epoch: int) -> None:
        """Switch the contrastive term on for the contrastive epochs of the cycle (when targets exist)."""
        self.active = self.targets is not None and epoch in self.contrastive and self.lam > 0
        self.epochs_contrastive += self.active

    def loss(self, model, x, y, gen):
        """``(CE [+ lam L_muscle], parts)``: the pilot minibatch indexes the pilots and both targets alike."""
        z, logits = latent_and_logits(model, x)
        ce = F.cross_entropy(logits, y)
        parts = {"ce": float(ce.detach()), "muscle-loss": 0.0}
        if not self.active:
            return ce, parts
        pidx = torch.randperm(self.x_pilot.shape[0], generator=gen)[: self.batch]
        reps = self.pool(model.latent(self.x_pilot[pidx]))
        others, every = self.targets
        term = muscle_loss(reps, others[pidx], every[pidx], self.tau)
        parts["muscle-loss"] = float(term.detach())
        return ce + self.lam * term, parts

    def metrics(self, steps: int) -> dict:
        """How many local epochs of this round had the contrastive term."""
        return {"contrastive-epochs": self.epochs_contrastive}


class FedMuscleClient(ClientMethod):
    """FedMuscle's hooks: contrastive plug-in in, pooled pilot representations out."""

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:
        """:class:`FedMuscleLoss` from the message's config, ``feature-dim`` and the targets.

        Raises:
            ConfigError / ProtocolError: a missing key, or targets whose shape is not ``(K, D)`` (named).
        """
        cfg = msg.content[CONFIG]
        mt = message_type(TRAIN, self.action)
        muscle = FedMuscleConfig.from_record(cfg)
        local_epochs = LocalTrainConfig.from_record(cfg).local_epochs
        pool = feature_pool(task.model, cfg, mt)
        first = (as_int(cfg[SERVER_ROUND], SERVER_ROUND) - 1) * local_epochs
        contrastive = {
            e for e in range(local_epochs) if is_contrastive_epoch(first + e, muscle.task_epochs)
        }
        targets = None
        if MUSCLE_TARGETS in msg.content:
            rec = array_record(msg.content, MUSCLE_TARGETS)
            shape = (int(task.x_pilot.shape[0]), pool.d_common)
            pair = []
            for key in (TARGET_OTHERS, TARGET_ALL):
                a = np.asarray(rec[key].numpy(), dtype=np.float32) if key in rec else None
                if a is None or a.shape != shape:
                    raise ProtocolError(
                        f"{mt}: target {key!r} has shape {None if a is None else a.shape}, expected {shape}"
                    )
                pair.append(from_numpy(a, task_device(task)))
            targets = (pair[0], pair[1])
        return FedMuscleLoss(
            pool,
            task.x_pilot,
            targets,
            contrastive,
            muscle.lam,
            muscle.temperature,
            muscle.pilot_batch_size,
        )

    @torch.no_grad()
    def after_train(
        self, msg: Message, context: Context, task: LocalTask, plugin: LossPlugin
    ) -> tuple[dict, dict]:
        """The node's pooled eval-mode pilot representations ``(K, D)`` float32 (for the network averages)."""
        pool = feature_pool(task.model, msg.content[CONFIG], message_type(TRAIN, self.action))
        reps = pool(eval_latents(task.model, task.x_pilot))
        return {UPLOAD: pack_arrays({PILOT_REPS: to_numpy(reps)})}, {}


def register_fedmuscle_handlers(
    app: ClientApp, factory: TaskFactory, action: str = ACTION
) -> ClientApp:
    """Add FedMuscle's handlers under ``action`` (pair with :class:`flwr_sheaf.methods.fedmuscle.strategy.FedMuscle`)."""
    return register_method_handlers(app, factory, FedMuscleClient(action))
