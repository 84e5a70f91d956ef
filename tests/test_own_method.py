"""The own-method template of docs/own-method.md is the code that runs: the page shows the files of
``examples/own_method_app/`` unchanged, the method keeps its trained parameter across rounds
in-process, and the app runs under ``flwr run`` (engine). An undeclared run-config key is named
before Flower starts (issue #28: Flower's own refusal names no key)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "own_method_app"
DOC = ROOT / "docs" / "own-method.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), re.S | re.M)


def _app_config() -> dict:
    return tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def test_the_page_shows_the_app_files_unchanged():
    assert _blocks("toml") == [(APP / "pyproject.toml").read_text()]
    assert _blocks("python") == [(APP / "my_method.py").read_text()]
    assert "..." not in (APP / "my_method.py").read_text()  # no body left to the reader


@pytest.fixture
def my_method(monkeypatch):
    monkeypatch.syspath_prepend(str(APP))
    import my_method

    return my_method


def test_the_method_keeps_each_nodes_trained_projection_across_rounds(my_method, tmp_path):
    from flwr_sheaf.apps.client_app import app
    from flwr_sheaf.apps.server_app import run_server
    from flwr_sheaf.testing import LocalGrid

    starts: dict[tuple[int, int], np.ndarray] = {}  # (partition-id, round) -> W_i at round start
    saved: dict[tuple[int, int], np.ndarray] = {}  # ... and as saved after training
    plugin, after = my_method.MyClient.plugin, my_method.MyClient.after_train

    def spy_plugin(self, msg, context, task):
        p = plugin(self, msg, context, task)
        key = (int(context.node_config["partition-id"]), int(msg.content["config"]["server-round"]))
        starts[key] = p.w.detach().numpy().copy()
        return p

    def spy_after(self, msg, context, task, p):
        out = after(self, msg, context, task, p)
        key = (int(context.node_config["partition-id"]), int(msg.content["config"]["server-round"]))
        saved[key] = context.state[my_method.STATE]["w"].numpy().copy()
        return out

    my_method.MyClient.plugin, my_method.MyClient.after_train = spy_plugin, spy_after
    try:
        rc = {**_app_config(), "num-server-rounds": 3, "results-dir": str(tmp_path / "res")}
        res = json.loads(Path(run_server(LocalGrid(app, 4, run_config=rc), rc)).read_text())
    finally:
        my_method.MyClient.plugin, my_method.MyClient.after_train = plugin, after
    assert res["status"] == "completed" and [r["round"] for r in res["rounds"]] == [1, 2, 3]
    for pid in range(4):
        for rnd in (1, 2):  # next round starts from what this round trained and saved
            np.testing.assert_array_equal(starts[(pid, rnd + 1)], saved[(pid, rnd)])
        assert not np.allclose(saved[(pid, 2)], starts[(pid, 2)])  # trained in round 2
    assert res["rounds"][0].get("anchor") is None and res["rounds"][2]["anchor"] > 0
    assert res["rounds"][2]["mymethod_nodes"] == 4 and res["config"]["mymethod-dim"] == 8


def test_run_flwr_names_an_undeclared_key_before_starting_flower():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "run_flwr.py"),
            "--app",
            str(APP),
            "--port",
            "0",
            "--run-config",
            "mymethod-lamda=0.5 num-server-rounds=2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "+ " not in proc.stdout  # flwr run never started
    assert proc.stderr.strip() == (
        f"--run-config key 'mymethod-lamda' (did you mean 'mymethod-lambda'?) is not declared in "
        f"{APP / 'pyproject.toml'} [tool.flwr.app.config]: Flower would refuse the run ('Invalid "
        f"run configuration', naming no key); declare it there with its default (e.g. "
        f"mymethod-lamda = ...) or fix its name"
    )


def test_a_check_a_user_runs_before_flwr_run_names_a_misspelt_key_of_their_own_app(capsys):
    """One's own app (the drop-in, a host app with its own keys) run by hand with `flwr run`: the
    check names the misspelt key, the closest declared key and the fix; declared keys pass."""
    from flwr_sheaf.tools.flwr_cli import main

    dropin = ROOT / "examples" / "dropin_app"
    assert main([str(dropin), "--run-config", "num-server-round=2 lr=0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(
            "--run-config key 'num-server-round' (did you mean 'num-server-rounds'?) is not declared in "
            f"{dropin / 'pyproject.toml'} [tool.flwr.app.config]"
        )
        and "fix its name" in err
        and "'lr'" not in err
    )
    assert main([str(dropin), "--run-config", "num-server-rounds=2 lr=0.1"]) == 0
    assert main([str(ROOT / "docs"), "--run-config", "lr=0.1"]) == 2  # no pyproject.toml there
    assert f"no {ROOT / 'docs' / 'pyproject.toml'}" in capsys.readouterr().err


def test_the_check_reads_every_run_config_as_flwr_run_does(capsys, tmp_path):
    """`flwr run` takes --run-config (or -c) repeatedly, or one TOML file: the check reads each, so
    a misspelt key in an earlier --run-config is named (it had kept only the last one: exit 0)."""
    from flwr_sheaf.tools.flwr_cli import main

    dropin = ROOT / "examples" / "dropin_app"
    assert main([str(dropin), "--run-config", "local-epoch=2", "-c", "lr=1"]) == 2
    assert "key 'local-epoch' (did you mean 'local-epochs'?)" in capsys.readouterr().err
    (tmp_path / "over.toml").write_text("lr = 0.1\nlocal-epoch = 2\n")
    assert main([str(dropin), "-c", str(tmp_path / "over.toml")]) == 2
    assert "key 'local-epoch' (did you mean 'local-epochs'?)" in capsys.readouterr().err
    assert main([str(dropin), "-c", str(tmp_path / "over.toml"), "-c", "lr=1"]) == 2
    assert "TOML files cannot be passed alongside key-value pairs" in capsys.readouterr().err
    assert main([str(dropin), "-c", "lr=1", "--run-config", "num-server-rounds=2"]) == 0


@pytest.mark.engine
def test_the_template_app_runs_under_flwr_run(tmp_path):
    app = tmp_path / "my_app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__", "results"))
    out = tmp_path / "res"
    proc = subprocess.run(
        [
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
            "--run-config",
            f"mymethod-lambda=0.5 num-server-rounds=2 results-dir='{out}'",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=700,
    )
    assert proc.returncode == 0 and "finished:completed" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-2000:]
    )
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["method"] == "my-method" and res["config"]["mymethod-lambda"] == 0.5
    assert [r["round"] for r in res["rounds"]] == [1, 2] and res["rounds"][1]["anchor"] > 0
    assert res["failures"] == [] and len(res["nodes"]) == 4


OWN_APP_PROGRESS = """
from flwr_sheaf import LocalGrid, NonCooperative
from flwr_sheaf.apps.client_app import app
from flwr_sheaf.config import FederationConfig

rc = {"zoo": "tiny-3", "num-pilots": 32, "max-steps-per-epoch": 2}
strategy = NonCooperative(3, federation=FederationConfig(graph="complete"))
strategy.start(grid=LocalGrid(app, 3, run_config=rc), num_rounds=1, timeout=60)
"""


def test_progress_of_ones_own_server_app_is_printed_without_configuring_logging():
    # issue #28: a GraphStrategy in one's own ServerApp ran silently unless the flwr_sheaf logger
    # was configured; logging configured by the app is left alone (then the root handler prints)
    run = [sys.executable, "-c"]
    proc = subprocess.run(run + [OWN_APP_PROGRESS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[flwr-sheaf] round   1 | private" in proc.stderr
    configured = "import logging; logging.basicConfig(level=logging.WARNING)\n" + OWN_APP_PROGRESS
    proc = subprocess.run(run + [configured], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "round   1" not in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------- issue 34: a method's hook failing on one node's reply
from flwr_sheaf.strategy.ledger import RunFailedError  # noqa: E402


def _run_template(my_method, tmp_path, rounds: int = 2) -> dict:
    from flwr_sheaf.apps.client_app import app
    from flwr_sheaf.apps.server_app import run_server
    from flwr_sheaf.testing import LocalGrid

    rc = {**_app_config(), "num-server-rounds": rounds, "results-dir": str(tmp_path / "res")}
    return json.loads(Path(run_server(LocalGrid(app, 4, run_config=rc), rc)).read_text())


def test_a_reply_missing_a_field_is_that_nodes_failure_and_the_others_are_aggregated(
    my_method, tmp_path, monkeypatch
):
    up = my_method.UPLOAD
    after = my_method.MyClient.after_train

    def no_upload_from_2_in_round_2(self, msg, context, task, plugin):
        records, metrics = after(self, msg, context, task, plugin)
        pid = int(context.node_config["partition-id"])
        if pid == 2 and int(msg.content["config"]["server-round"]) == 2:
            return {}, metrics  # the reply lacks the method's record
        return records, metrics

    def fragile_accept(self, server_round, ok):  # reads the field without checking it is there
        for pid, reply in ok.items():
            self.anchors[pid] = reply.content[up]["anchor"].numpy()
        return ok, {"mymethod_nodes": len(self.anchors)}

    monkeypatch.setattr(my_method.MyClient, "after_train", no_upload_from_2_in_round_2)
    monkeypatch.setattr(my_method.MyStrategy, "accept_train", fragile_accept)
    res = _run_template(my_method, tmp_path)
    assert [(f["round"], f["phase"], f["partition-id"]) for f in res["failures"]] == [
        (2, "train", 2)
    ]
    reason = res["failures"][0]["reason"]
    assert re.fullmatch(
        rf"MyStrategy\.accept_train raised on this node \(partition-id 2, node_id \d+\): "
        rf"field '{up}' is missing \(KeyError\)",
        reason,
    ), reason
    r2 = res["rounds"][1]
    assert r2["num_trained"] == 3 and r2["failed"]["train"] == [2] and r2["mymethod_nodes"] == 4
    assert res["status"] == "degraded" and res["rounds"][0]["num_trained"] == 4


def test_a_hook_raising_for_one_node_is_that_nodes_failure(my_method, tmp_path, monkeypatch):
    payload, accept = my_method.MyStrategy.node_payload, my_method.MyStrategy.accept_train

    def payload_fails_for_1(self, server_round, pid):
        if pid == 1 and server_round == 2:
            raise ValueError("no target for this node")
        return payload(self, server_round, pid)

    def accept_raises_on_3(self, server_round, ok):
        if 3 in ok and server_round == 1:
            raise ArithmeticError("anchor of partition-id 3 is odd")
        return accept(self, server_round, ok)

    monkeypatch.setattr(my_method.MyStrategy, "node_payload", payload_fails_for_1)
    monkeypatch.setattr(my_method.MyStrategy, "accept_train", accept_raises_on_3)
    res = _run_template(my_method, tmp_path)
    got = {(f["round"], f["partition-id"]): f["reason"] for f in res["failures"]}
    assert sorted(got) == [(1, 3), (2, 1)]
    assert "MyStrategy.accept_train raised on this node (partition-id 3, node_id" in got[(1, 3)]
    assert got[(1, 3)].endswith("ArithmeticError: anchor of partition-id 3 is odd")
    assert got[(2, 1)].endswith("ValueError: no target for this node")
    assert "MyStrategy.node_payload raised on this node (partition-id 1" in got[(2, 1)]
    assert [r["num_trained"] for r in res["rounds"]] == [3, 3]
    assert res["rounds"][0]["mymethod_nodes"] == 3  # the last call took the three good replies


def test_an_evaluation_payload_hook_raising_for_one_node_is_that_nodes_failure(
    my_method, tmp_path, monkeypatch
):
    # F12: evaluate_node_payload raising for partition-id 1 ended the run, nothing written
    payload = my_method.MyStrategy.evaluate_node_payload

    def fails_for_1(self, server_round, pid):
        if pid == 1:
            raise ValueError("no eval payload for 1")
        return payload(self, server_round, pid)

    monkeypatch.setattr(my_method.MyStrategy, "evaluate_node_payload", fails_for_1)
    res = _run_template(my_method, tmp_path)
    assert [(f["round"], f["phase"], f["partition-id"]) for f in res["failures"]] == [
        (1, "evaluate", 1),
        (2, "evaluate", 1),
    ]
    assert re.fullmatch(
        r"MyStrategy\.evaluate_node_payload raised on this node \(partition-id 1, node_id \d+\): "
        r"ValueError: no eval payload for 1",
        res["failures"][0]["reason"],
    )
    for r in res["rounds"]:  # the others evaluated
        assert r["evaluated"] == [0, 2, 3] and r["num_trained"] == 4
    assert sorted(res["nodes"]) == ["0", "2", "3"] and res["status"] == "degraded"


def test_a_results_extra_hook_raising_still_writes_results_json_degraded_and_names_it(
    my_method, tmp_path, monkeypatch
):
    # F13: results.json was never written (only checkpoint.pkl), a bare ValueError naming no hook
    def broken(self):
        raise ValueError("results_extra broken")

    monkeypatch.setattr(my_method.MyStrategy, "results_extra", broken)
    res = _run_template(my_method, tmp_path)
    said = (
        "MyStrategy.results_extra raised ValueError: results_extra broken; results.json is "
        "written without the method's own keys (fix the hook)"
    )
    assert res["status"] == "degraded" and res["degradation"]["problems"] == [said]
    assert [r["num_trained"] for r in res["rounds"]] == [4, 4] and not res["failures"]
    assert res["evaluation"]["evaluate-nodes"] == "drawn"  # the base's keys are kept


@pytest.mark.parametrize(
    "parts, said",
    [
        ({"cross_entropy": 1.0}, 'returned parts (cross_entropy) without "ce"'),
        ([1.0], 'returned parts of type list without "ce"'),
    ],
    ids=["no-ce", "not-a-mapping"],
)
def test_a_loss_without_its_ce_part_is_named_before_the_first_step(
    my_method, tmp_path, monkeypatch, parts, said
):
    loss = my_method.AnchorLoss.loss

    def loss_without_ce(self, model, x, y, gen):
        total, _ = loss(self, model, x, y, gen)
        return total, parts

    monkeypatch.setattr(my_method.AnchorLoss, "loss", loss_without_ce)
    with pytest.raises(RunFailedError, match="returned parts"):
        _run_template(my_method, tmp_path, rounds=1)
    res = json.loads((tmp_path / "res" / "results.json").read_text())
    assert res["status"] == "failed" and len(res["failures"]) == 4
    for f in res["failures"]:
        assert f["phase"] == "train" and f"my_method.AnchorLoss.loss {said}" in f["reason"], f
        assert 'the parts must hold the batch cross-entropy as "ce"' in f["reason"]


@pytest.mark.parametrize(
    "part, said",
    [
        ({"ce": "oops"}, 'returned part "ce" = oops (a str)'),
        ({"anchor": torch.zeros(3)}, 'returned part "anchor" = a tensor of shape (3,)'),
    ],
    ids=["ce-str", "part-vector"],
)
def test_a_loss_part_that_is_not_a_number_is_named_with_the_plugin(
    my_method, tmp_path, monkeypatch, part, said
):
    # F16: a "ce" that is a string failed each node with a bare ValueError (could not convert ...)
    loss = my_method.AnchorLoss.loss

    def loss_with_bad_part(self, model, x, y, gen):
        total, parts = loss(self, model, x, y, gen)
        return total, {**parts, **part}

    monkeypatch.setattr(my_method.AnchorLoss, "loss", loss_with_bad_part)
    with pytest.raises(RunFailedError, match="returned part"):
        _run_template(my_method, tmp_path, rounds=1)
    res = json.loads((tmp_path / "res" / "results.json").read_text())
    assert res["status"] == "failed" and len(res["failures"]) == 4
    for f in res["failures"]:
        assert f["phase"] == "train" and f"my_method.AnchorLoss.loss {said}" in f["reason"], f
        assert "each part must be a 0-d tensor or a number" in f["reason"]


def test_the_template_pyproject_passes_flowers_checks_without_warnings():
    # issue 34: `flwr run` printed 'Recommended property "license" missing in [project]'
    from flwr.common.config import validate_fields_in_config

    config = tomllib.loads((APP / "pyproject.toml").read_text())
    valid, errors, warnings = validate_fields_in_config(config)
    assert valid and errors == [] and warnings == [], (errors, warnings)
    assert config["project"]["license"] == "Apache-2.0"
