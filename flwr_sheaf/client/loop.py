"""The one local-training loop of every method; a method contributes only its loss plug-in.

:func:`train_local` owns batching (drop-last, reshuffled each epoch from the round's generator),
SGD, per-agent gradient clipping, the step cap and the non-finite-loss guard. A method's objective
is a :class:`LossPlugin`: cross-entropy (:class:`CrossEntropy`, the non-cooperative baseline),
Sheaf-FRL's gluing (:class:`flwr_sheaf.methods.sheaf_frl.client.SheafGluing`), FedProto's and FedSAF's
prototype terms (:mod:`flwr_sheaf.methods.fedproto.client`, :mod:`flwr_sheaf.methods.fedsaf.client`).
"""

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
    """A method's local objective, called by :func:`train_local` once per SGD step.

    Override :meth:`loss` (required), :meth:`begin_epoch` (e.g. refit restriction maps),
    :meth:`after_step` (step the method's own parameters, e.g. ComFed's projection) and
    :meth:`metrics` (values other than per-step means, e.g. per-edge lists).
    """

    def begin_epoch(self, model: StalkModel, epoch: int) -> None:
        """Called before each local epoch (``epoch = 0, 1, ...``) with the current weights."""

    def loss(
        self, model: StalkModel, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, Mapping[str, float]]:
        """Loss of one private batch ``x (B, ...)``, ``y (B,)`` (model in train mode on entry).

        Returns:
            ``(loss, parts)``: a scalar tensor to minimise and named values (``"ce"`` at least on
            the first step), each averaged over the steps that returned it into the round's metrics. A value may be a Python float or a
            detached 0-d tensor: tensors stay on the device and are read back once per round
            (no host synchronisation per step on a GPU).
        """
        raise NotImplementedError

    def plan_epoch(self, steps: int, gen: torch.Generator) -> None:
        """Called once per epoch after the batch order is drawn, with the epoch's number of steps.

        A plug-in that draws per-step randomness from ``gen`` may draw all of it here instead, in
        the same order (so the numbers are unchanged), and move it to the device in one copy (one
        host-to-device transfer per epoch instead of one per step). Default: nothing.
        """

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
    lines 4-12): per epoch ``plugin.begin_epoch``, then ``max(1, M // batch_size)`` batches (capped
    at ``max_steps_per_epoch`` when > 0) of a permutation drawn from the round's generator ``gen``;
    per batch ``plugin.loss``, backward, gradient-norm clipping at ``clip_norm`` (0 = off), SGD step.

    Returns:
        the means of the plug-in's parts (each over the steps that returned it) and of ``grad-norm``,
        ``steps``, plus ``plugin.metrics(steps)``.

    Raises:
        FloatingPointError: a non-finite loss (``server_round`` named); Flower turns it into this
            node's error reply and keeps its previous state.
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
            # the plug-in's contract, before the step is taken ("ce" on the first step at least)
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
    """:meth:`LossPlugin.metrics`' return as Flower's ``MetricRecord`` holds it: numpy and 0-d
    torch values become Python numbers (arrays lists of numbers).

    Raises:
        TypeError: not a mapping, or a value that is not a number or a list of numbers; the plug-in's
            class and the key named.
    """
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
    """What :meth:`LossPlugin.loss` must return: a 0-d tensor and a mapping (with ``"ce"``, the
    round's cross-entropy column, docs/results-schema.md, when ``need_ce``), each part a 0-d tensor
    or a real number (a part missing on some steps is averaged over the steps that returned it).

    Raises:
        TypeError: either is not so; the message names the plug-in's class (the method's code) and
            what it returned.
    """
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
    """What is wrong with one loss part ``value`` (a short description), or None when it is a 0-d
    tensor or a real number (not a bool)."""
    if isinstance(value, torch.Tensor):
        return None if value.dim() == 0 else f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return None
    return f"{value!s:.60} (a {type(value).__name__})"


def _mean(values: list) -> float:
    """Sequential float64 mean of per-step values (floats or 0-d tensors), read back in one transfer:
    over the steps that reported the value (a part a plug-in returns on some steps only).

    The sum runs in Python in step order, exactly as ``sum(float(v) for v in values)``, so the
    numbers do not depend on whether a plug-in returned floats or tensors.
    """
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
