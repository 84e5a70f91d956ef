"""Every graph method's 3-round in-process run as one JSON dump, to compare two versions of the code.

A refactor or a speed-up that must not change the numbers is checked by dumping before and after
and comparing (wall-clock fields are dropped):

    PYTHONPATH=<old tree>:<old tree>/simulations python benchmarks/fingerprint.py dump old.json
    python benchmarks/fingerprint.py dump new.json
    python benchmarks/fingerprint.py compare old.json new.json      # exit 1 and the differences, if any

Runs: ``zoo=tiny-4 graph=ring num-pilots=64 max-steps-per-epoch=4 num-server-rounds=3
evaluate-every=1 seed=3`` for each method (per-round metrics, per-node and per-edge results, failures).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulations"))

METHODS = (
    "sheaf-frl",
    "non-cooperative",
    "fedproto",
    "fedsaf-gcsa",
    "fedsaf-rcsa",
    "fedmuscle",
    "comfed",
    "sheaf-fmtl",
)
WALL = {"elapsed_seconds", "wall_seconds", "total_wall_seconds", "bytes_sent", "bytes_received"}


def dump(path: str, methods: list[str]) -> None:
    """Run each method (module docstring) and write their results, minus wall-clock fields, to ``path``."""
    from inprocess import run_inprocess

    out = {}
    for m in methods:
        with tempfile.TemporaryDirectory() as d:
            res = run_inprocess(
                {
                    "method": m,
                    "zoo": "tiny-4",
                    "graph": "ring",
                    "num-pilots": 64,
                    "max-steps-per-epoch": 4,
                    "num-server-rounds": 3,
                    "evaluate-every": 1,
                    "seed": 3,
                    "results-dir": d,
                }
            )
        out[m] = {
            "rounds": [{k: v for k, v in r.items() if k not in WALL} for r in res["rounds"]],
            "nodes": res.get("nodes"),
            "edges": res.get("edges"),
            "failures": res.get("failures"),
        }
    Path(path).write_text(json.dumps(out, indent=1, sort_keys=True, default=str))


def differences(a, b, path: str = "") -> list[str]:
    """Paths (``method/rounds[1]/ce``) where two dumps differ, with both values."""
    if type(a) is not type(b):
        return [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict):
        keys = sorted((set(a) | set(b)) - WALL, key=str)
        return [d for k in keys for d in differences(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3:] or list(METHODS))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        diff = differences(
            json.loads(Path(sys.argv[2]).read_text()), json.loads(Path(sys.argv[3]).read_text())
        )
        print("\n".join(diff[:50]) or "identical")
        sys.exit(1 if diff else 0)
    else:
        sys.exit(__doc__)
