"""Cross-device Sheaf-FRL: hundreds to a thousand agents, 10-20% participation, on Flower's Ray engine.

Scenario (cross-device, in the spirit of FedSAF's 50-200 clients with 20% sampled per round; here
100 to 1,000 agents at 10-20% participation):

- agents: the ``tiny-<N>`` zoo (:mod:`flwr_sheaf.models.zoo`: five small CNN encoder/head families,
  d in {16, 24, 32}, < 7k parameters each, class windows of 5-6 labels);
- data: the paper's label-shift partition (Eq. 23, s = 0.7) of Fashion-MNIST (``dataset=fashion-mnist``,
  70,000 images: ~50 train images per agent at N = 1,000), installed by
  ``bash scripts/get_data.sh fashion-mnist``; without it the script stops with that command (the
  bundled 5,000 digits leave agents with empty test splits from N = 300 and empty training sets at
  N = 1,000, so they are used only when asked for with ``--dataset mnist-bundled``);
- graph: sparse, ``class-overlap-knn:4`` (each agent links to the 4 agents sharing most classes,
  seeded ties, bridged to be connected; :func:`flwr_sheaf.topology.class_overlap_knn_graph`) or
  ``random-regular:<k>``;
- participation: ``fraction-train`` (uniform, default 15%) or per-node Bernoulli probabilities
  (``--participation "uniform:0.1-0.2"``); absent neighbours' pilots are served from the server's
  cache (policy ``cached``, exact);
- evaluation only at the end (``evaluate-every = rounds``): evaluating 1,000 nodes costs more than
  several training rounds.

Engines: ``ray`` (default) runs ``flwr run`` through ``scripts/run_flwr.py`` (private SuperLink,
``num-supernodes = N``, one CPU per ClientApp, so 2 Ray actors on 2 cores) and records the wall time
and the peak resident memory (RSS and PSS sums) of the whole process tree (``flwr`` CLI, SuperLink,
SuperExec, simulation process, Ray's GCS/raylet/workers); ``inprocess`` uses
:class:`flwr_sheaf.testing.LocalGrid` (no Ray). Writes ``<out>/N<N>/results.json`` per run and
``<out>/summary.json``.

The documented command (sampled discovery, 5% participation; tested at tiny scale):
docs/cross-device.md, "Cross-device run". A rerun of the same N moves the earlier run's files into
``<out>/N<N>/previous-<UTC time>/`` (nothing deleted). Usage::

    python simulations/cross_device.py --agents 100,300,1000 [--fraction 0.15] [--rounds 5]
        [--graph class-overlap-knn:4] [--engine ray] [--out results/cross_device]
        [--ray-address HEAD:PORT]   # an existing Ray cluster (docs/ray-cluster.md, "A Ray cluster")
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def default_dataset() -> str:
    """``fashion-mnist`` (installed by ``bash scripts/get_data.sh fashion-mnist``).

    Raises:
        SystemExit: it is not installed (the message lists where it was looked for and the command).
    """
    from flwr_sheaf.data.catalog import find_installed

    try:
        find_installed("fashion-mnist")
    except FileNotFoundError as exc:
        raise SystemExit(f"{exc}\n(or pass --dataset mnist-bundled for <= 100 agents)") from None
    return "fashion-mnist"


class TreeMemoryMonitor:
    """Samples the resident memory of a process tree (the root and all its descendants).

    Ray's GCS/raylet/workers descend from the simulation process, which descends from the SuperLink
    that ``flwr run`` starts, so following children from the root covers the whole run (and nothing
    of other Flower/Ray runs on the machine). Two sums are kept: RSS (counts shared pages, e.g.
    torch's libraries, once per process: an upper bound) and PSS (shared pages split between the
    processes that map them: the physical memory attributable to the tree), the latter sampled less
    often because reading ``smaps`` is slower.
    """

    def __init__(self, root_pid: int, interval: float = 0.5, pss_every: int = 4) -> None:
        self.root = psutil.Process(root_pid)
        self.interval = interval
        self.pss_every = pss_every
        self.t0 = time.time()
        self.peak_bytes = 0
        self.peak_pss_bytes = 0
        self.peak_procs = 0
        self.peak_breakdown: list[tuple[str, int]] = []
        self.samples: list[tuple[float, int]] = []
        self._n = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _procs(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def sample(self) -> int:
        """Take one sample: RSS of every live process of the tree (PSS every ``pss_every``-th
        call); updates the peaks and the sample list. Returns the RSS sum in bytes (int).
        Processes that vanish or deny access during the scan are skipped."""
        total, pss, n, parts = 0, 0, 0, []
        want_pss = self._n % self.pss_every == 0
        self._n += 1
        for p in self._procs():
            try:
                rss = p.memory_info().rss
                if want_pss:
                    pss += p.memory_full_info().pss
                name = " ".join(p.cmdline()[:2])[-60:]
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            total += rss
            n += 1
            parts.append((name, rss))
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_procs = total, n
            self.peak_breakdown = sorted(parts, key=lambda x: -x[1])[:8]
        self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
        self.samples.append((time.time() - self.t0, total))
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> TreeMemoryMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_config(n: int, args: argparse.Namespace, out: Path) -> dict:
    """Run config (``dict`` of run-config keys) of one cross-device run with ``n`` agents: the
    ``tiny-<n>`` zoo, the parsed command-line options, and ``results-dir = out``."""
    rc = {
        "zoo": f"tiny-{n}",
        "dataset": args.dataset,
        "graph": args.graph,
        "num-server-rounds": args.rounds,
        "evaluate-every": args.evaluate_every or args.rounds,
        "local-epochs": args.local_epochs,
        "batch-size": args.batch_size,
        "num-pilots": args.num_pilots,
        "pilot-batch-size": min(64, args.num_pilots),
        "absent-policy": args.absent_policy,
        "seed": args.seed,
        "results-dir": str(out),
        "overwrite": True,  # a rerun of this N replaces its own earlier run
        # discovery through Ray on 2 loaded cores: 10,000 SuperNodes in 953 s (Flower's in-memory
        # LinkState polling, benchmarks/records/performance.md, "The Ray scale curve"): allow 0.5 s a node, 300 s at least
        "discovery-timeout": max(300.0, 0.5 * n),
    }
    if args.participation:
        rc["participation"] = args.participation
    else:
        rc["fraction-train"] = args.fraction
    if args.max_steps_per_epoch:
        rc["max-steps-per-epoch"] = args.max_steps_per_epoch
    if args.partitioner:
        rc["partitioner"] = args.partitioner
    if args.fraction_evaluate:
        rc["fraction-evaluate"] = args.fraction_evaluate
    if args.evaluate_nodes:
        rc["evaluate-nodes"] = args.evaluate_nodes
    if args.discovery != "all":
        rc["discovery"] = args.discovery
    return rc


def _fmt(x, spec: str) -> str:
    """``x`` formatted with ``spec``, or ``n/a`` when not measured (None, e.g. no evaluated edge)."""
    return "n/a" if x is None else format(x, spec)


def _toml_value(v) -> str:
    """A run-config override value as ``flwr run --run-config`` parses it (TOML: ``true``, not ``True``)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return f"'{v}'" if isinstance(v, str) else repr(v)


def run_ray(
    n: int, rc: dict, log_path: Path, port: int, timeout: float, ray_address: str | None = None
) -> dict:
    """``flwr run`` with ``n`` SuperNodes; returns exit status, wall time and peak tree RSS.

    ``ray_address``: an existing Ray cluster (``host:port``, ``run_flwr.py --ray-address``); the
    memory figures then cover only this machine's process tree, not the other Ray nodes."""
    overrides = " ".join(f"{k}={_toml_value(v)}" for k, v in rc.items())
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "run_flwr.py"),
        "--app",
        str(ROOT),
        "--num-supernodes",
        str(n),
        "--cpus-per-client",
        "1",
        "--port",
        str(port),
        "--timeout",
        str(timeout),
        "--run-config",
        overrides,
    ]
    if ray_address:
        cmd += ["--ray-address", ray_address]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write("+ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        with TreeMemoryMonitor(proc.pid) as mon:
            try:
                code = proc.wait(timeout=timeout + 120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = -9
    return {
        "exit_code": code,
        "wall_seconds": time.monotonic() - t0,
        "peak_rss_bytes": mon.peak_bytes,
        "peak_pss_bytes": mon.peak_pss_bytes,
        "peak_rss_processes": mon.peak_procs,
        "peak_rss_breakdown": mon.peak_breakdown,
        "memory_samples": mon.samples[:: max(1, len(mon.samples) // 200)],
    }


def run_inprocess_measured(rc: dict) -> dict:
    """In-process (LocalGrid) run; peak RSS of this process (ru_maxrss)."""
    import resource

    sys.path.insert(0, str(ROOT / "simulations"))
    from inprocess import run_inprocess

    t0 = time.monotonic()
    run_inprocess(rc)
    return {
        "exit_code": 0,
        "wall_seconds": time.monotonic() - t0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_rss_processes": 1,
    }


def round_stats(results: dict) -> dict:
    """Per-round wall times: training rounds (no evaluation) vs the evaluation round(s)."""
    rounds = results["rounds"]
    train = [
        r["wall_seconds"]
        for r in rounds
        if r.get("private_accuracy_mean") is None and r["round"] > 1
    ]
    evals = [r["wall_seconds"] for r in rounds if r.get("private_accuracy_mean") is not None]
    first = rounds[0]["wall_seconds"] if rounds else None
    train_sorted = sorted(train)
    last = next((r for r in reversed(rounds) if r.get("private_accuracy_mean") is not None), {})
    return {
        "rounds": len(rounds),
        "round1_seconds": first,
        "train_round_seconds_median": train_sorted[len(train_sorted) // 2]
        if train_sorted
        else None,
        "train_round_seconds_mean": sum(train) / len(train) if train else None,
        "train_round_seconds": train,
        "eval_round_seconds": evals,
        "trained_per_round": sum(r.get("num_trained", 0) for r in rounds) / max(len(rounds), 1),
        "edges_relayed_per_round": sum(r.get("edges_relayed", 0) for r in rounds)
        / max(len(rounds), 1),
        "server_seconds_total": results.get("total_wall_seconds"),
        "setup_seconds": (results.get("total_wall_seconds") or 0)
        - sum(r["wall_seconds"] for r in rounds),
        "private_accuracy": last.get("private_accuracy_mean"),
        "communication_accuracy": last.get("communication_accuracy_degree_weighted"),
        "failures": len(results.get("failures", [])),
    }


def table(summary: dict) -> str:
    """Markdown table of the runs in ``summary`` (``summary.json``'s content)."""
    fmt = lambda x, f="{:.1f}": "-" if x is None else f.format(x)  # noqa: E731
    lines = [
        "| agents N | engine | trained/round | relayed edges/round | train round s (median) | eval round s (all N) "
        "| setup s | total wall s | peak RSS GiB (sum) | peak PSS GiB | private acc | comm acc (deg.-w.) | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(summary.values(), key=lambda r: r["n"]):
        lines.append(
            f"| {r['n']} | {r['engine']} | {fmt(r.get('trained_per_round'))} | {fmt(r.get('edges_relayed_per_round'))} | "
            f"{fmt(r.get('train_round_seconds_median'))} | {fmt((r.get('eval_round_seconds') or [None])[-1])} | "
            f"{fmt(r.get('setup_seconds'))} | {fmt(r.get('wall_seconds'), '{:.0f}')} | "
            f"{fmt(r.get('peak_rss_bytes', 0) / 2**30, '{:.2f}')} | "
            f"{fmt(r['peak_pss_bytes'] / 2**30 if r.get('peak_pss_bytes') else None, '{:.2f}')} | "
            f"{fmt(r.get('private_accuracy'), '{:.3f}')} | {fmt(r.get('communication_accuracy'), '{:.3f}')} | "
            f"{r.get('status', 'yes' if r.get('completed') else 'NO')} |"
        )
    return "\n".join(lines)


#: The largest population measured to fit one machine (10,000 SuperNodes with sampled discovery in
#: 5.1 GiB, benchmarks/records/performance-ray-sampled.md); the smallest that makes a federation with a graph.
MAX_AGENTS, MIN_AGENTS = 10_000, 2
#: ``--dataset mnist-bundled`` (5,000 digits) leaves agents with empty test splits from N = 300.
MAX_AGENTS_BUNDLED = 100


def agents_list(text: str) -> list[int]:
    """``--agents``: comma-separated population sizes, each an integer >= 2 (the upper bound,
    10,000 on this machine, is :func:`agents_bound_problem`'s, after parsing).

    Raises:
        argparse.ArgumentTypeError: an empty list, a value that is not an integer, or one outside
            2 (the value and the fix named).
    """
    out = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            n = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a whole number of agents; give comma-separated integers, e.g. "
                f"--agents 100,300,1000"
            ) from None
        if n < MIN_AGENTS:
            raise argparse.ArgumentTypeError(
                f"{n} agents: a cross-device run needs at least {MIN_AGENTS} agents (a graph needs "
                f"two ends); e.g. --agents 100"
            )
        out.append(n)
    return out


def agents_bound_problem(agents: list[int], engine: str, ray_address: str | None) -> str | None:
    """Why ``--agents`` exceeds what this machine is known to hold (``MAX_AGENTS`` SuperNodes), or
    None. Checked after parsing, since it depends on ``--ray-address``: on a Ray cluster
    (``--engine ray --ray-address``) the SuperNodes run on the cluster, so the bound is not applied
    (:func:`main` warns instead)."""
    n = max(agents)
    if n <= MAX_AGENTS or (engine == "ray" and ray_address is not None):
        return None
    return (
        f"argument --agents: {n} agents: more than this machine is known to hold ({MAX_AGENTS:,} "
        f"SuperNodes, 5.1 GiB with --discovery sampled, benchmarks/records/performance-ray-sampled.md); run at most "
        f"--agents {MAX_AGENTS} here, or on a Ray cluster with more memory (--ray-address HEAD:PORT)"
    )


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of this script (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--agents",
        type=agents_list,
        default="100,300,1000",
        help=f"comma-separated population sizes N, each in [{MIN_AGENTS}, {MAX_AGENTS}] "
        "(no upper bound with --ray-address: the cluster holds them)",
    )
    ap.add_argument(
        "--fraction", type=float, default=0.15, help="fraction-train per round (uniform)"
    )
    ap.add_argument(
        "--participation",
        default="",
        help="per-node Bernoulli spec instead of --fraction, e.g. uniform:0.1-0.2",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--evaluate-every", type=int, default=0, help="0 = only at the last round")
    ap.add_argument("--graph", default="class-overlap-knn:4")
    ap.add_argument("--dataset", default=None, help="default: fashion-mnist (must be installed)")
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-steps-per-epoch", type=int, default=0)
    ap.add_argument("--num-pilots", type=int, default=200)
    ap.add_argument("--absent-policy", default="cached")
    ap.add_argument(
        "--partitioner", default="", help="e.g. cross-device (a handful of samples per agent)"
    )
    ap.add_argument(
        "--fraction-evaluate", type=float, default=0.0, help="0 = the package default (all nodes)"
    )
    ap.add_argument(
        "--evaluate-nodes",
        choices=("", "auto", "trained", "panel", "drawn"),
        default="",
        help="run-config evaluate-nodes (empty = the package default, auto: this round's trainers "
        "when --fraction < 1; panel and drawn differ only with --fraction-evaluate < 1: at 1 both "
        "evaluate every node, which the run warns; notes/participation.md 1.4.1)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--discovery",
        choices=("all", "sampled"),
        default="all",
        help="run-config discovery: sampled = nodes describe themselves when first sampled",
    )
    ap.add_argument("--engine", choices=("ray", "inprocess"), default="ray")
    ap.add_argument("--port", type=int, default=39691)
    ap.add_argument(
        "--ray-address",
        default=None,
        help="engine ray: run on this existing Ray cluster (host:port of its head; docs/tutorial.md); "
        "peak memory then covers only this machine",
    )
    ap.add_argument("--timeout", type=float, default=1500.0, help="per run, seconds")
    ap.add_argument("--out", default="results/cross_device")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run each population size in ``--agents``; update ``<out>/summary.json`` and ``table.md``
    after every run. Returns exit status 0, or 1 if some run did not end `completed` (failed, degraded, or wrote no results)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    too_many = agents_bound_problem(args.agents, args.engine, args.ray_address)
    if too_many:
        parser.error(too_many)
    if max(args.agents) > MAX_AGENTS:  # on a Ray cluster: not refused by this machine's bound
        print(
            f"warning: --agents {max(args.agents)} is more than the {MAX_AGENTS:,} SuperNodes measured "
            f"on one machine (benchmarks/records/performance-ray-sampled.md); the cluster at {args.ray_address} "
            "must hold them, and this machine still runs the SuperLink and the ServerApp",
            file=sys.stderr,
        )
    if args.dataset == "mnist-bundled" and max(args.agents) > MAX_AGENTS_BUNDLED:
        parser.error(
            f"argument --agents: {max(args.agents)} agents with --dataset mnist-bundled (5,000 digits) "
            f"leaves agents with empty splits; use at most {MAX_AGENTS_BUNDLED} agents, or install "
            f"Fashion-MNIST (bash scripts/get_data.sh fashion-mnist) and leave --dataset out"
        )
    if args.engine == "ray" and args.ray_address is not None:  # before any run: one refusal
        from flwr_sheaf.tools.ray_cluster import RayClusterError, check_reachable, resolve_address

        try:
            args.ray_address = resolve_address(args.ray_address)
            check_reachable(args.ray_address)
        except RayClusterError as exc:
            print(exc, file=sys.stderr)
            return 2
    args.dataset = args.dataset or default_dataset()
    from flwr_sheaf.rundir import MOVED_FILES, RunDir

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    status = 0
    for n in args.agents:
        rdir = out / f"N{n}"
        rc = run_config(n, args, rdir)
        print(f"== N = {n}: {args.engine}, {rc}", flush=True)
        # the earlier run of this N is moved aside, never deleted (as the package's overwrite=true)
        moved = RunDir(rdir).move_aside((*MOVED_FILES, "flwr.log")) if rdir.is_dir() else None
        if moved is not None:
            print(f"   moved the earlier run's {', '.join(moved[1])} into {moved[0]}", flush=True)
        if args.engine == "ray":
            meas = run_ray(n, rc, rdir / "flwr.log", args.port, args.timeout, args.ray_address)
        else:
            meas = run_inprocess_measured(rc)
        res = None
        if meas["exit_code"] == 0 and (rdir / "results.json").exists():
            res = json.loads((rdir / "results.json").read_text())
        # the run's own status (docs/guarantees.md): a degraded run is not a clean one
        run_status = "no results.json" if res is None else str(res.get("status", "unknown"))
        ok = run_status == "completed"
        rec = {
            "n": n,
            "engine": args.engine,
            "completed": ok,
            "status": run_status,
            "run_config": rc,
        }
        rec.update(meas)
        if res is not None:
            rec.update(round_stats(res))
        if not ok:
            status = 1
        summary[f"N{n}"] = rec
        summary_path.write_text(json.dumps(summary, indent=1))
        (out / "table.md").write_text(table(summary) + "\n")
        print(
            f"   N={n}: status={run_status} wall {meas['wall_seconds']:.0f} s, peak RSS {meas['peak_rss_bytes'] / 2**30:.2f} GiB"
            f" (PSS {meas.get('peak_pss_bytes', 0) / 2**30:.2f} GiB)"
            + (
                f", train round median {_fmt(rec.get('train_round_seconds_median'), '.1f')} s, "
                f"private {_fmt(rec.get('private_accuracy'), '.3f')}, "
                f"comm {_fmt(rec.get('communication_accuracy'), '.3f')}"
                if res is not None
                else ""
            ),
            flush=True,
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
