"""Several in-process runs sharing one device: seconds per epoch and throughput against k.

For each k, starts k copies of ``benchmarks/epoch_time.py`` at once (the way the sweeps'
``--workers`` share a GPU: one process per run, each holding all agents of its run on the device),
with seeds 0..k-1, and reads back each one's ``seconds_per_epoch``. Throughput is
``k / mean seconds per epoch`` (epochs of the whole zoo per second, all processes together); the
speed-up against k = 1 says how much of the device one in-process run leaves idle.

    python benchmarks/concurrency.py --device cuda --dataset fashion-mnist --k 1 2 4 8
    python benchmarks/concurrency.py --device cpu --zoo tiny-3 --dataset mnist-bundled --k 1 2 \
        --extra graph=ring num-pilots=64 max-steps-per-epoch=2

Appends one JSON line per k to ``<out>/concurrency.jsonl`` as soon as that k is done (a run stopped
at a time limit keeps what it measured) and prints a table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_k(k: int, args: argparse.Namespace, out: Path) -> dict:
    """Start k epoch-time runs at once; wait (at most ``args.timeout`` s); their per-epoch figures.

    Returns:
        ``{"k", "seconds_per_epoch" (list, one per run that finished), "failed", "wall_seconds",
        "throughput_epochs_per_second"}``.
    """
    procs = []
    t0 = time.monotonic()
    for w in range(k):
        d = out / f"k{k}" / f"w{w}"
        cmd = [
            sys.executable,
            str(HERE / "epoch_time.py"),
            "--device",
            args.device,
            "--dataset",
            args.dataset,
            "--zoo",
            args.zoo,
            "--rounds",
            str(args.rounds),
            "--out",
            str(d),
            "--extra",
            f"seed={w}",
            *args.extra,
        ]
        d.parent.mkdir(parents=True, exist_ok=True)
        log = open(d.parent / f"w{w}.log", "w")
        procs.append(
            (
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()),
                d,
                log,
            )
        )
    per_epoch, failed = [], 0
    for p, d, log in procs:
        try:
            rc = p.wait(timeout=max(1.0, args.timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = -9
        log.close()
        recs = list(d.glob("epoch_time-*.json"))
        if rc == 0 and recs:
            per_epoch.append(json.loads(recs[0].read_text())["seconds_per_epoch"])
        else:
            failed += 1
    mean = sum(per_epoch) / len(per_epoch) if per_epoch else float("nan")
    return {
        "k": k,
        "seconds_per_epoch": per_epoch,
        "failed": failed,
        "wall_seconds": time.monotonic() - t0,
        "mean_seconds_per_epoch": mean,
        "throughput_epochs_per_second": len(per_epoch) / mean if per_epoch else 0.0,
    }


def main() -> None:
    """Parse options (module docstring), run each k, append and print the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--zoo", default="paper-15")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per k")
    ap.add_argument("--extra", nargs="*", default=[], help="more run-config overrides key=value")
    ap.add_argument("--out", default="results/concurrency")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in args.k:
        row = run_k(k, args, out)
        rows.append(row)
        with open(out / "concurrency.jsonl", "a") as f:
            f.write(
                json.dumps({**row, "device": args.device, "zoo": args.zoo, "dataset": args.dataset})
                + "\n"
            )
        print(
            f"k={k}: {row['mean_seconds_per_epoch']:.2f} s per epoch, "
            f"{row['throughput_epochs_per_second']:.3f} epochs/s in all, {row['failed']} failed",
            flush=True,
        )
    base = rows[0]["throughput_epochs_per_second"] or float("nan")
    print(f"{'k':>3}{'s/epoch':>10}{'epochs/s':>10}{'speed-up':>10}")
    for r in rows:
        print(
            f"{r['k']:>3}{r['mean_seconds_per_epoch']:>10.2f}{r['throughput_epochs_per_second']:>10.3f}"
            f"{r['throughput_epochs_per_second'] / base:>10.2f}"
        )
    if any(r["failed"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
