"""Sweeps shaped like the paper's Fig. 2 (label shift s, 15 agents) and Fig. 3 (two agents, latent size d).

For every point (s for Fig. 2, d for Fig. 3), seed and method, each weight of the method's grid
is trained (in-process: the same ServerApp/ClientApp code as ``flwr run``), the weight is chosen
per (point, seed, method) on the **validation** split (degree-weighted validation communication
accuracy, ties by validation private accuracy), and the chosen run's **test** numbers are
reported as mean +- 95% interval over seeds (Student t, n - 1 degrees of freedom; no interval
for one seed).

    python simulations/paper_figures.py --figure 2 --seeds 0 1 2 --rounds 10 --workers 2 --out results/fig2
    python simulations/paper_figures.py --figure 3 --dims 16 32 64 128 256 512 --seeds 0 1 2 --out results/fig3
    python simulations/paper_figures.py --figure 2 --extra preset=paper dataset=fashion-mnist device=cuda --workers 6

Methods and their weight (grid from ``--lambdas``, values in [1e-5, 1]):

- ``sheaf-frl`` (``lambda``); its ``lambda = 0`` run is also reported as ``posthoc-pilots``: no
  gluing, Procrustes fitted post hoc on the final pilots with the whitening fitted on the pilots
  (the strong post-hoc reading);
- ``non-cooperative`` (no weight): post hoc with the whitening fitted on each agent's private
  training latents (the paper's protocol), reported as ``posthoc-train``;
- ``fedproto`` (``fedproto-lambda``), ``fedsaf-gcsa`` / ``fedsaf-rcsa`` (``fedsaf-lambda``),
  ``fedmuscle`` (``fedmuscle-lambda``), ``comfed`` (``comfed-lambda``), ``sheaf-fmtl``
  (``sheaf-fmtl-lambda``): communication accuracy by post-hoc Procrustes with the whitening fitted
  on private training latents (the paper's protocol, as ``non-cooperative``), and also their
  strong reading, with the whitening fitted on the pilots (run-config ``posthoc-readings = both``,
  the default), reported as ``<method>-pilots`` with its own validation-chosen weight. (The
  non-cooperative strong reading is ``posthoc-pilots`` itself: the same training, the same number.)

Resumable: every run writes ``<out>/runs/<tag>/results.json`` and a finished run with the same
config is read back instead of retrained. Writes ``<out>/runs.csv`` (one row per run),
``<out>/figure.csv`` (one row per point and method) and ``<out>/figure.png``.
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
from progress import map_with_progress

from flwr_sheaf.config import DEFAULTS

WEIGHT_KEY = {
    "sheaf-frl": "lambda",
    "non-cooperative": None,
    "fedproto": "fedproto-lambda",
    "fedsaf-gcsa": "fedsaf-lambda",
    "fedsaf-rcsa": "fedsaf-lambda",
    "fedmuscle": "fedmuscle-lambda",
    "comfed": "comfed-lambda",
    "sheaf-fmtl": "sheaf-fmtl-lambda",
}
METRICS = (
    "private_accuracy_mean",
    "communication_accuracy_degree_weighted",
    "val_private_accuracy_mean",
    "val_communication_accuracy_degree_weighted",
    "communication_accuracy_pilot_whitening_degree_weighted",
    "val_communication_accuracy_pilot_whitening_degree_weighted",
)
PW = "communication_accuracy_pilot_whitening_degree_weighted"
#: the paper's figures are Alg. 1 (heterogeneous maps); pinned so that equal-d agents (the two-agent
#: family) do not switch to Alg. 2 under ``sheaf-variant = auto`` (override with ``--extra``)
ALG1 = {"sheaf-variant": "heterogeneous"}


def _run(job: dict) -> dict:
    """One training run (or its finished results.json); returns the CSV row."""
    t = time.monotonic()
    cfg = job["config"]
    done = Path(cfg["results-dir"]) / "results.json"
    res = None
    if done.exists():
        old = json.loads(done.read_text())
        if all(old.get("config", {}).get(k) == v for k, v in cfg.items() if k != "results-dir"):
            res = old
    error = ""
    if res is None:
        try:
            res = run_inprocess(
                {**cfg, "overwrite": True}
            )  # a different or unfinished run there: replaced
        except Exception as exc:  # one failed run is a row with its error, not a lost sweep
            error, res = f"{type(exc).__name__}: {exc}", {"rounds": []}
            print(f"run {cfg['results-dir']} failed: {error}", flush=True)
    if (
        not error and res.get("status", "completed") != "completed"
    ):  # a degraded run is not a figure's point
        error = f"run {res['status']}: {res.get('degradation')}"
    evaluated = [r for r in res["rounds"] if r.get("private_accuracy_mean") is not None]
    last = evaluated[-1] if evaluated else {}
    return {
        **job["meta"],
        **{k: last.get(k) for k in METRICS},
        "wall_seconds": round(time.monotonic() - t, 1),
        "error": error[:300],
    }


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` (dicts with the same keys) as a CSV with a header."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def run_jobs(jobs: list[dict], workers: int, out: Path) -> list[dict]:
    """Run (or read back) every job in ``workers`` spawned processes; writes ``<out>/runs.csv``; returns the rows."""
    print(f"{len(jobs)} runs, {workers} at a time -> {out}", flush=True)
    rows = map_with_progress(
        _run, jobs, workers, label=lambda j: Path(j["config"]["results-dir"]).name
    )
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "runs.csv", rows)
    return rows


def ci95(vals: list[float]) -> float:
    """Half-width of the 95% t interval of the mean of ``vals`` (NaN for fewer than two)."""
    return (
        t95(len(vals)) * statistics.stdev(vals) / math.sqrt(len(vals))
        if len(vals) > 1
        else float("nan")
    )


def t95(n: int) -> float:
    """Two-sided 95% Student-t quantile for n samples (n - 1 degrees of freedom)."""
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1))


def summarise(rows: list[dict], points: list, seeds: list[int]) -> list[dict]:
    """Validation-chosen weight per (point, seed, method), then mean +- 95% interval over seeds."""
    out = []
    methods = sorted({r["method"] for r in rows})
    for x in points:
        for method in methods:
            chosen = []
            for seed in seeds:
                runs = [
                    r
                    for r in rows
                    if r["x"] == x
                    and r["seed"] == seed
                    and r["method"] == method
                    and r["val_communication_accuracy_degree_weighted"] is not None
                    and not (method == "sheaf-frl" and r["weight"] == 0.0)
                ]  # lambda = 0 is posthoc-pilots
                if runs:
                    chosen.append(
                        max(
                            runs,
                            key=lambda r: (
                                r["val_communication_accuracy_degree_weighted"] or -1,
                                r["val_private_accuracy_mean"] or -1,
                            ),
                        )
                    )
            if not chosen:
                continue
            row = {
                "x": x,
                "method": method,
                "seeds": len(chosen),
                "weights": " ".join(str(c["weight"]) for c in chosen),
            }
            for key, name in (
                ("communication_accuracy_degree_weighted", "comm"),
                ("private_accuracy_mean", "private"),
            ):
                vals = [c[key] for c in chosen if c[key] is not None and not math.isnan(c[key])]
                row[f"{name}_mean"] = statistics.mean(vals) if vals else float("nan")
                row[f"{name}_ci95"] = ci95(vals)
            out.append(row)
    return out


def strong_readings(rows: list[dict], points: list, seeds: list[int]) -> list[dict]:
    """Table rows ``<method>-pilots``: each baseline's strong post-hoc reading (whitening fitted on the
    pilots), its weight chosen on the validation value of that reading (non-cooperative's is
    ``posthoc-pilots``; runs without the reading, ``posthoc-readings = paper``, are skipped)."""
    strong = [
        {
            **r,
            "method": f"{r['method']}-pilots",
            "communication_accuracy_degree_weighted": r[PW],
            "val_communication_accuracy_degree_weighted": r[f"val_{PW}"],
        }
        for r in rows
        if r["method"] not in ("sheaf-frl", "non-cooperative") and r.get(PW) is not None
    ]
    return summarise(strong, points, seeds) if strong else []


BASES = (
    "sheaf-frl",
    "posthoc-pilots",
    "posthoc-train",
    "fedproto",
    "fedsaf-gcsa",
    "fedsaf-rcsa",
    "fedmuscle",
    "comfed",
    "sheaf-fmtl",
)


def _base(method: str) -> str:
    """The method a table row belongs to (``fedproto-pilots`` -> ``fedproto``; ``posthoc-pilots`` is its own)."""
    return method if method == "posthoc-pilots" else method.removesuffix("-pilots")


def plot(table: list[dict], xlabel: str, path: Path, title: str) -> None:
    """Two panels (communication, private accuracy) against the point, one colour per method, 95% bars.

    A baseline's strong post-hoc reading (``<method>-pilots``, whitening fitted on the pilots) is the
    dashed line in its method's colour; in the private panel it is drawn only where its own
    validation choice picked other weights than its method's row (otherwise it is the same runs'
    private accuracy). Points are spread slightly along x so that the bars do not hide each other.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {b: plt.get_cmap("tab10")(i) for i, b in enumerate(BASES)}
    chosen = {(r["method"], r["x"]): r["weights"] for r in table}
    methods = sorted(
        {r["method"] for r in table},
        key=lambda m: (BASES.index(_base(m)) if _base(m) in BASES else len(BASES), m),
    )
    log_x = xlabel.startswith("latent")
    xs = sorted({r["x"] for r in table})
    step = 0.0 if len(xs) < 2 else min(b - a for a, b in zip(xs, xs[1:])) * 0.02
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, name, label in (
        (axes[0], "comm", "communication accuracy (degree-weighted)"),
        (axes[1], "private", "private accuracy (mean)"),
    ):
        for k, method in enumerate(methods):
            strong = method.endswith("-pilots") and method != "posthoc-pilots"
            rs = sorted((r for r in table if r["method"] == method), key=lambda r: r["x"])
            if (
                name == "private"
                and strong
                and all(r["weights"] == chosen.get((_base(method), r["x"])) for r in rs)
            ):
                continue
            off = k - len(methods) / 2
            x = [r["x"] * 2 ** (0.015 * off) if log_x else r["x"] + step * off for r in rs]
            ax.errorbar(
                x,
                [r[f"{name}_mean"] for r in rs],
                yerr=[0 if math.isnan(r[f"{name}_ci95"]) else r[f"{name}_ci95"] for r in rs],
                marker="o",
                markersize=4,
                capsize=2,
                elinewidth=0.8,
                label=method,
                color=colours.get(_base(method), "black"),
                linestyle="--" if strong else "-",
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if log_x:
            ax.set_xscale("log", base=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.savefig(path, dpi=120)


def main() -> None:
    """Parse the options (module docstring), run the grid in a process pool, write CSVs and the PNG."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--figure", type=int, choices=(2, 3), required=True)
    ap.add_argument(
        "--shifts", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9], help="Fig. 2 points"
    )
    ap.add_argument(
        "--dims", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512], help="Fig. 3 points"
    )
    ap.add_argument("--shift", type=float, default=0.7, help="Fig. 3 label shift")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=sorted(WEIGHT_KEY))
    ap.add_argument("--lambdas", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1, 1.0])
    ap.add_argument(
        "--default-weights",
        action="store_true",
        help="no weight grid: each method with its package default weight (plus sheaf-frl's lambda = 0)",
    )
    ap.add_argument(
        "--weights",
        nargs="*",
        default=[],
        metavar="METHOD=W1,W2",
        help="this method's own weight grid (overrides --lambdas / --default-weights for it), e.g. sheaf-frl=0.03,0.1,0.3",
    )
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--extra",
        nargs="*",
        default=[],
        help="more run-config overrides key=value (e.g. preset=paper)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bad = [m for m in args.methods if m not in WEIGHT_KEY]
    if bad:
        ap.error(f"unknown method(s) {bad}; known: {sorted(WEIGHT_KEY)}")
    own: dict[str, list[float]] = {}
    for item in args.weights:
        name, _, ws = item.partition("=")
        try:
            own[name] = [float(w) for w in ws.split(",")]
        except ValueError:
            ap.error(f"--weights {item!r}: expected METHOD=W1,W2,... with numbers")
        if name not in WEIGHT_KEY or WEIGHT_KEY[name] is None or not own[name]:
            ap.error(
                f"--weights {item!r}: {name!r} is not a method with a weight ({sorted(k for k, v in WEIGHT_KEY.items() if v)})"
            )
        if name not in args.methods or len(set(own[name])) != len(own[name]):
            ap.error(f"--weights {item!r}: {name!r} is not in --methods, or a weight is repeated")
    if any(not 1e-5 <= w <= 1.0 for w in args.lambdas + [w for ws in own.values() for w in ws]):
        ap.error(
            f"weights must lie in [1e-5, 1], got --lambdas {args.lambdas} --weights {args.weights}"
        )
    out = Path(args.out or f"results/fig{args.figure}").resolve()
    extra = parse_overrides(args.extra)
    points = args.shifts if args.figure == 2 else args.dims
    jobs = []
    for x in points:
        scen = (
            {"shift": x}
            if args.figure == 2
            else {"zoo": f"two-agent:{x}", "graph": "complete", "shift": args.shift}
        )
        for seed in args.seeds:
            for method in args.methods:
                key = WEIGHT_KEY[method]
                grid = (
                    [None]
                    if key is None
                    else ([0.0] if method == "sheaf-frl" else [])
                    + (
                        own[method]
                        if method in own
                        else [DEFAULTS[key]]
                        if args.default_weights
                        else list(args.lambdas)
                    )
                )
                for w in grid:
                    tag = f"x{x}-seed{seed}-{method}" + ("" if w is None else f"-w{w:g}")
                    cfg = {
                        **scen,
                        "seed": seed,
                        "method": method,
                        "num-server-rounds": args.rounds,
                        "evaluate-every": args.rounds,
                        **ALG1,
                        **extra,
                        "results-dir": str(out / "runs" / tag),
                    }
                    if key is not None:
                        cfg[key] = w
                    jobs.append(
                        {
                            "config": cfg,
                            "meta": {
                                "x": x,
                                "seed": seed,
                                "method": method,
                                "weight": 0.0 if w is None else w,
                            },
                        }
                    )
    t0 = time.monotonic()
    rows = run_jobs(jobs, args.workers, out)
    failed = [r for r in rows if r["error"]]
    if failed:
        print(
            f"{len(failed)} of {len(rows)} runs failed (column 'error' of runs.csv), e.g. {failed[0]['error']}"
        )
    if len(failed) == len(rows):
        raise SystemExit("every run failed: nothing to summarise")
    table = summarise(rows, points, args.seeds)
    table += [
        {**r, "method": "posthoc-pilots"}
        for r in summarise(
            [
                {**r, "method": "posthoc-pilots"}
                for r in rows
                if r["method"] == "sheaf-frl" and r["weight"] == 0.0
            ],
            points,
            args.seeds,
        )
    ]
    table += strong_readings(rows, points, args.seeds)
    table = [
        {**r, "method": "posthoc-train" if r["method"] == "non-cooperative" else r["method"]}
        for r in table
    ]
    write_csv(out / "figure.csv", table)
    xlabel = "label shift s" if args.figure == 2 else "latent dimension d (both agents)"
    plot(
        table,
        xlabel,
        out / "figure.png",
        f"Fig. {args.figure} shape: weight chosen on validation, mean +- 95% over seeds {args.seeds}; "
        f"{args.rounds} rounds; {' '.join(args.extra) or 'package defaults'}",
    )
    print(f"\n{'x':>6} {'method':>16} | {'comm':>13} | {'private':>13} | weights")
    for r in table:
        print(
            f"{r['x']:>6} {r['method']:>16} | {r['comm_mean']:.3f} ± {r['comm_ci95']:.3f} | "
            f"{r['private_mean']:.3f} ± {r['private_ci95']:.3f} | {r['weights']}"
        )
    print(
        f"total {time.monotonic() - t0:.0f} s; written {out / 'figure.csv'}, {out / 'figure.png'}"
    )


if __name__ == "__main__":
    main()
