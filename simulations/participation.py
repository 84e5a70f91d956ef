"""Sheaf-FRL under partial participation: absent-neighbour policies on the 15-agent scenario.

Runs the paper's 15-agent zoo on the bundled digits (in-process, :class:`flwr_sheaf.testing.LocalGrid`;
the same ServerApp/ClientApp code as ``flwr run``) at several mean participation levels, each under
the absent-neighbour policies ``cached``, ``drop`` and ``drop-reweighted``
(:mod:`flwr_sheaf.methods.sheaf_frl.strategy`), plus full participation (where the policies coincide).

Participation is per-node Bernoulli(p_i) with uneven probabilities ``p_i ~ U(m - spread, m + spread)``
(seeded, clipped to [0.02, 1]) around the mean level ``m``, so that dropping absent neighbours biases
the edge weights unevenly (with equal p_i the drop bias would only rescale lambda). The draws depend
only on ``(seed, round)``: every policy at a level sees exactly the same participants.

Writes ``<out>/<label>/results.json`` per run and ``<out>/summary.json`` / ``summary.md`` (final
private and communication accuracy, realised participation, pilot ages, wall time). Finished runs
are skipped on a rerun (delete the folder to redo one).

Usage::

    python simulations/participation.py [--rounds 20] [--local-epochs 2] [--levels 0.3,0.6,1.0]
        [--policies cached,drop,drop-reweighted] [--spread 0.2] [--evaluate-every 10] [--out results/participation]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inprocess import run_inprocess  # noqa: E402

POLICIES = ("cached", "drop", "drop-reweighted")


def participation_spec(level: float, spread: float, n: int, seed: int) -> str:
    """Comma list of ``p_i ~ U(level - spread, level + spread)`` clipped to [0.02, 1]; "" at level 1."""
    if level >= 1.0:
        return ""
    rng = np.random.default_rng([seed, 2024])
    p = np.clip(level + spread * (2 * rng.random(n) - 1), 0.02, 1.0)
    return ",".join(f"{x:.4f}" for x in p)


def summarise(res: dict) -> dict:
    """Summary of one run's ``results.json`` dict: final evaluated accuracies (test and
    validation; communication degree-weighted), the accuracy curve, realised participation,
    relayed edges, pilot ages, mean edge weight, wall time and failure count."""
    rounds = res["rounds"]
    evals = [r for r in rounds if r.get("private_accuracy_mean") is not None]
    last = evals[-1] if evals else {}
    ages = [
        r["relayed_pilot_age_mean"] for r in rounds if r.get("relayed_pilot_age_mean") is not None
    ]
    ws = [r["edge_weight_mean"] for r in rounds if r.get("edge_weight_mean") is not None]
    return {
        "final_round": last.get("round"),
        "private_accuracy": last.get("private_accuracy_mean"),
        "communication_accuracy": last.get("communication_accuracy_degree_weighted"),
        "val_private_accuracy": last.get("val_private_accuracy_mean"),
        "val_communication_accuracy": last.get("val_communication_accuracy_degree_weighted"),
        "curve": [
            (
                r["round"],
                r.get("private_accuracy_mean"),
                r.get("communication_accuracy_degree_weighted"),
            )
            for r in evals
        ],
        "trained_per_round": float(np.mean([r.get("num_trained", 0) for r in rounds])),
        "edges_relayed_per_round": float(np.mean([r.get("edges_relayed", 0) for r in rounds])),
        "relayed_pilot_age_mean": float(np.mean(ages)) if ages else None,
        "relayed_pilot_age_max": max((r.get("relayed_pilot_age_max") or 0) for r in rounds),
        "edge_weight_mean": float(np.mean(ws)) if ws else None,
        "wall_seconds": res.get("total_wall_seconds"),
        "failures": len(res.get("failures", [])),
    }


def main(argv: list[str] | None = None) -> int:
    """Run every (participation level, absent policy) pair (module docstring), skipping finished
    runs; write ``summary.json`` and ``summary.md`` and print the table. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--levels", default="0.3,0.6,1.0")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--spread", type=float, default=0.2)
    ap.add_argument("--evaluate-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zoo", default="paper-15")
    ap.add_argument("--num-pilots", type=int, default=500)
    ap.add_argument("--out", default="results/participation")
    args = ap.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.WARNING)

    from flwr_sheaf.models.zoo import zoo_specs

    n = len(zoo_specs(args.zoo))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for level in [float(x) for x in args.levels.split(",")]:
        spec = participation_spec(level, args.spread, n, args.seed)
        policies = ["cached"] if level >= 1.0 else args.policies.split(",")
        for policy in policies:
            label = "full" if level >= 1.0 else f"p{level:.1f}-{policy}"
            rdir = out / label
            if not (rdir / "results.json").exists():
                rc = {
                    "zoo": args.zoo,
                    "num-server-rounds": args.rounds,
                    "local-epochs": args.local_epochs,
                    "participation": spec,
                    "absent-policy": policy,
                    "evaluate-every": args.evaluate_every,
                    # every node evaluated, as in the recorded tables (auto would evaluate trainers)
                    "evaluate-nodes": "drawn",
                    "seed": args.seed,
                    "num-pilots": args.num_pilots,
                    "results-dir": str(rdir),
                }
                t0 = time.monotonic()
                print(
                    f"== {label}: p mean {np.mean([float(x) for x in spec.split(',')]) if spec else 1.0:.3f}",
                    flush=True,
                )
                run_inprocess(rc)
                print(f"   done in {time.monotonic() - t0:.0f} s", flush=True)
            res = json.loads((rdir / "results.json").read_text())
            s = summarise(res)
            s.update(
                {
                    "level": level,
                    "policy": "all (full participation)" if level >= 1.0 else policy,
                    "p_mean": float(np.mean([float(x) for x in spec.split(",")])) if spec else 1.0,
                }
            )
            summary[label] = s
            (out / "summary.json").write_text(
                json.dumps({"args": vars(args), "runs": summary}, indent=1)
            )
    lines = [
        f"Sheaf-FRL, zoo {args.zoo}, bundled digits, {args.rounds} rounds x {args.local_epochs} local epochs, "
        f"Bernoulli p_i ~ U(m-{args.spread}, m+{args.spread}), seed {args.seed}",
        "",
        "| level m | policy | realised p | trained/round | private acc | comm acc (deg.-w.) | val private | val comm "
        "| relayed edges/round | relayed age mean / max | edge weight mean | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
    for s in summary.values():
        lines.append(
            f"| {s['level']:.1f} | {s['policy']} | {s['p_mean']:.3f} | {s['trained_per_round']:.1f} | "
            f"{fmt(s['private_accuracy'])} | {fmt(s['communication_accuracy'])} | {fmt(s['val_private_accuracy'])} | "
            f"{fmt(s['val_communication_accuracy'])} | {s['edges_relayed_per_round']:.1f} | "
            f"{fmt(s['relayed_pilot_age_mean'], '{:.2f}')} / {s['relayed_pilot_age_max']} | "
            f"{fmt(s['edge_weight_mean'], '{:.2f}')} | {fmt(s['wall_seconds'], '{:.0f}')} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
