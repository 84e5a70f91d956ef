"""Real-engine tests: ``flwr run`` on a private local SuperLink + Ray (marked ``engine``).

Run locally with ``pytest -m engine``; skip with ``-m "not engine"``. CI runs them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = "zoo='tiny-4' num-pilots=64 local-epochs=1"


def _run(tmp_path, run_config, port):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_flwr.py"), "--app", str(ROOT), "--num-supernodes", "4",
         "--port", str(port), "--timeout", "600", "--run-config", run_config],
        cwd=ROOT, capture_output=True, text=True, timeout=700,
    )


@pytest.mark.engine
def test_flwr_run_completes_and_writes_results(tmp_path):
    out = tmp_path / "res"
    proc = _run(tmp_path, f"{TINY} graph='ring' num-server-rounds=2 results-dir='{out}'", 39391)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished:completed" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert len(res["edges"]) == 8 and len(res["nodes"]) == 4  # ring on 4 nodes: 8 directed edges
    assert (out / "accuracy.png").stat().st_size > 0
    assert "stopped" in proc.stdout


@pytest.mark.engine
def test_flwr_run_failure_is_detected(tmp_path):
    # A disconnected graph makes the ServerApp raise: flwr run still exits 0, the wrapper must not.
    proc = _run(tmp_path, f"{TINY} num-server-rounds=1 graph='0-1,2-3' results-dir='{tmp_path}'", 39491)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "finished:failed" in proc.stdout
