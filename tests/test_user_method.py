"""A researcher's own method, complete in this one file, with flwr-sheaf's public API only.

**Relational alignment** (dimension-free, so it works across heterogeneous stalks d_i): each
trained node uploads the cosine Gram matrix ``G_i = Z_i Z_i^T`` (P x P) of its latents on the first
P shared pilots; the server sends each node the mean of its graph neighbours' last Grams, and the
client adds ``lam * mean((G_i - mean_j G_j)^2)`` to its cross-entropy. Nothing under
``flwr_sheaf/`` is edited: this module registers the method, and ``flwr run`` imports it through
the run-config key ``method-module``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, Context, Message

from flwr_sheaf import (
    ClientMethod,
    GraphStrategy,
    LocalGrid,
    LocalTask,
    LossPlugin,
    Method,
    register,
    register_method_handlers,
)
from flwr_sheaf.config import Key, Section, parse_float, parse_int, section
from flwr_sheaf.methods import graph_args

ACTION = "relalign"
RECORD = "relalign"


@section(
    Key("relalign-lambda", 1.0, parse_float(0.0), "weight of the relational alignment term"),
    Key("relalign-pilots", 16, parse_int(2), "pilots P whose Gram matrix is aligned"),
    prefix="relalign-",
)
class RelAlignConfig(Section):
    """Relational alignment's run-config keys (``relalign-lambda``, ``relalign-pilots``)."""

    lam: float
    pilots: int


def pilot_gram(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Cosine Gram ``(P, P)`` of the model's latents on pilots ``x (P, ...)``."""
    z = F.normalize(model.latent(x), dim=1)
    return z @ z.T


class RelAlignLoss(LossPlugin):
    """Cross-entropy plus ``lam * mean((G_i - target)^2)`` (target None: cross-entropy only)."""

    def __init__(self, pilots: torch.Tensor, target: torch.Tensor | None, lam: float) -> None:
        self.pilots, self.target, self.lam = pilots, target, lam

    def loss(self, model, x, y, gen):  # noqa: D102
        ce = F.cross_entropy(model.private_logits(x), y)
        if self.target is None:
            return ce, {"ce": ce.detach()}
        align = ((pilot_gram(model, self.pilots) - self.target) ** 2).mean()
        return ce + self.lam * align, {"ce": ce.detach(), "relalign": align.detach()}


class RelAlignClient(ClientMethod):
    """Client side: the loss plug-in from the message, the Gram upload after training."""

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:  # noqa: D102
        cfg = msg.content["config"]
        pilots = task.x_pilot[: int(cfg["relalign-pilots"])]
        target = None
        if RECORD in msg.content.array_records:
            target = torch.from_numpy(msg.content[RECORD]["target"].numpy()).to(
                pilots.device, torch.float32
            )
        return RelAlignLoss(pilots, target, float(cfg["relalign-lambda"]))

    def after_train(self, msg, context, task, plugin):  # noqa: D102
        task.model.eval()
        with torch.no_grad():
            gram = pilot_gram(task.model, plugin.pilots).cpu().numpy().astype(np.float64)
        return {RECORD: ArrayRecord({"gram": Array(gram)})}, {}


class RelAlign(GraphStrategy):
    """Server side: keep each node's last Gram, send each node its neighbours' mean."""

    def __init__(self, num_nodes: int, *, relalign: RelAlignConfig, **kw: Any) -> None:
        super().__init__(num_nodes, action=ACTION, graph=None, **kw)
        self.cfg = relalign
        self.grams: dict[int, np.ndarray] = {}

    def method_config(self, server_round: int) -> dict:  # noqa: D102
        return self.cfg.to_dict()

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:  # noqa: D102
        have = [self.grams[j] for j in sorted(self.graph.neighbors(pid)) if j in self.grams]
        if not have:
            return {}, {}
        return {RECORD: ArrayRecord({"target": Array(np.mean(have, axis=0))})}, {}

    def accept_train(self, server_round: int, ok: Mapping[int, Message]) -> tuple[dict, dict]:  # noqa: D102
        accepted = {}
        p = self.cfg.pilots
        for pid, reply in ok.items():
            gram = (
                reply.content[RECORD]["gram"].numpy()
                if RECORD in reply.content.array_records
                else None
            )
            if gram is None or gram.shape != (p, p) or not np.isfinite(gram).all():
                self.record_failure(
                    server_round, "train", pid, f"bad Gram upload {getattr(gram, 'shape', None)}"
                )
                continue
            self.grams[pid] = gram
            accepted[pid] = reply
        return accepted, {"relalign_nodes": len(self.grams)}


METHOD = register(
    Method(
        "relalign",
        ACTION,
        strategy=lambda c, n: RelAlign(n, relalign=c.method_section, **graph_args(c)),
        handlers=lambda app, factory: register_method_handlers(
            app, factory, RelAlignClient(ACTION)
        ),
        config=RelAlignConfig,
    )
)

# ---------------------------------------------------------------------------------------- tests
TINY = {
    "method": "relalign",
    "zoo": "tiny-4",
    "graph": "ring",
    "num-pilots": 64,
    "max-steps-per-epoch": 4,
    "local-epochs": 1,
    "num-server-rounds": 3,
    "seed": 3,
    "relalign-lambda": 0.5,
}
COMMON_ROUND_KEYS = {
    "round",
    "sampled",
    "num_sampled",
    "num_trained",
    "failed",
    "bytes_sent",
    "bytes_received",
    "private_accuracy_mean",
    "communication_accuracy_mean",
    "communication_accuracy_degree_weighted",
    "gluing_loss",
    "wall_seconds",
    "elapsed_seconds",
}


def _run_local(tmp_path: Path, drop=None, **over: Any) -> tuple[dict, LocalGrid]:
    from flwr_sheaf.apps.client_app import app
    from flwr_sheaf.apps.server_app import run_server

    rc = {**TINY, "results-dir": str(tmp_path / "res"), **over}
    grid = LocalGrid(app, 4, run_config=rc, drop=drop)
    return json.loads(Path(run_server(grid, rc)).read_text()), grid


def test_user_method_is_registered_with_its_own_config_section():
    from flwr_sheaf.methods import METHODS, parse_run_config

    assert METHODS["relalign"] is METHOD and METHOD.action == ACTION
    cfg, method = parse_run_config({"method": "relalign", "relalign-pilots": 8})
    assert method is METHOD and cfg.method_section == RelAlignConfig(lam=1.0, pilots=8)
    assert cfg.to_dict()["relalign-pilots"] == 8
    with pytest.raises(ValueError, match="relalign-pilots"):
        RelAlignConfig(pilots=1)


def test_user_method_runs_through_local_grid_with_the_common_results_schema(tmp_path):
    res, grid = _run_local(tmp_path)
    assert [r["round"] for r in res["rounds"]] == [1, 2, 3]
    assert all(COMMON_ROUND_KEYS <= set(r) for r in res["rounds"])
    assert res["action"] == ACTION and len(res["edges"]) == 8 and len(res["nodes"]) == 4
    assert res["failures"] == []
    # round 1 trains on cross-entropy only; from round 2 every node gets its neighbours' mean Gram
    assert (
        np.isnan(res["rounds"][0].get("relalign") or float("nan"))
        and res["rounds"][1]["relalign"] > 0
    )
    targets = [
        m
        for m in grid.delivered
        if m.metadata.message_type == f"train.{ACTION}" and RECORD in m.content
    ]
    assert len(targets) == 8 and targets[0].content[RECORD]["target"].shape == (16, 16)


def test_user_method_samples_participants_and_records_a_lost_node_as_its_failure(tmp_path):
    grid_ref: list[LocalGrid] = []

    def drop(m: Message) -> bool:  # partition 1 never answers its train message of round 2
        g = grid_ref[0]
        return (
            m.metadata.message_type == f"train.{ACTION}"
            and m.metadata.group_id == "2"
            and g.partition_of(m.metadata.dst_node_id) == 1
        )

    from flwr_sheaf.apps.client_app import app
    from flwr_sheaf.apps.server_app import run_server

    rc = {**TINY, "results-dir": str(tmp_path / "res"), "participation": "1.0,1.0,1.0,0.5"}
    grid = LocalGrid(app, 4, run_config=rc, drop=drop)
    grid_ref.append(grid)
    res = json.loads(Path(run_server(grid, rc)).read_text())
    sampled = [r["sampled"] for r in res["rounds"]]
    assert all({0, 1, 2} <= set(s) for s in sampled) and res["participation"]["mode"] == "bernoulli"
    assert res["rounds"][1]["failed"]["train"] == [1]
    assert [(f["round"], f["phase"], f["partition-id"]) for f in res["failures"]] == [
        (2, "train", 1)
    ]
    assert res["rounds"][2]["num_trained"] == len(sampled[2])  # the run goes on


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.engine
def test_user_method_runs_under_flwr_run(tmp_path):
    app = tmp_path / "user_app"
    app.mkdir()
    shutil.copy(__file__, app / "user_relalign.py")
    out = tmp_path / "res"
    config = {
        **TINY,
        "method-module": "user_relalign",
        "num-server-rounds": 2,
        "results-dir": str(out),
    }
    toml = "\n".join(f"{k} = {json.dumps(v)}" for k, v in config.items())
    (app / "pyproject.toml").write_text(f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "user-relalign"
version = "1.0.0"
dependencies = ["flwr[simulation]>=1.42,<1.43", "flwr-sheaf"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "you"

[tool.flwr.app.components]
serverapp = "flwr_sheaf.apps.server_app:app"
clientapp = "flwr_sheaf.apps.client_app:app"

[tool.flwr.app.config]
{toml}
""")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "run_flwr.py"),
        "--app",
        str(app),
        "--num-supernodes",
        "4",
        "--port",
        "0",
        "--timeout",
        "600",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=700, env=env)
    assert proc.returncode == 0 and "finished:completed" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-2000:]
    )
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["method"] == "relalign" and res["config"]["relalign-lambda"] == 0.5
    assert [r["round"] for r in res["rounds"]] == [1, 2] and res["rounds"][1]["relalign"] > 0
    assert all(COMMON_ROUND_KEYS <= set(r) for r in res["rounds"])
