"""flwr_sheaf.write_results from one's own app (docs/results-schema.md): any flwr-sheaf strategy that
has run gets the bundled app's results.json + accuracy.png, with its status, config and failures;
a strategy that has not run, a foreign strategy and another run's results are refused."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flwr.serverapp.strategy import FedAvg

from flwr_sheaf import (
    FederationConfig,
    FedProto,
    LocalGrid,
    LocalTrainConfig,
    SheafFRL,
    write_results,
)
from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.methods.fedproto.config import FedProtoConfig
from flwr_sheaf.results import check_results_dir, strategy_config
from flwr_sheaf.rundir import LockedError

torch.set_num_threads(1)

RC = {"zoo": "tiny-3", "num-pilots": 64, "seed": 2}


def test_a_strategy_that_has_not_run_or_is_not_flwr_sheafs_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"SheafFRL has no completed round.*strategy\.start\("):
        write_results(SheafFRL(3, federation=FederationConfig(graph="ring")), tmp_path)
    with pytest.raises(TypeError, match="needs a flwr-sheaf strategy.*got FedAvg"):
        write_results(FedAvg(), tmp_path)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_fedproto_in_an_own_app_gets_the_bundled_apps_results_with_status_and_failures(tmp_path):
    # partition-id 2 goes silent in round 2's training: a degraded run, recorded as such
    def drop(msg):
        return (
            msg.metadata.message_type == "train.fedproto"
            and msg.metadata.group_id == "2"
            and msg.metadata.dst_node_id == grid.node_ids[2]
        )

    grid = LocalGrid(cnn_client_app, 3, run_config=RC, drop=drop)
    strategy = FedProto(
        3,
        federation=FederationConfig(graph="ring", seed=2),
        train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=2),
        fedproto=FedProtoConfig(lam=0.5),
    )
    out = check_results_dir(tmp_path / "run")  # a fresh directory passes
    strategy.start(grid=grid, num_rounds=2, timeout=5)
    path = write_results(strategy, out, config={"my-key": 7}, extra={"note": "own app"})
    res = json.loads(path.read_text())

    assert list(res)[:8] == [
        "config",
        "rounds",
        "nodes",
        "edges",
        "failures",
        "total_wall_seconds",
        "status",
        "degradation",
    ]
    assert res["note"] == "own app" and res["action"] == "fedproto" and "prototypes" in res
    # config: the given mapping first, then the strategy's sections; the method from its action
    cfg = res["config"]
    assert list(cfg)[:2] == ["method", "my-key"] and cfg["method"] == "fedproto"
    assert cfg["my-key"] == 7 and cfg["fedproto-lambda"] == 0.5 and cfg["graph"] == "ring"
    assert cfg["max-steps-per-epoch"] == 2 and cfg["seed"] == 2
    assert strategy_config(strategy)["fedproto-lambda"] == 0.5
    # rounds, nodes, edges: the strategy's, NaN written as null
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert [r["private_accuracy_mean"] for r in res["rounds"]] == [
        r["private_accuracy_mean"] for r in strategy.history
    ]
    assert set(res["nodes"]) == {"0", "1", "2"} and len(res["edges"]) == 6
    assert res["total_wall_seconds"] == strategy.ledger.rounds[-1].elapsed_seconds
    # the silent node: a recorded failure and a degraded (not failed: 1 of 6 < 0.5) run
    assert [(f["round"], f["phase"], f["partition-id"]) for f in res["failures"]] == [
        (2, "train", 2)
    ]
    assert res["status"] == "degraded" and res["degradation"]["train_failed"] == 1
    assert res["rounds"][1]["failed"]["train"] == [2]
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"

    # the same strategy, a stricter threshold: failed
    again = write_results(strategy, tmp_path / "strict", max_failed_fraction=0.1)
    assert json.loads(again.read_text())["status"] == "failed"

    # another run's results are never replaced silently
    before = path.read_text()
    with pytest.raises(FileExistsError, match=r"results\.json, accuracy\.png.*overwrite=True"):
        write_results(strategy, out)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        check_results_dir(out)
    assert path.read_text() == before
    assert write_results(strategy, out, overwrite=True, wall_seconds=1.5) == path
    assert json.loads(path.read_text())["total_wall_seconds"] == 1.5
    with pytest.raises(ValueError, match=r"extra keys \['status'\]"):
        write_results(strategy, out, overwrite=True, extra={"status": "fine"})
    with pytest.raises(NotADirectoryError):
        write_results(strategy, path)


def test_plot_rounds_leaves_the_callers_matplotlib_backend_alone(tmp_path):
    """accuracy.png is drawn without pyplot, so a notebook's inline backend is not switched to Agg
    (which made the notebook's own figures vanish); the PNG is still written, integer round ticks."""
    import matplotlib

    from flwr_sheaf.results import plot_rounds

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend that is not Agg, as a notebook's inline one is not
    try:
        rounds = [{"round": r, "private_accuracy_mean": 0.1 * r} for r in (1, 2, 3)]
        plot_rounds(rounds, tmp_path / "a.png", title="t")
        assert matplotlib.get_backend().lower() == "svg"
    finally:
        matplotlib.use(before)
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_round_means_do_not_depend_on_the_order_the_replies_arrived():
    """The main job's mean over receivers differed in its last digit between two runs of the same
    seed on the Ray engine (0.7716268000976434 / ...432): the replies' arrival order changed the
    float sum. ``nanmean`` sums with ``math.fsum``: every order gives the correctly rounded mean."""
    import itertools
    import math

    from flwr_sheaf.strategy.records import nanmean

    vals = [0.1, 0.7, 1e-16, 0.3, float("nan"), None, 0.2]  # order-sensitive under plain sum
    got = {nanmean(p) for p in itertools.permutations(vals)}
    clean = [0.1, 0.7, 1e-16, 0.3, 0.2]
    assert got == {math.fsum(clean) / 5}


def test_a_run_config_key_the_strategy_does_not_apply_is_warned_at_start_and_recorded_as_run(
    tmp_path, caplog
):
    """A host app's own ``fraction-evaluate = 0.5`` (for its FedAvg) beside a flwr-sheaf strategy
    built with ``FederationConfig()``: every node is evaluated, so results.json records 1.0, and the
    key is named at start and among results.json's warnings."""
    rc = {**RC, "fraction-evaluate": 0.5, "lr": 0.05, "fedproto-lamda": 0.5, "num-nodes": 3}
    strategy = FedProto(
        3,
        federation=FederationConfig(graph="ring", seed=2),
        train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=1, lr=0.05),
    )
    with caplog.at_level(logging.WARNING, logger="flwr_sheaf"):
        out = check_results_dir(tmp_path / "run", strategy=strategy, config=rc)
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run-config")]
    assert len(warned) == 2
    assert warned[0].startswith("run-config fraction-evaluate=0.5 is not applied")
    assert "FedProto runs with fraction-evaluate=1.0" in warned[0]  # lr: the same value, not named
    # a misspelt key of the package's (the app's own num-nodes is not named)
    assert warned[1].startswith(
        "run-config key 'fedproto-lamda' is no flwr-sheaf key: did you mean 'fedproto-lambda'?"
    )
    strategy.start(grid=LocalGrid(cnn_client_app, 3, run_config=rc), num_rounds=1, timeout=5)
    assert strategy.history[-1]["evaluated"] == [0, 1, 2]  # every node: 1.0 took effect
    res = json.loads(write_results(strategy, out, config=rc).read_text())
    assert res["config"]["fraction-evaluate"] == 1.0 and res["config"]["lr"] == 0.05
    assert res["config"]["zoo"] == "tiny-3" and res["warnings"] == warned


def test_a_host_apps_method_and_num_server_rounds_are_recorded_as_run_and_warned(tmp_path, caplog):
    """A host app's own ``method = "fedavg"`` (its pipeline switch) and ``num-server-rounds = 3``
    beside a FedProto started for 1 round: results.json had recorded both as given (method fedavg,
    3 rounds, no warning); it records what ran (fedproto, 1) and warns of both, the method at start."""
    rc = {**RC, "method": "fedavg", "num-server-rounds": 3}
    strategy = FedProto(
        3,
        federation=FederationConfig(graph="ring", seed=2),
        train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=1),
    )
    with caplog.at_level(logging.WARNING, logger="flwr_sheaf"):
        out = check_results_dir(tmp_path / "run", strategy=strategy, config=rc)
    at_start = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run-config")]
    assert at_start == [
        "run-config method='fedavg' is not applied: FedProto runs with method='fedproto' "
        "(results.json's config records 'fedproto'); to apply it, build that method's strategy"
    ]
    strategy.start(grid=LocalGrid(cnn_client_app, 3, run_config=rc), num_rounds=1, timeout=5)
    res = json.loads(write_results(strategy, out, config=rc).read_text())
    assert res["config"]["method"] == "fedproto" and res["config"]["num-server-rounds"] == 1
    assert res["warnings"] == [
        *at_start,
        "run-config num-server-rounds=3 is not applied: FedProto runs with num-server-rounds=1 "
        "(results.json's config records 1); to apply it, pass num_rounds=... to strategy.start",
    ]
    # the same keys with what ran: nothing warned (1.0 parses as 1), what ran recorded
    ok = {**RC, "method": "fedproto", "num-server-rounds": 1.0}
    res = json.loads(write_results(strategy, tmp_path / "ok", config=ok).read_text())
    assert "warnings" not in res and res["config"]["num-server-rounds"] == 1


@pytest.mark.parametrize(("key", "value"), [("max-failed-fraction", 2.0), ("keep-previous", -1)])
def test_a_bad_value_write_results_reads_from_the_config_is_refused_before_training(
    tmp_path, key, value
):
    """write_results reads ``max-failed-fraction`` and ``keep-previous`` from ``config``: a bad value
    had been refused only there, after training (results lost); check_results_dir refuses it at
    start, naming it, with nothing created."""
    from flwr_sheaf.config import KEYS, ConfigError

    with pytest.raises(ConfigError) as want:
        KEYS[key](value)  # the key's own parser's message
    with pytest.raises(ConfigError) as got:
        check_results_dir(tmp_path / "run", config={**RC, key: value})
    assert str(got.value) == str(want.value) and key in str(got.value)
    assert list(tmp_path.iterdir()) == []


def test_overwrite_given_as_text_is_refused_not_taken_as_true(tmp_path):
    """``--run-config 'overwrite="false"'`` hands a host app the string "false", which is truthy: the
    earlier results had been moved aside as if overwrite=true (logged "overwrite=True"). It is
    refused naming the value, at start and at write, with nothing moved."""
    from flwr_sheaf.config import ConfigError

    strategy = FedProto(
        3,
        federation=FederationConfig(graph="ring", seed=2),
        train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=1),
    )
    strategy.start(grid=LocalGrid(cnn_client_app, 3, run_config=RC), num_rounds=1, timeout=5)
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text("{}")
    for bad in ("false", 1):
        with pytest.raises(ConfigError, match=rf"^overwrite={bad!r}: expected true or false$"):
            check_results_dir(out, overwrite=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=rf"^overwrite={bad!r}: expected true or false$"):
            write_results(strategy, out, overwrite=bad)  # type: ignore[arg-type]
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]  # nothing moved, no lock


def test_a_results_dir_that_is_no_path_is_named(tmp_path, monkeypatch):
    """A host app's ``results-dir = 5`` had raised Python's "expected str, bytes or os.PathLike
    object, not int", naming neither the argument nor the value."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        TypeError, match=r"^out_dir=5: expected a directory path \(a str or Path\)$"
    ):
        check_results_dir(5)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_a_relative_results_dir_is_returned_absolute_and_where_it_goes_is_said(
    tmp_path, monkeypatch, caplog
):
    """Under flwr run a relative results-dir resolves in the ServerApp's working directory (where
    the local SuperLink was started), not the app's folder: one's own app got the relative path back
    (the drop-in printed "results in results/dropin/results.json") and nothing said where."""
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="flwr_sheaf"):
        out = check_results_dir("rel/run")
    assert out == tmp_path.resolve() / "rel" / "run" and out.is_dir()
    assert f"results-dir 'rel/run' is relative: results go to {out} " in caplog.text


def test_a_second_run_into_a_results_dir_a_live_run_holds_is_refused_at_its_start(tmp_path):
    """``flwr run --stream`` stopped with Ctrl-C leaves its run going: a rerun into the same
    results-dir is refused by check_results_dir (before training), naming the live Flower run and
    ``flwr stop <run-id>``; the directory is free again once that run's process ends."""
    out = tmp_path / "run"
    code = (
        "import sys\n"
        "import flwr.simulation.app\n"  # as in Flower's simulation process, which sets the run id
        "from flwr.supercore.task_identity import TaskIdentity\n"
        "TaskIdentity.run_id = 4242\n"
        "from flwr_sheaf.results import check_results_dir\n"
        f"check_results_dir({str(out)!r})\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(
            LockedError,
            match=rf"out_dir {out} is in use by another run: process {proc.pid} on this host holds "
            r".*it is Flower run 4242: stop it with `flwr stop 4242` \(`flwr ls` lists runs\)",
        ):
            check_results_dir(out)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    assert check_results_dir(out) == out  # that run ended: its lock went with its process
