"""Per-message cost of flwr-sheaf's discovery on Flower's Ray engine against a trivial Flower app.

One run of this script runs, through ``flwr run`` on a private local SuperLink (``--num-supernodes
N``, ``client-resources-num-cpus=1``, ``init-args-num-cpus=<actors>``: that many ClientApp actors):

- **trivial**: a Flower 1.42 app written by this script into a temporary directory: its ServerApp
  sends one small query (a one-entry ConfigRecord) to every node, twice; its ClientApp
  (``@app.query()``) replies with a one-entry MetricRecord. This is Flower's own floor.
- **flwr-sheaf**: the same ServerApp shape, but its first round is the package's discovery
  (``SheafFRL.discover``: ``query.sheaf`` to every node, the bundled ClientApp describing each node
  from its zoo spec and data, building and stalk-checking one CNN per architecture and actor; then
  the graph is built and the replies checked) and its second round repeats the same query messages through the package's
  own round trip (``GraphStrategy.exchange.round_trip``: ``flwr_sheaf/strategy/messaging.py``, at most
  ``SIMULATION_WINDOW`` messages in flight on Flower's simulation engine). The trivial app pushes
  all N messages at once (Flower's ``Grid.send_and_receive``), as a Flower app does by default.

For each round it prints the wall time and the CPU-seconds per message, and the ratio flwr-sheaf /
trivial. CPU is sampled with psutil (user + system) for the ``flwr-simulation`` process (the
ServerApp, the simulation engine and the Ray driver) and each of its descendants, by pid and start
time, just before and just after the measured round: a process started in between counts from zero,
one that ended in between is counted as ``vanished`` in the JSON. The **ratio** takes the CPU of the
processes that carry the messages (``APP_PROCESSES``: ``simulation``, the ClientApp ``actors`` and
Ray's idle workers, Ray's ``raylet`` and ``gcs_server``); Ray's background helpers (dashboard, its
agents, log monitor, autoscaler monitor) run whatever the app does, so they are left out of the
ratio for both apps alike, and printed by process with the whole-tree CPU (``all``) and a second
ratio row that includes them. Each app's CPU ms per message is also printed by process
(``actors`` with their count).

The first round is measured once per app (it is a first round by definition). The repeat round is
run ``--repeats`` times (default 3) in the same run; every repeat's CPU per message is printed, with
the median, and the ratio compares each app's **minimum**: a repeat of 1,000 messages lasts 2-5 s,
and on a shared machine other processes only add CPU time to it (a contended core, preemption, Ray's
polling while a message waits), never take it away, so the least-disturbed repeat is the best
estimate of the app's own cost (the usual choice for CPU cost under interference); the ratio of the
medians is printed beside it. CPU-seconds are what counts on a shared machine; wall time follows the
machine's load. The flwr-sheaf app's dataset is checked before anything starts (exit 2 with the
install command where it is missing).

Usage::

    python benchmarks/ray_message_cost.py [--supernodes 1000] [--actors 2] [--port 39901]
        [--num-pilots 200] [--timeout 1800] [--repeats 3] [--apps trivial,flwr-sheaf]

``--actors 1,2,4`` runs both apps for each actor count. The target (issue 34): every ratio (first
and repeat rounds) within 1.5 at 1,000 SuperNodes. ``--apps trivial`` runs Flower's
trivial app alone (its own scale curve, benchmarks/records/performance-ray.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))  # the data check imports this checkout's flwr_sheaf, as the apps do
from run_flwr import find_flwr, flwr_env, listening, run_status, stop_superlink  # noqa: E402

#: shared by both ServerApps: CPU-seconds of this process and all its descendants.
_TREE_CPU = """
import os, time, psutil

def _label(p, me):
    if p.pid == me.pid:
        return "simulation"  # the ServerApp, Flower's simulation engine and the Ray driver
    name = p.name()
    if "Actor" in name or name.startswith("ray::"):
        return "actors"
    if name.startswith("python"):  # Ray's helper scripts (log monitor, dashboard, ...)
        script = next((a for a in p.cmdline()[1:] if a.endswith(".py")), "")
        return "ray " + (os.path.basename(script)[:-3] or "python")
    return "ray " + name

def tree_cpu():
    # CPU-seconds (user + system) of this process and each descendant, by (pid, start time)
    me = psutil.Process(os.getpid())
    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[(p.pid, p.create_time())] = (_label(p, me), t.user + t.system)
        except psutil.Error:
            continue
    return out


def timed(fn):
    # Run fn; the CPU each process of the tree spent between the two samples, by label. Sampled
    # per process (pid and start time): a process started in between counts from zero; one that
    # ended in between cannot be read any more and is counted as "vanished".
    c0, t0 = tree_cpu(), time.monotonic()
    out = fn()
    wall = time.monotonic() - t0
    c1 = tree_cpu()
    parts, n = {}, {}
    for key, (name, cpu) in c1.items():
        parts[name] = parts.get(name, 0.0) + cpu - (c0[key][1] if key in c0 else 0.0)
        n[name] = n.get(name, 0) + 1
    parts = {k: round(v, 3) for k, v in parts.items()}
    gone = sum(1 for key in c0 if key not in c1)
    return out, wall, sum(parts.values()), {"cpu": parts, "processes": n, "vanished": gone}
"""

TRIVIAL_CLIENT = """
from flwr.app import Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def query(msg, context):
    return Message(RecordDict({"m": MetricRecord({"pid": int(context.node_config["partition-id"])})}), reply_to=msg)
"""

SERVER = (
    _TREE_CPU
    + """
import json
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import ServerApp

app = ServerApp()


def query_round(grid, nodes, message_type, config):
    msgs = [Message(RecordDict({"config": ConfigRecord(config)}), dst_node_id=n, message_type=message_type) for n in nodes]
    replies = SEND(grid, msgs)
    bad = [r for r in replies if r.has_error()]
    if len(replies) != len(nodes) or bad:
        raise RuntimeError(f"{len(replies)} replies of {len(nodes)}; {len(bad)} errors: {bad[:1]}")


@app.main()
def main(grid, context):
    n = int(context.run_config["bench-supernodes"])
    out = {"mode": MODE, "n": n}
    t0 = time.monotonic()
    while len(nodes := list(grid.get_node_ids())) < n:
        if time.monotonic() - t0 > TIMEOUT:
            raise RuntimeError(f"{len(nodes)} of {n} SuperNodes registered")
        time.sleep(0.2)
    out["registered_s"] = time.monotonic() - t0
    out["first"] = FIRST(grid, nodes, context)
    out["repeats"] = []
    for _ in range(int(context.run_config.get("bench-repeats", 1))):
        _, wall, cpu, parts = timed(lambda: query_round(grid, nodes, REPEAT_TYPE, REPEAT_CONFIG(context)))
        out["repeats"].append({"wall_s": wall, "cpu_s": cpu, "cpu_by_process": parts["cpu"], "processes": parts["processes"], "vanished": parts["vanished"]})
    with open(context.run_config["bench-out"], "w") as f:
        json.dump(out, f)
"""
)

TRIVIAL_SERVER = (
    SERVER
    + """
MODE, REPEAT_TYPE, TIMEOUT = "trivial", "query", 3600.0
SEND = lambda grid, msgs: list(grid.send_and_receive(msgs, timeout=TIMEOUT))
REPEAT_CONFIG = lambda context: {"x": 1}


def FIRST(grid, nodes, context):
    _, wall, cpu, parts = timed(lambda: query_round(grid, nodes, "query", {"x": 1}))
    return {"wall_s": wall, "cpu_s": cpu, "cpu_by_process": parts["cpu"], "processes": parts["processes"], "vanished": parts["vanished"]}
"""
)

SHEAF_SERVER = (
    SERVER
    + """
from flwr_sheaf.apps.methods import num_nodes
from flwr_sheaf.methods import parse_run_config
from flwr_sheaf.protocol import QUERY, message_type

MODE, REPEAT_TYPE, TIMEOUT = "flwr-sheaf", message_type(QUERY, "sheaf"), 3600.0
STRATEGY = {}


def SEND(grid, msgs):
    # the package's own round trip (flwr_sheaf.strategy.messaging via GraphStrategy.exchange.round_trip)
    return STRATEGY["s"].exchange.round_trip(grid, msgs, TIMEOUT)


def REPEAT_CONFIG(context):
    s = STRATEGY["s"]
    return {**s.query_config(), **s.resume_check}


def FIRST(grid, nodes, context):
    rc = {k: v for k, v in context.run_config.items() if not k.startswith("bench-")}
    config, method = parse_run_config(rc)
    s = STRATEGY["s"] = method.strategy(config, num_nodes(config, method))
    s.discovery_timeout = TIMEOUT
    _, wall, cpu, parts = timed(lambda: s.discover(grid, TIMEOUT))
    assert len(s.nodes) == len(nodes), (len(s.nodes), len(nodes))
    return {"wall_s": wall, "cpu_s": cpu, "cpu_by_process": parts["cpu"], "processes": parts["processes"], "vanished": parts["vanished"]}
"""
)


def write_app(root: Path, mode: str) -> Path:
    """The benchmark's Flower app of ``mode`` (``trivial`` / ``flwr-sheaf``) in ``root/<mode>``."""
    app = root / mode.replace("-", "_")
    pkg = app / "bench_app"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "server.py").write_text(TRIVIAL_SERVER if mode == "trivial" else SHEAF_SERVER)
    clientapp = "bench_app.client:app"
    if mode == "trivial":
        (pkg / "client.py").write_text(TRIVIAL_CLIENT)
    else:
        clientapp = "flwr_sheaf.apps.client_app:app"
    # the package's run-config keys and defaults (its ClientApp's task factory reads them)
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = {**cfg, "bench-supernodes": 0, "bench-out": "", "bench-repeats": 1}
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in cfg.items())
    (app / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["hatchling"]
            build-backend = "hatchling.build"

            [project]
            name = "bench-app"
            version = "1.0.0"
            dependencies = []

            [tool.hatch.build.targets.wheel]
            packages = ["."]

            [tool.flwr.app]
            publisher = "flwr-sheaf-benchmarks"

            [tool.flwr.app.components]
            serverapp = "bench_app.server:app"
            clientapp = "{clientapp}"

            [tool.flwr.app.config]
            """
        )
        + lines
        + "\n"
    )
    return app


def run_one(app: Path, mode: str, n: int, actors: int, args, work: Path) -> dict:
    """``flwr run`` of one app; returns the ServerApp's measurements (raises if the run failed)."""
    out = work / f"{mode}-{n}-{actors}.json"
    home = Path(tempfile.mkdtemp(prefix="flwr-home-", dir=work))
    env = flwr_env(
        home,
        {
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(args.port),
            "FLWR_LOCAL_CONTROL_API_PORT": str(args.port + 2),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    flwr = find_flwr(env)
    rc = {"bench-supernodes": n, "bench-out": str(out), "bench-repeats": args.repeats}
    if mode == "flwr-sheaf":
        rc.update(
            {
                "zoo": f"tiny-{n}",
                "dataset": args.dataset,
                "num-pilots": args.num_pilots,
                "partitioner": "cross-device",
                "graph": "class-overlap-knn:4",
                "discovery-timeout": float(args.timeout),
            }
        )
    cmd = [
        flwr,
        "run",
        str(app),
        "--stream",
        "--federation-config",
        f"num-supernodes={n} client-resources-num-cpus=1 init-args-num-cpus={actors}",
        "--run-config",
        " ".join(f"{k}={json.dumps(v)}" for k, v in rc.items()),
    ]
    log = work / f"{mode}-{n}-{actors}.log"
    t0 = time.monotonic()
    try:
        with open(log, "w") as f:
            subprocess.run(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, check=False
            )
        status = run_status(flwr, env)
    finally:
        stop_superlink(args.port)
        shutil.rmtree(home, ignore_errors=True)
    if status != "finished:completed" or not out.exists():
        raise RuntimeError(f"{mode} N={n} actors={actors}: run status {status}; log {log}")
    res = json.loads(out.read_text())
    res["total_wall_s"] = time.monotonic() - t0
    return res


#: Ray's own helpers that run whatever the app does (dashboard, its agents, the log monitor, the
#: autoscaler monitor): reported by process, left out of the ratio for both apps alike.
APP_PROCESSES = ("simulation", "actors", "ray raylet", "ray gcs_server")


def app_cpu(r: dict) -> float:
    """CPU-seconds of one measured round ``r`` in the processes that carry the messages
    (``APP_PROCESSES``: the simulation process, the actors, Ray's raylet and GCS); Ray's
    background helpers are left out (the same for both apps)."""
    return sum(v for k, v in r["cpu_by_process"].items() if k in APP_PROCESSES)


def best_repeat(repeats: list[dict]) -> dict:
    """The repeat round with the least ``app_cpu``: CPU time only grows under interference (a
    contended core, preemption, Ray's polling while a message waits), so the minimum is the
    round least disturbed by the machine's other work."""
    return min(repeats, key=app_cpu)


def median(xs) -> float:
    """The median of the numbers ``xs`` (the middle one, or the mean of the two middle ones)."""
    return statistics.median(list(xs))


def by_process(r: dict, n: int) -> str:
    """``r``'s CPU-seconds by process as CPU ms per message (the process count where more than one)."""
    procs = r.get("processes", {})
    return ", ".join(
        f"{k}{f' (x{procs[k]})' if procs.get(k, 1) > 1 else ''} {1e3 * v / n:.1f}"
        for k, v in sorted(r["cpu_by_process"].items(), key=lambda kv: -kv[1])
        if 1e3 * v / n >= 0.05
    )


def data_problem(dataset: str) -> str | None:
    """Why the flwr-sheaf app's ``dataset`` cannot be loaded here (None: it can), checked before
    anything starts, where the app's nodes will look (``FLWR_SHEAF_DATA``, this checkout's ``data/``
    unless set, as ``flwr_env`` gives the run). A hub dataset (``hf:``) is not downloaded to check."""
    if dataset.strip().startswith("hf:"):
        return None
    from flwr_sheaf.data.sources import load_source

    os.environ.setdefault("FLWR_SHEAF_DATA", str(ROOT / "data"))
    try:
        load_source(dataset)
    except (FileNotFoundError, ValueError, OSError, ImportError) as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    """Run both apps for each actor count; print per-message CPU and wall, and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--supernodes", type=int, default=1000)
    ap.add_argument("--actors", default="2", help="comma-separated ClientApp actor counts")
    ap.add_argument("--port", type=int, default=39901, help="SuperLink port (control: +2)")
    ap.add_argument("--num-pilots", type=int, default=200)
    ap.add_argument(
        "--dataset", default="fashion-mnist", help="bash scripts/get_data.sh fashion-mnist"
    )
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="repeat rounds per app (each printed; the ratio takes each app's least CPU)",
    )
    ap.add_argument(
        "--apps",
        default="trivial,flwr-sheaf",
        help="comma-separated apps to run (trivial alone: Flower's own scale curve)",
    )
    ap.add_argument(
        "--keep", default=None, help="directory for the apps, logs and JSON (default: temp)"
    )
    args = ap.parse_args(argv)
    if "flwr-sheaf" in args.apps.split(",") and (problem := data_problem(args.dataset)):
        print(
            f"--dataset {args.dataset}: the flwr-sheaf app's data is not usable here: {problem}",
            file=sys.stderr,
        )
        return 2
    busy = [p for p in (args.port, args.port + 2) if listening(p)]
    if busy:
        print(f"port(s) {busy} in use: pick free ones with --port", file=sys.stderr)
        return 2
    work = Path(args.keep or tempfile.mkdtemp(prefix="ray-message-cost-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    modes = [m for m in ("trivial", "flwr-sheaf") if m in args.apps.split(",")]
    if not modes:
        print(f"--apps {args.apps!r}: name trivial and/or flwr-sheaf", file=sys.stderr)
        return 2
    apps = {m: write_app(work / "apps", m) for m in modes}
    n = args.supernodes
    rows = []
    print(
        f"N = {n} SuperNodes, client-resources-num-cpus=1, dataset {args.dataset}, "
        f"{args.num_pilots} pilots (work dir {work})"
    )
    print(
        "| actors | app | first round: CPU ms / msg | wall ms / msg | repeat round: CPU ms / msg "
        "| wall ms / msg | total wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for actors in [int(a) for a in args.actors.split(",")]:
        res = {m: run_one(apps[m], m, n, actors, args, work) for m in modes}
        for r in res.values():
            r["repeat"] = best_repeat(r["repeats"])
        for m, r in res.items():
            each = ", ".join(f"{1e3 * app_cpu(x) / n:.2f}" for x in r["repeats"])
            print(
                f"| {actors} | {m} | {1e3 * app_cpu(r['first']) / n:.1f} "
                f"(all {1e3 * r['first']['cpu_s'] / n:.1f}) | "
                f"{1e3 * r['first']['wall_s'] / n:.1f} | {1e3 * app_cpu(r['repeat']) / n:.2f} "
                f"(all {1e3 * r['repeat']['cpu_s'] / n:.2f}; each {each}; "
                f"median {1e3 * median(app_cpu(x) for x in r['repeats']) / n:.2f}) | "
                f"{1e3 * r['repeat']['wall_s'] / n:.1f} | {r['total_wall_s']:.0f} |",
                flush=True,
            )
        for m, r in res.items():
            print(
                f"|   | {m}: CPU ms / msg by process | {by_process(r['first'], n)} |   | "
                f"{by_process(r['repeat'], n)} |   |   |"
            )
        if len(modes) < 2:
            rows.append({"actors": actors, **res})
            continue
        sheaf, trivial = res["flwr-sheaf"], res["trivial"]
        ratio = {k: app_cpu(sheaf[k]) / app_cpu(trivial[k]) for k in ("first", "repeat")}
        ratio["repeat-median"] = median(app_cpu(x) for x in sheaf["repeats"]) / median(
            app_cpu(x) for x in trivial["repeats"]
        )
        whole = {k: sheaf[k]["cpu_s"] / trivial[k]["cpu_s"] for k in ("first", "repeat")}
        rows.append({"actors": actors, **res, "ratio": ratio, "ratio_whole_tree": whole})
        print(
            f"|   | ratio flwr-sheaf / trivial (CPU of the app's processes) | {ratio['first']:.2f} |"
            f"   | {ratio['repeat']:.2f} (medians: {ratio['repeat-median']:.2f}) |   |   |",
            flush=True,
        )
        print(
            f"|   | ratio with Ray's background helpers (whole tree) | {whole['first']:.2f} |   | "
            f"{whole['repeat']:.2f} |   |   |",
            flush=True,
        )
    (work / "summary.json").write_text(json.dumps(rows, indent=1))
    if len(modes) == 2:
        worst = max(max(r["ratio"]["first"], r["ratio"]["repeat"]) for r in rows)
        print(
            f"worst CPU ratio (first and repeat rounds, app processes) {worst:.2f} (target <= 1.5)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
