"""FedSAF on the client: FedProto's protocol with FedSAF's loss plug-in (Eq. 19; notes/baselines-prototypes.md, s4):
``L_sup + fedsaf-lambda L_proto + fedsaf-gamma L_inst``, ``D o S`` picked by ``fedsaf-structure``;
a structure term with fewer than 3 rows is skipped, and the share of steps each term applied is
reported (``proto-applied``, ``inst-applied``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ...client.handlers import register_method_handlers
from ...client.loop import LossPlugin
from ...client.task import LocalTask, TaskFactory
from ...protocol import CONFIG, TRAIN, ProtocolError, message_type, required
from .._shared.protocol import NUM_CLASSES
from .._shared.prototypes import PoolingAdapter
from ..fedproto.client import FedProtoClient, feature_pool, latent_and_logits, received_prototypes
from . import ACTION
from .config import FedSAFConfig
from .maths import fedsaf_objective, structure_alignment_inputs

__all__ = ["FedSAFLoss", "FedSAFClient", "register_fedsaf_handlers"]


class FedSAFLoss(LossPlugin):
    """FedSAF's objective (module docstring).

    Args:
        pool: adapter ``(B, d_i) -> (B, D)``; protos: global prototypes ``{class: (D,)}``;
        num_classes: size of the label space; lam, gamma: weights; structure: ``gcsa``/``rcsa``/``mse``/``cosine``.
    """

    def __init__(
        self,
        pool: PoolingAdapter,
        protos: Mapping[int, torch.Tensor],
        num_classes: int,
        lam: float,
        gamma: float,
        structure: str,
    ) -> None:
        self.pool, self.protos, self.num_classes = pool, protos, int(num_classes)
        self.lam, self.gamma, self.structure = float(lam), float(gamma), structure

    def loss(self, model, x, y, gen):
        """``(L_sup + lam L_proto + gamma L_inst, parts)`` of a batch (FedSAF Eq. 19; terms with < 3 rows skipped)."""
        z, logits = latent_and_logits(model, x)
        ce = F.cross_entropy(logits, y)
        inp = structure_alignment_inputs(self.pool(z), y, self.protos, self.num_classes)
        t = fedsaf_objective(
            ce,
            inp.p_local,
            inp.q_global,
            inp.z_inst,
            inp.z_global_inst,
            self.lam,
            self.gamma,
            self.structure,
        )
        return t.total, {
            "ce": float(ce.detach()),
            "proto-loss": float(t.proto.detach()),
            "inst-loss": float(t.inst.detach()),
            "proto-applied": float(t.proto_applied),
            "inst-applied": float(t.inst_applied),
        }


class FedSAFClient(FedProtoClient):
    """FedSAF's hooks: FedProto's upload and evaluation, FedSAF's loss plug-in."""

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:
        """:class:`FedSAFLoss` from the message's :class:`~flwr_sheaf.methods.fedsaf.config.FedSAFConfig` (FedSAF Eq. 19).

        Raises:
            ConfigError / ProtocolError: a missing key or an unresolved (empty) structure (named).
        """
        cfg = msg.content[CONFIG]
        saf = FedSAFConfig.from_record(cfg)
        if not saf.structure:
            raise ProtocolError(
                "fedsaf-structure is empty in the train config: the server must resolve it"
            )
        return FedSAFLoss(
            feature_pool(task.model, cfg, message_type(TRAIN, self.action)),
            received_prototypes(msg),
            int(required(cfg, NUM_CLASSES, message_type(TRAIN, self.action))),
            saf.lam,
            saf.gamma,
            saf.structure,
        )


def register_fedsaf_handlers(
    app: ClientApp, factory: TaskFactory, action: str = ACTION
) -> ClientApp:
    """Add FedSAF's handlers under ``action`` (pair with :class:`flwr_sheaf.methods.fedsaf.strategy.FedSAF`)."""
    return register_method_handlers(app, factory, FedSAFClient(action))
