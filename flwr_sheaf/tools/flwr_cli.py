"""Helpers of the tools that drive Flower 1.42's ``flwr`` CLI (``scripts/run_flwr.py``,
:mod:`flwr_sheaf.tools.deploy_local`): environment, executables, free ports, run status (``flwr run``
exits 0 even when the run failed; docs/deployment.md), stopping exactly the processes a tool started.
Standard library and ``psutil`` only: ``scripts/run_flwr.py`` loads this file by path (no torch).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

#: the optional-dependency group of pyproject.toml that the tools need
EXTRA = "deploy"


def missing(package: str) -> str:
    """The ``ImportError`` message for a missing ``package`` of the extra (names the pip command)."""
    return (
        f"flwr_sheaf.tools needs {package!r}, which is not installed: "
        f"pip install 'flwr-sheaf[{EXTRA}]' (the optional {EXTRA!r} extra: cryptography, psutil)"
    )


try:
    import psutil
except ImportError as e:  # the optional deploy extra
    raise ImportError(missing("psutil")) from e

__all__ = [
    "CHECKOUT",
    "EXTRA",
    "missing",
    "flwr_env",
    "find_flwr",
    "free_port_block",
    "last_run",
    "process_tree",
    "run_status",
    "stop_processes",
    "undeclared_keys",
]

#: the repository this package was imported from (``flwr_sheaf/tools/`` is two levels below it)
CHECKOUT = Path(__file__).resolve().parents[2]


def flwr_env(home: str | Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for Flower CLI and server processes: ``FLWR_HOME=home``, ``extra`` on top.

    Returns:
        A copy of ``os.environ`` with ``FLWR_HOME``, telemetry, update check and runtime dependency
        installation off, ``RAY_DEDUP_LOGS=0``, ``FLWR_SHEAF_DATA`` (default :data:`CHECKOUT`'s
        ``data/``) and this interpreter's ``bin`` first on ``PATH`` (Flower spawns its executables
        by name).
    """
    env = dict(os.environ)
    env.update(
        {
            "FLWR_HOME": str(home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "RAY_DEDUP_LOGS": "0",
            # named datasets (dataset=fashion-mnist): `flwr run` may import the app from its FAB copy,
            # whose location says nothing about this checkout's data/ folder
            "FLWR_SHEAF_DATA": os.environ.get("FLWR_SHEAF_DATA", str(CHECKOUT / "data")),
            "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
        }
    )
    env.update(extra or {})
    return env


def free_port_block(width: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port ``P`` with ``P .. P + width - 1`` all free on ``host`` now (each bound once and
    released), from the OS's ephemeral range: what ``--port 0`` picks.

    Raises:
        RuntimeError: no such block found in ``tries`` draws.
    """
    import socket

    for _ in range(tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + width - 1 > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + width):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return base
    raise RuntimeError(f"no block of {width} free ports found on {host} in {tries} tries")


def undeclared_keys(app: str | Path, run_config: str | list[str]) -> list[str]:
    """One line per ``--run-config`` key (a text, a list of texts, or a ``.toml`` file's keys)
    that the app's ``pyproject.toml`` does not declare in ``[tool.flwr.app.config]``, naming the
    closest declared key and the fix (Flower 1.42 refuses such a run naming no key). Empty when
    every key is declared or there is no pyproject.toml.

    Raises:
        ValueError: ``run_config`` does not parse (Flower's own parser, its text kept).
    """
    import difflib
    import tomllib

    from flwr.common.config import flatten_dict, parse_config_args

    toml = Path(app).expanduser() / "pyproject.toml"
    texts = [run_config] if isinstance(run_config, str) else list(run_config)
    if not any(t.strip() for t in texts) or not toml.is_file():
        return []
    try:
        given = parse_config_args(texts)
    except Exception as exc:  # click / TOML errors with Flower's text
        raise ValueError(f"--run-config {run_config!r} does not parse: {exc}") from None
    app_table = tomllib.loads(toml.read_text()).get("tool", {}).get("flwr", {}).get("app", {})
    declared = flatten_dict(app_table.get("config", {}))
    out = []
    for key in sorted(set(given) - set(declared)):
        close = difflib.get_close_matches(key, list(declared), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        out.append(
            f"--run-config key {key!r}{hint} is not declared in {toml} [tool.flwr.app.config]: "
            f"Flower would refuse the run ('Invalid run configuration', naming no key); declare it "
            f"there with its default (e.g. {key} = ...) or fix its name"
        )
    return out


def find_flwr(env: dict[str, str], name: str = "flwr") -> str:
    """Path of the Flower executable ``name`` on ``env["PATH"]``.

    Raises:
        FileNotFoundError: not installed in this environment (install the package first, README).
    """
    exe = shutil.which(name, path=env["PATH"])
    if exe is None:
        raise FileNotFoundError(f"{name} not found on PATH: install the package first (README)")
    return exe


def last_run(
    flwr: str,
    env: dict[str, str],
    connection: str | None = None,
    run_id: int | None = None,
    timeout: float = 120.0,
) -> dict[str, str]:
    """Run ``run_id`` (default: the last) as ``flwr ls [connection] [--run-id ID] --format json``
    lists it (``"run-id"``, ``"status"``, ...); ``{}`` when none is listed or no JSON came.

    Raises:
        subprocess.TimeoutExpired: the CLI did not answer within ``timeout`` seconds.
    """
    cmd = [flwr, "ls"] + ([connection] if connection else []) + ["--format", "json"]
    if run_id is not None:
        cmd += ["--run-id", str(run_id)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout).stdout
    try:
        runs = list(json.loads(out).get("runs", []))
    except (json.JSONDecodeError, AttributeError):
        runs = []
    return {str(k): str(v) for k, v in runs[-1].items()} if runs else {}


def run_status(
    flwr: str,
    env: dict[str, str],
    connection: str | None = None,
    run_id: int | None = None,
    timeout: float = 120.0,
) -> str:
    """Status of :func:`last_run` (its Raises), e.g. ``"finished:completed"``, or ``"no run found"``."""
    return last_run(flwr, env, connection, run_id, timeout).get("status", "no run found")


def process_tree(roots: Iterable[psutil.Process | subprocess.Popen | int]) -> list[psutil.Process]:
    """``roots`` and all their descendants now (each once, roots first), taken before anything is
    stopped so that orphans (Ray's GCS, raylet, ...) stay known; a reused pid is left out."""
    out: dict[int, psutil.Process] = {}
    for p in roots:
        try:
            pid = p.pid if isinstance(p, subprocess.Popen) else p
            root = p if isinstance(p, psutil.Process) else psutil.Process(int(pid))
            if not root.is_running():
                continue
            for q in [root] + root.children(recursive=True):
                out.setdefault(q.pid, q)
        except psutil.NoSuchProcess:
            continue
    return list(out.values())


def stop_processes(
    procs: Iterable[psutil.Process | subprocess.Popen | int],
    timeout: float = 10.0,
    first: signal.Signals = signal.SIGTERM,
) -> int:
    """Stop exactly ``procs`` and their descendants (:func:`process_tree`; none chosen by name):
    ``first`` (SIGTERM; SIGKILL for a crash), wait up to ``timeout`` s, then SIGKILL.

    Returns:
        Number of processes that were still alive and got signalled.
    """
    procs = list(procs)
    alive = []
    for q in process_tree(procs):
        with contextlib.suppress(psutil.NoSuchProcess):
            q.send_signal(first)
            alive.append(q)
    own = {p.pid: p for p in procs if isinstance(p, subprocess.Popen)}

    def wait(qs: list[psutil.Process]) -> list[psutil.Process]:
        # our own children are reaped by their Popen, which keeps the exit status (-9, -15):
        # psutil reaping them would leave Popen.returncode 0, a crash looking like a clean exit
        _, still = psutil.wait_procs([q for q in qs if q.pid not in own], timeout=timeout)
        for q in qs:
            if q.pid in own:
                try:
                    own[q.pid].wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    still.append(q)
        return still

    still = wait(alive)
    for q in still:
        with contextlib.suppress(psutil.NoSuchProcess):
            q.kill()
    wait(still)
    for p in procs:  # reap our direct children (no zombies left behind)
        if isinstance(p, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=1)
    return len(alive)


def main(argv: list[str] | None = None) -> int:
    """``python -m flwr_sheaf.tools.flwr_cli [APP] --run-config "k=v ..."``: :func:`undeclared_keys`
    on stderr. Returns 0 when every key is declared, else 2 (also no pyproject.toml, unparsable)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flwr_sheaf.tools.flwr_cli")
    parser.add_argument("app", nargs="?", default=".", help="the app's folder (default: .)")
    parser.add_argument(  # repeatable, as flwr run's
        "--run-config", "-c", action="append", default=[], help='as for `flwr run`, e.g. "lr=0.1"'
    )
    args = parser.parse_args(argv)
    toml = Path(args.app).expanduser() / "pyproject.toml"
    try:
        bad = undeclared_keys(args.app, args.run_config) if toml.is_file() else [f"no {toml}"]
    except ValueError as exc:
        bad = [str(exc)]
    print("\n".join(bad) or f"every --run-config key is declared in {toml}", file=sys.stderr)
    return 2 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
