"""The one local-training loop of every method; a method contributes only its :class:`LossPlugin`."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..config import LocalTrainConfig
from .task import LocalTask, StalkModel

__all__ = ["LossPlugin", "CrossEntropy", "train_local"]


class LossPlugin:
    """A method's local objective, called by :func:`train_local` once per SGD step (override
    :meth:`loss`; the other hooks are optional)."""

    def begin_epoch(self, model: StalkModel, epoch: int) -> None:
        """Called before each local epoch (``epoch = 0, 1, ...``) with the current weights."""

    def loss(
        self, model: StalkModel, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, Mapping[str, float]]:
        """Loss of one private batch ``x (B, ...)``, ``y (B,)`` (model in train mode on entry).

        Returns:
            ``(loss, parts)``: a 0-d tensor to minimise and named values (``"ce"`` at least on the
            first step; floats or detached 0-d tensors), each averaged over the steps returning it.
        """
        raise NotImplementedError

    def plan_epoch(self, steps: int, gen: torch.Generator) -> None:
        """Called once per epoch after the batch order is drawn, with its number of steps (a plug-in
        may draw the epoch's per-step randomness from ``gen`` here, in the same order)."""

    def after_step(self) -> None:
        """Called after each SGD step of the model (a method with its own parameters steps them here)."""

    def metrics(self, steps: int) -> dict:
        """Extra metrics after training (``steps`` = SGD steps taken)."""
        return {}


class CrossEntropy(LossPlugin):
    """Cross-entropy of the private path ``model.private_logits`` (the non-cooperative objective)."""

    def loss(self, model, x, y, gen):  # noqa: D102 - documented on the base class
        ce = F.cross_entropy(model.private_logits(x), y)
        return ce, {"ce": ce.detach()}


def train_local(
    task: LocalTask,
    opt: torch.optim.Optimizer,
    cfg: LocalTrainConfig,
    plugin: LossPlugin,
    gen: torch.Generator,
    server_round: int,
) -> dict:
    """Train ``task.model`` for ``cfg.local_epochs`` epochs on ``plugin``'s objective (paper Alg. 1
    lines 4-12): ``max(1, M // batch_size)`` batches an epoch (capped at ``max_steps_per_epoch`` when
    > 0) of a permutation from ``gen``; per batch loss, backward, clipping at ``clip_norm`` (0 = off), SGD.

    Returns:
        the means of the plug-in's parts and of ``grad-norm``, ``steps``, ``plugin.metrics(steps)``.

    Raises:
        FloatingPointError: a non-finite loss (``server_round`` named).
        ValueError: an empty training set.
    """
    model = task.model
    n = int(task.x_train.shape[0])
    if n == 0:
        raise ValueError("the node has no training samples (x_train is empty)")
    dev = task.x_train.device
    on_cpu = dev.type == "cpu"
    values: dict[str, list] = {"grad-norm": []}
    steps = 0
    clip = cfg.clip_norm if cfg.clip_norm > 0 else float("inf")
    for epoch in range(cfg.local_epochs):
        plugin.begin_epoch(model, epoch)
        perm = torch.randperm(n, generator=gen)
        nb = max(1, n // cfg.batch_size)  # drop_last, at least one batch
        if cfg.max_steps_per_epoch > 0:
            nb = min(nb, cfg.max_steps_per_epoch)
        plugin.plan_epoch(nb, gen)
        perm = perm[: nb * cfg.batch_size].to(dev)  # one host-to-device copy per epoch
        finite = None
        for b in range(nb):
            idx = perm[b * cfg.batch_size : (b + 1) * cfg.batch_size]
            model.train()
            loss, parts = plugin.loss(model, task.x_train[idx], task.y_train[idx], gen)
            _check_loss_output(plugin, loss, parts, need_ce=steps == 0)
            if on_cpu:  # no device to wait for: check every step, before the step is taken
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"non-finite loss {float(loss)} at server round {server_round}"
                    )
            else:  # accumulate on the device; checked once per epoch (state is committed only after)
                ok = torch.isfinite(loss.detach())
                finite = ok if finite is None else finite & ok
            opt.zero_grad(set_to_none=True)
            loss.backward()
            values["grad-norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            opt.step()
            plugin.after_step()
            for name, v in parts.items():
                values.setdefault(name, []).append(v)
            steps += 1
        if finite is not None and not bool(finite):
            raise FloatingPointError(
                f"non-finite loss at server round {server_round}, local epoch {epoch} "
                "(checked once per epoch on an accelerator)"
            )
    out = {k: _mean(v) for k, v in values.items()}
    out["steps"] = steps
    out.update(_checked_metrics(plugin, plugin.metrics(steps)))
    return out


def _checked_metrics(plugin: LossPlugin, metrics: Any) -> dict:
    """:meth:`LossPlugin.metrics`' return with numpy / torch values as Python numbers (or lists);
    TypeError for anything else (class and key named)."""
    where = f"{type(plugin).__module__}.{type(plugin).__qualname__}.metrics"
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where} returned a {type(metrics).__name__}; it must return a dict")
    out = {}
    for name, value in metrics.items():
        v = value.tolist() if hasattr(value, "tolist") else value  # numpy, torch: Python numbers
        items = v if isinstance(v, list) else [v]
        if not all(isinstance(x, (int, float)) for x in items):
            raise TypeError(
                f'{where} returned "{name}" = {value!s:.60} (a {type(value).__name__}): each metric '
                "must be a number or a list of numbers (docs/own-method.md)"
            )
        out[str(name)] = v
    return out


def _check_loss_output(plugin: LossPlugin, loss: Any, parts: Any, need_ce: bool = True) -> None:
    """TypeError unless :meth:`LossPlugin.loss` returned a 0-d tensor and a mapping (with ``"ce"``
    when ``need_ce``) of 0-d tensors or real numbers."""
    where = f"{type(plugin).__module__}.{type(plugin).__qualname__}.loss"
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise TypeError(
            f"{where} returned {got} as the loss; it must return (loss, parts) with loss a 0-d "
            "tensor to minimise (docs/own-method.md)"
        )
    if not isinstance(parts, Mapping) or (need_ce and "ce" not in parts):
        got = (
            f"parts ({', '.join(sorted(map(str, parts))) or 'none'})"
            if isinstance(parts, Mapping)
            else f"parts of type {type(parts).__name__}"
        )
        raise TypeError(
            f'{where} returned {got} without "ce": the parts must hold the batch cross-entropy '
            'as "ce" (e.g. {"ce": ce.detach(), ...}; docs/own-method.md)'
        )
    for name, value in parts.items():
        problem = _part_problem(value)
        if problem is not None:
            raise TypeError(
                f'{where} returned part "{name}" = {problem}: each part must be a 0-d tensor or a '
                'number (e.g. {"ce": ce.detach(), ...}; docs/own-method.md)'
            )


def _part_problem(value: Any) -> str | None:
    """What is wrong with one loss part (None for a 0-d tensor or a real number, not a bool)."""
    if isinstance(value, torch.Tensor):
        return None if value.dim() == 0 else f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return None
    return f"{value!s:.60} (a {type(value).__name__})"


def _mean(values: list) -> float:
    """Mean of per-step floats or 0-d tensors (one device read-back), summed in step order exactly
    as ``sum(float(v) for v in values)``."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    host = iter(
        torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors]).cpu().tolist()
        if tensors
        else []
    )
    total = 0.0
    for v in values:
        total += next(host) if isinstance(v, torch.Tensor) else float(v)
    return total / max(len(values), 1)
