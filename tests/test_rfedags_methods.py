"""The RFedAGS family as methods of the app: selectable by ``method``, on the planted problems, with
the numpy loop (``run_federated`` of ``tests/oracles/rfedags_runner.py``) as the oracle."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from oracles.rfedags_runner import run_federated

from flwr_sheaf.apps.client_app import app
from flwr_sheaf.apps.methods import num_nodes
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.methods import parse_run_config
from flwr_sheaf.methods.rfedags import planted_problem
from flwr_sheaf.testing import LocalGrid

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, **rc):
    rc = {"num-server-rounds": 4, "seed": 1, "results-dir": str(tmp_path / "res"), **rc}
    cfg, method = parse_run_config(rc)
    grid = LocalGrid(app, num_nodes(cfg, method), run_config=rc)
    return json.loads(Path(run_server(grid, rc)).read_text())


@pytest.mark.parametrize(
    "method, problem",
    [("rfedags", "pca"), ("rfedavg", "spd"), ("rfedsvrg", "poincare"), ("rfedproj", "pca")],
)
def test_app_run_equals_the_numpy_reference_loop(tmp_path, method, problem):
    res = _run(tmp_path, method=method, **{"rfedags-problem": problem})
    prob, p = planted_problem(problem, 1)
    x0 = prob.manifold.random_point(np.random.default_rng([1, 2]))
    ref = run_federated(
        prob,
        p,
        method=method,
        mode="corrected" if method == "rfedags" else "uncorrected",
        num_rounds=4,
        local_steps=5,
        step_size=0.02,
        x0=x0,
        seed=1,
    )
    np.testing.assert_allclose(
        [r["gap"] for r in res["rounds"]], ref["gap"][1:], rtol=1e-9, atol=1e-12
    )
    assert [r["num_trained"] for r in res["rounds"]] == ref["num_responders"][1:]
    assert all(
        {"round", "sampled", "num_sampled", "failed", "gap", "distance_to_optimum"} <= set(r)
        for r in res["rounds"]
    )
    assert res["config"]["method"] == method and res["action"] == method


def test_participation_comes_from_the_sampler_key(tmp_path):
    res = _run(tmp_path, method="rfedags", participation="0.5", **{"rfedags-problem": "spd"})
    assert res["participation"]["mode"] != "fraction" and res["rounds"][0]["num_sampled"] < 10


ENGINE_METHODS = ["rfedags", "rfedavg"]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """Both flwr runs started at once (own free ports, FLWR_HOME and Ray instance each): they spend
    most of their wall time waiting on process start-ups, so side by side they overlap."""
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {}
    for method in ENGINE_METHODS:
        out = tmp_path_factory.mktemp(method) / "res"
        cmd = [
            sys.executable,
            str(ROOT / "scripts" / "run_flwr.py"),
            "--app",
            str(ROOT),
            "--num-supernodes",
            "10",
            "--port",
            "0",
            "--timeout",
            "600",
            "--run-config",
            f"method='{method}' rfedags-problem='spd' num-server-rounds=3 results-dir='{out}'",
        ]
        kw = {"cwd": ROOT, "capture_output": True, "text": True, "timeout": 700}
        runs[method] = (pool.submit(subprocess.run, cmd, **kw), out)
    yield runs
    pool.shutdown(wait=True)


@pytest.mark.engine
@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_flwr_run_selects_the_rfedags_family_and_writes_results(engine_runs, method):
    future, out = engine_runs[method]
    proc = future.result()
    assert proc.returncode == 0 and "finished:completed" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-2000:]
    )
    res = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [1, 2, 3]
    assert res["rounds"][-1]["gap"] < res["rounds"][0]["gap"]
