"""The ``device`` key: forms, a clear error before training where CUDA is missing, placement, and
unchanged CPU numbers (docs/devices.md).

Where a CUDA device exists (``torch.cuda.is_available()``), the tests marked ``gpu`` also run every
method's handlers end to end on it; elsewhere they skip.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.client import common
from flwr_sheaf.client.task import TASK_TENSORS
from flwr_sheaf.config import ConfigError, LocalTrainConfig, RunConfig
from flwr_sheaf.devices import DeviceUnavailableError, check_device_spec, resolve_device
from flwr_sheaf.methods import METHODS
from flwr_sheaf.testing import LocalGrid

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "zoo": "tiny-3",
    "graph": "ring",
    "num-pilots": 24,
    "local-epochs": 1,
    "max-steps-per-epoch": 2,
    "batch-size": 16,
    "num-server-rounds": 2,
    "seed": 3,
}
HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", " cuda:12 "])
def test_device_forms_accepted(spec):
    assert check_device_spec(spec) == spec.strip()


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "CUDA", "mps0", ""])
def test_device_bad_forms_named(spec):
    with pytest.raises(ValueError, match="valid forms: auto, cpu, cuda, cuda:<index>"):
        check_device_spec(spec)
    with pytest.raises(ConfigError, match=f"device={spec!r}"):
        LocalTrainConfig(device=spec)


def test_auto_and_cpu_resolve_here():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
def test_cuda_without_cuda_fails_at_discovery_before_any_training(tmp_path):
    with pytest.raises(
        DeviceUnavailableError, match="no usable CUDA device.*use device=auto or device=cpu"
    ):
        resolve_device("cuda")
    rc = {**TINY, "device": "cuda"}
    grid = LocalGrid(cnn_client_app, 3, run_config=rc)
    with pytest.raises(
        RuntimeError, match="discovery failed.*device='cuda'.*no usable CUDA device"
    ):
        run_server(grid, {**rc, "results-dir": str(tmp_path)})
    kinds = {m.metadata.message_type.split(".")[0] for m in grid.delivered}
    assert kinds == {"query"}  # nothing was trained or evaluated


def test_index_beyond_the_gpu_count_is_named():
    n = torch.cuda.device_count() if HAS_CUDA else 0
    with pytest.raises(DeviceUnavailableError, match=f"device='cuda:{n + 3}'"):
        resolve_device(f"cuda:{n + 3}")


def test_build_places_model_and_every_tensor_on_the_resolved_device(monkeypatch):
    """Placement without a GPU: resolve to the ``meta`` device and inspect what ``build`` returns."""
    from flwr.app import Context, RecordDict

    from flwr_sheaf.apps.scenario import cnn_task_factory

    monkeypatch.setattr(common, "resolve_device", lambda spec: torch.device("meta"))
    ctx = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 1, "num-partitions": 3},
        state=RecordDict(),
        run_config=dict(TINY),
    )
    cpu_task = cnn_task_factory(ctx)
    task, model, opt = common.build(
        cnn_task_factory, ctx, "sheaf", 1, LocalTrainConfig(device="cuda:0")
    )
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"meta"}
    for name in TASK_TENSORS:
        assert getattr(task, name).device.type == "meta", name
        assert getattr(task, name).shape == getattr(cpu_task, name).shape
    assert common.task_device(task).type == "meta"
    # the factory's cached CPU tensors were copied, not moved
    assert cnn_task_factory(ctx).x_train.device.type == "cpu"
    assert opt.param_groups[0]["params"][0].device.type == "meta"


def test_client_code_converts_arrays_only_through_the_device_helpers():
    """Every tensor<->array crossing in the graph methods' client code goes through ``to_numpy`` /
    ``from_numpy`` (device-aware), so no handler hands a CUDA tensor to numpy or a CPU tensor to a
    CUDA model. RFedAGS's client is numpy-only (CPU) and is exempt."""
    offenders = []
    for path in sorted((ROOT / "flwr_sheaf" / "client").glob("*.py")):
        if path.name in ("common.py", "rfedags.py", "task.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "from_numpy" and ast.unparse(node.func.value) == "torch":
                    offenders.append(f"{path.name}:{node.lineno} torch.from_numpy")
                if node.func.attr == "numpy" and not node.args:
                    # record.numpy() on a received ArrayRecord entry is fine; a tensor's .numpy() is not
                    src = ast.unparse(node.func.value)
                    if not src.startswith(
                        ("rec[", "msg.content", "context.state", "arrays[", "stored[")
                    ):
                        offenders.append(f"{path.name}:{node.lineno} {src}.numpy()")
    assert not offenders, offenders


def _final_metrics(path: Path) -> list[dict]:
    res = json.loads(Path(path).read_text())
    keep = ("private_accuracy_mean", "communication_accuracy_degree_weighted", "gluing_loss", "ce")
    return [{k: r.get(k) for k in keep} for r in res["rounds"]]


def test_cpu_numbers_unchanged_by_device_auto(tmp_path):
    """On a CPU machine ``device=auto`` is ``cpu``; on any machine ``cpu`` twice gives the same numbers."""
    out = {}
    for spec in ("cpu", "auto", "cpu") if not HAS_CUDA else ("cpu", "cpu"):
        grid = LocalGrid(cnn_client_app, 3, run_config={**TINY, "device": spec})
        out.setdefault(spec, []).append(
            _final_metrics(
                run_server(
                    grid,
                    {
                        **TINY,
                        "device": spec,
                        "results-dir": str(tmp_path / f"{spec}{len(out.get(spec, []))}"),
                    },
                )
            )
        )
    runs = [r for v in out.values() for r in v]
    assert all(r == runs[0] for r in runs[1:])
    assert runs[0][-1]["private_accuracy_mean"] is not None


def test_preset_paper_fills_only_keys_at_their_default():
    cfg = RunConfig.from_run_config({"preset": "paper", "lr": 0.03})
    assert cfg.train.lr == 0.03  # the user's choice stands
    assert (
        cfg.train.momentum,
        cfg.train.weight_decay,
        cfg.train.batch_size,
        cfg.train.clip_norm,
    ) == (0.9, 5e-4, 64, 1.0)
    assert (cfg.num_server_rounds, cfg.train.local_epochs, cfg.scenario.num_pilots) == (100, 1, 0)
    two = RunConfig.from_run_config({"preset": "paper", "zoo": "two-agent:64", "graph": "complete"})
    assert (two.train.clip_norm, two.num_server_rounds, two.train.lr) == (0.0, 20, 0.01)
    assert RunConfig.from_run_config({}).train.lr == 0.05  # no preset: package defaults
    with pytest.raises(ConfigError, match="preset='papers'"):
        RunConfig.from_run_config({"preset": "papers"})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_runs_on_cuda(method, tmp_path, monkeypatch):
    seen = []
    real = common.to_device

    def spy(task, device):
        out = real(task, device)
        seen.append(next(out.model.parameters()).device.type)
        return out

    monkeypatch.setattr(common, "to_device", spy)
    rc = {**TINY, "device": "cuda", "method": method}
    grid = LocalGrid(cnn_client_app, 3, run_config=rc)
    res = json.loads(run_server(grid, {**rc, "results-dir": str(tmp_path)}).read_text())
    assert seen and set(seen) == {"cuda"}
    assert not res["failures"], res["failures"]
    last = res["rounds"][-1]
    assert 0.0 <= last["private_accuracy_mean"] <= 1.0
