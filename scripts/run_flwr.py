#!/usr/bin/env python3
"""Run the app with ``flwr run`` on a private local SuperLink, check the run really finished, clean up.

``flwr run`` exits 0 even when the run failed and leaves its local SuperLink running, so this
wrapper (used by the README's main job and the engine tests):

1. points Flower at a private ``FLWR_HOME`` and non-default ports, with runtime dependency
   installation, telemetry and update checks off (offline, no ``uv sync`` of torch);
2. runs ``flwr run <app> --stream`` with the given run/federation config;
3. reads ``flwr ls --format json`` and fails unless the run's status is ``finished:completed``;
4. stops the SuperLink (and its SuperExec) that step 2 started, with every process under them
   (the simulation process, Ray's GCS, raylet, agents and workers): SIGTERM, 10 s, then SIGKILL.
   Ports already in use are refused before anything starts, so the processes on them at the end
   are this run's own (``--port 0`` picks free ones: what the tests use).

SIGINT (Ctrl-C) or SIGTERM stops the run with ``flwr stop <run-id>`` (its ServerApp then writes the
rounds done and releases results-dir), stops the processes as in step 4, prints how to run again
(``resume=true`` only when the run set ``node-state-dir``: a simulated node keeps its state in
memory only; else ``overwrite=true``, which moves the stopped run's files aside) and exits with
status 130.

Before anything starts, every ``--run-config`` key must be declared in the app's ``pyproject.toml``
(``[tool.flwr.app.config]``): an undeclared key is named, with the closest declared one (Flower
itself refuses such a run with ``[code: 15] Invalid run configuration.``, naming no key).

The Ray cluster is chosen explicitly (flwr_sheaf/tools/ray_cluster.py): ``--ray-address host:port`` runs the
ClientApps on that existing cluster (``auto``: the one ``ray start`` recorded; a Ray GCS must answer
there within seconds, else the run is refused naming what listens; ``init-args-num-cpus/-gpus`` in
``--federation-config`` are refused: each node declares its resources with ``ray start``);
without it the run gets a private local Ray instance (``RAY_ADDRESS=local``) even where a
``ray start`` left its address file (said so), and a ``RAY_ADDRESS`` set in the environment is
refused. A ``flwr run`` that outlives ``--timeout`` is stopped with a message (exit status 1).
Across machines: docs/ray-cluster.md, "A Ray cluster".

Usage: ``python scripts/run_flwr.py [--app .] [--num-supernodes 15] [--cpus-per-client 1]
[--port 29291 | --port 0] [--timeout 900] [--run-config "k=v k2=v2"] [--federation-config "k=v"]
[--ray-address host:port]``
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

# the package's flwr CLI helpers, loaded by path: importing flwr_sheaf would import torch and flwr
# (seconds), which a run refused for a busy port should not wait for
_spec = importlib.util.spec_from_file_location(
    "_flwr_sheaf_flwr_cli", Path(__file__).resolve().parents[1] / "flwr_sheaf/tools/flwr_cli.py"
)
assert _spec is not None and _spec.loader is not None
_flwr_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_flwr_cli)
find_flwr, flwr_env, run_status = _flwr_cli.find_flwr, _flwr_cli.flwr_env, _flwr_cli.run_status
free_port_block, undeclared_keys = _flwr_cli.free_port_block, _flwr_cli.undeclared_keys
last_run, process_tree, stop_processes = (
    _flwr_cli.last_run,
    _flwr_cli.process_tree,
    _flwr_cli.stop_processes,
)

# which Ray cluster the run gets (loaded by path for the same reason)
_spec = importlib.util.spec_from_file_location(
    "_flwr_sheaf_ray_cluster",
    Path(__file__).resolve().parents[1] / "flwr_sheaf/tools/ray_cluster.py",
)
assert _spec is not None and _spec.loader is not None
_ray_cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ray_cluster)
RayClusterError = _ray_cluster.RayClusterError
check_federation_for_cluster = _ray_cluster.check_federation_for_cluster
check_reachable = _ray_cluster.check_reachable
ray_environment = _ray_cluster.ray_environment


def superlink_processes(port: int) -> list[psutil.Process]:
    """The SuperLink, SuperExec and simulation processes whose command line names ``port``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if (
            "flower-superlink" in cmd or "flower-superexec" in cmd or "flwr-simulation" in cmd
        ) and any(t in cmd for t in (f":{port}", f"--port {port}", f":{port + 2}")):
            found.append(p)
    return found


def stop_superlink(port: int, known: list[psutil.Process | subprocess.Popen] | None = None) -> int:
    """Stop the SuperLink on ``port`` and every process under it, and ``known`` (a
    :func:`process_tree` taken earlier: processes whose parent has since ended, e.g. Ray's agents
    after the simulation process): SIGTERM, 10 s, then SIGKILL. Returns how many were signalled."""
    return stop_processes(process_tree(superlink_processes(port)) + list(known or []))


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived (:attr:`signum`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, frame: object) -> None:
    """Raise :class:`Interrupted` once; later signals (a second Ctrl-C, main.sh's SIGTERM) are
    ignored while the run is being stopped."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def run_config_value(app: str, run_config: str, key: str) -> str:
    """``key``'s value in ``--run-config`` (Flower's parser), else the app's pyproject.toml default
    (``""`` when neither has it)."""
    import tomllib

    from flwr.common.config import parse_config_args

    try:
        given = parse_config_args([run_config]) if run_config.strip() else {}
    except Exception:  # noqa: BLE001 - refused before the run started (undeclared_keys)
        given = {}
    if key in given:
        return str(given[key])
    toml = Path(app).expanduser() / "pyproject.toml"
    table = tomllib.loads(toml.read_text()) if toml.is_file() else {}
    return str(table.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}).get(key, ""))


def rerun_advice(out: Path, node_state_dir: str, rerun_as: str, rerun_config: str) -> str:
    """How to run a stopped run again, as a command that works: ``resume=true`` when
    ``out/checkpoint.pkl`` exists and the run kept its node state on disk (``node_state_dir``: a
    simulated node keeps its state in memory only, so without it resuming is refused), else
    ``overwrite=true`` (the stopped run's files moved into ``out/previous-<time>/``) when ``out``
    holds its files, else the command as it was. ``rerun_config`` loses its own resume/overwrite."""
    base = re.sub(r"(?:^|\s)(?:resume|overwrite)=\S+", "", rerun_config).strip()

    def cmd(extra: str) -> str:
        text = f"{base} {extra}".strip()
        quoted = f'"{text}"' if not set(text) & set('"$`\\!') else shlex.quote(text)
        return f"{rerun_as} {quoted}" if text else rerun_as

    if (out / "checkpoint.pkl").is_file() and node_state_dir:
        return f"to continue it from its last checkpoint: {cmd('resume=true')}"
    files = [f for f in ("results.json", "checkpoint.pkl") if (out / f).exists()]
    if not files:
        return f"to run it again: {cmd('')}"
    why = (
        " (resume=true cannot continue it: its nodes kept their state in memory only; set "
        "node-state-dir=<dir> in a run you may want to continue after a stop)"
        if "checkpoint.pkl" in files
        else ""
    )
    return (
        f"to run it again{why}: {cmd('overwrite=true')} (moves its {', '.join(files)} into "
        f"{out}/previous-<time>/)"
    )


def stop_interrupted(
    flwr: str, env: dict[str, str], port: int, child: subprocess.Popen, grace: float = 30.0
) -> str:
    """After SIGINT/SIGTERM: ``flwr stop`` the run (its ServerApp writes the rounds done and
    releases results-dir), wait up to ``grace`` s for its simulation process, then stop every
    process this run started (:func:`stop_superlink`, the tree taken before anything was stopped,
    and the ``flwr run`` CLI). Returns what was done, in one sentence."""
    known: list[psutil.Process | subprocess.Popen] = [
        *process_tree(superlink_processes(port)),
        child,
    ]
    what = "no run was listed yet"
    try:
        run = last_run(flwr, env, timeout=grace)
    except subprocess.TimeoutExpired:
        run = {}
    run_id = run.get("run-id")
    if run_id and not run.get("status", "").startswith("finished"):
        try:
            subprocess.run(
                [flwr, "stop", run_id], env=env, capture_output=True, text=True, timeout=grace
            )
            what = f"run {run_id} stopped (flwr stop)"
        except subprocess.TimeoutExpired:
            what = f"flwr stop {run_id} did not answer within {grace:g} s"
        sims = [
            p
            for p in known
            if isinstance(p, psutil.Process) and "flwr-simulation" in " ".join(_cmdline(p))
        ]
        deadline = time.monotonic() + grace  # a finished one may linger as a zombie: done too
        while time.monotonic() < deadline and any(_running(p) for p in sims):
            time.sleep(0.2)
    elif run_id:
        what = f"run {run_id} had already ended ({run.get('status')})"
    n = stop_superlink(port, known)
    return f"{what}; {n} process(es) it started stopped"


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def parse_federation(text: str) -> dict[str, str]:
    """``--federation-config`` items ``"k=v k2=v2"`` as ``{key: value}`` (values kept as written).

    Raises:
        RayClusterError: an item without ``=`` (named).
    """
    out: dict[str, str] = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RayClusterError(
                f"--federation-config item {item!r}: expected key=value (e.g. init-args-num-cpus=2)"
            )
        out[key] = value
    return out


def last_status(flwr: str, env: dict[str, str]) -> str:
    """The run's status from ``flwr ls`` (:func:`run_status`), or why it is unknown: ``flwr ls``
    that does not answer within its own time limit is said, not raised."""
    try:
        return str(run_status(flwr, env))
    except subprocess.TimeoutExpired as exc:
        return f"unknown (`flwr ls` did not answer within {exc.timeout:g} s)"


def timeout_message(timeout: float, status: str, ray_address: str | None) -> str:
    """What the user reads when ``flwr run`` outlived ``--timeout`` (it was killed; the SuperLink is
    stopped next): the limit, the run's last status, and where to look."""
    where = (
        f"the Ray cluster at {ray_address} (is every node up? `ray status --address {ray_address}`)"
        if ray_address
        else "a private local Ray instance"
    )
    return (
        f"flwr run did not finish within --timeout {timeout:g} s and was stopped (run status: "
        f"{status}; its ClientApps ran on {where}). A larger run needs a larger --timeout; a run "
        "that never started waits for SuperNodes or Ray: see the output above"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--app", default=".")
    ap.add_argument(
        "--num-supernodes",
        type=int,
        default=15,
        help="0 = set neither num-supernodes nor client-resources-* (Flower's default local simulation: 2 SuperNodes)",
    )
    ap.add_argument("--cpus-per-client", type=int, default=1)
    ap.add_argument(
        "--gpus-per-client",
        type=float,
        default=0.0,
        help="Ray GPU share per ClientApp (e.g. 0.1: ten ClientApps share one GPU; docs/devices.md)",
    )
    ap.add_argument(
        "--port",
        type=int,
        default=29291,
        help="SuperLink HTTP port (control = port + 2); 0 = pick free ports",
    )
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--run-config", default="")
    ap.add_argument(
        "--federation-config",
        default="",
        help="further Flower federation settings 'k=v k2=v2' (e.g. init-args-num-cpus=2, verbose=true); "
        "num-supernodes and client-resources-* come from the options above",
    )
    ap.add_argument(
        "--ray-address",
        default=None,
        help="run the ClientApps on this existing Ray cluster (host:port of its head's GCS, the "
        "--port of `ray start --head`; auto: the one `ray start` recorded on this machine); "
        "default: a private local Ray instance (docs/tutorial.md)",
    )
    ap.add_argument("--flwr-home", default=None, help="default: a fresh temporary directory")
    ap.add_argument(
        "--rerun-as",
        default=None,
        help="the command (without its run config) that the advice after an interruption names "
        "(default: this script with these options; scripts/main.sh passes itself)",
    )
    ap.add_argument(
        "--rerun-config",
        default=None,
        help="the run config that advice shows (default: --run-config)",
    )
    args = ap.parse_args(argv)

    try:
        federation = parse_federation(args.federation_config)
        ray_vars, note = ray_environment(args.ray_address)
        if args.ray_address is not None:  # `auto` resolved to the recorded host:port
            args.ray_address = ray_vars["RAY_ADDRESS"]
            check_federation_for_cluster(federation, args.ray_address)
            check_reachable(args.ray_address)
    except RayClusterError as exc:
        print(exc, file=sys.stderr)
        return 2
    if note:
        print(note, flush=True)
    try:  # keys the app does not declare: Flower's refusal would name none of them
        bad = undeclared_keys(args.app, args.run_config)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 2
    if args.port == 0:
        args.port = free_port_block(3)
        print(
            f"picked free ports {args.port} (SuperLink) and {args.port + 2} (control)", flush=True
        )
    busy = [p for p in (args.port, args.port + 2) if listening(p)]
    if busy:  # another SuperLink (perhaps another user's): never run on it, never stop it
        print(
            f"port(s) {busy} already in use on 127.0.0.1 (another SuperLink or flwr run?): pick "
            f"free ports with --port N (SuperLink N, control N + 2; scripts/main.sh: "
            f"FLWR_SHEAF_PORT=N bash scripts/main.sh)",
            file=sys.stderr,
        )
        return 2
    home = Path(args.flwr_home) if args.flwr_home else Path(tempfile.mkdtemp(prefix="flwr-home-"))
    env = flwr_env(
        home,
        {
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(args.port),
            "FLWR_LOCAL_CONTROL_API_PORT": str(args.port + 2),
            **ray_vars,
        },
    )
    try:
        flwr = find_flwr(env)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.gpus_per_client > 0 and args.ray_address is None:  # a cluster's GPUs are on its nodes
        import torch  # Ray would fail with "ActorPool is empty" and flwr run would still exit 0

        if not torch.cuda.is_available():
            print(
                f"--gpus-per-client={args.gpus_per_client}: torch sees no CUDA device on this machine; "
                "use --gpus-per-client 0 (device=auto then runs on the CPU)",
                file=sys.stderr,
            )
            return 2
    cmd = [flwr, "run", args.app, "--stream"]
    if args.num_supernodes > 0:
        federation = {
            "num-supernodes": str(args.num_supernodes),
            "client-resources-num-cpus": str(args.cpus_per_client),
            **(
                {"client-resources-num-gpus": str(args.gpus_per_client)}
                if args.gpus_per_client > 0
                else {}
            ),
            **federation,
        }
    if federation:
        cmd += ["--federation-config", " ".join(f"{k}={v}" for k, v in federation.items())]
    if args.run_config:
        cmd += ["--run-config", args.run_config]
    where = (
        f"Ray cluster {args.ray_address}" if args.ray_address else "a private local Ray instance"
    )
    print(f"+ RAY_ADDRESS={ray_vars['RAY_ADDRESS']} ({where})", flush=True)
    print("+", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    old_handlers = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # its own session: a Ctrl-C reaches this script, which stops the run, not the CLI halfway
    child = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        try:
            rc = child.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            stop_processes([child])
            status = last_status(flwr, env)
            print(timeout_message(args.timeout, status, args.ray_address), file=sys.stderr)
            return 1
        except Interrupted as exc:
            print(f"{exc}: stopping the run and the processes it started ...", flush=True)
            done = stop_interrupted(flwr, env, args.port, child)
            out = Path(run_config_value(args.app, args.run_config, "results-dir")).expanduser()
            rerun_as = args.rerun_as or shlex.join(
                ["python", "scripts/run_flwr.py", *_without_run_config(argv)]
            )
            advice = rerun_advice(
                out.resolve(),
                run_config_value(args.app, args.run_config, "node-state-dir"),
                rerun_as + ("" if args.rerun_as else " --run-config"),
                args.run_config if args.rerun_config is None else args.rerun_config,
            )
            print(f"interrupted ({exc}): {done}; {advice}", file=sys.stderr, flush=True)
            return 128 + exc.signum
        wall = time.monotonic() - t0
        status = last_status(flwr, env)
        print(f"flwr run exit code {rc}; run status: {status}; wall time {wall:.1f} s", flush=True)
        return 0 if status == "finished:completed" else 1
    finally:
        n = stop_superlink(args.port)
        print(f"stopped {n} Flower process(es) on port {args.port}", flush=True)
        if not args.flwr_home:
            shutil.rmtree(home, ignore_errors=True)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


def _without_run_config(argv: list[str] | None) -> list[str]:
    """The command-line options of this run without ``--run-config`` and the rerun options."""
    args = list(sys.argv[1:] if argv is None else argv)
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--run-config", "--rerun-as", "--rerun-config"):
            skip = "=" not in a
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
