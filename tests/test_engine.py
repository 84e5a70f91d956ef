"""Real-engine tests: ``flwr run`` on a private local SuperLink + Ray (marked ``engine``).

Run locally with ``pytest -m engine``; skip with ``-m "not engine"``. CI runs them.

The runs are independent (each on its own free ports, its own FLWR_HOME and Ray instance) and spend
most of their wall time waiting on process start-ups and Flower's polling, so the module fixture
``runs`` starts the selected ones two at a time (two such runs side by side took 26 s each, one after
the other 25 + 22 s); each test then waits for its own run and checks it as before.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = "zoo='tiny-4' num-pilots=64 local-epochs=1"


def _run(tmp_path, run_config, port, app=ROOT, num_supernodes=4, cwd=ROOT):
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "run_flwr.py"),
        "--app",
        str(app),
        "--num-supernodes",
        str(num_supernodes),
        "--port",
        str(port),
        "--timeout",
        "600",
    ]
    if run_config:
        cmd += ["--run-config", run_config]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=700)
    proc.wall = time.monotonic() - t0  # type: ignore[attr-defined]  # this run's own wall time
    return proc


# test name -> (run config with {out} for its results-dir, app, num_supernodes)
RUNS = {
    "test_flwr_run_completes_and_writes_results": (
        f"{TINY} graph='ring' num-server-rounds=2 results-dir='{{out}}'",
        ROOT,
        4,
    ),
    "test_sampled_discovery_under_flwr_run_describes_only_the_drawn_nodes": (
        # discovery='sampled' on the Ray engine: Flower's random node ids, 2 of 4 nodes drawn per phase
        f"{TINY} graph='ring' num-server-rounds=2 fraction-train=0.5 fraction-evaluate=0.5 "
        "discovery='sampled' results-dir='{out}'",
        ROOT,
        4,
    ),
    # `flwr run . --stream` with no --federation-config: Flower 1.42 starts 2 SuperNodes
    "test_plain_flwr_run_on_flowers_default_federation_fails_fast_naming_the_fix": ("", ROOT, 0),
    "test_dropin_app_runs_under_flwr_run": (
        "num-server-rounds=2 results-dir='{out}'",
        ROOT / "examples" / "dropin_app",
        4,
    ),
    "test_a_run_in_which_nobody_trains_ends_failed_under_flwr_run": (
        f"{TINY} graph='ring' num-server-rounds=2 lr=1e8 clip-norm=0.0 results-dir='{{out}}'",
        ROOT,
        4,
    ),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """{test name: (Future of its CompletedProcess, its results dir)} for the selected tests of this
    module, started two at a time in the order above."""
    here = request.module.__name__
    selected = {i.originalname for i in request.session.items if i.module.__name__ == here}
    pool = ThreadPoolExecutor(max_workers=2)
    out: dict[str, tuple[Future, Path]] = {}
    for name, (rc, app, n) in RUNS.items():
        if name in selected:
            res = tmp_path_factory.mktemp(name[5:40]) / "res"
            out[name] = (pool.submit(_run, None, rc.format(out=res), 0, app, n), res)
    yield out
    pool.shutdown(wait=True)


@pytest.mark.engine
def test_flwr_run_completes_and_writes_results(runs):
    future, out = runs["test_flwr_run_completes_and_writes_results"]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished:completed" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert len(res["edges"]) == 8 and len(res["nodes"]) == 4  # ring on 4 nodes: 8 directed edges
    assert (out / "accuracy.png").stat().st_size > 0
    assert "stopped" in proc.stdout


@pytest.mark.engine
def test_sampled_discovery_under_flwr_run_describes_only_the_drawn_nodes(runs):
    future, out = runs["test_sampled_discovery_under_flwr_run_describes_only_the_drawn_nodes"]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished:completed" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and res["discovery"]["registered"] == 4
    assert [r["num_trained"] for r in res["rounds"]] == [2, 2]
    drawn = {p for r in res["rounds"] for p in r["sampled"] + r.get("evaluated", [])}
    described = {
        p for phases in res["discovery"]["rounds"].values() for v in phases.values() for p in v
    }
    assert described == drawn and res["discovery"]["described"] == len(drawn)


@pytest.mark.engine
def test_plain_flwr_run_on_flowers_default_federation_fails_fast_naming_the_fix(runs):
    # `flwr run . --stream` with no --federation-config: Flower 1.42 starts 2 SuperNodes, the default
    # scenario has 15 agents. The ServerApp must stop at discovery, not wait for nodes that never come.
    proc = runs["test_plain_flwr_run_on_flowers_default_federation_fails_fast_naming_the_fix"][
        0
    ].result()
    wall = proc.wall  # the run's own wall time (not the wait for a slot in the module's pool)
    assert proc.returncode == 1 and "finished:failed" in proc.stdout, proc.stdout[-3000:]
    assert 'flwr run . --stream --federation-config "num-supernodes=15"' in proc.stdout
    # Waiting for the 13 SuperNodes that never come would take the whole default discovery-timeout
    # (300 s) after SuperLink + Ray start; stopping at once stays below it even on a loaded machine
    # (a fixed bound such as 120 s measured the machine's load, not the fail-fast).
    from flwr_sheaf.config import DEFAULTS

    assert wall < float(DEFAULTS["discovery-timeout"]), wall


@pytest.mark.engine
def test_dropin_app_runs_under_flwr_run(runs):
    future, out = runs["test_dropin_app_runs_under_flwr_run"]
    proc = future.result()
    assert proc.returncode == 0 and "finished:completed" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-2000:]
    )
    assert "communication accuracy" in proc.stdout
    res = json.loads((out / "results.json").read_text())  # flwr_sheaf.write_results in the example
    assert [r["round"] for r in res["rounds"]] == [1, 2] and res["status"] == "completed"
    assert (out / "accuracy.png").stat().st_size > 0


@pytest.mark.engine
def test_a_run_in_which_nobody_trains_ends_failed_under_flwr_run(runs):
    """Issue "no silent failure", item 4, on the real engine: every node's loss diverges (lr 1e8, no
    clipping), so no node trains; the ServerApp writes results.json with status failed and then fails,
    so `flwr ls` says failed and the wrapper exits 1 (flwr run itself exits 0). This is also the
    engine test of the wrapper's failure detection (a ServerApp that raises: flwr run exits 0, the
    wrapper must not); the ServerApp's refusals themselves (e.g. a disconnected graph) are tested
    in-process (tests/test_flower_e2e.py, tests/test_config.py)."""
    future, out = runs["test_a_run_in_which_nobody_trains_ends_failed_under_flwr_run"]
    proc = future.result()
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "finished:failed" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "failed" and res["degradation"]["all_rounds_trained_nobody"] is True


@pytest.mark.engine
def test_a_superlink_started_from_another_apps_folder_is_named_at_discovery(tmp_path):
    """`flwr run` of the drop-in from a folder holding another app's package of the same name: the
    local SuperLink starts there and its Ray workers import that package first. The run fails at
    discovery naming both files and the fix, instead of running the other app's code."""
    other = tmp_path / "other-app"
    shutil.copytree(
        ROOT / "examples" / "dropin_app" / "dropin_app",
        other / "dropin_app",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    with (other / "dropin_app" / "client_app.py").open("a") as f:
        f.write("# the other app's version of the module\n")
    out = tmp_path / "res"
    app = ROOT / "examples" / "dropin_app"
    proc = _run(None, f"num-server-rounds=1 results-dir='{out}'", 0, app, 4, cwd=other)
    assert proc.returncode == 1 and "finished:failed" in proc.stdout, proc.stdout[-3000:]
    text = proc.stdout + proc.stderr
    assert "discovery failed on node" in text
    assert f"this worker imported {other / 'dropin_app' / 'client_app.py'}, not this run's " in text
    assert "Stop that SuperLink" in text and not (out / "results.json").exists()


def _cmdline(p) -> str:
    import psutil

    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


@pytest.mark.engine
def test_ctrl_c_on_main_sh_stops_every_process_it_started_and_its_advice_runs(tmp_path):
    """Ctrl-C on scripts/main.sh (SIGINT to its process group, as a terminal sends it) once round 1
    is checkpointed: exit status 130, none of the processes the run started (SuperLink, SuperExec,
    simulation, Ray's GCS / raylet / agents) is left, and the command the advice names (no
    node-state-dir: overwrite=true, not resume=true) runs to a completed run. About 3 minutes on
    2 loaded cores (two runs of 15 SuperNodes)."""
    import os
    import re
    import signal

    import psutil

    from flwr_sheaf.tools.flwr_cli import free_port_block

    out = tmp_path / "out"
    env = {
        **os.environ,
        "FLWR_SHEAF_SETUP": "0",  # this environment, not a .venv of the checkout
        "RESULTS_DIR": str(out),
        "FLWR_SHEAF_PORT": str(free_port_block(3)),
    }
    args = f"{TINY} graph='ring' num-server-rounds=20 max-steps-per-epoch=2"
    log = tmp_path / "main.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            ["bash", "scripts/main.sh", args],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 400
        while not (out / "checkpoint.pkl").exists():  # round 1 done: the run is under way
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        started = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(_cmdline(p) for p in started)
        assert "flower-superlink" in names and "raylet" in names, names
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 130, text[-3000:]
    time.sleep(1)
    left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], [_cmdline(p)[:120] for p in left]
    (line,) = [x for x in text.splitlines() if x.startswith("interrupted (SIGINT): ")]
    assert "(flwr stop)" in line, line
    advised = re.search(r'(bash scripts/main\.sh "[^"]*")', line)
    assert advised is not None, line
    assert "overwrite=true" in advised.group(1) and "resume=true" not in advised.group(1)
    again = subprocess.run(
        ["bash", "-c", advised.group(1)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and len(res["rounds"]) == 20
