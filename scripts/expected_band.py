"""Write ``flwr_sheaf/expected_results.json`` (the main job's expected band, flwr_sheaf/expected.py)
and ``benchmarks/records/expected-band.json`` (every run's verdict), from measured runs.

    # the main job in-process, one run per seed (3-10 min each on 2 cores)
    for s in 0 1 2 3 4 5 6 7 8 9; do
        python simulations/inprocess.py seed=$s checkpoint-every=0 torch-threads=1 results-dir=/tmp/band/seed$s
    done
    # seed 0 under other CPU kernel paths (digits differ between CPUs: these measure by how much)
    C="seed=0 checkpoint-every=0"
    ATEN_CPU_CAPABILITY=avx2 python simulations/inprocess.py $C torch-threads=1 results-dir=/tmp/band/cap-avx2
    ATEN_CPU_CAPABILITY=default python simulations/inprocess.py $C torch-threads=1 results-dir=/tmp/band/cap-default
    python simulations/inprocess.py $C torch-threads=2 results-dir=/tmp/band/threads2
    python benchmarks/band_breakages.py mkldnn-off $C torch-threads=1 results-dir=/tmp/band/mkldnn-off
    # breakages patched at run time (benchmarks/band_breakages.py names them), seed 0
    for b in no-gluing identity-maps lr-tenth gluing-sign pilots-permuted labels-shuffled; do
        python benchmarks/band_breakages.py $b $C torch-threads=1 results-dir=/tmp/band/brk-$b
    done
    # the band and the records, in one command
    python scripts/expected_band.py --seeds /tmp/band/seed{0,1,2,3,4,5,6,7,8,9} \\
        --variant avx2=/tmp/band/cap-avx2 --variant default=/tmp/band/cap-default \\
        --variant threads2=/tmp/band/threads2 --variant mkldnn-off=/tmp/band/mkldnn-off \\
        --breakage no-gluing=/tmp/band/brk-no-gluing ...  # one per breakage run

The band of each headline number is :func:`flwr_sheaf.expected.prediction_interval` of its
final-round values over the seeds at ``--probability`` (default 0.99, joint over the three numbers).
A variant (same config, another CPU kernel path; or ``NAME=SEED:P,C,M``, the seed and three final
numbers of an earlier variant run whose directory is gone) is compared with the seed run of its own seed:
``cpu_check`` is, per number, the root mean square of those differences over ``sqrt(2)`` times the
seeds' standard deviation (1.0: a CPU change moves a run as far as drawing another seed does).
Every run must have the main job's config apart from ``seed`` and the keys that do not enter
results; seed and variant runs must have completed on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from datetime import date
from pathlib import Path

from flwr_sheaf.config import RESUME_MUTABLE_KEYS
from flwr_sheaf.devices import cpu_environment
from flwr_sheaf.expected import (
    _FREE,
    METRICS,
    REFERENCE_PATH,
    not_judged,
    outside,
    prediction_interval,
    reference_mismatch,
)
from flwr_sheaf.report import ResultsFileError, read_results

ROOT = Path(__file__).resolve().parents[1]
RECORDS_PATH = ROOT / "benchmarks" / "records" / "expected-band.json"
RULE = (
    "per headline number: mean +- t(1 - (1 - probability) / 6, n - 1) * sd * sqrt(1 + 1/n) over the "
    "n seeds' final-round values (a normal prediction interval for one more run, Bonferroni over the "
    "3 numbers: all three inside with probability >= probability); a CPU change counts as one more "
    "random perturbation, like a seed (cpu_check)"
)


def _load(d: str, clean: bool = True) -> dict:
    """``d``'s results.json, checked; ``clean``: a completed CPU run (:func:`not_judged`).

    Raises:
        SystemExit: unreadable, malformed (:func:`flwr_sheaf.report.read_results`), or a run the band
            cannot be measured from; the message names the directory and why.
    """
    try:
        res = read_results(d)
    except ResultsFileError as e:
        sys.exit(f"expected_band.py: {e}")
    why = not_judged(res)
    if clean and why:
        sys.exit(f"expected_band.py: {d}: {'; '.join(why)}; the band is measured from clean runs")
    if not isinstance(res.get("config"), dict) or "seed" not in res["config"]:
        sys.exit(f"expected_band.py: {d}/results.json records no config with a seed")
    return res


def _final(res: dict, final: int, d: str, strict: bool = True) -> dict[str, float | None]:
    """The headline numbers of round ``final`` of ``d``'s run (``None`` where missing, unless ``strict``).

    Raises:
        SystemExit (``strict``): the run has no such round, or one of its numbers is null (named).
    """
    rows = [x for x in res["rounds"] if x["round"] == final]
    if strict and len(rows) != 1:
        sys.exit(f"expected_band.py: {d}: {len(rows)} entries for round {final}, expected one")
    row = rows[0] if rows else {}
    missing = [k for k in METRICS if row.get(k) is None]
    if strict and missing:
        sys.exit(f"expected_band.py: {d}: round {final} has no {', '.join(missing)}")
    return {k: None if row.get(k) is None else float(row[k]) for k in METRICS}


def _same_config(d: str, res: dict, ref0: dict, first: str) -> None:
    why = reference_mismatch(res["config"], ref0)
    if why:
        sys.exit(f"expected_band.py: {d}: another config than {first}: {why}")


def build(
    seed_dirs: list[str],
    variants: dict[str, str],
    breakages: dict[str, str],
    probability: float,
    note: str,
) -> tuple[dict, dict]:
    """``(reference, records)``: the reference dict (``flwr_sheaf.expected.load_reference``'s schema)
    and the records of every run's verdict against it, from the runs' results.json.

    Raises:
        SystemExit: an unreadable or malformed results.json, a seed or variant run that did not
            complete or ran on CUDA, fewer than 2 seeds, runs of different configs, a variant whose
            seed has no seed run (named).
    """
    if len(seed_dirs) < 2:
        sys.exit("expected_band.py: the band needs >= 2 seed runs (10 or more for a useful one)")
    runs = [_load(d) for d in seed_dirs]
    skip = RESUME_MUTABLE_KEYS | _FREE
    config = {k: v for k, v in runs[0]["config"].items() if k not in skip}
    ref0 = {"config": config}
    for d, r in zip(seed_dirs, runs):
        _same_config(d, r, ref0, seed_dirs[0])
    if not runs[0]["rounds"]:
        sys.exit(f"expected_band.py: {seed_dirs[0]}: no rounds")
    final = max(x["round"] for x in runs[0]["rounds"])
    seeds = [int(r["config"]["seed"]) for r in runs]
    if len(set(seeds)) != len(seeds):
        sys.exit(f"expected_band.py: a seed appears twice among --seeds ({seeds})")
    per_seed = {
        str(s): {
            k: [x.get(k) for x in sorted(r["rounds"], key=lambda x: x["round"])] for k in METRICS
        }
        for s, r in zip(seeds, runs)
    }
    finals = {s: _final(r, final, d) for s, r, d in zip(seeds, runs, seed_dirs)}
    band = {}
    for k in METRICS:
        vals = [float(f[k]) for f in finals.values()]  # type: ignore[arg-type]
        low, high = prediction_interval(vals, probability)
        band[k] = {
            "mean": statistics.fmean(vals),
            "sd": statistics.stdev(vals),
            "low": low,
            "high": high,
            "min": min(vals),
            "max": max(vals),
        }
    cpu: dict[str, dict] = {}
    diffs: dict[str, list[float]] = {k: [] for k in METRICS}
    v: dict[str, float | None]
    for name, d in variants.items():
        if re.fullmatch(r"\d+:[0-9.]+,[0-9.]+,[0-9.]+", d):  # an earlier run's SEED:P,C,M
            seed_txt, nums = d.split(":")
            s, v, env = int(seed_txt), dict(zip(METRICS, map(float, nums.split(",")))), None
        else:
            res = _load(d)
            _same_config(d, res, ref0, seed_dirs[0])
            s, v, env = int(res["config"]["seed"]), _final(res, final, d), res.get("environment")
        if s not in finals:
            sys.exit(
                f"expected_band.py: variant {name} ({d}) is of seed {s}, which has no --seeds run"
            )
        diff = {k: float(v[k]) - float(finals[s][k]) for k in METRICS}  # type: ignore[arg-type]
        for k in METRICS:
            diffs[k].append(diff[k])
        cpu[name] = {
            "seed": s,
            "dir": d,
            "environment": env,
            "final_round": v,
            "difference_to_seed_run": diff,
        }
    cpu_check = {
        k: math.sqrt(statistics.fmean(x * x for x in diffs[k])) / (math.sqrt(2) * band[k]["sd"])
        for k in METRICS
        if diffs[k]
    }
    reference = {
        "scenario": "the main job (bash scripts/main.sh): every key at its default, Sheaf-FRL, 15 agents, 10 rounds x 2 epochs",
        "command": "scripts/expected_band.py (its docstring lists the runs)",
        "measured": note,
        "rule": RULE,
        "probability": probability,
        "seeds": seeds,
        # the runs' CPU (one that records it; older runs do not: this machine's)
        "cpu": next((r["environment"] for r in runs if r.get("environment")), None)
        or cpu_environment(),
        "runs": dict(zip(map(str, seeds), seed_dirs)),
        "config": config,
        "final_round": final,
        "per_seed": per_seed,
        "band": band,
        "cpu_variants": cpu,
        "cpu_check": cpu_check,
    }
    records: dict = {"band": band, "probability": probability, "seeds": {}, "variants": {}}
    for s, f in finals.items():
        records["seeds"][str(s)] = {"final_round": f, "outside": outside(f, reference)}
    for name, c in cpu.items():
        v = c["final_round"]
        records["variants"][name] = {
            "seed": c["seed"],
            "final_round": v,
            "outside": outside(v, reference),
        }
    records["breakages"] = {}
    for name, d in breakages.items():
        res = _load(d, clean=False)
        _same_config(d, res, ref0, seed_dirs[0])
        v = _final(res, final, d, strict=False)
        records["breakages"][name] = {
            "seed": int(res["config"]["seed"]),
            "status": res.get("status"),
            "final_round": v,
            "outside": outside(v, reference),
        }
    return reference, records


def _row(name: str, v: dict, bad: list[str]) -> str:
    nums = " / ".join("n/a" if v[k] is None else f"{v[k]:.3f}" for k in METRICS)
    return f"| {name} | {nums} | {'OUTSIDE (' + ', '.join(METRICS[k] for k in bad) + ')' if bad else 'INSIDE'} |"


def main(argv: list[str] | None = None) -> int:
    """CLI: ``--seeds DIR... [--variant NAME=DIR ...] [--breakage NAME=DIR ...] [--probability P]
    [--out PATH] [--records PATH]``; writes both JSON files and prints the band and a markdown table
    of every run's verdict."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", nargs="+", required=True, help="results directories, one per seed")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=DIR: a seed run under another CPU kernel",
    )
    ap.add_argument(
        "--breakage", action="append", default=[], help="NAME=DIR: a run with a patched breakage"
    )
    ap.add_argument("--probability", type=float, default=0.99)
    ap.add_argument("--out", default=str(REFERENCE_PATH))
    ap.add_argument("--records", default=str(RECORDS_PATH))
    a = ap.parse_args(argv)
    pairs = {}
    for opt in ("variant", "breakage"):
        bad = [v for v in getattr(a, opt) if "=" not in v]
        if bad:
            ap.error(f"--{opt} {bad[0]!r}: expected NAME=DIR")
        pairs[opt] = dict(v.split("=", 1) for v in getattr(a, opt))
    env = cpu_environment()
    note = f"{date.today().isoformat()}, {env['cpu']} ({env['machine']}), torch {env['torch']}, in-process (simulations/inprocess.py)"
    ref, records = build(a.seeds, pairs["variant"], pairs["breakage"], a.probability, note)
    Path(a.out).write_text(json.dumps(ref, indent=1) + "\n")
    Path(a.records).write_text(json.dumps(records, indent=1) + "\n")
    for k, b in ref["band"].items():
        print(
            f"{k}: mean {b['mean']:.4f} sd {b['sd']:.4f} band {b['low']:.4f}-{b['high']:.4f} "
            f"(range {b['min']:.4f}-{b['max']:.4f})"
        )
    print("cpu_check (1.0: a CPU change moves a run as far as another seed):", ref["cpu_check"])
    print(f"| run | {' / '.join(METRICS.values())} | verdict |\n|---|---|---|")
    for group in ("seeds", "variants", "breakages"):
        for name, r in records[group].items():
            print(_row(f"{group[:-1]} {name}", r["final_round"], r["outside"]))
    print(f"written to {a.out} and {a.records}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
