"""Peak memory of each method on the 15-agent zoo (all agents and the server in one process).

For every ``--methods`` entry a fresh Python process runs the method in-process (LocalGrid: the
same ServerApp/ClientApp code as ``flwr run``, all 15 agents' models, optimisers and data in that
one process) for ``--rounds`` server rounds of one local epoch capped at ``--steps`` SGD steps,
with evaluation in the last round, and reports:

* ``peak_rss_mib``: the process's peak resident set size (``getrusage(RUSAGE_SELF).ru_maxrss``,
  KiB on Linux, converted to MiB = 2**20 bytes), i.e. the whole simulated federation;
* ``import_rss_mib``: its resident set size after importing torch, Flower and the package, before
  the run (interpreter + libraries, shared by every method);
* ``per_agent_mib``: ``(peak - import) / num_agents``, a per-SuperNode estimate (in a deployment
  each SuperNode also pays the import footprint once);
* ``cuda_peak_mib``: ``torch.cuda.max_memory_allocated`` when ``--device cuda``.

Peak memory is reached in the first steps (activations of one batch and one pilot minibatch per
agent, plus the evaluation passes), so a capped round measures it; CPU load from other programs
does not change it. Sheaf-FMTL's restriction maps are allocated at construction, so they are
included whatever ``--steps`` is.

    python benchmarks/method_memory.py                       # eight methods, paper-15, bundled digits
    python benchmarks/method_memory.py --methods sheaf-frl --extra dataset=fashion-mnist preset=paper

Prints a markdown table and writes ``<out>/method_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = [
    "non-cooperative",
    "fedproto",
    "fedsaf-gcsa",
    "fedsaf-rcsa",
    "fedmuscle",
    "comfed",
    "sheaf-fmtl",
    "sheaf-frl",
]
#: the 15-agent zoo needs a common dimension for the prototype / contrastive baselines (as the notebook).
COMMON = [
    "zoo=paper-15",
    "shift=0.7",
    "seed=0",
    "fedproto-dim=64",
    "fedmuscle-dim=64",
    "torch-threads=1",
]


def _rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def child(method: str, overrides: list[str], out: Path) -> None:
    """Run one method in this process and write its memory figures to ``out`` (JSON)."""
    sys.path.insert(0, str(ROOT / "simulations"))
    import torch
    from inprocess import parse_overrides, run_inprocess

    from flwr_sheaf.apps.scenario import agent_specs
    from flwr_sheaf.config import RunConfig

    rc = parse_overrides(overrides + [f"method={method}"])
    n = len(agent_specs(RunConfig.from_run_config(rc).scenario))
    import_rss = _rss_mib()
    t0 = time.monotonic()
    res = run_inprocess(rc)
    rec = {
        "method": method,
        "num_agents": n,
        "import_rss_mib": import_rss,
        "peak_rss_mib": _rss_mib(),
        "wall_s": time.monotonic() - t0,
        "failures": len(res["failures"]),
        "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20
        if torch.cuda.is_available()
        else None,
    }
    rec["per_agent_mib"] = (rec["peak_rss_mib"] - import_rss) / n
    out.write_text(json.dumps(rec))


def main() -> None:
    """Parse arguments; one fresh process per method; print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="server rounds (>= 2: round 1 has no neighbour payloads)",
    )
    ap.add_argument("--steps", type=int, default=5, help="max SGD steps per local epoch")
    ap.add_argument("--extra", nargs="*", default=[], help="more run-config overrides key=value")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "method_memory")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    overrides = (
        COMMON
        + [
            f"num-server-rounds={args.rounds}",
            "local-epochs=1",
            f"max-steps-per-epoch={args.steps}",
            f"evaluate-every={args.rounds}",
        ]
        + list(args.extra)
    )
    if args.child:
        child(args.child, overrides, args.child_out)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for m in args.methods:
        tmp = args.out / f"{m}.json"
        cmd = [
            sys.executable,
            __file__,
            "--child",
            m,
            "--child-out",
            str(tmp),
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--extra",
            *args.extra,
            f"results-dir={args.out / m}",
        ]
        subprocess.run(cmd, check=True, cwd=ROOT)
        rows.append(json.loads(tmp.read_text()))
        r = rows[-1]
        print(
            f"{m:>16}: peak {r['peak_rss_mib']:.0f} MiB (import {r['import_rss_mib']:.0f}), "
            f"{r['per_agent_mib']:.1f} MiB / agent, {r['wall_s']:.0f} s",
            flush=True,
        )
    (args.out / "method_memory.json").write_text(
        json.dumps({"overrides": overrides, "rows": rows}, indent=1)
    )
    print(
        "\n| method | peak RSS, 15 agents + server (MiB) | after imports (MiB) | per agent (MiB) | CUDA peak (MiB) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        cuda = "-" if r["cuda_peak_mib"] is None else f"{r['cuda_peak_mib']:.0f}"
        print(
            f"| {r['method']} | {r['peak_rss_mib']:.0f} | {r['import_rss_mib']:.0f} | {r['per_agent_mib']:.1f} | {cuda} |"
        )


if __name__ == "__main__":
    main()
