"""FedSAF ClientApp handlers (structural alignment on FedProto's global prototypes; notes C).

Same protocol as FedProto (:mod:`flwr_sheaf.client.fedproto`: global prototypes in, local
prototypes + counts out, pooled to the common ``feature-dim``, nearest-prototype accuracy
reported); only the batch objective differs (FedSAF Eq. (19)):

    L_sup + fedsaf-lambda * L_proto + fedsaf-gamma * L_inst

with ``L_proto = D(S(P_i^{C_i}), S(P_g^{C_i}))`` on the batch's local class means and
``L_inst = D(S(z), S(z~))``, ``z~_j = P_g^{y_j}`` (:func:`~flwr_sheaf.baselines.fedsaf.structure_alignment_inputs`,
:func:`~flwr_sheaf.baselines.fedsaf.fedsaf_objective`). ``fedsaf-structure`` picks ``D o S``:
``"gcsa"`` (Eq. 13), ``"rcsa"`` (Eq. 14), or the coordinate ablations ``"mse"`` / ``"cosine"``
(Eq. 6). A structure term with fewer than 3 rows is skipped (GCSA/RCSA are identically 0 at 2 rows);
the fraction of steps where each term applied is reported (``proto-applied``, ``inst-applied``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flwr.app import Message
from flwr.clientapp import ClientApp
from torch import nn

from ..baselines.fedsaf import fedsaf_objective, structure_alignment_inputs
from .fedproto import feature_adapter, latent_and_logits, received_prototypes, register_prototype_handlers
from .sheaf import BatchLoss
from .task import LocalTask, TaskFactory

__all__ = ["register_fedsaf_handlers"]


def _fedsaf_objective(msg: Message, task: LocalTask, model: nn.Module) -> BatchLoss:
    cfg = msg.content["config"]
    lam = float(cfg.get("fedsaf-lambda", 1.0))
    gamma = float(cfg.get("fedsaf-gamma", 1.0))
    structure = str(cfg.get("fedsaf-structure", "gcsa"))
    num_classes = int(cfg.get("num-classes", 10))
    pool = feature_adapter(model, cfg)
    protos = received_prototypes(msg)

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        z, logits = latent_and_logits(model, x)
        ce = F.cross_entropy(logits, y)
        inp = structure_alignment_inputs(pool(z), y, protos, num_classes)
        t = fedsaf_objective(ce, inp.p_local, inp.q_global, inp.z_inst, inp.z_global_inst, lam, gamma, structure)
        return t.total, {"ce": ce.detach(), "proto-loss": t.proto.detach(), "inst-loss": t.inst.detach(),
                         "proto-applied": float(t.proto_applied), "inst-applied": float(t.inst_applied)}

    return loss


def register_fedsaf_handlers(app: ClientApp, factory: TaskFactory, action: str = "fedsaf") -> ClientApp:
    """Register FedSAF's handlers under ``action`` (pair with :class:`flwr_sheaf.strategy.fedsaf.FedSAF`)."""
    return register_prototype_handlers(app, factory, action, _fedsaf_objective)
