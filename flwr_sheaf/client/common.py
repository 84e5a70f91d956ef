"""Client-side helpers shared by every method's handlers (no CNN specifics, no method logic)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, Context
from torch import nn

from .task import TaskFactory, load_module_state, set_torch_threads

__all__ = ["accuracy", "transport", "eval_latents", "eval_logits", "edges_from_config", "build",
           "whitened_pilots", "cached_pilots", "model_key", "pilots_key", "neighbour_arrays"]


def model_key(action: str) -> str:
    """``context.state`` key of a method's model (+ ``.optim``)."""
    return f"{action}.model"


def pilots_key(action: str) -> str:
    """``context.state`` key of the node's last whitened pilots and collapse diagnostic."""
    return f"{action}.pilots"


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of ``(M, C)`` logits against ``(M,)`` labels (nan for M = 0)."""
    if y.numel() == 0:
        return float("nan")
    return float((logits.argmax(1) == y).float().mean())


def transport(z_src: torch.Tensor, v: torch.Tensor, receiver_is_head: bool) -> torch.Tensor:
    """Move row-wise whitened latents ``(M, d_src)`` into the receiver's stalk (Eq. 22).

    ``V`` is ``(d_head, d_tail)``. Receiver head: ``z_h = V z_t`` (rows ``Z V^T``);
    receiver tail: ``z_t = V^T z_h`` (rows ``Z V``).
    """
    return z_src @ v.T if receiver_is_head else z_src @ v


@torch.no_grad()
def eval_latents(model: nn.Module, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    model.eval()
    return torch.cat([model.latent(x[i : i + batch]) for i in range(0, len(x), batch)]) if len(x) else x.new_zeros(0, model.d)


@torch.no_grad()
def eval_logits(model: nn.Module, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    model.eval()
    return torch.cat([model.private_logits(x[i : i + batch]) for i in range(0, len(x), batch)])


def neighbour_arrays(rec: ArrayRecord, prefix: str = "") -> dict[int, torch.Tensor]:
    out = {}
    for key in rec.keys():
        if prefix and not key.startswith(prefix):
            continue
        pid = int(key[len(prefix):])
        out[pid] = torch.from_numpy(np.ascontiguousarray(rec[key].numpy())).float()
    return out


def edges_from_config(cfg: Mapping) -> list[tuple[int, int, bool]]:
    """(neighbour, d_j, i_is_head) triples from the message config (lists aligned by index)."""
    nbrs = [int(x) for x in cfg.get("neighbours", [])]
    dims = [int(x) for x in cfg.get("neighbour-dims", [])]
    heads = [bool(int(x)) for x in cfg.get("i-is-head", [])]
    if not (len(nbrs) == len(dims) == len(heads)):
        raise ValueError(f"malformed neighbour config: {len(nbrs)} neighbours, {len(dims)} dims, {len(heads)} roles")
    return list(zip(nbrs, dims, heads))


def build(factory: TaskFactory, context: Context, action: str, sgd: Mapping | None = None):
    """Build the node's task and restore its weights (and SGD state when ``sgd`` is given).

    Args:
        sgd: ``{"lr", "momentum", "weight-decay"}``; None builds no optimizer.

    Returns:
        ``(task, model, optimizer_or_None)``.
    """
    set_torch_threads(context)
    task = factory(context)
    model = task.model
    opt = None
    if sgd is not None:
        opt = torch.optim.SGD(model.parameters(), lr=float(sgd["lr"]), momentum=float(sgd["momentum"]),
                              weight_decay=float(sgd["weight-decay"]))
    load_module_state(context, model_key(action), model, opt)
    return task, model, opt


def whitened_pilots(model: nn.Module, x_pilot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode pilot latents ``(K, d)`` and their whitening with statistics fitted on them."""
    z = eval_latents(model, x_pilot)
    model.whitening.fit(z)
    model.whitening.eval()
    with torch.no_grad():
        return z, model.whitening(z)


def cached_pilots(context: Context, action: str) -> torch.Tensor | None:
    """This node's whitened pilots ``(K, d_i)`` from the end of its last training round, if any."""
    key = pilots_key(action)
    if key not in context.state:
        return None
    return torch.from_numpy(context.state[key]["pilots"].numpy().copy())


