"""Client-side helpers shared by every method's handlers (no CNN specifics, no method logic)."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import numpy as np
import torch
from flwr.app import Context

from ..config import LocalTrainConfig
from ..devices import resolve_device
from ..protocol import array_record, pack_arrays, pilot_digest
from ..sheaf.whitening import low_variance_fraction
from .task import (
    TASK_TENSORS,
    LocalTask,
    StalkModel,
    TaskFactory,
    load_module_state,
    set_torch_threads,
)

__all__ = [
    "accuracy",
    "transport",
    "eval_latents",
    "eval_logits",
    "build",
    "whitened_pilots",
    "cached_pilots",
    "store_pilots",
    "model_key",
    "round_generator",
    "to_device",
    "to_numpy",
    "from_numpy",
    "task_device",
    "resident",
    "inference_batch",
    "shared_pilot_digest",
]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor on any device as a CPU numpy array (detached; what goes into a message)."""
    return t.detach().cpu().numpy()


def from_numpy(a, on: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
    """A received array (numpy or array-like) as a tensor on device ``on`` (optionally cast to ``dtype``)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(device=on, dtype=dtype) if dtype is not None else t.to(on)


def task_device(task: LocalTask) -> torch.device:
    """The device the task's tensors (and model) live on."""
    return task.x_pilot.device


def to_device(task: LocalTask, device: torch.device) -> LocalTask:
    """The task with its model (moved in place) and every tensor (:func:`resident`) on ``device``."""
    task.model.to(device)
    if all(getattr(task, name).device == device for name in TASK_TENSORS):
        return task
    moved: dict[str, Any] = {name: resident(getattr(task, name), device) for name in TASK_TENSORS}
    return dataclasses.replace(task, **moved)


#: ``(id(cpu_tensor), device) -> device copy``; an entry is dropped when its CPU tensor is freed.
_RESIDENT: dict[tuple[int, str], torch.Tensor] = {}


def resident(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, copied once per CPU tensor object while it lives (never modify ``t``)."""
    if t.device == device:
        return t
    key = (id(t), str(device))
    hit = _RESIDENT.get(key)
    if hit is None:
        hit = _RESIDENT[key] = t.to(device)
        weakref.finalize(t, _RESIDENT.pop, key, None)
    return hit


def model_key(action: str) -> str:
    """``context.state`` key of a method's model (and ``<key>.optim``)."""
    return f"{action}.model"


def _pilots_key(action: str) -> str:
    return f"{action}.pilots"


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of ``(M, C)`` logits against ``(M,)`` int64 labels (NaN for M = 0)."""
    if y.numel() == 0:
        return float("nan")
    return float((logits.argmax(1) == y).float().mean())


def transport(z_src: torch.Tensor, v: torch.Tensor, receiver_is_head: bool) -> torch.Tensor:
    """Move row-wise whitened latents ``(M, d_src)`` into the receiver's stalk (paper Eq. 22).

    ``v`` is the restriction map ``(d_head, d_tail)``. Receiver head: ``z_h = V z_t`` (rows
    ``Z V^T``); receiver tail: ``z_t = V^T z_h`` (rows ``Z V``).
    """
    return z_src @ v.T if receiver_is_head else z_src @ v


@torch.no_grad()
def eval_latents(model: StalkModel, x: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """Raw eval-mode latents ``(M, d)`` float32 of inputs ``(M, ...)`` (batched, no gradient)."""
    batch = batch or inference_batch(x)
    model.eval()
    if not len(x):
        return x.new_zeros(0, model.d)
    return torch.cat([model.latent(x[i : i + batch]) for i in range(0, len(x), batch)])


@torch.no_grad()
def eval_logits(model: StalkModel, x: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """Eval-mode private logits ``(M, C)`` of inputs ``(M, ...)`` (batched, no gradient)."""
    batch = batch or inference_batch(x)
    model.eval()
    return torch.cat([model.private_logits(x[i : i + batch]) for i in range(0, len(x), batch)])


def inference_batch(x: torch.Tensor) -> int:
    """Rows per inference pass: 512 on the CPU (the numbers tests pin), 8192 on an accelerator."""
    return 512 if x.device.type == "cpu" else 8192


def round_generator(seed: int, partition_id: int, server_round: int) -> torch.Generator:
    """A CPU ``torch.Generator`` of (seed, partition-id, round); reseeds torch's global one too."""
    entropy = [int(seed), int(partition_id), int(server_round)]
    s = int(np.random.SeedSequence(entropy).generate_state(1)[0])
    if _accelerator_present():
        torch.manual_seed(s)
    else:  # the same CPU stream without the accelerators' lazy seeding (a stack trace each, ~4 ms)
        torch.default_generator.manual_seed(s)
    return torch.Generator().manual_seed(s)


@functools.cache
def _accelerator_present() -> bool:
    """Whether torch sees an accelerator whose generator ``torch.manual_seed`` also seeds."""
    mps = getattr(torch.backends, "mps", None)
    return bool(
        torch.cuda.is_available()
        or (hasattr(torch, "xpu") and torch.xpu.is_available())
        or (mps is not None and mps.is_available())
        or (hasattr(torch, "mtia") and torch.mtia.is_available())
    )


def build(
    factory: TaskFactory,
    context: Context,
    action: str,
    threads: int,
    train: LocalTrainConfig | None = None,
    device_spec: str | None = None,
) -> tuple[LocalTask, StalkModel, torch.optim.Optimizer | None]:
    """``(task, task.model, optimizer or None)``: the node's task on the device of ``train.device``
    (else ``device_spec``) with its weights (and SGD state when ``train`` is given) restored.

    Raises:
        whatever the factory raises; :class:`~flwr_sheaf.devices.DeviceUnavailableError` for a device
        this machine lacks; ``RuntimeError`` when the stored state does not fit the rebuilt model.
    """
    set_torch_threads(threads)
    spec = train.device if train is not None else device_spec
    if spec is None:
        raise ValueError("build() needs train or device_spec (the run-config key 'device')")
    task = to_device(factory(context), resolve_device(spec))
    opt = None
    if train is not None:
        opt = torch.optim.SGD(
            task.model.parameters(),
            lr=train.lr,
            momentum=train.momentum,
            weight_decay=train.weight_decay,
        )
    load_module_state(context, model_key(action), task.model, opt)
    return task, task.model, opt


def whitened_pilots(model: StalkModel, x_pilot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode pilot latents ``(K, d)`` and their whitening fitted on them (notes/stability.md)."""
    z = eval_latents(model, x_pilot)
    model.whitening.fit(z)
    model.whitening.eval()
    with torch.no_grad():
        return z, model.whitening(z)


def store_pilots(
    context: Context, action: str, latents: torch.Tensor, pilots: torch.Tensor
) -> float:
    """Cache the node's whitened pilots ``(K, d_i)``; returns the low-variance fraction of its raw
    ``latents`` (share of dimensions with variance < 1e-3), cached with them."""
    lvf = low_variance_fraction(latents)
    context.state[_pilots_key(action)] = pack_arrays(
        {"pilots": to_numpy(pilots), "low-variance-fraction": np.array([lvf])}
    )
    return lvf


def cached_pilots(
    context: Context, action: str, on: torch.device | str = "cpu"
) -> tuple[torch.Tensor, float] | None:
    """This node's whitened pilots ``(K, d_i)`` on ``on`` and low-variance fraction from its last
    training round (exact for the current weights), or None."""
    key = _pilots_key(action)
    if key not in context.state:
        return None
    rec = array_record(context.state, key)
    lvf = float(rec["low-variance-fraction"].numpy()[0])
    return from_numpy(rec["pilots"].numpy().copy(), on), lvf


#: ``id(pilot tensor) -> (tensor version, digest)``; an entry is dropped when its tensor is freed.
_DIGESTS: dict[int, tuple[int, int]] = {}


def shared_pilot_digest(x_pilot: torch.Tensor) -> int:
    """:func:`~flwr_sheaf.protocol.pilot_digest` of ``x_pilot``, cached per tensor and version."""
    key, version = id(x_pilot), x_pilot._version
    hit = _DIGESTS.get(key)
    if hit is not None and hit[0] == version:
        return hit[1]
    digest = pilot_digest(to_numpy(x_pilot))
    if hit is None:
        weakref.finalize(x_pilot, _DIGESTS.pop, key, None)
    _DIGESTS[key] = (version, digest)
    return digest
