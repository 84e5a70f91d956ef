"""Markdown tables of a ``paper_figures.py`` output (``<out>/figure.csv``): one row per method, one
column per point (label shift s for Fig. 2, latent size d for Fig. 3), cells ``mean ± 95% half-width``.

    python simulations/figure_markdown.py results/fig2_cpu/figure.csv            # communication accuracy
    python simulations/figure_markdown.py results/fig2_cpu/figure.csv --metric private
    python simulations/figure_markdown.py results/fig2_cpu/runs.csv --paired       # Sheaf-FRL vs its lambda = 0

Methods are ordered as in benchmarks/records/results-paper-figures.md: Sheaf-FRL, the two no-cooperation readings, then the
baselines with their strong (``-pilots``) reading after each. A NaN half-width (one seed) prints
as the mean alone.
"""

from __future__ import annotations

import argparse
import csv
import math

ORDER = (
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


def _rank(method: str) -> tuple[int, int]:
    base = method.removesuffix("-pilots") if method != "posthoc-pilots" else method
    return (
        ORDER.index(base) if base in ORDER else len(ORDER),
        method.endswith("-pilots") and method != "posthoc-pilots",
    )


def table(rows: list[dict], metric: str) -> str:
    """The markdown table of ``rows`` (``figure.csv`` dicts) for ``metric`` (``comm`` or ``private``).

    Raises:
        KeyError: ``metric`` is not a column prefix of the CSV (``<metric>_mean``).
    """
    xs = sorted({float(r["x"]) for r in rows})
    methods = sorted({r["method"] for r in rows}, key=_rank)
    cell = {(r["method"], float(r["x"])): r for r in rows}

    def fmt(x):
        return f"{x:g}"

    lines = ["| method | " + " | ".join(fmt(x) for x in xs) + " |", "|---|" + "---|" * len(xs)]
    for m in methods:
        out = []
        for x in xs:
            r = cell.get((m, x))
            if r is None:
                out.append("-")
                continue
            mean, half = float(r[f"{metric}_mean"]), float(r[f"{metric}_ci95"])
            out.append(f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} ± {half:.3f}")
        lines.append(f"| {m} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def _num(v) -> float:
    return float("nan") if v in (None, "", "None") else float(v)


def paired(runs: list[dict]) -> tuple[str, dict]:
    """Sheaf-FRL (lambda chosen per point and seed on validation communication accuracy, ties by
    validation private accuracy; lambda = 0 excluded) minus its own lambda = 0 run (the strong
    post-hoc baseline), per (point, seed), from a ``runs.csv`` of ``paper_figures.py``.

    Returns:
        ``(markdown table, pooled)`` with ``pooled = {"n", "comm_diff", "comm_ci95", "private_diff",
        "private_ci95", "comm_wins"}`` over all (point, seed) pairs (95% Student t; NaN for n < 2).
    """
    from paper_figures import ci95

    comm, vcomm = (
        "communication_accuracy_degree_weighted",
        "val_communication_accuracy_degree_weighted",
    )
    priv, vpriv = "private_accuracy_mean", "val_private_accuracy_mean"
    lines = [
        "| point | seed | lambda* | comm Sheaf-FRL | comm lambda = 0 | difference | private Sheaf-FRL | "
        "private lambda = 0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    dc, dp = [], []
    sf = [r for r in runs if r["method"] == "sheaf-frl"]
    for x in sorted({r["x"] for r in sf}, key=float):
        for seed in sorted({r["seed"] for r in sf if r["x"] == x}, key=int):
            rs = [r for r in sf if r["x"] == x and r["seed"] == seed]
            base = [r for r in rs if _num(r["weight"]) == 0.0]
            glued = [r for r in rs if _num(r["weight"]) > 0 and not math.isnan(_num(r[vcomm]))]
            if not base or not glued or math.isnan(_num(base[0][comm])):
                continue
            g, b = max(glued, key=lambda r: (_num(r[vcomm]), _num(r[vpriv]))), base[0]
            dc.append(_num(g[comm]) - _num(b[comm]))
            dp.append(_num(g[priv]) - _num(b[priv]))
            lines.append(
                f"| {float(x):g} | {seed} | {_num(g['weight']):g} | {_num(g[comm]):.3f} | {_num(b[comm]):.3f} | "
                f"{dc[-1]:+.3f} | {_num(g[priv]):.3f} | {_num(b[priv]):.3f} |"
            )
    pooled = {
        "n": len(dc),
        "comm_diff": sum(dc) / len(dc) if dc else float("nan"),
        "comm_ci95": ci95(dc),
        "private_diff": sum(dp) / len(dp) if dp else float("nan"),
        "private_ci95": ci95(dp),
        "comm_wins": sum(d > 0 for d in dc),
    }
    return "\n".join(lines), pooled


def main() -> None:
    """Print the table of the CSV named on the command line (``--paired``: of a ``runs.csv``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--metric", choices=("comm", "private"), default="comm")
    ap.add_argument(
        "--paired",
        action="store_true",
        help="the CSV is a runs.csv: Sheaf-FRL minus its lambda = 0 run per point and seed",
    )
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if args.paired:
        text, p = paired(rows)
        print(text)
        print(
            f"\npooled over {p['n']} (point, seed) pairs: communication {p['comm_diff']:+.4f} ± {p['comm_ci95']:.4f}, "
            f"private {p['private_diff']:+.4f} ± {p['private_ci95']:.4f}; Sheaf-FRL higher in {p['comm_wins']} of {p['n']}"
        )
    else:
        print(table(rows, args.metric))


if __name__ == "__main__":
    main()
