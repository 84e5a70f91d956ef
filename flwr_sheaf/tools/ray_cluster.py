"""Which Ray cluster a ``flwr run`` simulation runs on: an existing one only when asked for.

For ``scripts/run_flwr.py`` (which loads this file by path): the ``RAY_ADDRESS`` a run gets, the
federation settings Ray refuses on a cluster, and a check that a Ray GCS answers (pitfalls:
docs/ray-cluster.md, "A Ray cluster"). As a script: ``free-ports N`` prints N free TCP ports;
``stop --temp-dir DIR`` stops exactly the Ray processes of ``ray start --temp-dir DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import ipaddress
import os
import re
import socket
import sys
import time
from pathlib import Path

if __package__:  # imported as flwr_sheaf.tools.ray_cluster
    from ..engine import ray_address_file
else:  # loaded by path (scripts/run_flwr.py): Ray's address-file rule from flwr_sheaf/engine.py,
    # without importing the package (torch, flwr) to start a run
    _spec = importlib.util.spec_from_file_location(
        "_flwr_sheaf_engine", Path(__file__).resolve().parents[1] / "engine.py"
    )
    assert _spec is not None and _spec.loader is not None
    _engine = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_engine)
    ray_address_file = _engine.ray_address_file

__all__ = [
    "CLUSTER_CONFLICTS",
    "RayClusterError",
    "check_federation_for_cluster",
    "check_reachable",
    "cluster_processes",
    "describe_listener",
    "free_ports",
    "gcs_answers",
    "parse_address",
    "ray_address_file",
    "ray_environment",
    "resolve_address",
    "shared_temp_dir_problem",
    "stop_cluster",
]

#: the gRPC method every Ray client calls first on a GCS (Ray 2.55): answered only by a GCS
GCS_HANDSHAKE = "/ray.rpc.NodeInfoGcsService/GetClusterId"

#: environment variable: ``1`` checks only a TCP connection, not :data:`GCS_HANDSHAKE` (as does
#: ``RAY_USE_TLS=1``, which this plain-text probe cannot speak)
SKIP_PROBE_ENV = "FLWR_SHEAF_SKIP_GCS_PROBE"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


#: Federation-config keys (Flower 1.42 ``--federation-config``) that ``ray.init`` refuses when it
#: connects to an existing cluster, with the per-node ``ray start`` option that replaces each.
CLUSTER_CONFLICTS = {
    "init-args-num-cpus": "ray start --num-cpus N",
    "init-args-num-gpus": "ray start --num-gpus N",
}


class RayClusterError(ValueError):
    """A run's Ray cluster settings that cannot work; the message names the setting and the fix."""


def parse_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a Ray GCS address ``host:port`` (e.g. ``10.0.0.5:6379``).

    Raises:
        RayClusterError: not ``host:port`` (e.g. a URL or a Ray Client ``ray://`` address).
    """
    scheme = address.split("://", 1)[0].lower()
    if scheme in ("http", "https"):
        raise RayClusterError(
            f"--ray-address {address!r}: an {scheme}:// URL (the Ray dashboard's, or another web "
            "service's), not a Ray cluster address; give the GCS address host:port that "
            "`ray start --head` printed (its --port, e.g. 10.0.0.5:6379; not the dashboard's port), "
            "without http://"
        )
    if "://" in address:
        raise RayClusterError(
            f"--ray-address {address!r}: give the cluster's GCS address host:port (what "
            "`ray start --head` prints after `ray start --address=`), not a Ray Client ray:// "
            "address; run `flwr run` on a machine that can reach every Ray node (docs/tutorial.md)"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RayClusterError(
            f"--ray-address {address!r}: expected host:port of the Ray head's GCS, e.g. "
            "10.0.0.5:6379 (the --port of `ray start --head`), or `auto` for the cluster that "
            "`ray start` recorded on this machine"
        )
    if not 1 <= int(port) <= 65535:
        raise RayClusterError(
            f"--ray-address {address!r}: port {port} is not a TCP port (1..65535); give the --port "
            "that `ray start --head` was started with, e.g. 10.0.0.5:6379"
        )
    return host.strip("[]"), int(port)


def _recorded_cluster(env: dict[str, str] | None) -> tuple[Path, str]:
    """:func:`ray_address_file` and the address it records (``""`` when there is none)."""
    f = ray_address_file(env)
    return f, (f.read_text().strip() if f.is_file() else "")


def resolve_address(address: str, env: dict[str, str] | None = None) -> str:
    """``address`` as ``host:port``: ``auto`` becomes the address in :func:`ray_address_file`
    (located by ``env``, default ``os.environ``); anything else is checked and returned as given.

    Raises:
        RayClusterError: ``auto`` with no recorded cluster (the file named), or a malformed address.
    """
    if address == "auto":
        f, recorded = _recorded_cluster(env)
        if not recorded:
            raise RayClusterError(
                f"--ray-address auto: no Ray cluster is recorded on this machine ({f} does not "
                "exist: `ray start` writes it); give the head's address host:port, e.g. "
                "--ray-address 10.0.0.5:6379, or drop --ray-address to run on a private local Ray "
                "instance"
            )
        parse_address(recorded)
        return recorded
    parse_address(address)
    return address


def describe_listener(host: str, port: int, timeout: float = 1.0) -> str:
    """A phrase (maybe empty; never raises) on what listens at ``host:port``: the local process
    when visible, and how it answers an HTTP request within ``timeout`` s."""
    parts: list[str] = []
    try:
        import psutil

        # a process of this machine only when the address is this machine's (else the same port
        # number here says nothing about the remote host)
        here = {a.address.split("%")[0] for nic in psutil.net_if_addrs().values() for a in nic}
        asked = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        local = any(ipaddress.ip_address(a).is_loopback or a in here for a in asked)
        for conn in psutil.net_connections(kind="tcp") if local else ():
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                if conn.pid:
                    p = psutil.Process(conn.pid)
                    parts.append(f"process {p.name()} (pid {conn.pid}) listens on port {port}")
                break
    except Exception:  # noqa: BLE001 - another user's sockets, no psutil: say less
        pass
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(f"HEAD / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            reply = s.recv(512)
        if reply.startswith(b"HTTP/"):
            head = reply.decode("latin-1").splitlines()
            server = next((h for h in head if h.lower().startswith("server:")), "")
            parts.append(
                f"it answers HTTP ({head[0].strip()}{'; ' + server.strip() if server else ''})"
            )
        elif len(reply) >= 9 and reply[3] == 4:  # an HTTP/2 SETTINGS frame: gRPC's transport
            parts.append("it speaks HTTP/2 (a gRPC server)")
        elif reply:
            parts.append(f"it answers {reply[:40]!r}")
        else:
            parts.append("it closes the connection without a word")
    except TimeoutError:
        parts.append("it accepts connections but answers nothing")
    except OSError as exc:
        parts.append(f"a second connection failed ({exc})")
    return "; ".join(parts)


def gcs_answers(address: str, timeout: float = 5.0) -> str | None:
    """None when a Ray GCS answers at ``host:port`` within ``timeout`` s, else why not (a phrase).

    The probe is :data:`GCS_HANDSHAKE` over gRPC (``UNAUTHENTICATED`` counts as a GCS). Like Ray's
    own channels it ignores web proxies unless ``RAY_grpc_enable_http_proxy=1``. With
    ``RAY_USE_TLS=1`` or :data:`SKIP_PROBE_ENV` only a TCP connection is checked.

    Raises:
        RayClusterError: ``address`` is not ``host:port``.
    """
    host, port = parse_address(address)
    if _truthy(os.environ.get(SKIP_PROBE_ENV)) or _truthy(os.environ.get("RAY_USE_TLS")):
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return None
        except OSError as exc:
            return f"nothing accepts TCP connections there ({exc})"
    import grpc  # Ray's and Flower's dependency; imported here: only a run on a cluster needs it

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    proxy = int(os.environ.get("RAY_grpc_enable_http_proxy", "0").lower() in ("1", "true"))
    channel = grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", proxy)])
    try:
        call = channel.unary_unary(GCS_HANDSHAKE)
        call(b"", timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return None
        details = exc.details()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no answer to Ray's GCS handshake within {timeout:g} s"
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return f"a gRPC server that is not a Ray GCS answers ({code.name}: {details})"
        if "Connection refused" in (details or ""):
            return "nothing listens there (connection refused)"
        if "HTTP/2" in (details or ""):
            return "not a gRPC server: it does not speak HTTP/2"
        return f"no gRPC answer ({code.name}: {details})"
    finally:
        channel.close()
    return None


def _ray_version() -> str:
    """This environment's Ray version (without importing Ray), or ``"?"``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError:
        return "?"


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Check that a Ray GCS answers at ``host:port``: a TCP connection, then :func:`gcs_answers`
    (each within ``timeout`` s).

    Raises:
        RayClusterError: nothing answers, or something that is not a Ray GCS does (named, with how
            to start the head).
    """
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        start = (
            f"`ray start --head --port {port}` on {host} (and open that port to this machine)"
            if port >= 1024
            else f"`ray start --head --port N` on {host}, N a free unprivileged port (port {port} "
            "is below 1024, reserved to the system): `python flwr_sheaf/tools/ray_cluster.py "
            "free-ports 1` prints one; then --ray-address host:N"
        )
        raise RayClusterError(
            f"--ray-address {address}: no Ray cluster answers there ({exc}); start its head with "
            f"{start}, or drop --ray-address to run on a private local Ray instance "
            "(docs/tutorial.md)"
        ) from exc
    why = gcs_answers(address, timeout)
    if why is not None:
        what = describe_listener(host, port)
        raise RayClusterError(
            f"--ray-address {address}: something listens there but it is not a Ray cluster's GCS "
            f"({why}{'; ' + what if what else ''}); give the --port that `ray start --head` "
            f"printed (its GCS, e.g. 6379; not the dashboard's or the Ray Client's port), or start "
            f"a head on a free port: `ray start --head --port N` (docs/ray-cluster.md, 'A Ray cluster'). "
            f"If it is a Ray head of another Ray than this one's {_ray_version()} (the cluster "
            f"must run the same Ray anyway), {SKIP_PROBE_ENV}=1 checks only that it accepts "
            "connections"
        )


def check_federation_for_cluster(federation: dict[str, str], address: str) -> None:
    """Refuse ``--federation-config`` items (``{key: value}``) that Ray refuses on the cluster at
    ``address``.

    Raises:
        RayClusterError: one of :data:`CLUSTER_CONFLICTS` is set (named, with its ``ray start`` option).
    """
    bad = {k: v for k, v in federation.items() if k in CLUSTER_CONFLICTS}
    if bad:
        items = ", ".join(f"{k}={v}" for k, v in bad.items())
        fixes = "; ".join(f"{k}: `{CLUSTER_CONFLICTS[k]}` on each node" for k in bad)
        raise RayClusterError(
            f"--federation-config {items} with --ray-address {address}: Ray refuses num_cpus/"
            "num_gpus when it joins an existing cluster (ValueError: When connecting to an "
            "existing cluster, num_cpus and num_gpus must not be provided); a cluster's resources "
            f"are declared where each node starts ({fixes}); drop {', '.join(bad)}"
        )


def ray_environment(
    ray_address: str | None, env: dict[str, str] | None = None, probe_timeout: float = 2.0
) -> tuple[dict[str, str], str | None]:
    """The Ray variables for a simulation's environment (inheriting ``env``, default ``os.environ``)
    on ``ray_address`` (``host:port``, ``auto`` or None: a private local instance), and a note for the
    user or None; ``probe_timeout`` bounds the wait for a GCS at a recorded address.

    Returns:
        ``({"RAY_ADDRESS": host:port or "local"}, note)``; ``note`` names a recorded cluster this
        run does not join (how to join it), or says the recorded file is stale.

    Raises:
        RayClusterError: an inherited ``RAY_ADDRESS`` (not ``local``) without or unlike
            ``ray_address``; a malformed address or ``auto`` with no recorded cluster;
            ``RAY_ADDRESS=auto`` whose recorded cluster does not answer.
    """
    env = dict(os.environ) if env is None else env
    inherited = env.get("RAY_ADDRESS", "")
    if ray_address is not None:
        resolved = resolve_address(ray_address, env)
        if inherited and inherited not in ("local", ray_address, resolved):
            if inherited != "auto" or resolve_address("auto", env) != resolved:
                raise RayClusterError(
                    f"RAY_ADDRESS={inherited} is set in the environment and --ray-address "
                    f"{ray_address} was given: unset RAY_ADDRESS or pass the same address"
                )
        return {"RAY_ADDRESS": resolved}, None
    if inherited and inherited != "local":
        advice = _auto_advice(env, probe_timeout) if inherited == "auto" else inherited
        raise RayClusterError(
            f"RAY_ADDRESS={inherited} is set in the environment: the simulation would join that Ray "
            f"cluster although --ray-address was not given; pass --ray-address {advice} to run "
            "on it, or `unset RAY_ADDRESS` to run on a private local Ray instance"
        )
    note = None
    f = ray_address_file(env)
    if f.is_file():
        recorded = f.read_text().strip()
        why = _gone(recorded, probe_timeout)
        if why is None:
            note = (
                f"note: {f} (left by `ray start`) names a Ray cluster at {recorded}; a plain "
                "`flwr run` would join it. This run starts its own local Ray instance "
                f"(RAY_ADDRESS=local); to run on that cluster pass --ray-address {recorded}"
            )
        else:
            note = (
                f"note: {f} (left by a `ray start`) names a Ray cluster at {recorded} that is gone "
                f"({why}): a stale file, on which a plain `flwr run` would wait to join a dead "
                "cluster and never start. This run starts its own local Ray instance "
                f"(RAY_ADDRESS=local); delete the file if nobody uses it: rm {f}"
            )
    return {"RAY_ADDRESS": "local"}, note


def _gone(recorded: str, probe_timeout: float) -> str | None:
    """Why no Ray GCS answers at the ``recorded`` address (:func:`gcs_answers`), or None when one does."""
    try:
        return gcs_answers(recorded, probe_timeout)
    except RayClusterError:
        return "not a host:port address"


def _auto_advice(env: dict[str, str], probe_timeout: float) -> str:
    """``--ray-address`` advice for an inherited ``RAY_ADDRESS=auto``; RayClusterError when no
    cluster is recorded or the recorded one is gone (never advise ``--ray-address auto`` then)."""
    f, recorded = _recorded_cluster(env)
    if not recorded:
        raise RayClusterError(
            f"RAY_ADDRESS=auto is set in the environment but no Ray cluster is recorded on "
            f"this machine ({f} does not exist): `unset RAY_ADDRESS` to run on a private "
            "local Ray instance, or pass --ray-address host:port of a running cluster"
        )
    why = _gone(recorded, probe_timeout)
    if why is not None:  # advising --ray-address auto would be refused: it is gone
        raise RayClusterError(
            f"RAY_ADDRESS=auto is set in the environment, but the Ray cluster recorded in "
            f"{f} (left by a `ray start`) at {recorded} is gone ({why}): a stale file, "
            f"delete it if nobody uses it (rm {f}); `unset RAY_ADDRESS` to run on a private "
            "local Ray instance, or start a cluster first (ray start --head)"
        )
    return f"auto (the cluster at {recorded} recorded in {f})"


# ------------------------------------------------------------------ the shared-machine recipe


#: Most ports one ``free-ports`` call holds open at once (each is a file descriptor).
MAX_FREE_PORTS = 256


def _ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's ``ip_local_port_range``, else IANA's)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 49152, 65535
    return lo, hi


#: ``ray start``'s default ``--min-worker-port`` / ``--max-worker-port``: a component port there is refused
RAY_WORKER_PORTS = (10002, 19999)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports in 1024..65535 free now (bound together, then released), outside
    the OS's ephemeral range (an outgoing connection could take one) and :data:`RAY_WORKER_PORTS`.

    Raises:
        ValueError: ``n`` outside 1..MAX_FREE_PORTS, or not that many free ports (named).
    """
    import random

    if not 1 <= n <= MAX_FREE_PORTS:
        raise ValueError(f"free-ports {n}: ask for 1 to {MAX_FREE_PORTS} ports")
    lo, hi = _ephemeral_range()
    wlo, whi = RAY_WORKER_PORTS
    candidates = [p for p in range(1024, 65536) if not (lo <= p <= hi or wlo <= p <= whi)]
    random.SystemRandom().shuffle(candidates)  # not a run's draw: any free port will do
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            if len(socks) == n:
                return [s.getsockname()[1] for s in socks]
        raise ValueError(f"free-ports {n}: only {len(socks)} free ports outside {lo}..{hi}")
    finally:
        for s in socks:
            s.close()


def _is_ray(cmd: list[str]) -> bool:
    """Whether a command line is a Ray process's (a program under a ``ray/`` directory, ``-m ray...``,
    a worker ``ray::...``), not a shell or editor naming the temp dir."""
    sep = os.sep
    return any(f"{sep}ray{sep}" in a or a.startswith(("ray.", "ray::")) for a in cmd)


def cluster_processes(temp_dir: str | Path) -> list:
    """The live processes (``psutil.Process``) of the Ray node(s) of ``ray start --temp-dir temp_dir``: this
    user's Ray processes whose command line names that directory as a whole path (``/tmp/ray-a``
    matches neither ``/tmp/ray-ab`` nor ``/tmp/ray-a/node2``), the head's Ray Client server (by the
    recorded GCS address), and their descendants; never this process or its parents."""
    import psutil

    mark = str(Path(temp_dir).resolve())
    # as given (made absolute) and resolved: /tmp may be a link; a whole path, not a prefix
    spellings = sorted({mark, os.path.abspath(temp_dir)}, key=len, reverse=True)
    # what Ray keeps in its temp dir is under session_*: DIR/node2/... is another cluster's
    names_dir = re.compile(
        "(?:" + "|".join(map(re.escape, spellings)) + r")(?=/?$|/?[\s'\",;:=]|/session_)"
    )
    # the head's Ray Client server names only the GCS address, which the temp dir records
    recorded = Path(mark) / "ray_current_cluster"
    gcs = recorded.read_text().strip() if recorded.is_file() else ""
    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    uid = os.getuid() if hasattr(os, "getuid") else None
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline", "uids"]):
        try:
            if uid is not None and p.info["uids"] is not None and p.info["uids"].real != uid:
                continue
            cmd = p.info["cmdline"] or []
            if p.pid not in me and (
                (_is_ray(cmd) and any(names_dir.search(arg) for arg in cmd))
                or (gcs and "ray.util.client.server" in cmd and f"--address={gcs}" in cmd)
            ):
                found[p.pid] = p
                for c in p.children(recursive=True):
                    if c.pid not in me:
                        found[c.pid] = c
        except psutil.Error:
            continue
    return list(found.values())


def _wait_gone(procs: list, timeout: float) -> list:
    """The processes of ``procs`` still running after up to ``timeout`` s (a zombie counts as gone)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def stop_cluster(temp_dir: str | Path, grace: float = 15.0) -> tuple[int, list]:
    """Stop exactly the Ray processes of ``temp_dir`` (:func:`cluster_processes`): SIGTERM, then
    SIGKILL after ``grace`` s.

    Returns:
        ``(stopped, still_alive)``: how many processes were signalled, and any left running.
    """
    import psutil

    procs = cluster_processes(temp_dir)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.terminate()
    alive = _wait_gone(procs, grace)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.kill()
    _wait_gone(alive, 5.0)
    left = _wait_gone(cluster_processes(temp_dir), 0.0)
    return len(procs), left


def shared_temp_dir_problem(temp_dir: str | Path, env: dict[str, str] | None = None) -> str | None:
    """The refusal message when ``temp_dir`` is Ray's shared default temp dir (``/tmp/ray`` or the
    parent of :func:`ray_address_file`, located by ``env``) or a parent of it: every private Ray
    instance keeps its session there. None for a private directory."""
    given = Path(os.path.abspath(temp_dir))
    asked = {given, given.resolve()}
    for default in {Path("/tmp/ray"), ray_address_file(env).parent}:
        for d in {Path(os.path.abspath(default)), Path(default).resolve()}:
            if asked & {d, *d.parents}:
                return (
                    f"--temp-dir {temp_dir}: this is Ray's shared default temp dir {d} or a parent "
                    "of it; every private Ray instance on this machine (each `flwr run` without a "
                    "cluster) keeps its session there, so stopping it would stop them all: give "
                    "the --temp-dir that your `ray start` was given, e.g. $RAYDIR of the recipe in "
                    "docs/ray-cluster.md ('A Ray cluster'); nothing was stopped"
                )
    return None


def main(argv: list[str] | None = None) -> int:
    """``free-ports N`` | ``stop --temp-dir DIR`` (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="python flwr_sheaf/tools/ray_cluster.py",
        description="Helpers for a Ray cluster on a shared machine (docs/ray-cluster.md, 'A Ray cluster')",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    fp = sub.add_parser("free-ports", help="print N free TCP ports, space-separated")
    fp.add_argument("n", type=int)
    stop_help = "stop the Ray processes started with `ray start --temp-dir DIR`"
    sub.add_parser("stop", help=stop_help).add_argument("--temp-dir", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "free-ports":
        try:
            print(" ".join(map(str, free_ports(args.n))))
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        return 0
    problem = shared_temp_dir_problem(args.temp_dir)
    if problem is None and not Path(args.temp_dir).is_dir():
        problem = f"--temp-dir {args.temp_dir}: no such directory (the --temp-dir of `ray start`)"
    elif problem is None and not any(Path(args.temp_dir).glob("session_*")):
        problem = (
            f"--temp-dir {args.temp_dir}: no Ray session in it (`ray start --temp-dir DIR` makes "
            "DIR/session_latest): give the --temp-dir that `ray start` was given, e.g. $RAYDIR of "
            "docs/ray-cluster.md ('A Ray cluster'); nothing was stopped"
        )
    if problem:
        print(problem, file=sys.stderr)
        return 2
    n, left = stop_cluster(args.temp_dir)
    print(f"stopped {n} Ray process(es) of {args.temp_dir}")
    if left:
        print(f"still running: {[p.pid for p in left]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
