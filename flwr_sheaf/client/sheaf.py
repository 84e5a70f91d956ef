"""Sheaf-FRL ClientApp handlers (paper Alg. 1, one server round = a few local epochs).

``register_sheaf_handlers(app, factory)`` adds, under their own action names so they sit beside a
user's default ``train``/``evaluate``:

- ``query.sheaf``: discovery reply (partition-id, num-partitions, d_i, C_i);
- ``train.sheaf``: receive the neighbours' latest whitened pilot matrices, then per local epoch
  (i) refit every incident restriction map by Procrustes (Eq. 18) on the current pilots and
  (ii) train on CE + the local gluing penalty (Eq. 16, neighbours' pilots constant, Eq. 19);
  finally re-estimate the whitening statistics on the pilot latents and reply with the new
  whitened pilot matrix ``(K, d_i)``;
- ``evaluate.sheaf``: private accuracy and the whitened validation/test latents to route;
- ``evaluate.sheaf_comm``: communication accuracy per incoming edge (Eq. 22): neighbour j's
  latents are moved into this stalk by the Procrustes map fitted on the final pilots, coloured
  and classified by this node's head.

Stable formulation (see README "Why it is stable"): the penalty is computed on *dropout-free*
pilot passes (encoder in eval mode) whose latents are whitened with *differentiable batch
statistics* (the whitening layer in train mode, as BatchNorm), so the encoder cannot lower the
penalty by shrinking or by dropout noise; restriction maps are refitted every local epoch; the
gradient norm is clipped per agent. All per-node state lives in ``context.state`` (committed by
Flower only when a handler succeeds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from ..sheaf import EdgeTerm, check_pilots, local_gluing_penalty, procrustes
from ..sheaf.whitening import low_variance_fraction
from .common import build, cached_pilots, edges_from_config, model_key, neighbour_arrays, whitened_pilots
from .evaluation import register_evaluation_handlers, register_query_handler, store_pilots
from .task import LocalTask, TaskFactory, numpy_record, save_module_state

__all__ = ["register_sheaf_handlers", "SheafTrainConfig", "train_sheaf", "BatchLoss", "edge_weights_from_config"]

#: ``batch_loss(model, x, y) -> (loss, parts)``: a training batch's objective (see :func:`train_sheaf`).
BatchLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Mapping[str, float]]]

class SheafTrainConfig:
    """Local-training hyper-parameters read from a message's ``config`` record (with defaults).

    Keys (run-config spelling): ``lambda`` (0.1), ``local-epochs`` (2), ``lr`` (0.05),
    ``momentum`` (0.9), ``weight-decay`` (5e-4), ``batch-size`` (32), ``pilot-batch-size`` (64),
    ``clip-norm`` (5.0), ``seed`` (0), ``server-round``, ``max-steps-per-epoch`` (0 = every batch of the
    local data; a positive cap fixes the work per participant, e.g. for scale benchmarks).

    Raises:
        ValueError: negative lambda / epochs / learning rate (the value is named).
    """

    def __init__(self, cfg: Mapping) -> None:
        self.lam = float(cfg.get("lambda", 0.1))
        self.local_epochs = int(cfg.get("local-epochs", 2))
        self.lr = float(cfg.get("lr", 0.05))
        self.momentum = float(cfg.get("momentum", 0.9))
        self.weight_decay = float(cfg.get("weight-decay", 5e-4))
        self.batch_size = int(cfg.get("batch-size", 32))
        self.pilot_batch_size = int(cfg.get("pilot-batch-size", 64))
        self.clip_norm = float(cfg.get("clip-norm", 5.0))
        self.seed = int(cfg.get("seed", 0))
        self.server_round = int(cfg.get("server-round", 0))
        self.max_steps_per_epoch = int(cfg.get("max-steps-per-epoch", 0))
        for name, v in [("lambda", self.lam), ("local-epochs", self.local_epochs), ("lr", self.lr)]:
            if v < 0 or (isinstance(v, float) and math.isnan(v)):
                raise ValueError(f"{name} must be >= 0, got {v}")


def cfg_rec_sgd(cfg: "SheafTrainConfig") -> dict:
    """SGD settings of a :class:`SheafTrainConfig` in :func:`~flwr_sheaf.client.common.build`'s form."""
    return {"lr": cfg.lr, "momentum": cfg.momentum, "weight-decay": cfg.weight_decay}


def train_sheaf(task: LocalTask, model: nn.Module, opt: torch.optim.Optimizer, cfg: SheafTrainConfig,
                neighbour_pilots: Mapping[int, torch.Tensor], edges: list[tuple[int, int, bool]],
                own_pilots: torch.Tensor | None = None, batch_loss: BatchLoss | None = None,
                edge_weights: Mapping[int, float] | None = None) -> dict:
    """Local Sheaf-FRL training of one node for ``cfg.local_epochs`` epochs (paper Alg. 1).

    Args:
        task: the node's model and data.
        model: ``task.model`` (weights already restored).
        opt: its SGD optimizer.
        cfg: hyper-parameters.
        neighbour_pilots: ``{j: (K, d_j)}`` latest whitened pilots of the neighbours that have
            reported any (a neighbour without pilots contributes no term this round).
        edges: ``(j, d_j, i_is_head)`` for every incident edge.
        own_pilots: this node's whitened pilots ``(K, d_i)`` as last sent (exact for the current
            weights when nothing changed since); saves one pilot pass for the first epoch's maps.
        batch_loss: the supervised loss of a training batch, ``batch_loss(model, x, y) ->
            (loss, parts)`` (model in train mode; ``parts`` maps names, including ``"ce"``, to
            floats averaged over steps into the returned metrics). Default: cross-entropy of
            ``model.private_logits``. Other methods (FedProto, FedSAF) pass their objective here
            and reuse this loop (batching, clipping, SGD) with no pilots.
        edge_weights: optional ``{j: w_ij >= 0}`` multipliers of the edge terms (default 1; the
            server's ``drop-reweighted`` absent policy sends ``1/q_j``). Restriction maps do not
            depend on them.

    Returns:
        metrics dict (means over steps): ``ce``, ``gluing``, ``grad-norm``, per-edge residuals.
    """
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + cfg.server_round * 7919 + int(model.d))
    k = task.x_pilot.shape[0]
    active = [(j, dj, hd) for j, dj, hd in edges if j in neighbour_pilots]
    for j, dj, _ in active:
        check_pilots(neighbour_pilots[j], f"pilots of neighbour partition-id {j}", d=dj, k=k)
    ce_fn = nn.CrossEntropyLoss()
    sums = {"ce": 0.0, "gluing": 0.0, "grad-norm": 0.0}
    steps = 0
    edge_res = {j: 0.0 for j, _, _ in active}
    n = task.x_train.shape[0]
    for _epoch in range(cfg.local_epochs):
        maps = {}
        if active and cfg.lam > 0:
            own = own_pilots if (_epoch == 0 and own_pilots is not None) else whitened_pilots(model, task.x_pilot)[1]
            for j, _, i_head in active:
                a_j = neighbour_pilots[j]
                maps[j] = procrustes(own, a_j) if i_head else procrustes(a_j, own)
        perm = torch.randperm(n, generator=gen)
        nb = max(1, n // cfg.batch_size)  # drop_last, at least one batch
        if cfg.max_steps_per_epoch > 0:
            nb = min(nb, cfg.max_steps_per_epoch)
        for b in range(nb):
            idx = perm[b * cfg.batch_size : (b + 1) * cfg.batch_size]
            model.train()
            if batch_loss is None:
                loss = ce_fn(model.private_logits(task.x_train[idx]), task.y_train[idx])
                sums["ce"] += float(loss.detach())
            else:
                loss, parts = batch_loss(model, task.x_train[idx], task.y_train[idx])
                for name, v in parts.items():
                    sums[name] = sums.get(name, 0.0) + float(v)
            if maps:
                pidx = torch.randperm(k, generator=gen)[: cfg.pilot_batch_size]
                model.eval()  # dropout-free, BN running statistics ...
                model.whitening.train()  # ... but differentiable batch whitening of the pilots
                a_i = model.whitening(model.latent(task.x_pilot[pidx]))
                ew = edge_weights or {}
                terms = [EdgeTerm(j, neighbour_pilots[j][pidx], maps[j], hd, float(ew.get(j, 1.0))) for j, _, hd in active]
                pen, per_edge = local_gluing_penalty(a_i, terms, cfg.lam)
                loss = loss + pen
                sums["gluing"] += float(pen.detach())
                for j, r in per_edge.items():
                    edge_res[j] += r
                model.train()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {float(loss)} at server round {cfg.server_round}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm if cfg.clip_norm > 0 else float("inf"))
            sums["grad-norm"] += float(gn)
            opt.step()
            steps += 1
    out = {k2: v / max(steps, 1) for k2, v in sums.items()}
    out["edge-residual"] = [edge_res[j] / max(steps, 1) for j, _, _ in active]
    out["edge-neighbour"] = [j for j, _, _ in active]
    return out


def edge_weights_from_config(cfg: Mapping, edges: list[tuple[int, int, bool]]) -> dict[int, float] | None:
    """Per-edge weights ``{j: w_ij}`` from the optional ``edge-weights`` config list (aligned with
    ``neighbours``); None when absent (all weights 1).

    Raises:
        ValueError: a list of the wrong length, or a negative / non-finite weight (named).
    """
    if "edge-weights" not in cfg:
        return None
    ws = [float(w) for w in cfg["edge-weights"]]
    if len(ws) != len(edges):
        raise ValueError(f"malformed neighbour config: {len(edges)} neighbours but {len(ws)} edge weights")
    for (j, _, _), w in zip(edges, ws):
        if not (math.isfinite(w) and w >= 0.0):
            raise ValueError(f"edge weight of neighbour partition-id {j} must be finite and >= 0, got {w}")
    return {j: w for (j, _, _), w in zip(edges, ws)}


def register_sheaf_handlers(app: ClientApp, factory: TaskFactory, action: str = "sheaf") -> ClientApp:
    """Register the Sheaf-FRL handlers on a (possibly existing) ``ClientApp``.

    Args:
        app: the ClientApp to extend; its own default handlers are untouched.
        factory: builds the node's :class:`LocalTask` from its ``Context``.
        action: action name; messages ``query.<action>``, ``train.<action>``,
            ``evaluate.<action>`` and ``evaluate.<action>_comm`` are routed here.

    Returns:
        ``app`` (for chaining).
    """

    register_query_handler(app, factory, action)
    register_evaluation_handlers(app, factory, action)

    @app.train(action)
    def _train(msg: Message, context: Context) -> Message:
        cfg_rec = msg.content["config"]
        cfg = SheafTrainConfig(cfg_rec)
        task, model, opt = build(factory, context, action, sgd=cfg_rec_sgd(cfg))
        edges = edges_from_config(cfg_rec)
        pilots = neighbour_arrays(msg.content["pilots"]) if "pilots" in msg.content else {}
        unknown = sorted(set(pilots) - {j for j, _, _ in edges})
        if unknown:
            raise ValueError(f"received pilots from partition-id(s) {unknown} that are not neighbours")
        weights = edge_weights_from_config(cfg_rec, edges)
        metrics = train_sheaf(task, model, opt, cfg, pilots, edges, own_pilots=cached_pilots(context, action),
                              edge_weights=weights)
        z, a = whitened_pilots(model, task.x_pilot)
        save_module_state(context, model_key(action), model, opt)
        store_pilots(context, action, z, a)
        reply = RecordDict({
            "pilots": numpy_record({"pilots": a.numpy()}),
            "metrics": MetricRecord({
                "num-examples": int(task.x_train.shape[0]),
                "ce": metrics["ce"],
                "gluing": metrics["gluing"],
                "grad-norm": metrics["grad-norm"],
                "edge-neighbour": metrics["edge-neighbour"],
                "edge-residual": metrics["edge-residual"],
                "low-variance-fraction": low_variance_fraction(z),
            }),
        })
        return Message(reply, reply_to=msg)

    return app
