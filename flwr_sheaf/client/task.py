"""What a node brings to the handlers: a model with the stalk protocol (:mod:`flwr_sheaf.sheaf.stalk`)
and its data; any encoder/head pair can be glued.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from torch import nn

from ..protocol import array_record, as_bytes, config_record
from ..sheaf.stalk import StalkModel

__all__ = [
    "LocalTask",
    "StalkModel",
    "TaskDescription",
    "TaskDescriber",
    "TaskFactory",
    "describer_of",
    "with_describer",
    "set_torch_threads",
    "load_module_state",
    "save_module_state",
]


#: Tensor fields of :class:`LocalTask`, in constructor order.
TASK_TENSORS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test", "x_pilot")


@dataclass
class LocalTask:
    """A node's model and data (CPU tensors).

    Attributes:
        model: ``nn.Module`` with the stalk protocol (module docstring).
        x_train, y_train: private training images ``(M, ...)`` float32 and labels ``(M,)`` int64.
        x_val, y_val: private validation split (model and lambda selection, never test).
        x_test, y_test: private test split.
        x_pilot: the shared pilot inputs ``(K, ...)`` float32: **the same rows in the same order on
            every node** (Procrustes pairs row k of one node with row k of its neighbour).
        classes: the node's target class set C_i (ints; used by the ``class-overlap`` graph).
        y_pilot: optional ``(K,)`` int64 public labels of the pilots (``pilot-strategy=*-class``).
    """

    model: StalkModel
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_pilot: torch.Tensor
    classes: tuple[int, ...]
    y_pilot: torch.Tensor | None = None


TaskFactory = Callable[[Context], LocalTask]
"""``factory(context) -> LocalTask``, called for **every message**: it must rebuild the same
architecture (weights are restored from ``context.state``)."""


@dataclass(frozen=True)
class TaskDescription:
    """What a node's discovery reply says of its :class:`LocalTask`.

    Attributes:
        d, classes: the stalk dimension ``model.d`` and the class set ``task.classes`` (ints).
        num_pilots, num_train: ``task.x_pilot.shape[0]`` and ``task.x_train.shape[0]``.
        pilot_digest: :func:`~flwr_sheaf.client.common.shared_pilot_digest` of ``task.x_pilot``.
        architecture: a hashable key of the architecture and the pilots' shape and dtype.
    """

    d: int
    classes: tuple[int, ...]
    num_pilots: int
    num_train: int
    pilot_digest: int
    architecture: Hashable


TaskDescriber = Callable[[Context], TaskDescription]
"""``describe(context) -> TaskDescription``: a factory's hook (:func:`with_describer`); it must
equal what the built task gives."""

#: ``(factory, describe)``: the owner named, so a ``functools.wraps`` wrapper does not inherit it
_DESCRIBER_ATTR = "_flwr_sheaf_describer"


def with_describer(factory: TaskFactory, describe: TaskDescriber) -> TaskFactory:
    """Attach ``describe`` to ``factory`` (not to its wrappers) as its description hook and return
    ``factory``; the ``query`` handler fails a node whose built task says otherwise.

    Raises:
        TypeError: ``describe`` is not callable, or ``factory`` takes no attributes.
    """
    if not callable(describe):
        raise TypeError(f"describe must be callable, got {describe!r}")
    try:
        setattr(factory, _DESCRIBER_ATTR, (factory, describe))
    except AttributeError:
        raise TypeError(
            f"with_describer: cannot attach a hook to {factory!r}; pass a plain function or a "
            f"functools.partial as the factory"
        ) from None
    return factory


def describer_of(factory: TaskFactory) -> TaskDescriber | None:
    """The description hook attached to ``factory`` itself by :func:`with_describer`, or None."""
    owner, describe = getattr(factory, _DESCRIBER_ATTR, (None, None))
    return describe if owner is factory and callable(describe) else None


def save_module_state(
    context: Context, key: str, module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Store a module's ``state_dict`` in ``context.state[key]`` (ArrayRecord) and optionally its
    optimizer's as ``torch.save`` bytes in ``context.state[key + ".optim"]`` (ConfigRecord)."""
    context.state[key] = ArrayRecord(
        {k: v.detach().cpu() for k, v in module.state_dict().items()}, keep_input=True
    )
    if optimizer is not None:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        context.state[f"{key}.optim"] = ConfigRecord({"blob": buf.getvalue()})


def load_module_state(
    context: Context, key: str, module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> bool:
    """Restore what :func:`save_module_state` stored; returns False when nothing was stored yet.

    Raises:
        RuntimeError: the stored ``state_dict`` does not fit ``module``.
    """
    if key not in context.state:
        return False
    module.load_state_dict(array_record(context.state, key).to_torch_state_dict())
    okey = f"{key}.optim"
    if optimizer is not None and okey in context.state:
        blob = as_bytes(config_record(context.state, okey)["blob"], f"{okey}/blob")
        optimizer.load_state_dict(
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
        )
    return True


def set_torch_threads(n: int) -> None:
    """Set torch's intra-op threads (run-config ``torch-threads``; 0 leaves torch's default:
    simulated nodes sharing few cores ran ~30x slower with more than one thread each)."""
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)
