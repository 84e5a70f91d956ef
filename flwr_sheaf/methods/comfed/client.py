"""ComFed on the client: a projection ``P_i (r, d_i)`` trained with the encoder (notes/baselines-alignment.md, s7).

``P_i`` is Xavier-initialised from (seed, partition-id), kept in the node state and stepped by its own SGD.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from ...client.common import accuracy, eval_latents, from_numpy, task_device, to_numpy
from ...client.handlers import ClientMethod, register_method_handlers
from ...client.loop import LossPlugin
from ...client.task import LocalTask, TaskFactory, load_module_state, save_module_state
from ...config import LocalTrainConfig, node_partition_id
from ...protocol import CONFIG, SEED, TRAIN, array_record, message_type, required
from .._shared.protocol import FEATURE_DIM, NUM_CLASSES, UPLOAD, pack_prototypes, unpack_prototypes
from .._shared.prototypes import class_prototypes
from ..fedproto.client import latent_and_logits
from . import ACTION, COMFED_ROUTED, COMFED_TARGETS
from .config import ComFedConfig
from .maths import comfed_alignment_loss, comfed_message, xavier_projection

__all__ = ["Projection", "ComFedLoss", "ComFedClient", "register_comfed_handlers"]


class Projection(nn.Module):
    """ComFed's ``P_i`` as a module (so it is saved and restored like the model): parameter ``(r, d_i)``."""

    def __init__(self, p: torch.Tensor) -> None:
        super().__init__()
        self.p = nn.Parameter(p.clone())


class ComFedLoss(LossPlugin):
    """``CE + lam * ComFed alignment`` with the projection's own SGD step.

    Args:
        proj: the node's :class:`Projection` (trained here).
        opt: its optimizer.
        clip: its gradient clip (0 = off).
        targets: ``{class: (r,)}`` mean of the neighbours' projected prototypes (may be empty).
        num_classes: label-space size.
        lam: weight >= 0.
    """

    def __init__(
        self,
        proj: Projection,
        opt: torch.optim.Optimizer,
        clip: float,
        targets: dict[int, torch.Tensor],
        num_classes: int,
        lam: float,
    ) -> None:
        self.proj, self.opt, self.clip, self.targets = proj, opt, float(clip), targets
        self.num_classes, self.lam = int(num_classes), float(lam)

    def loss(self, model, x, y, gen):
        """``(CE + lam * mean_m ||P vbar_m - t_m||^2, parts)`` of a batch ``x (B, ...)``, ``y (B,)`` int64."""
        self.opt.zero_grad(set_to_none=True)
        z, logits = latent_and_logits(model, x)
        ce = F.cross_entropy(logits, y)
        means, _ = class_prototypes(z, y, self.num_classes)
        align = comfed_alignment_loss({m: self.proj.p @ v for m, v in means.items()}, self.targets)
        return ce + self.lam * align, {
            "ce": float(ce.detach()),
            "comfed-loss": float(align.detach()),
        }

    def after_step(self) -> None:
        """Clip and step the projection (its gradient came from the same backward pass)."""
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.proj.parameters(), self.clip)
        self.opt.step()


class ComFedClient(ClientMethod):
    """ComFed's hooks: projection plug-in, projected prototypes up, learned-map communication accuracy."""

    routed_arrays = COMFED_ROUTED

    def _key(self) -> str:
        return f"{self.action}.projection"

    def _projection(self, msg: Message, context: Context, task: LocalTask) -> Projection:
        cfg = msg.content[CONFIG]
        mt = message_type(TRAIN, self.action)
        r, seed = int(required(cfg, FEATURE_DIM, mt)), int(required(cfg, SEED, mt))
        gen = torch.Generator().manual_seed(
            int(np.random.SeedSequence([seed, node_partition_id(context), 7]).generate_state(1)[0])
        )
        return Projection(xavier_projection(r, int(task.model.d), gen)).to(task_device(task))

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:
        """:class:`ComFedLoss` with the node's restored projection and the neighbours' mean projected prototypes.

        Raises:
            ConfigError / ProtocolError: a missing key or malformed targets (named).
        """
        cfg = msg.content[CONFIG]
        mt = message_type(TRAIN, self.action)
        comfed, train = ComFedConfig.from_record(cfg), LocalTrainConfig.from_record(cfg)
        proj = self._projection(msg, context, task)
        opt = torch.optim.SGD(proj.parameters(), lr=train.lr, momentum=train.momentum)
        load_module_state(context, self._key(), proj, opt)
        targets = {}
        if COMFED_TARGETS in msg.content:
            raw, _ = unpack_prototypes(array_record(msg.content, COMFED_TARGETS), f"{mt} targets")
            targets = {m: from_numpy(v, task_device(task)) for m, v in raw.items()}
        return ComFedLoss(
            proj, opt, train.clip_norm, targets, int(required(cfg, NUM_CLASSES, mt)), comfed.lam
        )

    @torch.no_grad()
    def after_train(
        self, msg: Message, context: Context, task: LocalTask, plugin: LossPlugin
    ) -> tuple[dict, dict]:
        """Save the projection; upload ``P_i vbar_m`` over the whole training set (eval mode) with counts."""
        assert isinstance(plugin, ComFedLoss)  # made by self.plugin
        save_module_state(context, self._key(), plugin.proj, plugin.opt)
        means, counts = class_prototypes(
            eval_latents(task.model, task.x_train), task.y_train, plugin.num_classes
        )
        protos = {m: to_numpy(plugin.proj.p @ v) for m, v in means.items()}
        return {UPLOAD: pack_prototypes(protos, counts, dim=plugin.proj.p.shape[0])}, {}

    @torch.no_grad()
    def evaluation_arrays(self, msg: Message, context: Context, task: LocalTask) -> dict:
        """The projection ``(r, d_i)`` and the raw test/validation latents ``(M, d_i)`` for the neighbours.

        Raises:
            ProtocolError: the node has no projection yet (it never trained).
        """
        m = task.model
        arrays = (
            self._stored(context, task),
            eval_latents(m, task.x_test),
            eval_latents(m, task.x_val),
        )
        return {k: to_numpy(a) for k, a in zip(COMFED_ROUTED, arrays)}

    def _stored(self, context: Context, task: LocalTask) -> torch.Tensor:
        key = self._key()
        # never trained: no learned map, report NaN accuracies downstream
        if key not in context.state:
            return torch.full((1, int(task.model.d)), float("nan"), device=task_device(task))
        return from_numpy(array_record(context.state, key)["p"].numpy().copy(), task_device(task))

    @torch.no_grad()
    def edge_metrics(
        self, msg: Message, context: Context, task: LocalTask, j: int, arrays: dict
    ) -> dict[str, float]:
        """Accuracy of the receiver's head on ``P_i^+ P_j z_j`` (raw test / validation latents of j)."""
        dev = task_device(task)
        p_i, p_j = self._stored(context, task), from_numpy(arrays[COMFED_ROUTED[0]], dev)
        out = {}
        for prefix, split in (("", "test"), ("val-", "val")):
            name = f"{prefix}comfed-communication-accuracy"
            if (
                not (torch.isfinite(p_i).all() and torch.isfinite(p_j).all())
                or p_i.shape[0] != p_j.shape[0]
            ):
                out[name] = float("nan")
                continue
            zhat = comfed_message(
                from_numpy(arrays[f"raw-{split}-latents"], dev, torch.float32), p_j, p_i
            )
            task.model.eval()
            # colouring o whitening = identity
            logits = task.model.classify_whitened(task.model.whitening(zhat))
            out[name] = accuracy(logits, from_numpy(arrays[f"{split}-labels"], dev, torch.int64))
        return out


def register_comfed_handlers(
    app: ClientApp, factory: TaskFactory, action: str = ACTION
) -> ClientApp:
    """Add ComFed's handlers under ``action`` (pair with :class:`flwr_sheaf.methods.comfed.strategy.ComFed`)."""
    return register_method_handlers(app, factory, ComFedClient(action))
