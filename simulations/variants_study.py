"""Pilot strategies x Parseval normalisation (paper App. B) under the shared issue-9 protocol.

Each row is a set of run-config switches of ``method=sheaf-frl``; each (row, seed) is one in-process
run of ``zoo=tiny-6 shift=0.7 num-server-rounds=3 local-epochs=1`` (the same ServerApp/ClientApp
code as ``flwr run``; equivalent to ``python simulations/inprocess.py zoo=tiny-6 shift=0.7
num-server-rounds=3 local-epochs=1 seed=S results-dir=<out>/runs/<row>-S <switches>``).

    nice python simulations/variants_study.py --out /tmp/pilots/study --seeds 0 1 2
    python simulations/variants_study.py --out /tmp/pilots/study --table-only   # print the table

Resumable: every finished (row, seed) is appended to ``<out>/runs.csv`` at once and skipped on a
rerun. Prints a markdown table: per row mean +- std over seeds of the last round's
``private_accuracy_mean`` and ``communication_accuracy_degree_weighted``, the train-phase bytes of
the last round (``train_bytes_sent + train_bytes_received``: pilots relayed both ways, evaluation
excluded), the pilot rows per relayed matrix, the communication accuracy minus that of ``all`` without
normalisation on the same seed (paired: same data, same initial weights), and the wall time per run.

Rows (default data: M = 500 shared pilots): ``K = 500`` of ``uniform``, ``stratified-*``,
``dynamic`` and ``adaptive`` selects every pilot, i.e. is ``all`` (the ``all`` row stands for them);
``prototype-cluster:500`` makes 500 singleton clusters, i.e. ``all`` as well; ``prototype-class`` has
one row per pilot class whatever K.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inprocess import run_inprocess  # noqa: E402

BASE = {
    "method": "sheaf-frl",
    "zoo": "tiny-6",
    "shift": 0.7,
    "num-server-rounds": 3,
    "local-epochs": 1,
}
STRATEGIES = [
    "all",
    "uniform:50",
    "uniform:100",
    "stratified-class:50",
    "stratified-class:100",
    "stratified-cluster:50",
    "stratified-cluster:100",
    "prototype-class",
    "prototype-cluster:50",
    "prototype-cluster:100",
    "dynamic:25+25",
    "dynamic:50+50",
    "adaptive:50",
    "adaptive:100",
]
FIELDS = [
    "row",
    "strategy",
    "normalisation",
    "seed",
    "private_accuracy_mean",
    "communication_accuracy_degree_weighted",
    "train_bytes",
    "bytes_round",
    "pilot_rows",
    "num_groups",
    "wall_seconds",
    "failures",
]


def rows(strategies: list[str], normalisations: list[str]) -> list[tuple[str, dict]]:
    """``[(tag, switches)]`` for every strategy x normalisation."""
    return [
        (
            f"{s.replace(':', '-').replace('+', 'p')}_{n}",
            {"pilot-strategy": s, "pilot-normalisation": n},
        )
        for s in strategies
        for n in normalisations
    ]


def read_done(path: Path) -> list[dict]:
    """Rows of ``runs.csv`` (empty when absent)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run_one(tag: str, switches: dict, seed: int, out: Path) -> dict:
    """One run; returns its CSV row (metrics of the last round)."""
    cfg = {**BASE, **switches, "seed": seed, "results-dir": str(out / "runs" / f"{tag}-{seed}")}
    t = time.monotonic()
    res = run_inprocess(cfg)
    wall = time.monotonic() - t
    last = res["rounds"][-1]
    return {
        "row": tag,
        "strategy": switches["pilot-strategy"],
        "normalisation": switches["pilot-normalisation"],
        "seed": seed,
        "private_accuracy_mean": last.get("private_accuracy_mean"),
        "communication_accuracy_degree_weighted": last.get(
            "communication_accuracy_degree_weighted"
        ),
        "train_bytes": last.get("train_bytes_sent", 0) + last.get("train_bytes_received", 0),
        "bytes_round": last["bytes_sent"] + last["bytes_received"],
        "pilot_rows": last.get("pilot_rows"),
        "num_groups": res.get("pilot_selection", {}).get("num_groups"),
        "wall_seconds": round(wall, 1),
        "failures": len(res.get("failures", [])),
    }


def _ms(vals: list[float]) -> str:
    """``mean +- std`` (sample std) of ``vals``, 3 decimals."""
    return (
        f"{statistics.mean(vals):.3f} +- {statistics.stdev(vals):.3f}"
        if len(vals) > 1
        else (f"{vals[0]:.3f}" if vals else "n/a")
    )


def table(done: list[dict], order: list[str]) -> str:
    """Markdown table, one line per row tag in ``order`` that has runs."""
    lines = [
        "| pilot-strategy | normalisation | seeds | rows/matrix | private acc. | comm. acc. (deg.-w.) | "
        "comm. minus `all`/none, paired | train bytes/round | all bytes/round | wall s/run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    comm = "communication_accuracy_degree_weighted"
    ref = {
        r["seed"]: float(r[comm])
        for r in done
        if r["strategy"] == "all" and r["normalisation"] == "none"
    }
    for tag in order:
        rs = [r for r in done if r["row"] == tag]
        if not rs:
            continue
        f = lambda k: [float(r[k]) for r in rs if r[k] not in ("", "None", "nan")]  # noqa: E731, B023 - this iteration only
        paired = [
            float(r[comm]) - ref[r["seed"]] for r in rs if r["seed"] in ref
        ]  # same seed: same data and init
        lines.append(
            f"| `{rs[0]['strategy']}` | {rs[0]['normalisation']} | {len(rs)} | {rs[0]['pilot_rows']} | "
            f"{_ms(f('private_accuracy_mean'))} | {_ms(f(comm))} | {_ms(paired)} | "
            f"{statistics.mean(f('train_bytes')):,.0f} | {statistics.mean(f('bytes_round')):,.0f} | "
            f"{statistics.mean(f('wall_seconds')):.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Parse options (module docstring), run what is missing, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/pilots/study")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--strategies", nargs="+", default=STRATEGIES)
    ap.add_argument("--normalisations", nargs="+", default=["none", "parseval"])
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument(
        "--seed-major",
        action="store_true",
        help="every row's first seed before any second seed "
        "(default: row by row, so a cut leaves complete rows)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "runs.csv"
    grid = rows(args.strategies, args.normalisations)
    if not args.table_only:
        order = (
            [(tag, sw, seed) for seed in args.seeds for tag, sw in grid]
            if args.seed_major
            else [(tag, sw, seed) for tag, sw in grid for seed in args.seeds]
        )
        for tag, sw, seed in order:
            if any(r["row"] == tag and int(r["seed"]) == seed for r in read_done(csv_path)):
                continue
            try:
                row = run_one(tag, sw, seed, out)
            except Exception as exc:  # report and go on; the (row, seed) is retried on a rerun
                print(f"FAILED {tag} seed {seed}: {exc!r}", flush=True)
                continue
            new = not csv_path.exists()
            with open(csv_path, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                if new:
                    w.writeheader()
                w.writerow(row)
            print(json.dumps(row), flush=True)
    print(table(read_done(csv_path), [t for t, _ in grid]))


if __name__ == "__main__":
    main()
