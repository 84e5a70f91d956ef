"""Experiment tracking (flwr_sheaf.tracking, docs/tracking.md): the run-config keys refuse bad values
before any message, and what a tracked run wrote is read back (TensorBoard's event files with
TensorBoard's own EventAccumulator, the W&B offline run with ``wandb leet inspect --json``) and compared
with the run's ``results.json`` round by round. W&B runs offline only: nothing leaves the machine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.config import ConfigError, RunConfig, parse_trackers
from flwr_sheaf.testing import LocalGrid
from flwr_sheaf.tracking import Tracker, round_scalars

torch.set_num_threads(1)

TINY = {
    "zoo": "tiny-3",
    "graph": "ring",
    "num-pilots": 64,
    "max-steps-per-epoch": 2,
    "local-epochs": 1,
    "num-server-rounds": 2,
}


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, silent, every file of it under tmp_path (no network, nothing in ~)."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DIR": str(tmp_path / "wandb-dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }.items():
        monkeypatch.setenv(name, value)


def _expected(round_: dict) -> dict[str, float]:
    """What results.json says a round's trackers got: its numbers (null = not measured) and the
    count of failed nodes per phase."""
    out = {
        k: v
        for k, v in round_.items()
        if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    out.update({f"failed/{phase}": len(pids) for phase, pids in round_["failed"].items()})
    return out


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history records of an offline W&B run, read by W&B's own CLI from its ``.wandb`` log."""
    exe = shutil.which("wandb", path=str(Path(sys.executable).parent)) or "wandb"
    proc = subprocess.run(
        [exe, "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [r["history"] for r in records if r.get("type") == "history"]


def test_tracking_keys_refuse_bad_values_naming_key_value_and_choices():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_run_config({"tracking": "tensorbord"})
    msg = str(err.value)
    assert "tracking='tensorbord'" in msg and "'tensorboard'" in msg and "'wandb'" in msg
    with pytest.raises(ConfigError, match=r"wandb-mode='cloud'.*\['offline', 'online'\]"):
        RunConfig.from_run_config({"wandb-mode": "cloud"})
    cfg = RunConfig.from_run_config({"tracking": " wandb, TensorBoard ,wandb"})
    assert parse_trackers(cfg.tracking) == ("wandb", "tensorboard")
    assert cfg.tracking == "wandb,tensorboard"  # one spelling per choice: resume compares it
    off = RunConfig.from_run_config({"tracking": " , \t,"})
    assert off.tracking == "" and Tracker.from_config(off) is None
    assert RunConfig().tracking == "" and Tracker.from_config(RunConfig()) is None  # off by default


def test_a_tracker_whose_package_is_missing_is_refused_before_any_message(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else real(name, *a),
    )
    rc = {**TINY, "tracking": "tensorboard,wandb", "results-dir": str(tmp_path / "res")}
    grid = LocalGrid(cnn_client_app, 3, run_config=rc)
    with pytest.raises(ConfigError) as err:
        run_server(grid, rc)
    assert "tracking='tensorboard,wandb'" in str(err.value)
    assert "pip install -e '.[wandb]'" in str(err.value)
    assert grid.delivered == [] and not (tmp_path / "res").exists()


def test_round_scalars_are_the_rounds_finite_numbers_and_failure_counts():
    record = {
        "round": 3,
        "private_accuracy_mean": 0.5,
        "gluing_loss": float("nan"),  # not measured this round: left out
        "bytes_sent": np.int64(7),
        "sheaf_near_kernel_exact": True,
        "sampled": [0, 1],
        "non_edges_skipped": "reason",
        "failed": {"train": [1], "evaluate": []},
    }
    assert round_scalars(record) == {
        "private_accuracy_mean": 0.5,
        "bytes_sent": 7,
        "failed/train": 1,
        "failed/evaluate": 0,
    }


def test_a_failing_tracker_is_switched_off_and_the_run_goes_on(tmp_path, caplog):
    with Tracker("tensorboard", tmp_path, run_name="r") as t:

        def broken(*a, **k):
            raise OSError("disk full")

        t._writer.add_scalar = broken
        t.log_round({"round": 1, "ce": 1.0, "failed": {}})
        t.log_round({"round": 2, "ce": 0.5, "failed": {}})  # no second error: switched off
    assert t.errors == {"tensorboard": "OSError: disk full"}
    assert t.describe()["errors"] == {"tensorboard": "OSError: disk full"}
    assert t.rounds_logged == 0  # no tracker took either round
    assert [r.message for r in caplog.records if "switched off" in r.message] == [
        "tracking: tensorboard switched off after an error: OSError: disk full"
    ]
    with pytest.raises(ConfigError, match="name at least one"):
        Tracker("", tmp_path)


def test_tensorboard_and_wandb_get_every_rounds_numbers_of_results_json(tmp_path, offline_wandb):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "res"
    rc = {**TINY, "tracking": "tensorboard,wandb", "results-dir": str(out)}
    path = run_server(LocalGrid(cnn_client_app, 3, run_config=rc), rc)
    res = json.loads(Path(path).read_text())
    info = res["tracking"]
    assert info["trackers"] == ["tensorboard", "wandb"] and info["errors"] == {}
    assert info["rounds_logged"] == 2
    want = {r["round"]: _expected(r) for r in res["rounds"]}
    assert [r for r in want] == [1, 2]
    assert {"private_accuracy_mean", "communication_accuracy_degree_weighted", "ce"} <= set(want[2])

    # TensorBoard: default tracking-dir <results-dir>/tracking, one run directory; float32 values
    tb = Path(info["tensorboard_dir"])
    assert tb.parent == out.resolve() / "tracking" / "tensorboard"
    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    assert set(ea.Tags()["scalars"]) == set(want[1]) | set(want[2])
    for tag in ea.Tags()["scalars"]:
        got = {e.step: e.value for e in ea.Scalars(tag)}
        assert got == {r: float(np.float32(v[tag])) for r, v in want.items() if tag in v}, tag
    assert ea.Tags()["tensors"] == ["config/text_summary"]  # the run config, as text

    # W&B: an offline run under <results-dir>/tracking/wandb, its history = results.json exactly
    run_dir = Path(info["wandb_dir"])
    assert run_dir.parent == out.resolve() / "tracking" / "wandb"
    assert run_dir.name.startswith("offline-run-")
    history = _wandb_history(run_dir)
    assert [h["step"]["num"] for h in history] == [1, 2]
    for h in history:
        item = {k: v for k, v in h["item"].items() if not k.startswith("_")}
        expected = want[int(h["step"]["num"])]
        assert item == expected


def test_a_run_whose_tracker_failed_is_written_degraded_not_completed(tmp_path, monkeypatch):
    """Tracking was asked for and stopped working: the run goes on, but results.json says
    ``degraded`` and names the tracker and its error (never a clean-looking run)."""
    from torch.utils.tensorboard import SummaryWriter

    def broken(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(SummaryWriter, "add_scalar", broken)
    rc = {**TINY, "tracking": "tensorboard", "results-dir": str(tmp_path / "res")}
    res = json.loads(Path(run_server(LocalGrid(cnn_client_app, 3, run_config=rc), rc)).read_text())
    assert res["failures"] == [] and res["status"] == "degraded"
    assert res["degradation"]["problems"] == [
        "tracker tensorboard switched off after an error: OSError: disk full"
    ]
    assert res["tracking"]["errors"] == {"tensorboard": "OSError: disk full"}


def test_a_tracker_that_fails_to_close_costs_the_run_nothing_but_its_clean_status(
    tmp_path, monkeypatch
):
    """SummaryWriter.close raising after training (a full disk) must not lose the results: they are
    written, ``degraded``, naming the tracker."""
    from torch.utils.tensorboard import SummaryWriter

    def broken(self, *a, **k):
        raise OSError("disk full at close")

    monkeypatch.setattr(SummaryWriter, "close", broken)
    rc = {**TINY, "tracking": "tensorboard", "results-dir": str(tmp_path / "res")}
    res = json.loads(Path(run_server(LocalGrid(cnn_client_app, 3, run_config=rc), rc)).read_text())
    assert res["status"] == "degraded" and res["tracking"]["rounds_logged"] == 2
    assert res["degradation"]["problems"] == [
        "tracker tensorboard switched off after an error: OSError: disk full at close"
    ]


def test_tracking_dir_without_tracking_is_warned_naming_both_keys(tmp_path, caplog):
    """Issue 34, case 9 (docs/guarantees.md): was silently ignored; then (attack F2) warned
    twice with two texts, by the preflight and by ``run_config_warnings``: now once, by the latter
    (logged at the ServerApp's start and recorded in results.json's ``warnings``)."""
    import logging

    from flwr_sheaf.apps.methods import num_nodes
    from flwr_sheaf.methods import run_config_warnings
    from flwr_sheaf.methods.registry import parse_run_config
    from flwr_sheaf.rundir import preflight

    def warnings(rc):
        cfg, method = parse_run_config(rc)
        n = num_nodes(cfg, method)
        return run_config_warnings(rc, cfg, method, method.strategy(cfg, n))

    log = logging.getLogger("flwr_sheaf")
    log.addHandler(caplog.handler)
    try:
        tb = str(tmp_path / "tb")
        rc = {"results-dir": str(tmp_path / "r"), "tracking-dir": tb}
        with preflight(parse_run_config(rc)[0]):
            pass
        assert "tracking-dir" not in caplog.text  # was: a second, different warning here
        assert warnings(rc) == [
            f"tracking-dir={tb!r} is ignored: tracking is off (tracking=''); set "
            "tracking='tensorboard' (or 'wandb') to track the run there"
        ]
        assert warnings({**rc, "tracking": "tensorboard"}) == []
    finally:
        log.removeHandler(caplog.handler)


def test_two_runs_started_in_the_same_second_get_their_own_tensorboard_directories(tmp_path):
    """Issue 34, case 9: ``Tracker.from_config`` names a run by the second it started; two such runs
    (same name) must not share one TensorBoard directory (their curves would interleave)."""
    pytest.importorskip("tensorboard")
    with Tracker("tensorboard", tmp_path, run_name="r-20260101-000000") as first:
        with Tracker("tensorboard", tmp_path, run_name="r-20260101-000000") as second:
            first.log_round({"round": 1, "ce": 1.0})
            second.log_round({"round": 1, "ce": 2.0})
    assert first.tensorboard_dir == tmp_path / "tensorboard" / "r-20260101-000000"
    assert second.tensorboard_dir == tmp_path / "tensorboard" / "r-20260101-000000-2"
    assert (
        second.run_name == "r-20260101-000000-2"
        and second.describe()["run_name"] == second.run_name
    )
    assert len(list(first.tensorboard_dir.glob("events.out.tfevents.*"))) == 1
    assert len(list(second.tensorboard_dir.glob("events.out.tfevents.*"))) == 1
