"""Sheaf-FRL (lambda > 0) against lambda = 0 (no gluing, post-hoc Procrustes alignment).

For each shift s and seed, every lambda in the grid is trained on the 15-agent zoo (bundled
digits); lambda is chosen per (s, seed) on the *validation* split (degree-weighted validation
communication accuracy, ties by validation private accuracy), never on test. Prints and writes
test private / communication accuracy of the chosen lambda next to lambda = 0.

    python simulations/gluing_vs_posthoc.py --seeds 0 1 2 --shifts 0.7 0.9 --lambdas 0.03 0.3 \
        --rounds 10 --workers 2 --out results/gluing_vs_posthoc

Finished runs (``results.json`` present) are reused, so an interrupted sweep resumes. Runs go
through the in-process grid (same ServerApp/ClientApp code as ``flwr run``), ``workers``
processes at a time, one torch thread each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from inprocess import run_inprocess
from progress import map_with_progress

KEYS = (
    "private_accuracy_mean",
    "communication_accuracy_degree_weighted",
    "val_private_accuracy_mean",
    "val_communication_accuracy_degree_weighted",
    "low_variance_fraction_mean",
)


def _one(job: dict) -> dict:
    t = time.monotonic()
    done = Path(job["config"]["results-dir"]) / "results.json"
    if (
        done.exists()
        and json.loads(done.read_text()).get("config", {}).get("lambda") == job["config"]["lambda"]
    ):
        res = json.loads(done.read_text())  # resume: this run finished in an earlier invocation
    else:
        res = run_inprocess(
            {**job["config"], "overwrite": True}
        )  # a different or unfinished run there: replaced
    last = [r for r in res["rounds"] if r.get("private_accuracy_mean") is not None][-1]
    return {**job["meta"], **{k: last.get(k) for k in KEYS}, "wall_seconds": time.monotonic() - t}


def main() -> None:
    """Parse the options (module docstring), run the (shift, seed, lambda) grid in a process pool,
    choose lambda per (shift, seed) on validation, print the table and write ``summary.json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--shifts", type=float, nargs="+", default=[0.7, 0.9])
    ap.add_argument("--lambdas", type=float, nargs="+", default=[0.03, 0.3])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--zoo", default="paper-15")
    ap.add_argument("--extra", nargs="*", default=[], help="more run-config overrides key=value")
    ap.add_argument("--out", default="results/gluing_vs_posthoc")
    args = ap.parse_args()
    from inprocess import parse_overrides

    out = Path(args.out).resolve()
    jobs = []
    for s in args.shifts:
        for seed in args.seeds:
            for lam in [0.0, *args.lambdas]:
                tag = f"s{s}-seed{seed}-lam{lam}"
                cfg = {
                    "shift": s,
                    "seed": seed,
                    "lambda": lam,
                    "num-server-rounds": args.rounds,
                    "zoo": args.zoo,
                    "evaluate-every": args.rounds,
                    "results-dir": str(out / tag),
                    **parse_overrides(args.extra),
                }
                jobs.append({"config": cfg, "meta": {"shift": s, "seed": seed, "lambda": lam}})
    t0 = time.monotonic()
    rows = map_with_progress(
        _one, jobs, args.workers, label=lambda j: Path(j["config"]["results-dir"]).name
    )
    table = []
    for s in args.shifts:
        for seed in args.seeds:
            runs = [r for r in rows if r["shift"] == s and r["seed"] == seed]
            base = next(r for r in runs if r["lambda"] == 0.0)
            glued = max(
                (r for r in runs if r["lambda"] > 0),
                key=lambda r: (
                    r["val_communication_accuracy_degree_weighted"],
                    r["val_private_accuracy_mean"],
                ),
            )
            table.append(
                {
                    "shift": s,
                    "seed": seed,
                    "chosen_lambda": glued["lambda"],
                    "sheaf_private": glued["private_accuracy_mean"],
                    "sheaf_comm": glued["communication_accuracy_degree_weighted"],
                    "posthoc_private": base["private_accuracy_mean"],
                    "posthoc_comm": base["communication_accuracy_degree_weighted"],
                    "sheaf_low_var_frac": glued["low_variance_fraction_mean"],
                }
            )
    print(
        f"\nSheaf-FRL (lambda chosen on validation) vs lambda = 0 (post-hoc alignment); {args.rounds} rounds; "
        f"total {time.monotonic() - t0:.0f} s"
    )
    print(
        f"{'s':>4} {'seed':>4} {'lambda*':>8} | {'priv SFRL':>9} {'priv l=0':>8} | {'comm SFRL':>9} {'comm l=0':>8}"
    )
    for r in table:
        print(
            f"{r['shift']:>4} {r['seed']:>4} {r['chosen_lambda']:>8} | {r['sheaf_private']:>9.3f} {r['posthoc_private']:>8.3f} | "
            f"{r['sheaf_comm']:>9.3f} {r['posthoc_comm']:>8.3f}"
        )
    for s in args.shifts:
        rs = [r for r in table if r["shift"] == s]
        m = lambda k: statistics.mean(r[k] for r in rs)  # noqa: E731, B023 - used in this iteration only
        sd = lambda k: statistics.pstdev(r[k] for r in rs)  # noqa: E731, B023 - used in this iteration only
        print(
            f"s={s}: mean over {len(rs)} seeds | private SFRL {m('sheaf_private'):.3f}±{sd('sheaf_private'):.3f} "
            f"vs {m('posthoc_private'):.3f}±{sd('posthoc_private'):.3f} | comm SFRL {m('sheaf_comm'):.3f}±{sd('sheaf_comm'):.3f} "
            f"vs {m('posthoc_comm'):.3f}±{sd('posthoc_comm'):.3f}"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(
        json.dumps({"args": vars(args), "runs": rows, "table": table}, indent=1)
    )
    print(f"written {out / 'summary.json'}")


if __name__ == "__main__":
    main()
