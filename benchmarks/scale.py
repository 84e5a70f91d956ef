"""Scale benchmark: wall time per round and peak memory against the number of agents.

Runs the cross-device Sheaf-FRL scenario (:mod:`simulations.cross_device`: ``tiny-<N>`` zoo,
label-shift partition of Fashion-MNIST, or the bundled digits, ``class-overlap-knn:4`` graph,
cached pilots) for N = 15, 100, 300, 1,000 agents with a **fixed number of participants per round**
(default 15), on Flower's Ray engine through ``flwr run`` (``scripts/run_flwr.py``), and prints:

- ``train round``: median wall time of the training rounds (round 2 onwards, rounds without
  evaluation), measured by the strategy from ``configure_train`` to ``aggregate_evaluate``;
- ``round 1``: the first round (first ClientApp calls on each worker);
- ``eval round``: the final round, which also evaluates all N nodes (two phases);
- ``setup``: ServerApp time outside rounds (discovery: one query per node, graph building);
- ``total``: the whole ``flwr run`` command (SuperLink start, Ray start, data loading, ...);
- ``peak RSS`` / ``peak PSS``: the summed resident memory of the process tree (flwr CLI, SuperLink,
  SuperExec, simulation process, Ray GCS/raylet/workers), sampled every 0.5 s (PSS every 2 s). The
  RSS sum counts shared pages once per process (an upper bound); PSS splits them (the physical
  memory attributable to the run).

The per-participant work is held constant: ``max-steps-per-epoch = 1`` (one SGD step of
``batch-size`` images plus one pilot batch per round), so differences between rows come from the
population, not from more local data per agent at small N.

Usage::

    python benchmarks/scale.py [--agents 15,100,300,1000] [--participants 15] [--rounds 6]
        [--engine ray|inprocess] [--discovery all|sampled] [--out results/benchmarks/scale]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "simulations"))
import cross_device as cd  # noqa: E402


def table(rows: list[dict], participants: int, engine: str, dataset: str) -> str:
    """Markdown table (title line + table) of the per-N records of ``cross_device``'s summary."""
    fmt = lambda x, f="{:.1f}": "-" if x is None else f.format(x)  # noqa: E731
    lines = [
        f"Sheaf-FRL scale benchmark ({engine} engine, {participants} participants per round, tiny-N zoo, {dataset}, "
        f"class-overlap-knn:4, 1 local step per participant)",
        "",
        "| agents N | participants/round | train round s (median) | round 1 s | eval round s (all N) | setup s "
        "| total wall s | peak RSS GiB (sum) | peak PSS GiB | processes at peak | completed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {fmt(r.get('trained_per_round'))} | {fmt(r.get('train_round_seconds_median'), '{:.2f}')} | "
            f"{fmt(r.get('round1_seconds'))} | {fmt((r.get('eval_round_seconds') or [None])[-1])} | "
            f"{fmt(r.get('setup_seconds'))} | {fmt(r.get('wall_seconds'), '{:.0f}')} | "
            f"{fmt(r.get('peak_rss_bytes', 0) / 2**30, '{:.2f}')} | {fmt(r['peak_pss_bytes'] / 2**30 if r.get('peak_pss_bytes') else None, '{:.2f}')} | "
            f"{r.get('peak_rss_processes', '-')} | "
            f"{'yes' if r.get('completed') else 'NO'} |"
        )
    return "\n".join(lines)


def agent_counts(text: str) -> list[int]:
    """``--agents``: a comma-separated list of population sizes, each an integer >= 2 (a sheaf needs
    an edge).

    Raises:
        argparse.ArgumentTypeError: an empty entry, a non-integer or a size below 2 (named), so
            argparse prints ``argument --agents: ...`` and exits 2 instead of a traceback.
    """
    sizes = []
    for i, item in enumerate(str(text).split(",")):
        item = item.strip()
        if not item.isdigit() or not item.isascii():
            raise argparse.ArgumentTypeError(
                f"{text!r}: entry {i} ({item!r}) is not a whole number; give population sizes "
                f">= 2 separated by commas, e.g. --agents 15,100,300"
            )
        if int(item) < 2:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {int(item)} agents is too few (a sheaf needs at least 2); e.g. --agents 15,100"
            )
        sizes.append(int(item))
    return sizes


def _positive_int(text: str) -> int:
    """An integer >= 1 (``--participants``, ``--rounds``); argparse names the flag on an error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the cross-device scenario for each N with a fixed number of participants; write and
    print ``table.md``. Returns 0, or non-zero if some run failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--agents", type=agent_counts, default=[15, 100, 300, 1000], help="e.g. 15,100,300,1000"
    )
    ap.add_argument("--participants", type=_positive_int, default=15)
    ap.add_argument("--rounds", type=_positive_int, default=6)
    ap.add_argument("--engine", choices=("ray", "inprocess"), default="ray")
    ap.add_argument("--dataset", default=None, help="default: fashion-mnist (must be installed)")
    ap.add_argument("--num-pilots", type=int, default=200)
    ap.add_argument("--port", type=int, default=39791)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument(
        "--partitioner", default="", help="e.g. cross-device: a handful of samples per agent"
    )
    ap.add_argument(
        "--evaluated", type=int, default=0, help="nodes evaluated in the last round (0 = all N)"
    )
    ap.add_argument(
        "--discovery",
        choices=("all", "sampled"),
        default="all",
        help="run-config discovery (sampled: nodes describe themselves when first sampled)",
    )
    ap.add_argument("--out", default="results/benchmarks/scale")
    args = ap.parse_args(argv)
    args.dataset = args.dataset or cd.default_dataset()
    out = Path(args.out).resolve() / args.engine
    out.mkdir(parents=True, exist_ok=True)
    rows, status = [], 0
    for n in args.agents:
        status |= cd.main(
            [
                "--agents",
                str(n),
                "--fraction",
                str(min(1.0, (args.participants + 0.5) / n)),
                "--rounds",
                str(args.rounds),
                "--evaluate-every",
                str(args.rounds),
                "--dataset",
                args.dataset,
                "--num-pilots",
                str(args.num_pilots),
                "--max-steps-per-epoch",
                "1",
                "--engine",
                args.engine,
                "--port",
                str(args.port),
                "--timeout",
                str(args.timeout),
                "--out",
                str(out),
                "--partitioner",
                args.partitioner,
                "--fraction-evaluate",
                str(min(1.0, (args.evaluated + 0.5) / n) if args.evaluated else 0.0),
                "--discovery",
                args.discovery,
            ]
        )
        summary = json.loads((out / "summary.json").read_text())
        rows.append(summary[f"N{n}"])
        (out / "table.md").write_text(
            table(rows, args.participants, args.engine, args.dataset) + "\n"
        )
    text = table(rows, args.participants, args.engine, args.dataset)
    print(text)
    (out / "table.md").write_text(text + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
