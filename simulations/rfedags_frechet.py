"""RFedAGS and its baselines on the planted Fréchet-mean problems (SPD, Poincaré ball): distance to the truth.

Problems (:mod:`flwr_sheaf.methods.rfedags.frechet`; notes/baselines-rfedags.md, s5.7): commuting SPD matrices (closed-form
mean ``exp(mean log)``) and a symmetric Poincaré-ball configuration (mean = origin), each with 5 frequent
(``p = 0.9``) and 5 rare (``p = 0.4``) clients holding different data. Every method runs ``--rounds``
rounds with ``K = 3`` exact local steps and ``alpha_t = 0.3/(1 + t/5)`` under the same Bernoulli
participation; reported per seed: geodesic distance of the final iterate to the Fréchet mean ``x*`` and
to the ``p~``-re-weighted mean ``x~`` (where the uncorrected average converges; closed form on SPD,
geoopt Karcher flow on the ball), and the largest constraint violation over all rounds. RFedProj is
not run (neither manifold is compact). Writes ``<out>/frechet.csv`` and prints a table (mean over seeds).

    python simulations/rfedags_frechet.py [--out results/rfedags_frechet] [--rounds 300] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

from flwr_sheaf.methods.rfedags.aggregation import effective_weights_uncorrected
from flwr_sheaf.methods.rfedags.frechet import (
    centralised_frechet_mean,
    commuting_spd_problem,
    symmetric_poincare_problem,
)
from flwr_sheaf.methods.rfedags.local import step_size_schedule

# the numpy loop is the tests' oracle of the Flower strategies (tests/oracles/), not package code
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from oracles.rfedags_runner import run_federated  # noqa: E402

RUNS = {
    "RFedAGS (estimated p)": ("rfedags", "corrected"),
    "RFedAGS (known p)": ("rfedags", "known-p"),
    "RFedAGS (uncorrected)": ("rfedags", "uncorrected"),
    "RFedAvg": ("rfedavg", "uncorrected"),
    "RFedSVRG": ("rfedsvrg", "uncorrected"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/rfedags_frechet")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    rows = []
    for make in (commuting_spd_problem, symmetric_poincare_problem):
        for seed in [int(s) for s in args.seeds.split(",")]:
            prob, p = make(seed=seed)
            man = prob.manifold
            x_star = prob.optimum()[0]
            pt = effective_weights_uncorrected(p)
            x_tilde = (
                prob.weighted_optimum(pt)
                if prob.log_spectra is not None
                else centralised_frechet_mean(man, prob.samples, weights=pt)
            )
            for label, (method, mode) in RUNS.items():
                h = run_federated(
                    prob,
                    p,
                    method=method,
                    mode=mode,
                    num_rounds=args.rounds,
                    local_steps=3,
                    step_size=step_size_schedule(0.3, 5),
                    seed=seed,
                    record_every=args.rounds,
                )
                rows.append(
                    {
                        "problem": repr(man),
                        "method": label,
                        "seed": seed,
                        "dist_to_mean": float(man.dist(h["x"], x_star)),
                        "dist_to_reweighted_mean": float(man.dist(h["x"], x_tilde)),
                        "mean_to_reweighted": float(man.dist(x_star, x_tilde)),
                        "max_feasibility": h["max_feasibility"],
                        "cpu_seconds": h["cpu_seconds"][-1],
                    }
                )
                print(
                    f"{rows[-1]['problem']:40s} seed {seed} {label:22s} d(x, x*) {rows[-1]['dist_to_mean']:.4f} "
                    f"d(x, x~) {rows[-1]['dist_to_reweighted_mean']:.4f}",
                    flush=True,
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "frechet.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(
        f"\n{'problem':40s} {'method':22s} {'d(x,x*)':>8s} {'d(x,x~)':>8s} {'d(x*,x~)':>8s} {'max viol.':>9s}"
    )
    for prob_name in dict.fromkeys(r["problem"] for r in rows):
        for label in RUNS:
            mine = [r for r in rows if r["problem"] == prob_name and r["method"] == label]
            print(
                f"{prob_name:40s} {label:22s} {statistics.mean(r['dist_to_mean'] for r in mine):8.4f} "
                f"{statistics.mean(r['dist_to_reweighted_mean'] for r in mine):8.4f} "
                f"{statistics.mean(r['mean_to_reweighted'] for r in mine):8.4f} "
                f"{max(r['max_feasibility'] for r in mine):9.2e}"
            )


if __name__ == "__main__":
    main()
