"""FedProto ClientApp handlers (Tan et al., AAAI 2022; notes ``anchor-rfedags-fedsaf-fedproto.md`` D).

Per ``train.fedproto`` message a node receives the global prototypes (``ArrayRecord``
``"global-prototypes"``: ``classes (n,)`` int64, ``prototypes (n, D)`` float32; absent before the
first aggregation) and trains ``local-epochs`` epochs of

    CE(h_i(f_i(x)), y) + fedproto-lambda * L_R(pool(f_i(x)), y; P_g)

(:func:`flwr_sheaf.baselines.fedproto.fedproto_loss`; ``fedproto-reduction`` ``"mse"`` = the
official code's ``nn.MSELoss``, ``"per_sample"`` = mean squared distance). ``pool`` is the
parameter-free :class:`~flwr_sheaf.baselines.fedproto.PoolingAdapter` from the stalk dimension
``d_i`` to the common ``feature-dim`` D (the identity when ``d_i = D``), as HtFLlib does. After
training it uploads its local prototypes: per-class means of the pooled latents of its whole
training set in eval mode (FedTGP style, notes C.3) with the class counts, in the ``ArrayRecord``
``"upload"`` (``classes``, ``prototypes``, ``counts``).

Evaluation is the shared one (post-hoc alignment for communication accuracy) plus FedProto's
inference rule, named apart from the head's accuracy: ``prototype-accuracy`` (nearest global
prototype, :func:`~flwr_sheaf.baselines.fedproto.nearest_prototype_predict`, over every class
with a global prototype; NaN before the first aggregation) on the test and validation splits.

Prototypes are keyed by Python ``int`` class ids everywhere (pitfall E.2).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Message
from flwr.clientapp import ClientApp
from torch import nn

from ..baselines.fedproto import PoolingAdapter, class_prototypes, fedproto_loss, nearest_prototype_predict
from .common import eval_latents
from .noncooperative import register_local_handlers
from .sheaf import BatchLoss
from .task import LocalTask, TaskFactory

__all__ = ["register_fedproto_handlers", "register_prototype_handlers", "prototype_arrays", "prototypes_from_arrays",
           "latent_and_logits", "feature_adapter", "received_prototypes", "GLOBAL_RECORD"]

#: Name of the ``ArrayRecord`` with the global prototypes in train/evaluate messages.
GLOBAL_RECORD = "global-prototypes"


def prototype_arrays(protos: Mapping[int, torch.Tensor], counts: Mapping[int, int] | None = None) -> dict[str, np.ndarray]:
    """Prototype dict -> arrays ``classes (n,)`` int64, ``prototypes (n, D)`` float32 [, ``counts (n,)`` int64]."""
    classes = sorted(int(c) for c in protos)
    dim = next(iter(protos.values())).shape[0] if protos else 0
    out = {
        "classes": np.asarray(classes, dtype=np.int64),
        "prototypes": (torch.stack([protos[c].detach().float() for c in classes]).cpu().numpy() if classes
                       else np.zeros((0, dim), np.float32)),
    }
    if counts is not None:
        out["counts"] = np.asarray([int(counts[c]) for c in classes], dtype=np.int64)
    return out


def prototypes_from_arrays(rec: ArrayRecord, where: str) -> tuple[dict[int, torch.Tensor], dict[int, int] | None]:
    """Inverse of :func:`prototype_arrays` on a received ``ArrayRecord`` (keys: Python ints).

    Only the layout is checked here (ranks, lengths, integral and unique class ids); values (NaN,
    class range, counts) are checked by :func:`~flwr_sheaf.baselines.fedproto.aggregate_prototypes`.

    Raises:
        ValueError: malformed record; the message starts with ``where`` (e.g. ``"partition-id 3"``).
    """
    missing = {"classes", "prototypes"} - set(rec.keys())
    if missing:
        raise ValueError(f"{where}: prototype record lacks {sorted(missing)}")
    classes = rec["classes"].numpy()
    protos = rec["prototypes"].numpy()
    counts = rec["counts"].numpy() if "counts" in rec else None
    if classes.ndim != 1 or not np.issubdtype(classes.dtype, np.integer):
        raise ValueError(f"{where}: class ids must be a 1-D integer array, got {classes.dtype} {classes.shape}")
    if protos.ndim != 2 or protos.shape[0] != classes.shape[0]:
        raise ValueError(f"{where}: prototypes have shape {protos.shape}, expected ({classes.shape[0]}, D)")
    if counts is not None and counts.shape != classes.shape:
        raise ValueError(f"{where}: counts have shape {counts.shape}, expected {classes.shape}")
    if len(set(classes.tolist())) != len(classes):
        raise ValueError(f"{where}: class ids {classes.tolist()} repeat")
    ids = [int(c) for c in classes.tolist()]
    out = {c: torch.from_numpy(protos[i].copy()) for i, c in enumerate(ids)}
    return out, ({c: int(counts[i]) for i, c in enumerate(ids)} if counts is not None else None)


def received_prototypes(msg: Message) -> dict[int, torch.Tensor]:
    """Global prototypes carried by a train/evaluate message (empty before the first aggregation)."""
    if GLOBAL_RECORD not in msg.content:
        return {}
    return prototypes_from_arrays(msg.content[GLOBAL_RECORD], "global prototypes")[0]


def feature_adapter(model: nn.Module, cfg: Mapping) -> PoolingAdapter:
    """Pooling from the stalk dimension ``model.d`` to the message's ``feature-dim`` (default ``d``)."""
    dim = int(cfg.get("feature-dim", 0)) or int(model.d)
    return PoolingAdapter(int(model.d), dim)


def latent_and_logits(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw latents ``(B, d)`` and private logits of one forward pass.

    Uses ``model.head.mlp`` on the latents when the model has it (the CNN zoo: ``private_logits =
    head.mlp(latent)``), so both come from the same dropout mask; otherwise calls
    ``model.private_logits(x)`` separately.
    """
    z = model.latent(x)
    mlp = getattr(getattr(model, "head", None), "mlp", None)
    return z, (mlp(z) if mlp is not None else model.private_logits(x))


def _num_classes(cfg: Mapping) -> int:
    return int(cfg.get("num-classes", 10))


def _fedproto_objective(msg: Message, task: LocalTask, model: nn.Module) -> BatchLoss:
    cfg = msg.content["config"]
    lam = float(cfg.get("fedproto-lambda", 1.0))
    reduction = str(cfg.get("fedproto-reduction", "mse"))
    pool = feature_adapter(model, cfg)
    protos = received_prototypes(msg)

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        z, logits = latent_and_logits(model, x)
        ce = F.cross_entropy(logits, y)
        reg, covered = fedproto_loss(pool(z), y, protos, reduction=reduction)
        return ce + lam * reg, {"ce": ce.detach(), "proto-loss": reg.detach(), "proto-covered": covered / max(len(y), 1)}

    return loss


@torch.no_grad()
def local_prototype_upload(msg: Message, task: LocalTask, model: nn.Module):
    """Per-class means (and counts) of the pooled eval-mode latents of the node's training set."""
    cfg = msg.content["config"]
    feats = feature_adapter(model, cfg)(eval_latents(model, task.x_train))
    protos, counts = class_prototypes(feats, task.y_train, _num_classes(cfg))
    return prototype_arrays(protos, counts), {"num-prototypes": len(protos)}


@torch.no_grad()
def prototype_accuracy(msg: Message, task: LocalTask, model: nn.Module) -> dict[str, float]:
    """Nearest-global-prototype accuracy on the test and validation splits (NaN without prototypes)."""
    protos = received_prototypes(msg)
    out = {}
    pool = feature_adapter(model, msg.content["config"])
    for split, x, y in (("", task.x_test, task.y_test), ("val-", task.x_val, task.y_val)):
        if not protos:
            out[f"{split}prototype-accuracy"] = float("nan")
            continue
        pred = nearest_prototype_predict(pool(eval_latents(model, x)), protos)
        out[f"{split}prototype-accuracy"] = float((pred == y).float().mean()) if len(y) else float("nan")
    return out


def register_prototype_handlers(app: ClientApp, factory: TaskFactory, action: str, objective) -> ClientApp:
    """Handlers of a prototype method (FedProto, FedSAF): ``objective`` + prototype upload + prototype accuracy."""
    return register_local_handlers(app, factory, action, objective=objective, upload=local_prototype_upload,
                                   extra_metrics=prototype_accuracy)


def register_fedproto_handlers(app: ClientApp, factory: TaskFactory, action: str = "fedproto") -> ClientApp:
    """Register FedProto's ``query``/``train``/``evaluate``/``evaluate_comm`` handlers under ``action``.

    Pair with :class:`flwr_sheaf.strategy.fedproto.FedProto` (same ``action``).
    """
    return register_prototype_handlers(app, factory, action, _fedproto_objective)
