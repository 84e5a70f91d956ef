"""Discovery and evaluation handlers shared by every method (paper Eq. 22).

- ``query.<action>``: partition-id, num-partitions, d_i, C_i, K (discovery, design.md s4.1);
- ``evaluate.<action>``: private accuracy (test and validation) and the node's whitened pilots
  and whitened validation/test latents, for the server to route to neighbours;
- ``evaluate.<action>_comm``: communication accuracy per incoming edge: neighbour j's whitened
  latents are moved into this stalk by the Procrustes map fitted on the two nodes' final pilots
  (Eq. 18), coloured and classified by this node's head (whiten_j -> V or V^T -> colour_i -> head_i).

Whitening statistics come from the pilots by default; ``whitening-fit = "train"`` in the
evaluate config refits them on the node's private training latents first (the post-hoc protocol
of the paper's non-cooperative baseline, notes anchor-sfrl-reference.md s4).
Refitting maps on the final pilots makes lambda = 0 exactly the post-hoc alignment baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..sheaf import check_pilots, procrustes
from ..sheaf.whitening import low_variance_fraction
from .common import (accuracy, build, cached_pilots, edges_from_config, eval_latents, eval_logits, pilots_key,
                     transport, whitened_pilots)
from .task import LocalTask, TaskFactory, numpy_record, set_torch_threads

__all__ = ["register_query_handler", "register_evaluation_handlers", "store_pilots"]


def store_pilots(context: Context, action: str, latents: torch.Tensor, pilots: torch.Tensor) -> None:
    """Cache the node's whitened pilots ``(K, d_i)`` and the collapse diagnostic of its raw latents."""
    context.state[pilots_key(action)] = numpy_record(
        {"pilots": pilots.numpy(), "low-variance-fraction": np.array([low_variance_fraction(latents)])}
    )


def register_query_handler(app: ClientApp, factory: TaskFactory, action: str) -> None:
    """Add ``query.<action>`` (discovery reply as a MetricRecord named ``info``)."""

    @app.query(action)
    def _query(msg: Message, context: Context) -> Message:
        set_torch_threads(context)
        task = factory(context)
        info = MetricRecord({
            "partition-id": int(context.node_config["partition-id"]),
            "num-partitions": int(context.node_config.get("num-partitions", 0)),
            "d": int(task.model.d),
            "classes": [int(c) for c in task.classes],
            "num-pilots": int(task.x_pilot.shape[0]),
        })
        return Message(RecordDict({"info": info}), reply_to=msg)


def register_evaluation_handlers(app: ClientApp, factory: TaskFactory, action: str,
                                 extra_metrics: Callable[[Message, LocalTask, nn.Module], Mapping] | None = None) -> None:
    """Add ``evaluate.<action>`` and ``evaluate.<action>_comm`` (see the module docstring).

    Args:
        extra_metrics: optional ``extra_metrics(msg, task, model) -> {name: float}`` merged into the
            ``evaluate.<action>`` reply (e.g. FedProto's nearest-prototype accuracy); the model is
            in eval mode with its trained weights.
    """

    def _pilots(task, model, context, cfg):
        """Whitened pilots for evaluation (refitting the whitening when asked or never trained)."""
        fit = str(cfg.get("whitening-fit", "pilots")) if cfg is not None else "pilots"
        if fit not in ("pilots", "train"):
            raise ValueError(f"whitening-fit must be 'pilots' or 'train', got {fit!r}")
        cached = cached_pilots(context, action)
        if fit == "pilots" and cached is not None:
            return cached, float(context.state[pilots_key(action)]["low-variance-fraction"].numpy()[0])
        z = eval_latents(model, task.x_pilot)
        if fit == "train":
            model.whitening.fit(eval_latents(model, task.x_train))
            model.whitening.eval()
            with torch.no_grad():
                return model.whitening(z), low_variance_fraction(z)
        return whitened_pilots(model, task.x_pilot)[1], low_variance_fraction(z)

    @app.evaluate(action)
    def _evaluate(msg: Message, context: Context) -> Message:
        task, model, _ = build(factory, context, action)
        cfg = msg.content["config"] if "config" in msg.content else None
        a, lvf = _pilots(task, model, context, cfg)
        with torch.no_grad():
            zt = model.whitening(eval_latents(model, task.x_test))
            zv = model.whitening(eval_latents(model, task.x_val))
        arrays = numpy_record({
            "pilots": a.numpy(),
            "test-latents": zt.numpy(), "test-labels": task.y_test.numpy(),
            "val-latents": zv.numpy(), "val-labels": task.y_val.numpy(),
        })
        metrics = MetricRecord({
            "private-accuracy": accuracy(eval_logits(model, task.x_test), task.y_test),
            "val-private-accuracy": accuracy(eval_logits(model, task.x_val), task.y_val),
            "num-test": int(task.y_test.numel()),
            "low-variance-fraction": lvf,
            "d": int(model.d),
            **(dict(extra_metrics(msg, task, model)) if extra_metrics is not None else {}),
        })
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    @app.evaluate(f"{action}_comm")
    def _evaluate_comm(msg: Message, context: Context) -> Message:
        task, model, _ = build(factory, context, action)
        cfg = msg.content["config"]
        own, _ = _pilots(task, model, context, cfg)
        rec = msg.content["arrays"]
        src, acc_test, acc_val = [], [], []
        model.eval()
        for j, dj, i_head in edges_from_config(cfg):
            a_j = torch.from_numpy(rec[f"{j}/pilots"].numpy()).float()
            check_pilots(a_j, f"pilots of neighbour partition-id {j}", d=dj, k=own.shape[0])
            v = procrustes(own, a_j) if i_head else procrustes(a_j, own)
            res = []
            for split in ("test", "val"):
                z = torch.from_numpy(rec[f"{j}/{split}-latents"].numpy()).float()
                y = torch.from_numpy(rec[f"{j}/{split}-labels"].numpy()).long()
                check_pilots(z, f"{split} latents of neighbour partition-id {j}", d=dj)
                with torch.no_grad():
                    res.append(accuracy(model.classify_whitened(transport(z, v, i_head)), y))
            src.append(j)
            acc_test.append(res[0])
            acc_val.append(res[1])
        metrics = MetricRecord({"src": src, "communication-accuracy": acc_test, "val-communication-accuracy": acc_val})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)
