"""FedSAF's alignment study (its Table III protocol, scaled down): coordinate vs structural alignment.

FedSAF (notes/baselines-prototypes.md, s4) aligns client prototypes with the global ones either by coordinates
(MSE, cosine; ``fedsaf-structure=mse|cosine``) or by structure (GCSA, RCSA). Its Table III compares the
four under Dirichlet label shift ``alpha in {0.1, 0.5, 1.0}`` on a heterogeneous model zoo and reports
test accuracy. Here: flwr-datasets' ``DirichletPartitioner`` (run-config ``partitioner=dirichlet:<alpha>``),
the heterogeneous ``tiny-<N>`` zoo (architecture ``i mod 5``), the complete graph, FedSAF's
``lambda = gamma = 1`` (the package defaults), a few rounds, 3 seeds; metric: the mean over agents of
the test accuracy of each agent's own head (``private_accuracy_mean`` of the last round; FedSAF's
"average test accuracy over clients"), with the validation accuracy alongside.

Every run is the real ServerApp/ClientApp code in-process (:func:`inprocess.run_inprocess`, no Ray),
one process for all runs (imports paid once). Resumable: ``<out>/runs/<tag>/results.json`` of a finished
run with the same config is read back. Writes ``<out>/runs.csv``, ``<out>/table.csv`` (mean +- 95% CI
per structure and alpha) and ``<out>/fedsaf_alignment.png``.

    python simulations/fedsaf_alignment.py [--out results/fedsaf_alignment] [--dataset mnist-bundled]
        [--alphas 0.1,0.5,1.0] [--seeds 0,1,2] [--rounds 4] [--zoo tiny-4] [--extra key=value ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import time
from pathlib import Path

from inprocess import parse_overrides, run_inprocess

#: structure -> method value (mse/cosine/gcsa ride on fedsaf-gcsa with fedsaf-structure set)
STRUCTURES = {
    "mse": "fedsaf-gcsa",
    "cosine": "fedsaf-gcsa",
    "gcsa": "fedsaf-gcsa",
    "rcsa": "fedsaf-rcsa",
}
KIND = {"mse": "coordinate", "cosine": "coordinate", "gcsa": "structural", "rcsa": "structural"}


def ci95(vals: list[float]) -> float:
    """Half-width of the 95% Student-t interval of the mean (NaN for fewer than two values)."""
    from scipy.stats import t

    return (
        float(t.ppf(0.975, len(vals) - 1)) * statistics.stdev(vals) / math.sqrt(len(vals))
        if len(vals) > 1
        else float("nan")
    )


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` (same keys) with a header."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def run(cfg: dict) -> dict:
    """The finished ``results.json`` of ``cfg`` if one with the same config exists, else a fresh run."""
    done = Path(cfg["results-dir"]) / "results.json"
    if done.exists():
        old = json.loads(done.read_text())
        if all(old.get("config", {}).get(k) == v for k, v in cfg.items() if k != "results-dir"):
            return old
    return run_inprocess(
        {**cfg, "overwrite": True}
    )  # a different or unfinished run there: replaced


def plot(table: list[dict], alphas: list[float], path: Path, title: str) -> None:
    """Grouped bars: test accuracy (mean +- 95% CI) per alpha, one bar per structure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.2
    for j, s in enumerate(STRUCTURES):
        rows = {r["alpha"]: r for r in table if r["structure"] == s}
        xs = [i + (j - 1.5) * width for i in range(len(alphas))]
        ys = [rows[a]["test_accuracy_mean"] if a in rows else float("nan") for a in alphas]
        es = [rows[a]["test_accuracy_ci95"] if a in rows else 0.0 for a in alphas]
        ax.bar(
            xs,
            ys,
            width,
            yerr=[0 if math.isnan(e) else e for e in es],
            capsize=2,
            label=f"{s} ({KIND[s]})",
        )
    ax.set_xticks(range(len(alphas)), [f"alpha={a:g}" for a in alphas])
    ax.set_ylabel("test accuracy (own head, mean over agents)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/fedsaf_alignment")
    ap.add_argument("--dataset", default="mnist-bundled")
    ap.add_argument("--alphas", default="0.1,0.5,1.0")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--zoo", default="tiny-4")
    ap.add_argument("--structures", default=",".join(STRUCTURES))
    ap.add_argument(
        "--extra",
        nargs="*",
        default=["local-epochs=1", "max-steps-per-epoch=30"],
        help="further run-config overrides",
    )
    args = ap.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    structures = [s for s in args.structures.split(",") if s]
    out = Path(args.out)
    rows = []
    for alpha in alphas:
        for seed in seeds:
            for s in structures:
                tag = f"{s}_a{alpha:g}_s{seed}"
                cfg = {
                    "method": STRUCTURES[s],
                    "fedsaf-structure": s,
                    "zoo": args.zoo,
                    "graph": "complete",
                    "dataset": args.dataset,
                    "partitioner": f"dirichlet:{alpha:g}",
                    "seed": seed,
                    "num-server-rounds": args.rounds,
                    "evaluate-every": args.rounds,
                    "results-dir": str(out / "runs" / tag),
                    **parse_overrides(args.extra),
                }
                t0 = time.monotonic()
                res = run(cfg)
                last = [r for r in res["rounds"] if r.get("private_accuracy_mean") is not None][-1]
                rows.append(
                    {
                        "structure": s,
                        "kind": KIND[s],
                        "alpha": alpha,
                        "seed": seed,
                        "test_accuracy": last["private_accuracy_mean"],
                        "val_accuracy": last["val_private_accuracy_mean"],
                    }
                )
                print(
                    f"{tag:22s} test {rows[-1]['test_accuracy']:.4f} val {rows[-1]['val_accuracy']:.4f} "
                    f"({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "runs.csv", rows)
    table = []
    for alpha in alphas:
        for s in structures:
            acc = [r["test_accuracy"] for r in rows if r["structure"] == s and r["alpha"] == alpha]
            val = [r["val_accuracy"] for r in rows if r["structure"] == s and r["alpha"] == alpha]
            table.append(
                {
                    "structure": s,
                    "kind": KIND[s],
                    "alpha": alpha,
                    "seeds": len(acc),
                    "test_accuracy_mean": statistics.mean(acc),
                    "test_accuracy_ci95": ci95(acc),
                    "val_accuracy_mean": statistics.mean(val),
                }
            )
    write_csv(out / "table.csv", table)
    plot(
        table,
        alphas,
        out / "fedsaf_alignment.png",
        f"FedSAF alignment, {args.dataset}, zoo {args.zoo}, {args.rounds} rounds, {len(seeds)} seeds",
    )
    print(f"{'structure':10s} {'alpha':>5s} {'test acc':>18s} {'val acc':>8s}")
    for r in table:
        print(
            f"{r['structure']:10s} {r['alpha']:5g} {r['test_accuracy_mean']:8.4f} +- {r['test_accuracy_ci95']:6.4f} "
            f"{r['val_accuracy_mean']:8.4f}"
        )


if __name__ == "__main__":
    main()
