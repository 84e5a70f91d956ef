"""``flwr run`` (real engine: local SuperLink + Ray) for every comparison method (marked ``engine``).

The 2-agent family has equal latent sizes, so FedProto/FedSAF need no adapter key here (``flwr run
--run-config`` only overrides keys that the app's pyproject lists).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TWO = "zoo='two-agent:8' graph='0-1' num-pilots=64 local-epochs=1 num-server-rounds=1"


def _cmd(method: str, out: Path) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "scripts" / "run_flwr.py"),
        "--app",
        str(ROOT),
        "--num-supernodes",
        "2",
        "--port",
        "0",
        "--timeout",
        "600",
        "--run-config",
        f"{TWO} method='{method}' results-dir='{out}'",
    ]


METHODS = ["fedmuscle", "comfed"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs started at once (own free ports, FLWR_HOME and Ray instance each): they spend most
    of their wall time waiting on process start-ups, so side by side they overlap (tests/test_engine.py)."""
    pool = ThreadPoolExecutor(max_workers=2)
    out = {}
    for method in METHODS:
        res = tmp_path_factory.mktemp(method) / "res"
        out[method] = (
            pool.submit(
                subprocess.run,
                _cmd(method, res),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=700,
            ),
            res,
        )
    yield out
    pool.shutdown(wait=True)


@pytest.mark.engine
# FedSAF runs FedProto's strategy and client path with another loss plug-in (in-process tests and the
# notebook cover it); one real-engine run per distinct path keeps the suite within its time budget.
# FedProto and the non-cooperative baseline send the same kinds of records through the engine as
# FedMuscle (a server-built target record) and Sheaf-FRL (tests/test_engine.py); their logic is
# covered in-process (tests/test_methods_flower.py). One real-engine run per kind of payload keeps the
# suite near its 15-minute budget now that the deployment-engine tests run too.
@pytest.mark.parametrize("i, method", list(enumerate(METHODS)))
def test_flwr_run_each_comparison_method(runs, i, method):
    future, out = runs[method]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["method"] == method and res["failures"] == []
    assert len(res["nodes"]) == 2 and len(res["edges"]) == 2
    assert res["rounds"][-1]["communication_accuracy_degree_weighted"] is not None
