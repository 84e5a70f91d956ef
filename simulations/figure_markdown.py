"""Markdown tables of a ``paper_figures.py`` output (``<out>/figure.csv``): one row per method, one
column per point (label shift s for Fig. 2, latent size d for Fig. 3), cells ``mean ± 95% half-width``.

    python simulations/figure_markdown.py results/fig2_cpu/figure.csv            # communication accuracy
    python simulations/figure_markdown.py results/fig2_cpu/figure.csv --metric private

Methods are ordered as in docs/results.md: Sheaf-FRL, the two no-cooperation readings, then the
baselines with their strong (``-pilots``) reading after each. A NaN half-width (one seed) prints
as the mean alone.
"""

from __future__ import annotations

import argparse
import csv
import math

ORDER = ("sheaf-frl", "posthoc-pilots", "posthoc-train", "fedproto", "fedsaf-gcsa", "fedsaf-rcsa", "fedmuscle",
         "comfed", "sheaf-fmtl")


def _rank(method: str) -> tuple[int, int]:
    base = method.removesuffix("-pilots") if method != "posthoc-pilots" else method
    return (ORDER.index(base) if base in ORDER else len(ORDER), method.endswith("-pilots") and method != "posthoc-pilots")


def table(rows: list[dict], metric: str) -> str:
    """The markdown table of ``rows`` (``figure.csv`` dicts) for ``metric`` (``comm`` or ``private``).

    Raises:
        KeyError: ``metric`` is not a column prefix of the CSV (``<metric>_mean``).
    """
    xs = sorted({float(r["x"]) for r in rows})
    methods = sorted({r["method"] for r in rows}, key=_rank)
    cell = {(r["method"], float(r["x"])): r for r in rows}
    fmt = (lambda x: f"{x:g}")
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


def main() -> None:
    """Print the table of the CSV named on the command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--metric", choices=("comm", "private"), default="comm")
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        print(table(list(csv.DictReader(f)), args.metric))


if __name__ == "__main__":
    main()
