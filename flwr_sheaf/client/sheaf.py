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
from ..protocol import (CONFIG, LOW_VARIANCE_FRACTION, OWN_PILOTS, PILOT_DESCRIBE, PILOT_FEATURES, PILOT_INDEX_DIGEST,
                        PILOT_LABELS, PILOT_PUBLIC, PILOT_SELECTION, PILOTS, EdgeConfig, ProtocolError, index_digest,
                        pack_arrays, unpack_neighbour_pilots, unpack_pilot_selection)
from ..sheaf import EdgeTerm, check_pilots, local_gluing_penalty, procrustes
from ..sheaf.pilots import PilotSelection, apply_selection, group_means, parseval, public_pilot_features
from .common import cached_pilots, from_numpy, store_pilots, task_device, to_numpy, whitened_pilots
from .handlers import ClientMethod, register_method_handlers
from .loop import LossPlugin
from .task import LocalTask, TaskFactory

__all__ = ["SheafGluing", "SheafClient", "register_sheaf_handlers", "received_selection", "describe_pilots"]


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
        selection: this round's pilot selection (paper App. B; None = every pilot): neighbours'
            matrices then have ``selection.num_rows`` rows (the selected pilots, or one group mean per
            group for prototypes) and this node reduces its own pilots the same way
            (:func:`flwr_sheaf.sheaf.pilots.apply_selection`).
        normalisation: ``"none"`` or ``"parseval"``: maps fitted on the polar factors of both pilot
            matrices (:func:`flwr_sheaf.sheaf.pilots.parseval`); the penalty itself uses the whitened
            pilots (docs/variants.md).

    Raises:
        ProtocolError: pilots from a partition-id that is not a neighbour.
        ValueError: a neighbour's pilots with the wrong K or d_j, or NaN/inf entries (named).
    """

    def __init__(self, task: LocalTask, lam: float, pilot_batch_size: int, edges: EdgeConfig,
                 neighbour_pilots: dict[int, torch.Tensor], own_pilots: torch.Tensor | None,
                 selection: PilotSelection | None = None, normalisation: str = "none") -> None:
        unknown = sorted(set(neighbour_pilots) - set(edges.neighbours))
        if unknown:
            raise ProtocolError(f"received pilots from partition-id(s) {unknown} that are not neighbours")
        if normalisation not in ("none", "parseval"):
            raise ValueError(f"pilot-normalisation={normalisation!r}: must be 'none' or 'parseval'")
        self.selection, self.normalisation = selection, normalisation
        k = task.x_pilot.shape[0] if selection is None else selection.num_rows
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
        own = apply_selection(own, self.selection)
        norm = parseval if self.normalisation == "parseval" else (lambda a: a)
        own = norm(own)
        for j, i_head, _ in self.active:
            nbr = norm(self.pilots[j])
            self.maps[j] = procrustes(own, nbr) if i_head else procrustes(nbr, own)

    def loss(self, model, x, y, gen):
        """``(CE + R_A|_i, parts)``: CE of the private batch plus the Eq. 16 penalty on a pilot minibatch
        drawn from ``gen`` (encoder in eval mode, whitening in train mode; docs/stability.md)."""
        ce = F.cross_entropy(model.private_logits(x), y)
        parts = {"ce": float(ce.detach()), "gluing": 0.0}
        if not self.maps:
            return ce, parts
        sel = self.selection
        m = self.task.x_pilot.shape[0] if sel is None else int(sel.indices.size)
        pidx = torch.randperm(m, generator=gen)[: self.batch]
        rows = pidx if sel is None else torch.as_tensor(sel.indices)[pidx]
        model.eval()  # dropout-free, BatchNorm running statistics ...
        model.whitening.train()  # ... but differentiable batch whitening of the pilots
        a_i = model.whitening(model.latent(self.task.x_pilot[rows.to(self.task.x_pilot.device)]))
        nrows = pidx
        if sel is not None and sel.groups is not None:  # prototypes: minibatch means of the groups present
            g = torch.as_tensor(sel.groups)[pidx]
            present, inv = torch.unique(g, return_inverse=True)
            a_i = group_means(a_i, inv, int(present.numel()))
            nrows = present
        terms = [EdgeTerm(j, self.pilots[j][nrows.to(self.pilots[j].device)], self.maps[j], hd, float(w))
                 for j, hd, w in self.active]
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
                           {j: from_numpy(a, dev) for j, a in pilots.items()}, None if cached is None else cached[0],
                           selection=received_selection(msg, int(task.x_pilot.shape[0])),
                           normalisation=sheaf.pilot_normalisation)

    def after_train(self, msg: Message, context: Context, task: LocalTask, plugin: LossPlugin) -> tuple[dict, dict]:
        """Fit the whitening on the pilot latents, cache the whitened pilots ``(K, d_i)`` and upload them
        (paper Alg. 1 line 13); the metric ``low-variance-fraction`` is the collapse diagnostic."""
        z, a = whitened_pilots(task.model, task.x_pilot)
        lvf = store_pilots(context, self.action, z, a)
        records, metrics = {PILOTS: pack_arrays({OWN_PILOTS: to_numpy(a)})}, {LOW_VARIANCE_FRACTION: lvf}
        sel = getattr(plugin, "selection", None)
        if sel is not None:  # echo the selection this node used: the strategy refuses a mismatch
            metrics[PILOT_INDEX_DIGEST] = index_digest(sel.indices, sel.groups)
        cfg = msg.content[CONFIG]
        if PILOT_DESCRIBE in cfg:
            records[PILOT_PUBLIC] = describe_pilots(task, str(cfg[PILOT_DESCRIBE]))
        return records, metrics


def received_selection(msg: Message, num_pilots: int) -> PilotSelection | None:
    """The pilot selection of a ``train.sheaf`` message (None when it carries none: every pilot).

    Raises:
        ProtocolError: a selection record without the config's :data:`~flwr_sheaf.protocol.PILOT_INDEX_DIGEST`
            (or the reverse), or indices whose digest differs from it (both keys named).
    """
    cfg = msg.content[CONFIG]
    has_rec, has_digest = PILOT_SELECTION in msg.content, PILOT_INDEX_DIGEST in cfg
    if has_rec != has_digest:
        raise ProtocolError(f"train message has {'record ' + repr(PILOT_SELECTION) if has_rec else 'config key ' + repr(PILOT_INDEX_DIGEST)}"
                            f" without {'config key ' + repr(PILOT_INDEX_DIGEST) if has_rec else 'record ' + repr(PILOT_SELECTION)}")
    if not has_rec:
        return None
    idx, grp = unpack_pilot_selection(msg.content[PILOT_SELECTION], int(cfg[PILOT_INDEX_DIGEST]), num_pilots)
    return PilotSelection(idx, grp)


def describe_pilots(task: LocalTask, what: str):
    """Record :data:`~flwr_sheaf.protocol.PILOT_PUBLIC`: the shared pilots' labels (``what="class"``) or
    public features (``"cluster"``: :func:`flwr_sheaf.sheaf.pilots.public_pilot_features` of the raw inputs).

    Raises:
        ProtocolError: an unknown ``what``; ``"class"`` with a task whose ``y_pilot`` is None.
    """
    if what == "class":
        if task.y_pilot is None:
            raise ProtocolError("pilot-strategy *-class needs the pilots' labels: this node's LocalTask has y_pilot=None")
        return pack_arrays({PILOT_LABELS: to_numpy(task.y_pilot).astype("int64")})
    if what == "cluster":
        return pack_arrays({PILOT_FEATURES: public_pilot_features(to_numpy(task.x_pilot)).astype("float32")})
    raise ProtocolError(f"{PILOT_DESCRIBE}={what!r}: must be 'class' or 'cluster'")


def register_sheaf_handlers(app: ClientApp, factory: TaskFactory, action: str = "sheaf") -> ClientApp:
    """Add Sheaf-FRL's ``query``/``train``/``evaluate``/``evaluate_comm`` handlers under ``action``.

    Pair with :class:`flwr_sheaf.strategy.sheaf_frl.SheafFRL` (same ``action``). ``factory(context)``
    returns the node's :class:`~flwr_sheaf.client.task.LocalTask`.
    """
    return register_method_handlers(app, factory, SheafClient(action))
