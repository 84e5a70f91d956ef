"""Write ``flwr_sheaf/expected_results.json``: the main job's expected band, from measured runs.

    # one in-process run of the main job's scenario per seed (about 3-8 min each on 2 cores)
    for s in 0 1 2 3 4; do
        python simulations/inprocess.py seed=$s checkpoint-every=0 results-dir=/tmp/band/seed$s
    done
    # seed 0 under other CPU kernels (digits differ between CPUs; these measure by how much)
    python simulations/inprocess.py seed=0 torch-threads=2 checkpoint-every=0 results-dir=/tmp/band/threads2
    python -c "import sys, runpy, torch; torch.backends.mkldnn.enabled = False; \\
        sys.argv = ['inprocess.py', 'seed=0', 'checkpoint-every=0', 'results-dir=/tmp/band/no-mkldnn']; \\
        runpy.run_path('simulations/inprocess.py', run_name='__main__')"
    python scripts/expected_band.py --seeds /tmp/band/seed{0,1,2,3,4} \\
        --variant "torch-threads=2=/tmp/band/threads2" --variant "mkldnn off=/tmp/band/no-mkldnn"

The band of each headline number is its final-round mean, min and max over the seeds; the tolerance
is the largest final-round difference between seed 0 and a variant (over the headline numbers).
Every seed run must have the same config apart from ``seed`` and the keys that do not enter results.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date
from pathlib import Path

import torch

from flwr_sheaf.config import RESUME_MUTABLE_KEYS
from flwr_sheaf.expected import _FREE, METRICS, REFERENCE_PATH, not_judged, reference_mismatch
from flwr_sheaf.report import ResultsFileError, read_results


def _load(d: str) -> dict:
    """``d``'s results.json, checked: a completed CPU run with a config (:func:`not_judged`).

    Raises:
        SystemExit: unreadable, malformed (:func:`flwr_sheaf.report.read_results`), or a run the band
            cannot be measured from; the message names the directory and why.
    """
    try:
        res = read_results(d)
    except ResultsFileError as e:
        sys.exit(f"expected_band.py: {e}")
    why = not_judged(res)
    if why:
        sys.exit(f"expected_band.py: {d}: {'; '.join(why)}; the band is measured from clean runs")
    if not isinstance(res.get("config"), dict) or "seed" not in res["config"]:
        sys.exit(f"expected_band.py: {d}/results.json records no config with a seed")
    return res


def _final(res: dict, final: int, d: str) -> dict[str, float]:
    """The headline numbers of round ``final`` of ``d``'s run.

    Raises:
        SystemExit: the run has no such round, or one of its numbers is null (named).
    """
    rows = [x for x in res["rounds"] if x["round"] == final]
    if len(rows) != 1:
        sys.exit(f"expected_band.py: {d}: {len(rows)} entries for round {final}, expected one")
    missing = [k for k in METRICS if rows[0].get(k) is None]
    if missing:
        sys.exit(f"expected_band.py: {d}: round {final} has no {', '.join(missing)}")
    return {k: float(rows[0][k]) for k in METRICS}


def build(seed_dirs: list[str], variants: dict[str, str], note: str) -> dict:
    """The reference dict (``flwr_sheaf.expected.load_reference``'s schema) from the runs' results.json.

    Raises:
        SystemExit: an unreadable or malformed results.json, a run that did not complete or ran on
            CUDA, or runs of different configs (named).
    """
    runs = [_load(d) for d in seed_dirs]
    skip = RESUME_MUTABLE_KEYS | _FREE
    config = {k: v for k, v in runs[0]["config"].items() if k not in skip}
    ref0 = {"config": config}
    for d, r in zip(seed_dirs, runs):
        why = reference_mismatch(r["config"], ref0)
        if why:
            sys.exit(f"{d}: another config than {seed_dirs[0]}: {why}")
    if not runs[0]["rounds"]:
        sys.exit(f"expected_band.py: {seed_dirs[0]}: no rounds")
    final = max(x["round"] for x in runs[0]["rounds"])
    per_seed = {
        str(r["config"]["seed"]): {
            k: [x.get(k) for x in sorted(r["rounds"], key=lambda x: x["round"])] for k in METRICS
        }
        for r in runs
    }
    finals = [_final(r, final, d) for r, d in zip(runs, seed_dirs)]
    band = {
        k: {
            "mean": round(sum(f[k] for f in finals) / len(finals), 6),
            "min": min(f[k] for f in finals),
            "max": max(f[k] for f in finals),
        }
        for k in METRICS
    }
    if not any(r["config"]["seed"] == 0 for r in runs):
        sys.exit(
            "expected_band.py: no run of seed 0 among --seeds (the CPU variants are of seed 0)"
        )
    seed0 = next(_final(r, final, d) for r, d in zip(runs, seed_dirs) if r["config"]["seed"] == 0)
    cpu = {}
    for name, d in variants.items():
        v = _final(_load(d), final, d)
        cpu[name] = {
            "final_round": v,
            "max_abs_difference_to_seed_0": max(abs(v[k] - seed0[k]) for k in METRICS),
        }
    tol = max((c["max_abs_difference_to_seed_0"] for c in cpu.values()), default=0.0)
    return {
        "scenario": "the main job (bash scripts/main.sh): every key at its default, Sheaf-FRL, 15 agents, 10 rounds x 2 epochs",
        "command": "scripts/expected_band.py (its docstring lists the runs)",
        "measured": note,
        "config": config,
        "final_round": final,
        "per_seed": per_seed,
        "band": band,
        "cpu_variants": cpu,
        "tolerance": round(tol, 6),
    }


def main(argv: list[str] | None = None) -> int:
    """CLI: ``--seeds DIR... [--variant NAME=DIR ...] [--out PATH]``; writes the JSON, prints the band."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", nargs="+", required=True, help="results directories, one per seed")
    ap.add_argument(
        "--variant", action="append", default=[], help="NAME=DIR: seed 0 under other CPU kernels"
    )
    ap.add_argument("--out", default=str(REFERENCE_PATH))
    a = ap.parse_args(argv)
    variants = dict(v.rsplit("=", 1) for v in a.variant)
    note = (
        f"{date.today().isoformat()}, {platform.machine()} CPU ({platform.processor() or 'unknown'}), "
        f"torch {torch.__version__}, in-process (simulations/inprocess.py)"
    )
    ref = build(a.seeds, variants, note)
    Path(a.out).write_text(json.dumps(ref, indent=1) + "\n")
    for k, b in ref["band"].items():
        print(f"{k}: mean {b['mean']:.4f} range {b['min']:.4f}-{b['max']:.4f}")
    print(f"tolerance between CPU kernels: {ref['tolerance']:.4f}; written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
