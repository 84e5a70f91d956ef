"""Deploy the app on Flower's deployment engine on this machine: one SuperLink, N SuperNodes, ``flwr run``.

Each component is its own OS process on loopback, with the cross-host flags: TLS and SuperNode
authentication (``--insecure`` drops both), ``--node-config "partition-id=i num-partitions=N
state-dir=..."``, and ``--unregistered K`` intruders that must be refused (docs/deployment.md).
Entry point ``flwr-sheaf-deploy``; needs the ``deploy`` extra. Exit status: 0 ``finished:completed``,
1 failed or timed out, 2 run config refused or federation not up, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .flwr_cli import (
    CHECKOUT,
    find_flwr,
    flwr_env,
    free_port_block,
    missing,
    process_tree,
    run_status,
    stop_processes,
)

try:
    import psutil
except ImportError as e:  # the optional deploy extra
    raise ImportError(missing("psutil")) from e

CONNECTION = "deploy"

__all__ = ["LocalDeployment", "SuperNodeProc", "make_tls", "make_node_key", "main"]


class DeployError(RuntimeError):
    """The federation could not be brought up (the message names the step and the log to read)."""


# --------------------------------------------------------------------------------------------- keys


def make_tls(out_dir: Path, hosts: list[str], days: int = 30) -> dict[str, Path]:
    """Create a CA and a SuperLink server certificate signed by it (EC P-384, SHA-384) for the SANs
    ``hosts``: ``out_dir``'s ``ca.pem``, ``ca.key``, ``server.pem``, ``server.key`` (keys mode 0600).

    Returns:
        ``{"ca": ..., "ca_key": ..., "cert": ..., "key": ...}`` paths.

    Raises:
        ValueError: ``hosts`` is empty.
        ImportError: ``cryptography`` is not installed (names ``pip install 'flwr-sheaf[deploy]'``).
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:  # the optional deploy extra
        raise ImportError(missing("cryptography")) from e

    if not hosts:
        raise ValueError("make_tls: hosts must name at least one host")
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flwr-sheaf deployment CA")])
    off = ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement")
    usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        **dict.fromkeys((*off, "encipher_only", "decipher_only"), False),
    )
    ca_id = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_ext = [(x509.BasicConstraints(ca=True, path_length=0), True), (usage, True), (ca_id, False)]
    ca = _signed(ca_name, ca_name, ca_key.public_key(), ca_key, (start, end), ca_ext)
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    server_ext = [
        (x509.SubjectAlternativeName(sans), False),
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
        (x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False),
    ]
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    cert = _signed(name, ca_name, key.public_key(), ca_key, (start, end), server_ext)
    names = {"ca": "ca.pem", "ca_key": "ca.key", "cert": "server.pem", "key": "server.key"}
    paths = {k: out_dir / v for k, v in names.items()}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    for k, pk in (("ca_key", ca_key), ("key", key)):
        pem = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        paths[k].write_bytes(pk.private_bytes(serialization.Encoding.PEM, *pem))
        paths[k].chmod(0o600)
    return paths


def _signed(subject, issuer, public_key, ca_key, validity, extensions):
    """A certificate for ``public_key`` signed by ``ca_key``; ``extensions``: ``(ext, critical)``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
    )
    for ext, critical in extensions:
        builder = builder.add_extension(ext, critical=critical)
    return builder.sign(ca_key, hashes.SHA384())


def make_node_key(out_dir: Path, name: str) -> tuple[Path, Path]:
    """Create a SuperNode's EC P-384 key pair in OpenSSH format (what Flower 1.42 reads).

    Returns:
        ``(private_key_path, public_key_path)``: ``<name>`` (mode 0600) and ``<name>.pub``.

    Raises:
        ImportError: ``cryptography`` is not installed (names ``pip install 'flwr-sheaf[deploy]'``).
    """
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError as e:  # the optional deploy extra
        raise ImportError(missing("cryptography")) from e

    out_dir.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    priv, pub = out_dir / name, out_dir / f"{name}.pub"
    enc = serialization.Encoding
    fmt = serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    priv.write_bytes(key.private_bytes(enc.PEM, *fmt))
    priv.chmod(0o600)
    ssh = key.public_key().public_bytes(enc.OpenSSH, serialization.PublicFormat.OpenSSH)
    pub.write_bytes(ssh + f" {name}\n".encode())
    return priv, pub


# ---------------------------------------------------------------------------------------- processes


def _json_out(text: str) -> dict:
    """The JSON object ``flwr ... --format json`` printed (maybe after other lines); ValueError if none."""
    return json.loads(text[text.index("{") :])


@dataclass
class SuperNodeProc:
    """One started SuperNode: its partition-id, whether its key is registered, port, key, process, log."""

    index: int
    partition_id: int
    registered: bool
    port: int
    key: Path
    pub: Path
    log: Path
    proc: subprocess.Popen | None = None
    node_id: str | None = None  # SuperLink's node id, from `flwr supernode register`
    state_dir: Path | None = None  # its node-config `state-dir` (docs/resume.md)

    def started(self) -> subprocess.Popen:
        """Its process; DeployError if it was never started."""
        if self.proc is None:
            raise DeployError(f"{self.name} was never started")
        return self.proc

    @property
    def name(self) -> str:
        """``site-<index>`` (registered) or ``intruder-<k>``."""
        return f"site-{self.index}" if self.registered else f"intruder-{self.index}"


def _cli(dep: LocalDeployment, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``flwr ARGS`` with the deployment's environment, output captured."""
    return subprocess.run(
        [dep.flwr, *args], env=dep.env, capture_output=True, text=True, timeout=timeout
    )


@dataclass
class LocalDeployment:
    """A SuperLink and N SuperNodes as separate OS processes on this machine (module docstring).

    A context manager (``with LocalDeployment(...) as d: d.start(); d.run(...)``) that stops every
    process it started. Files under ``workdir``: ``tls/``, ``keys/``, ``flwr-home/`` (private
    ``FLWR_HOME``), ``logs/``, ``superlink.db``. Also site crash and recovery (docs/resume.md).

    Args:
        num_supernodes: N, the registered SuperNodes (partition-ids 0..N-1).
        port: SuperLink port; SuperNode i's ClientAppIo port is ``port + 1 + i`` (intruders
            follow); 0 = a free block (:func:`flwr_sheaf.tools.flwr_cli.free_port_block`).
        insecure: no TLS, hence no SuperNode authentication (SuperNodes register themselves).
        unregistered: K extra SuperNodes with keys that are never registered.
        host, sans: the SuperLink's address; extra names/IPs for its certificate.
        state_dir: SuperNode ``<name>`` gets ``state-dir='<state_dir>/<name>'`` (default
            ``<workdir>/state``).

    Raises:
        ValueError: ``num_supernodes < 1``, ``unregistered < 0``, a port outside 1024..65535.
    """

    workdir: Path
    num_supernodes: int = 3
    port: int = 29700
    insecure: bool = False
    unregistered: int = 0
    host: str = "127.0.0.1"
    sans: list[str] = field(default_factory=list)
    app: Path = CHECKOUT
    state_dir: Path | None = None
    nodes: list[SuperNodeProc] = field(default_factory=list, init=False)
    superlink: subprocess.Popen | None = field(default=None, init=False)
    started: list[subprocess.Popen] = field(default_factory=list, init=False)
    seen: dict[int, psutil.Process] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.num_supernodes < 1:
            raise ValueError(f"--num-supernodes must be >= 1, got {self.num_supernodes}")
        if self.unregistered < 0:
            raise ValueError(f"--unregistered must be >= 0, got {self.unregistered}")
        if self.insecure and self.unregistered:
            raise ValueError(
                f"--unregistered {self.unregistered} with --insecure: SuperNode authentication needs TLS "
                "(Flower 1.42 refuses --enable-supernode-auth without it), so nothing would be refused"
            )
        if self.port == 0:  # pick a free block: port, port + 1 .. port + N + K
            self.port = free_port_block(1 + self.num_supernodes + self.unregistered, self.host)
        last = self.port + self.num_supernodes + self.unregistered
        if not (1024 <= self.port and last <= 65535):
            raise ValueError(
                f"--port {self.port}: ports {self.port}..{last} must lie in 1024..65535"
            )
        self.workdir = Path(self.workdir).resolve()
        self.home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.state_dir = Path(self.state_dir or self.workdir / "state").expanduser().resolve()
        if "'" in str(self.state_dir):
            raise ValueError(
                f"--state-dir {str(self.state_dir)!r}: a node-config string value cannot contain '"
            )
        for d in (self.home, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.env = flwr_env(self.home)
        self.flwr = find_flwr(self.env)

    def kill_supernode(self, n: SuperNodeProc) -> None:
        """SIGKILL SuperNode ``n`` and its descendants at once (a site crash: no clean shutdown)."""
        stop_processes([n.started()], first=signal.SIGKILL)

    def restart_supernode(
        self, n: SuperNodeProc, timeout: float = 240.0, retry_every: float = 5.0
    ) -> int:
        """Start SuperNode ``n`` again after a crash (same key, node config, ``state-dir``) until
        the SuperLink accepts it; returns the number of attempts. Flower 1.42 activates a node only
        while the SuperLink holds it ``offline``; a refusal (exit 305) is retried every ``retry_every`` s.

        Raises:
            DeployError: an attempt failed for another reason, it came back under another node id,
                or it was not accepted within ``timeout`` s (the log is named).
        """
        deadline = time.monotonic() + timeout
        # first attempt when the SuperLink holds the node offline (a node id is known under TLS)
        while n.node_id is not None and time.monotonic() < deadline:
            if self.nodes_status().get(n.node_id) != "online":
                break
            time.sleep(1.0)
        attempts = 0
        while True:
            attempts += 1
            start = n.log.stat().st_size if n.log.exists() else 0
            self.start_supernode(n)
            while True:
                self.track()
                with open(n.log, "rb") as fh:
                    fh.seek(start)
                    new = fh.read().decode(errors="replace")
                if "SuperNode ID: " in new:
                    got = new.split("SuperNode ID: ", 1)[1].split()[0]
                    if n.node_id is not None and got != n.node_id:
                        raise DeployError(
                            f"{n.name} restarted as node {got}, registered as {n.node_id}; see {n.log}"
                        )
                    return attempts
                if n.started().poll() is not None:
                    break
                if time.monotonic() > deadline:
                    raise DeployError(
                        f"{n.name} not accepted within {timeout:.0f} s after {attempts} attempt(s); "
                        f"see {n.log}"
                    )
                time.sleep(0.2)
            if "Failed to activate SuperNode" not in new:
                raise DeployError(
                    f"{n.name} restart exited with code {n.started().returncode}: {new[-1500:]}"
                )
            if time.monotonic() + retry_every > deadline:
                raise DeployError(
                    f"{n.name} still refused after {attempts} attempt(s) in {timeout:.0f} s; see {n.log}"
                )
            time.sleep(retry_every)

    def submit(self, run_config: str = "") -> int:
        """``flwr run <app> deploy --format json [--run-config ...]``; returns the run id.

        Raises:
            DeployError: the SuperLink did not accept the run (the CLI's output is quoted).
        """
        cmd = ["run", str(self.app), CONNECTION, "--format", "json"]
        if run_config:
            cmd += ["--run-config", run_config]
        print("+ flwr", shlex.join(cmd), flush=True)
        r = _cli(self, *cmd, timeout=300)
        try:
            return int(_json_out(r.stdout)["run-id"])
        except (ValueError, KeyError, TypeError):
            raise DeployError(
                f"flwr run was not accepted: {(r.stdout + r.stderr)[-2000:]}"
            ) from None

    def follow_log(self, run_id: int, log: Path | None = None) -> subprocess.Popen:
        """Stream the run's log (``flwr log ID deploy --stream``) to ``log`` or to this stdout."""
        env = {**self.env, "PYTHONUNBUFFERED": "1"}  # lines as they come, also into a file or pipe
        return self._spawn([self.flwr, "log", str(run_id), CONNECTION, "--stream"], log, env)

    def wait_run(
        self,
        run_id: int,
        timeout: float,
        follower: subprocess.Popen | None = None,
        every: float = 10.0,
    ) -> str:
        """Wait until run ``run_id`` is finished (status read when ``follower`` exits, else every
        ``every`` s); its status, ``"timeout"`` (the run stopped) or ``"superlink exited (<code>)"``."""
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + every
        while time.monotonic() < deadline:
            self.track()
            if self.superlink is not None and self.superlink.poll() is not None:
                return f"superlink exited ({self.superlink.returncode})"
            ended = follower is not None and follower.poll() is not None
            if ended or time.monotonic() >= next_check:
                status = run_status(self.flwr, self.env, CONNECTION, run_id)
                if status.startswith("finished"):
                    return status
                if ended:
                    follower = None
                next_check = time.monotonic() + every
            time.sleep(0.5)
        _cli(self, "stop", str(run_id), CONNECTION, timeout=60)
        return "timeout"

    def run(
        self, run_config: str = "", timeout: float = 1800.0, log: Path | None = None
    ) -> tuple[int, str]:
        """Submit the app, follow its log, wait for the end; returns ``(run_id, status)``."""
        run_id = self.submit(run_config)
        follower = self.follow_log(run_id, log)
        try:
            status = self.wait_run(run_id, timeout, follower)
            time.sleep(1.0)  # let the log follower print the last lines
        finally:
            stop_processes([follower], timeout=5)
        return run_id, status

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def track(self) -> None:
        """Remember every current descendant of the started processes (Flower detaches its SuperExec
        and apps into their own sessions; :meth:`stop` still stops them once orphaned), and reap the
        started processes that exited (a SuperExec watches its parent's pid; a zombie keeps it)."""
        for p in self.started:
            p.poll()
            for q in process_tree([p])[1:]:
                self.seen.setdefault(q.pid, q)

    def _spawn(
        self, cmd: list[str], log: Path | None, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start ``cmd`` in its own session, stdout+stderr to ``log`` (None: this stdout)."""
        with open(log, "ab") if log is not None else contextlib.nullcontext() as fh:
            p = subprocess.Popen(
                cmd,
                env=env or self.env,
                stdout=fh,
                stderr=subprocess.STDOUT if fh is not None else None,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.workdir,
            )
        self.started.append(p)
        return p

    @property
    def address(self) -> str:
        """``host:port`` the local SuperNodes and the CLI dial (127.0.0.1 for all interfaces)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"{host}:{self.port}"

    def prepare(self) -> None:
        """Write certificates (unless insecure), SuperNode keys and the ``deploy`` connection."""
        if not self.insecure:
            hosts = [self.address.rsplit(":", 1)[0], "127.0.0.1", "localhost", *self.sans]
            self.tls = make_tls(self.workdir / "tls", list(dict.fromkeys(hosts)))
        self.nodes.clear()
        n = self.num_supernodes
        for i in range(n + self.unregistered):
            registered = i < n
            k = i if registered else i - n  # an intruder k poses as partition-id k % N
            name = f"site-{k}" if registered else f"intruder-{k}"
            priv, pub = make_node_key(self.workdir / "keys", name)
            node = SuperNodeProc(
                k, k % n, registered, self.port + 1 + i, priv, pub, self.logs / f"{name}.log"
            )
            node.state_dir = (self.state_dir or self.workdir / "state") / name
            self.nodes.append(node)
        auth = "insecure = true" if self.insecure else f'root-certificates = "{self.tls["ca"]}"'
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{self.address}"\n{auth}\n'
        )

    def start_superlink(self, timeout: float = 60.0) -> None:
        """Start ``flower-superlink`` and wait until its ``/health`` endpoint answers.

        Raises:
            DeployError: it exited or did not answer within ``timeout`` s (names its log).
        """
        cmd = [find_flwr(self.env, "flower-superlink"), "--isolation", "subprocess"]
        cmd += ["--host", self.host, "--port", str(self.port)]
        cmd += ["--database", str(self.workdir / "superlink.db")]
        cmd += ["--disable-runtime-dependency-installation"]
        if self.insecure:
            cmd += ["--insecure"]
        else:
            ca, cert, key = (str(self.tls[k]) for k in ("ca", "cert", "key"))
            cmd += ["--enable-supernode-auth", "--ssl-ca-certfile", ca, "--ssl-certfile", cert]
            cmd += ["--ssl-keyfile", key]
        log = self.logs / "superlink.log"
        print("+", shlex.join(cmd), flush=True)
        self.superlink = self._spawn(cmd, log)
        import ssl

        import httpx

        url = f"{'http' if self.insecure else 'https'}://{self.address}/health"
        verify = True if self.insecure else ssl.create_default_context(cafile=str(self.tls["ca"]))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.superlink.poll() is not None:
                raise DeployError(
                    f"flower-superlink exited with code {self.superlink.returncode}; see {log}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, verify=verify, timeout=2.0).is_success:
                    return
            time.sleep(0.5)
        raise DeployError(
            f"flower-superlink did not answer on {url} within {timeout:.0f} s; see {log}"
        )

    def register_keys(self) -> None:
        """``flwr supernode register keys/site-<i>.pub deploy`` for every registered SuperNode.

        Raises:
            DeployError: the CLI refused a key (its output is quoted).
        """
        if self.insecure:  # no authentication without TLS: SuperNodes register themselves
            return
        for n in self.nodes:
            if not n.registered:
                continue
            args = ("register", str(n.pub), CONNECTION, "--name", n.name, "--format", "json")
            r = _cli(self, "supernode", *args)
            try:
                n.node_id = str(_json_out(r.stdout)["node-id"])
            except (ValueError, KeyError, TypeError):
                raise DeployError(
                    f"flwr supernode register {n.pub} failed: {(r.stdout + r.stderr)[-1500:]}"
                ) from None

    def start_supernode(self, n: SuperNodeProc) -> None:
        """Start one ``flower-supernode`` process for ``n`` (log: ``logs/<name>.log``)."""
        node_config = (
            f"partition-id={n.partition_id} num-partitions={self.num_supernodes} "
            f"state-dir='{n.state_dir}'"
        )
        cmd = [find_flwr(self.env, "flower-supernode"), "--superlink", self.address]
        cmd += ["--node-config", node_config, "--isolation", "subprocess"]
        cmd += ["--host", "127.0.0.1", "--port", str(n.port)]
        cmd += ["--max-retries", "3", "--max-wait-time", "30"]
        if self.insecure:
            cmd += ["--insecure"]
        else:
            cmd += ["--root-certificates", str(self.tls["ca"])]
            cmd += ["--auth-supernode-private-key", str(n.key)]
        n.proc = self._spawn(cmd, n.log)

    def nodes_status(self) -> dict[str, str]:
        """``{node-id: status}`` from ``flwr supernode ls deploy --format json`` (empty on error)."""
        r = _cli(self, "supernode", "ls", CONNECTION, "--format", "json")
        try:
            return {str(x["node-id"]): x["status"] for x in _json_out(r.stdout)["nodes"]}
        except (ValueError, KeyError, TypeError):
            return {}

    def wait_online(self, timeout: float = 120.0) -> dict[str, str]:
        """Wait until every registered SuperNode is ``online``.

        Raises:
            DeployError: a registered SuperNode exited or is not online after ``timeout`` s.
        """
        want = {n.node_id for n in self.nodes if n.registered and n.node_id is not None}
        deadline = time.monotonic() + timeout
        status: dict[str, str] = {}
        while time.monotonic() < deadline:
            self.track()
            for n in self.nodes:
                if n.registered and n.proc is not None and n.proc.poll() is not None:
                    raise DeployError(f"{n.name} exited with code {n.proc.returncode}; see {n.log}")
            status = self.nodes_status()
            if self.insecure:  # self-registered: node ids unknown beforehand
                if sum(v == "online" for v in status.values()) >= self.num_supernodes:
                    return status
            elif all(status.get(i) == "online" for i in want):
                return status
            time.sleep(1.0)
        raise DeployError(f"SuperNodes not online after {timeout:.0f} s: {status}; see {self.logs}")

    def start(self, online_timeout: float = 120.0) -> None:
        """``prepare``, SuperLink, key registration, every SuperNode (intruders too), then wait
        until the registered ones are online."""
        self.prepare()
        self.start_superlink()
        self.register_keys()
        for n in self.nodes:
            self.start_supernode(n)
        self.wait_online(online_timeout)

    def stop(self) -> int:
        """Stop exactly the processes this deployment started and their descendants (idempotent);
        returns the number signalled."""
        self.track()
        n = stop_processes([*self.started, *self.seen.values()])
        self.started.clear()
        self.seen.clear()
        return n


# ----------------------------------------------------------------------------------------------- CLI


def to_run_config(values: dict) -> str:
    """Format ``{key: value}`` as a ``flwr run --run-config`` string (TOML values: strings and
    booleans as JSON writes them, numbers by ``repr``)."""
    return " ".join(
        f"{k}={json.dumps(v) if isinstance(v, (str, bool)) else repr(v)}" for k, v in values.items()
    )


def check_run_config(run_config: str, num_supernodes: int) -> dict:
    """Parse ``--run-config`` as ``flwr run`` does (``{key: int | float | bool | str}``) and check
    it against the federation.

    Raises:
        ValueError: ``num_supernodes < 1``, the string does not parse, a key or value refused by
            ``flwr_sheaf.config.RunConfig`` (named), or a zoo whose agent count is not ``num_supernodes``.
    """
    from flwr.common.config import parse_config_args

    from flwr_sheaf.config import RunConfig
    from flwr_sheaf.models.zoo import zoo_specs

    if (
        isinstance(num_supernodes, bool)
        or not isinstance(num_supernodes, int)
        or num_supernodes < 1
    ):
        raise ValueError(
            f"--num-supernodes {num_supernodes!r}: must be an integer >= 1 (each SuperNode serves one "
            f"agent, i.e. one partition-id, of the zoo); e.g. --num-supernodes 3 --run-config "
            f"\"zoo='tiny-3' graph='ring'\""
        )
    try:
        parsed = parse_config_args([run_config]) if run_config.strip() else {}
    except Exception as exc:  # flwr raises ValueError / TOML errors with its own text
        raise ValueError(f"--run-config {run_config!r} does not parse: {exc}") from None
    cfg = RunConfig.from_run_config(parsed)
    cfg.check()
    agents = len(zoo_specs(cfg.scenario.zoo))
    if agents != num_supernodes:
        # class-overlap needs N >= 5
        tiny = f"zoo='tiny-{num_supernodes}'" + (" graph='ring'" if num_supernodes < 5 else "")
        raise ValueError(
            f"zoo={cfg.scenario.zoo!r} has {agents} agents but --num-supernodes is {num_supernodes}: "
            f'start {agents} SuperNodes or pass --run-config "{tiny} ..."'
        )
    return parsed


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring); returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        parsed = check_run_config(args.run_config, args.num_supernodes)
    except ValueError as exc:  # ConfigError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="flwr-deploy-")).resolve()
    # results-dir made absolute here: the ServerApp process runs in another working directory
    results = Path(str(parsed.get("results-dir", workdir / "results"))).expanduser().resolve()
    parsed["results-dir"] = str(results)

    def _interrupt(signum, frame):  # noqa: ARG001 - signal API
        raise KeyboardInterrupt

    # SIGINT and SIGTERM (SIGINT is ignored in the background) must stop what main started
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    t0 = time.monotonic()
    try:
        dep = LocalDeployment(
            workdir,
            num_supernodes=args.num_supernodes,
            port=args.port,
            insecure=args.insecure,
            unregistered=args.unregistered,
            host=args.host,
            sans=args.san,
            app=Path(args.app),
            state_dir=Path(args.state_dir) if args.state_dir else None,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _bring_up_and_run(dep, args, to_run_config(parsed), results, t0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        n = dep.stop()
        print(f"stopped {n} process(es) started by this tool", flush=True)


def _parser() -> argparse.ArgumentParser:
    """The command line of :func:`main` (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    registered = "registered SuperNodes N (partition-ids 0..N-1)"
    add("--num-supernodes", type=int, default=3, help=registered)
    add("--run-config", default="", help="run-config overrides, e.g. \"zoo='tiny-3' graph='ring'\"")
    no_tls = "no TLS and hence no SuperNode authentication (debugging only)"
    add("--insecure", action="store_true", help=no_tls)
    keep = "leave SuperLink and SuperNodes running after the run (stop them with Ctrl-C)"
    add("--keep-running", action="store_true", help=keep)
    intruders = "extra SuperNodes whose keys are not registered"
    add("--unregistered", type=int, default=0, help=intruders)
    port = "SuperLink port; SuperNode i uses port+1+i; 0 = pick a free block"
    add("--port", type=int, default=29700, help=port)
    add("--host", default="127.0.0.1", help="address the SuperLink listens on")
    add("--san", action="append", default=[], help="extra host name/IP for the server certificate")
    add("--workdir", default=None, help="default: a new directory under the system temp dir")
    app = "app directory for flwr run (default: the flwr-sheaf checkout this package runs from)"
    add("--app", default=str(CHECKOUT), help=app)
    state = "root of the SuperNodes' node state (SuperNode <name> uses <root>/<name>; default: <workdir>/state)"
    add("--state-dir", default=None, help=state)
    add("--timeout", type=float, default=1800.0, help="seconds to wait for the run")
    return ap


def _bring_up_and_run(
    dep: LocalDeployment, args: argparse.Namespace, run_config: str, results: Path, t0: float
) -> int:
    """Start the federation, run the app, report; returns main's exit status. ``--keep-running``
    then waits until the SuperLink exits or Ctrl-C."""
    try:
        dep.start()
    except DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    up = time.monotonic() - t0
    print(
        f"federation up in {up:.1f} s: SuperLink {dep.address} ({'insecure' if args.insecure else 'TLS'}), "
        f"{args.num_supernodes} SuperNode(s) online, {args.unregistered} unregistered; logs in {dep.logs}",
        flush=True,
    )
    t1 = time.monotonic()
    run_id, status = dep.run(run_config, timeout=args.timeout)
    print(
        f"run {run_id}: status {status}; run wall time {time.monotonic() - t1:.1f} s "
        f"(total {time.monotonic() - t0:.1f} s)",
        flush=True,
    )
    if (results / "results.json").exists():
        print(f"results: {results / 'results.json'}", flush=True)
    else:
        print(f"no results.json under {results}; see {dep.logs}", flush=True)
    if args.keep_running:
        print(
            f"--keep-running: SuperLink {dep.address} and SuperNodes stay up; Ctrl-C stops them "
            f"(connection '{CONNECTION}' in FLWR_HOME={dep.home})",
            flush=True,
        )
        while dep.superlink is not None and dep.superlink.poll() is None:
            time.sleep(1.0)
    return 0 if status == "finished:completed" else 1


if __name__ == "__main__":
    sys.exit(main())
