"""The prepared GPU session script (benchmarks/gpu_session.sh) in its SMOKE=1 mode: the same steps,
tiny, on the CPU, so the script that runs once on a GPU machine is known to work before it goes
there (docs/devices.md, "The prepared GPU session")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.engine
def test_smoke_session_runs_every_step_and_returns_what_the_device_tool_can_carry(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "SMOKE": "1",
        "OUT": str(out),
        "WORK": str(tmp_path / "work"),
        "PORT": "0",
        "PY": os.environ.get("PYTHON", "python"),
    }
    venv_bin = str(Path(os.sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env["PY"] = os.sys.executable
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, log
    steps = {
        r["step"]: r for r in map(json.loads, (out / "summary.jsonl").read_text().splitlines())
    }
    assert set(steps) == {"a", "b", "c", "d", "e"}, log
    assert (
        steps["a"]["rc"] == 0
        and steps["b"]["ok"]
        and steps["d"]["rc"] == 0
        and steps["e"]["rc"] == 0
    ), log
    # c: the Ray engine's run completed, with a per-epoch time and final accuracies in [0, 1]
    assert steps["c"]["rc"] == 0 and len(steps["c"]["round_wall_seconds"]) == 3, log
    assert all(0.0 <= v <= 1.0 for v in steps["c"]["final"].values()), steps["c"]
    # b: product and floor timed the same number of steps in one process
    floor = json.loads((out / "floor.json").read_text())
    assert (
        floor["ratio_glued_cpu"] > 0 and floor["steps_per_epoch_all_agents"] == 3 * 2
    )  # tiny-3, 2 steps each
    # d: both shifts x both seeds, lambda chosen on validation from the grid
    study = json.loads((out / "study.json").read_text())
    assert len(study["table"]) == 4 and {r["chosen_lambda"] for r in study["table"]} <= {0.1, 1.0}
    # e: one line per k
    assert [json.loads(x)["k"] for x in (out / "concurrency.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
    # what comes back from the device tool: at most 8 plain files, names of letters, digits, '.', '_', '-'
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    with tarfile.open(out / "runs.tgz") as t:
        names = t.getnames()
    assert "./ray/results.json" in names and not any(n.endswith(".pkl") for n in names)
