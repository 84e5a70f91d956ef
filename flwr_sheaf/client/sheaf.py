"""Sheaf-FRL on the client (paper Alg. 1): the gluing loss plug-in and its handlers.

Per ``train.sheaf`` message a node receives its neighbours' latest whitened pilot matrices
``(K, d_j)`` (record ``pilots``), its incident edges (:class:`flwr_sheaf.protocol.EdgeConfig`) and
lambda for this round, then for every local epoch (i) refits every incident restriction map by
Procrustes (Eq. 18) on the current pilots and (ii) trains on CE + the local gluing penalty
(Eq. 16, neighbours' pilots constant, gradient Eq. 19). Afterwards it re-fits the whitening on its
pilot latents and replies with its new whitened pilot matrix ``(K, d_i)``, also cached in
``context.state`` (the next round's first maps and the evaluation reuse it). In round 1 no node has
pilots of its neighbours yet, so it trains on CE only.

Stable formulation (docs/stability.md): the penalty uses *dropout-free* pilot passes (encoder in
eval mode) whitened with *differentiable batch statistics* (whitening layer in train mode), so the
encoder cannot lower it by shrinking its latents or by dropout noise; maps are refitted every
local epoch; the loop clips the gradient norm per agent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from ..config import SheafConfig
from ..protocol import (CONFIG, LOW_VARIANCE_FRACTION, OWN_PILOTS, PILOTS, EdgeConfig, ProtocolError, pack_arrays,
                        unpack_neighbour_pilots)
from ..sheaf import EdgeTerm, check_pilots, local_gluing_penalty, procrustes
from .common import cached_pilots, from_numpy, store_pilots, task_device, to_numpy, whitened_pilots
from .handlers import ClientMethod, register_method_handlers
from .loop import LossPlugin
from .task import LocalTask, TaskFactory

__all__ = ["SheafGluing", "SheafClient", "register_sheaf_handlers"]


class SheafGluing(LossPlugin):
    """CE + the local gluing penalty of paper Eq. 16 on a pilot minibatch.

    Args:
        task: the node's task (its ``x_pilot (K, ...)``).
        lam: lambda >= 0 of this round (lambda_i = lambda / d_i inside the penalty).
        pilot_batch_size: pilot rows per step (the same rows of every neighbour's matrix).
        edges: the node's incident edges (neighbours, d_j, orientation, optional weights).
        neighbour_pilots: ``{j: (K, d_j)}`` float32 whitened pilots of the neighbours that have
            reported any; a neighbour without pilots contributes no term this round.
        own_pilots: this node's cached whitened pilots ``(K, d_i)`` (exact for the current weights),
            used for the first epoch's maps instead of a new pilot pass; None = compute them.

    Raises:
        ProtocolError: pilots from a partition-id that is not a neighbour.
        ValueError: a neighbour's pilots with the wrong K or d_j, or NaN/inf entries (named).
    """

    def __init__(self, task: LocalTask, lam: float, pilot_batch_size: int, edges: EdgeConfig,
                 neighbour_pilots: dict[int, torch.Tensor], own_pilots: torch.Tensor | None) -> None:
        unknown = sorted(set(neighbour_pilots) - set(edges.neighbours))
        if unknown:
            raise ProtocolError(f"received pilots from partition-id(s) {unknown} that are not neighbours")
        k = task.x_pilot.shape[0]
        weights = edges.weights or (1.0,) * len(edges.neighbours)
        self.active = [(j, hd, w) for j, hd, w in zip(edges.neighbours, edges.heads, weights) if j in neighbour_pilots]
        for j, dj in zip(edges.neighbours, edges.dims):
            if j in neighbour_pilots:
                check_pilots(neighbour_pilots[j], f"pilots of neighbour partition-id {j}", d=dj, k=k)
        self.task, self.lam, self.batch = task, float(lam), int(pilot_batch_size)
        self.pilots, self.own = neighbour_pilots, own_pilots
        self.maps: dict[int, torch.Tensor] = {}
        self.residual = {j: 0.0 for j, _, _ in self.active}

    def begin_epoch(self, model: nn.Module, epoch: int) -> None:
        """Refit every incident restriction map on the current pilots (Eq. 18; larger d is head)."""
        self.maps = {}
        if not self.active or self.lam <= 0:
            return
        own = self.own if (epoch == 0 and self.own is not None) else whitened_pilots(model, self.task.x_pilot)[1]
        for j, i_head, _ in self.active:
            self.maps[j] = procrustes(own, self.pilots[j]) if i_head else procrustes(self.pilots[j], own)

    def loss(self, model, x, y, gen):
        """``(CE + R_A|_i, parts)``: CE of the private batch plus the Eq. 16 penalty on a pilot minibatch
        drawn from ``gen`` (encoder in eval mode, whitening in train mode; docs/stability.md)."""
        ce = F.cross_entropy(model.private_logits(x), y)
        parts = {"ce": float(ce.detach()), "gluing": 0.0}
        if not self.maps:
            return ce, parts
        pidx = torch.randperm(self.task.x_pilot.shape[0], generator=gen)[: self.batch]
        model.eval()  # dropout-free, BatchNorm running statistics ...
        model.whitening.train()  # ... but differentiable batch whitening of the pilots
        a_i = model.whitening(model.latent(self.task.x_pilot[pidx]))
        terms = [EdgeTerm(j, self.pilots[j][pidx], self.maps[j], hd, float(w)) for j, hd, w in self.active]
        pen, per_edge = local_gluing_penalty(a_i, terms, self.lam)
        model.train()
        for j, r in per_edge.items():
            self.residual[j] += r
        parts["gluing"] = float(pen.detach())
        return ce + pen, parts

    def metrics(self, steps: int) -> dict:
        """Per-edge mean squared residuals (``edge-neighbour``, ``edge-residual``, aligned lists)."""
        return {"edge-neighbour": [j for j, _, _ in self.active],
                "edge-residual": [self.residual[j] / max(steps, 1) for j, _, _ in self.active]}


class SheafClient(ClientMethod):
    """Sheaf-FRL's hooks: gluing plug-in in, whitened pilots out (module docstring)."""

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:
        """:class:`SheafGluing` from the message: :class:`~flwr_sheaf.config.SheafConfig` (lambda of the
        round), the edges and the neighbours' pilots ``{j: (K, d_j)}`` (paper Alg. 1 line 3).

        Raises:
            ConfigError / ProtocolError: a missing key, malformed edges, pilots of a non-neighbour.
            ValueError: neighbour pilots with the wrong K or d_j, or NaN/inf (named).
        """
        cfg = msg.content[CONFIG]
        sheaf = SheafConfig.from_record(cfg)
        pilots = unpack_neighbour_pilots(msg.content[PILOTS]) if PILOTS in msg.content else {}
        dev = task_device(task)
        cached = cached_pilots(context, self.action, dev)
        return SheafGluing(task, sheaf.lam, sheaf.pilot_batch_size, EdgeConfig.from_config(cfg),
                           {j: from_numpy(a, dev) for j, a in pilots.items()}, None if cached is None else cached[0])

    def after_train(self, msg: Message, context: Context, task: LocalTask, plugin: LossPlugin) -> tuple[dict, dict]:
        """Fit the whitening on the pilot latents, cache the whitened pilots ``(K, d_i)`` and upload them
        (paper Alg. 1 line 13); the metric ``low-variance-fraction`` is the collapse diagnostic."""
        z, a = whitened_pilots(task.model, task.x_pilot)
        lvf = store_pilots(context, self.action, z, a)
        return {PILOTS: pack_arrays({OWN_PILOTS: to_numpy(a)})}, {LOW_VARIANCE_FRACTION: lvf}


def register_sheaf_handlers(app: ClientApp, factory: TaskFactory, action: str = "sheaf") -> ClientApp:
    """Add Sheaf-FRL's ``query``/``train``/``evaluate``/``evaluate_comm`` handlers under ``action``.

    Pair with :class:`flwr_sheaf.strategy.sheaf_frl.SheafFRL` (same ``action``). ``factory(context)``
    returns the node's :class:`~flwr_sheaf.client.task.LocalTask`.
    """
    return register_method_handlers(app, factory, SheafClient(action))
