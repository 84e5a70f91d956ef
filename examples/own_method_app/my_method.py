"""my-method: a researcher's own method for flwr-sheaf, complete in one file (docs/own-method.md).

Each node learns a projection ``W_i (d_i, k)`` of its latents to a shared ``k``-dimensional
anchor space: a trained parameter of the method, kept in the node's ``context.state`` from one
round to the next. After training, it uploads its projected pilots ``A_i = Z_i W_i (P, k)``; the
server keeps every node's last upload across rounds and sends each sampled node the mean of its
graph neighbours' ``A_j`` as a target, and the node adds ``lam * mean((Z_i W_i - target)^2)`` to
its cross-entropy. ``flwr run`` imports this module through the run-config key ``method-module``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, Context, Message

from flwr_sheaf import (
    ClientMethod,
    GraphStrategy,
    LocalTask,
    LossPlugin,
    Method,
    register,
    register_method_handlers,
)
from flwr_sheaf.config import Key, Section, parse_float, parse_int, section
from flwr_sheaf.methods import graph_args

ACTION = "mymethod"  # its messages: train.mymethod, evaluate.mymethod and the others
UPLOAD = "mymethod-anchor"  # record of the node's projected pilots (and of the server's target)
STATE = "mymethod.w"  # where a node keeps its projection W_i between rounds


@section(
    Key("mymethod-lambda", 1.0, parse_float(0.0), "weight of the anchor term"),
    Key("mymethod-dim", 8, parse_int(1), "dimension k of the shared anchor space"),
    Key("mymethod-pilots", 32, parse_int(2), "pilots P that are projected and uploaded"),
    prefix="mymethod-",
)
class MyConfig(Section):
    """my-method's run-config keys (declare them in the app's pyproject.toml too)."""

    lam: float
    dim: int
    pilots: int


class AnchorLoss(LossPlugin):
    """Cross-entropy plus ``lam * mean((Z_i W_i - target)^2)`` on the pilots; ``W_i`` is trained too."""

    def __init__(self, pilots: torch.Tensor, w: torch.Tensor, target, lam: float, lr: float):
        self.pilots, self.w, self.target, self.lam = pilots, w.requires_grad_(True), target, lam
        self.opt = torch.optim.SGD([self.w], lr=lr)  # the method's own parameter, own optimizer

    def loss(self, model, x, y, gen):
        ce = F.cross_entropy(model.private_logits(x), y)
        if self.target is None:  # round 1, or no neighbour uploaded yet: cross-entropy only
            return ce, {"ce": ce.detach()}
        anchor = ((model.latent(self.pilots) @ self.w - self.target) ** 2).mean()
        return ce + self.lam * anchor, {"ce": ce.detach(), "anchor": anchor.detach()}

    def after_step(self) -> None:  # called after each SGD step of the model
        self.opt.step()
        self.opt.zero_grad()


class MyClient(ClientMethod):
    """Client side: restore W_i, build the loss from the message, save W_i and upload after training."""

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:
        cfg = msg.content["config"]  # the strategy's method_config() plus the shared keys
        pilots = task.x_pilot[: int(cfg["mymethod-pilots"])]
        if STATE in context.state:  # trained in an earlier round: go on from there
            w = torch.from_numpy(context.state[STATE]["w"].numpy())
        else:  # first round of this node: a draw from (seed, partition-id) only
            pid = int(context.node_config["partition-id"])
            gen = torch.Generator().manual_seed(int(cfg["seed"]) * 100_003 + pid)
            d = task.model.latent(pilots[:1]).shape[1]
            w = torch.randn(d, int(cfg["mymethod-dim"]), generator=gen) / d**0.5
        target = None
        if UPLOAD in msg.content.array_records:
            target = torch.from_numpy(msg.content[UPLOAD]["target"].numpy())
        dev = pilots.device
        target = target.to(dev, torch.float32) if target is not None else None
        return AnchorLoss(
            pilots,
            w.to(dev, torch.float32),
            target,
            float(cfg["mymethod-lambda"]),
            float(cfg["lr"]),
        )

    def after_train(self, msg, context, task, plugin):
        w = plugin.w.detach().cpu().numpy().astype(np.float32)
        context.state[STATE] = ArrayRecord({"w": Array(w)})  # kept for the next round
        task.model.eval()
        with torch.no_grad():
            anchor = (task.model.latent(plugin.pilots) @ plugin.w).cpu().numpy()
        return {UPLOAD: ArrayRecord({"anchor": Array(anchor.astype(np.float64))})}, {}


class MyStrategy(GraphStrategy):
    """Server side: keep each node's last upload, send each node its neighbours' mean."""

    def __init__(self, num_nodes: int, *, cfg: MyConfig, **kw: Any) -> None:
        super().__init__(num_nodes, action=ACTION, **kw)
        self.cfg = cfg
        self.anchors: dict[int, np.ndarray] = {}  # partition-id -> last A_i, across rounds

    def method_config(self, server_round: int) -> dict:  # keys every train message carries
        return self.cfg.to_dict()

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        have = [self.anchors[j] for j in sorted(self.graph.neighbors(pid)) if j in self.anchors]
        if not have:
            return {}, {}
        return {UPLOAD: ArrayRecord({"target": Array(np.mean(have, axis=0))})}, {}

    def accept_train(self, server_round: int, ok: Mapping[int, Message]) -> tuple[dict, dict]:
        accepted = {}
        shape = (self.cfg.pilots, self.cfg.dim)
        for pid, reply in ok.items():
            rec = reply.content.array_records.get(UPLOAD)
            a = rec["anchor"].numpy() if rec is not None and "anchor" in rec else None
            if a is None or a.shape != shape or not np.isfinite(a).all():
                why = f"bad {UPLOAD} upload {getattr(a, 'shape', None)}, expected {shape}"
                self.record_failure(server_round, "train", pid, why)  # that node's failure
                continue
            self.anchors[pid] = a
            accepted[pid] = reply
        return accepted, {"mymethod_nodes": len(self.anchors)}


METHOD = register(
    Method(
        "my-method",
        ACTION,
        strategy=lambda c, n: MyStrategy(n, cfg=c.method_section, **graph_args(c)),
        handlers=lambda app, factory: register_method_handlers(app, factory, MyClient(ACTION)),
        config=MyConfig,
    )
)
