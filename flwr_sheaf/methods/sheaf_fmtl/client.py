"""Sheaf-FMTL on the client: parameter-space restriction maps owned by the node (notes/baselines-sheaf-fmtl.md, s8).

The map step (F2) is deferred from the previous iteration (notes/deviations-methods.md); the node
uploads ``P_ij theta_i`` per neighbour, never the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ...client.common import from_numpy, task_device, to_numpy
from ...client.handlers import ClientMethod, register_method_handlers
from ...client.loop import CrossEntropy, LossPlugin
from ...client.task import LocalTask, TaskFactory
from ...config import LocalTrainConfig, node_partition_id
from ...protocol import (
    CONFIG,
    SEED,
    TRAIN,
    ProtocolError,
    array_record,
    message_type,
    pack_arrays,
    required,
)
from .._shared.protocol import UPLOAD
from . import (
    ACTION,
    SHEAF_FMTL_DIMS,
    SHEAF_FMTL_NEIGHBOURS,
    SHEAF_FMTL_NUM_PARAMS,
    SHEAF_FMTL_PROJECTIONS,
)
from .config import SheafFMTLConfig
from .maths import init_map, map_step, parameter_step

__all__ = ["SheafFMTLLoss", "SheafFMTLClient", "register_sheaf_fmtl_handlers", "trainable_vector"]


def trainable_vector(model: torch.nn.Module) -> torch.Tensor:
    """theta_i: the trainable parameters flattened in ``model.parameters()`` order, ``(n_i,)`` float32 (a copy)."""
    return parameters_to_vector([p for p in model.parameters() if p.requires_grad]).detach().clone()


@dataclass(eq=False)
class SheafFMTLLoss(CrossEntropy):
    """Cross-entropy, carrying the node's maps and received projections for the steps around it.

    Args:
        maps: ``{j: (d_ij, n_i)}`` float16 (after this message's map step).
        received: ``{j: (d_ij,)}`` float32 neighbours' ``P_ji theta_j`` (may be empty).
        cfg: lambda, eta.
        lr: the parameter step's alpha (the run's SGD lr).
        map_change: ``sum_j ||P_ij(new) - P_ij(old)||_F`` of this message's map step.
    """

    maps: dict[int, torch.Tensor]
    received: dict[int, torch.Tensor]
    cfg: SheafFMTLConfig
    lr: float
    map_change: float


class SheafFMTLClient(ClientMethod):
    """Sheaf-FMTL's hooks: map step and restore before training, parameter step and projections after it."""

    def _maps_key(self) -> str:
        return f"{self.action}.maps"

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:
        """Restore or draw the maps, apply the map step (F2) with the received projections.

        Raises:
            ProtocolError: a missing key, a parameter count other than the server's, neighbours and
                dimensions of different lengths, projections from a non-neighbour or a stored map of
                another shape (all named).
            ValueError: a projection of the wrong length or with NaN/inf (the neighbour named).
        """
        cfg = msg.content[CONFIG]
        mt = message_type(TRAIN, self.action)
        fm, train = SheafFMTLConfig.from_record(cfg), LocalTrainConfig.from_record(cfg)
        nbrs = [int(j) for j in required(cfg, SHEAF_FMTL_NEIGHBOURS, mt)]
        dims = [int(d) for d in required(cfg, SHEAF_FMTL_DIMS, mt)]
        n_server, seed = int(required(cfg, SHEAF_FMTL_NUM_PARAMS, mt)), int(required(cfg, SEED, mt))
        pid = node_partition_id(context)
        theta = trainable_vector(task.model)
        n_i = int(theta.numel())
        if n_i != n_server:
            raise ProtocolError(
                f"{mt}: partition-id {pid} has {n_i} trainable parameters, the server assumed {n_server}"
            )
        if len(nbrs) != len(dims):
            raise ProtocolError(f"{mt}: {len(nbrs)} neighbours but {len(dims)} edge dimensions")
        dev = task_device(task)
        stored = (
            array_record(context.state, self._maps_key())
            if self._maps_key() in context.state
            else None
        )
        maps: dict[int, torch.Tensor] = {}
        for j, d in zip(nbrs, dims):
            if stored is not None and str(j) in stored:
                p = from_numpy(stored[str(j)].numpy(), dev)
                if tuple(p.shape) != (d, n_i):
                    raise ProtocolError(
                        f"{mt}: stored map for neighbour {j} has shape {tuple(p.shape)}, expected {(d, n_i)}"
                    )
            else:
                p = init_map(d, n_i, seed, pid, j).to(device=dev, dtype=torch.float16)
            maps[j] = p
        received: dict[int, torch.Tensor] = {}
        if SHEAF_FMTL_PROJECTIONS in msg.content:
            rec = array_record(msg.content, SHEAF_FMTL_PROJECTIONS)
            for k in rec:
                if int(k) not in maps:
                    raise ProtocolError(
                        f"{mt}: projection from partition-id {k}, not a neighbour of {pid} ({nbrs})"
                    )
                received[int(k)] = from_numpy(rec[k].numpy(), dev, torch.float32)
        theta = theta.to(dev)
        change = 0.0
        for j, y in received.items():  # (F2), deferred from the previous iteration
            old = maps[j].float()
            new = map_step(old, theta, y, fm.eta, fm.lam, j).to(torch.float16)
            change += float(torch.linalg.norm(new.float() - old))
            maps[j] = new
        return SheafFMTLLoss(maps, received, fm, train.lr, change)

    @torch.no_grad()
    def after_train(
        self, msg: Message, context: Context, task: LocalTask, plugin: LossPlugin
    ) -> tuple[dict, dict]:
        """Parameter step (F1), store the maps (float16), upload ``P_ij theta_i`` per neighbour."""
        assert isinstance(plugin, SheafFMTLLoss)  # made by self.plugin
        params = [p for p in task.model.parameters() if p.requires_grad]
        theta = trainable_vector(task.model)
        if plugin.received:
            theta = parameter_step(
                theta,
                {j: plugin.maps[j] for j in plugin.received},
                plugin.received,
                plugin.lr,
                plugin.cfg.lam,
            )
            vector_to_parameters(theta, params)
        proj = {j: p.float() @ theta for j, p in plugin.maps.items()}
        residual = sum(float(((proj[j] - y) ** 2).sum()) for j, y in plugin.received.items())
        context.state[self._maps_key()] = ArrayRecord(
            {str(j): p.cpu() for j, p in plugin.maps.items()}, keep_input=True
        )
        metrics = {
            "sheaf-fmtl-residual": residual,
            "sheaf-fmtl-map-change": plugin.map_change,
            "sheaf-fmtl-received": len(plugin.received),
        }
        return {UPLOAD: pack_arrays({str(j): to_numpy(v) for j, v in proj.items()})}, metrics


def register_sheaf_fmtl_handlers(
    app: ClientApp, factory: TaskFactory, action: str = ACTION
) -> ClientApp:
    """Add Sheaf-FMTL's handlers under ``action`` (pair with :class:`flwr_sheaf.methods.sheaf_fmtl.strategy.SheafFMTL`)."""
    return register_method_handlers(app, factory, SheafFMTLClient(action))
