"""What a node brings to the sheaf handlers: a model with the stalk protocol and its data.

The Flower glue only needs these few operations, so any encoder/head pair can be glued
(the CNN zoo in ``flwr_sheaf.models`` is one implementation):

- ``model.d``: stalk dimension d_i;
- ``model.private_logits(x) -> (B, C)``: the private path h_i(f_i(x));
- ``model.latent(x) -> (B, d_i)``: raw latents f_i(x) (before whitening);
- ``model.whitening``: a ``flwr_sheaf.sheaf.Whitening`` (train mode: batch statistics; ``fit``);
- ``model.classify_whitened(zhat) -> (B, C)``: colour into the node's own latent space, then head.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import torch
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from torch import nn

__all__ = ["set_torch_threads", "numpy_record", "LocalTask", "TaskFactory", "load_module_state", "save_module_state"]


@dataclass
class LocalTask:
    """A node's model and data (tensors on CPU).

    Attributes:
        model: ``nn.Module`` with the stalk protocol above.
        x_train, y_train: private training images ``(M, ...)`` float32 and labels ``(M,)`` int64.
        x_val, y_val: private validation split (for model/lambda selection, never test).
        x_test, y_test: private test split.
        x_pilot: the shared pilot images ``(K, ...)``, identical rows in identical order on
            every node (the paper's pilot set A).
        classes: the node's target class set C_i.
    """

    model: nn.Module
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_pilot: torch.Tensor
    classes: tuple[int, ...]


#: ``factory(context) -> LocalTask``; called for every message. It must build the model afresh
#: (deterministically from run config + partition-id); weights are then restored from
#: ``context.state``. Data may come from a read-only cache shared by the simulated nodes.
TaskFactory = Callable[[Context], LocalTask]


def save_module_state(context: Context, key: str, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Store a module's ``state_dict`` (params + buffers) and optionally its optimizer in ``context.state``."""
    context.state[key] = ArrayRecord({k: v.detach().cpu() for k, v in module.state_dict().items()}, keep_input=True)
    if optimizer is not None:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        context.state[f"{key}.optim"] = ConfigRecord({"blob": buf.getvalue()})


def load_module_state(context: Context, key: str, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> bool:
    """Restore what :func:`save_module_state` stored; returns False when nothing was stored yet."""
    if key not in context.state:
        return False
    module.load_state_dict(context.state[key].to_torch_state_dict())
    okey = f"{key}.optim"
    if optimizer is not None and okey in context.state:
        optimizer.load_state_dict(torch.load(io.BytesIO(context.state[okey]["blob"]), weights_only=False))
    return True


def numpy_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """``ArrayRecord`` from named numpy arrays of any shapes/dtypes (e.g. ``(K, d_j)`` pilots per neighbour)."""
    return ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def set_torch_threads(context: Context) -> None:
    """Set torch's intra-op threads from the run config key ``torch-threads`` (default 1).

    Several simulated nodes share few cores; with more than one OpenMP thread per ClientApp a
    2-core machine under load ran small CNN steps ~30x slower (spin-waiting threads), measured
    12 ms vs 360 ms per step. ``0`` leaves torch's default.
    """
    n = int(context.run_config.get("torch-threads", 1))
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)
