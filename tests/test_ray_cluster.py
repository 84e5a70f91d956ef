"""The simulation on a Ray cluster, chosen explicitly (flwr_sheaf/tools/ray_cluster.py,
scripts/run_flwr.py).

- Fast tests: which cluster Ray's own resolver picks with and without the ``RAY_ADDRESS`` that
  ``run_flwr.py`` sets (a forgotten ``ray start`` captures a plain run; ``RAY_ADDRESS=local`` does
  not), and the settings refused before anything starts (a ``RAY_ADDRESS`` nobody passed,
  ``init-args-num-cpus`` on a cluster, an address where no cluster answers, a ``ray://`` address).
- Engine tests: a stale ``ray_current_cluster`` file (what a forgotten ``ray start`` leaves) does
  not capture a ``run_flwr.py`` run without ``--ray-address`` (a plain ``flwr run`` would try to
  join the dead address and fail); a two-node Ray cluster on this host (its own temp dirs, free ports, one CPU per
  node), ``flwr run`` through ``run_flwr.py --ray-address``, then Ray's task timeline read from the
  cluster's GCS: ``ClientAppActor.run`` executed by a worker of each node (a worker's node is the
  node whose temp dir holds its log file). Exactly the processes of the two ``ray start`` sessions
  are stopped, by the tool docs/tutorial.md documents (``flwr_sheaf/tools/ray_cluster.py stop
--temp-dir``; never ``ray stop``: it stops every Ray instance on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
from flwr_sheaf.tools.ray_cluster import (
    RayClusterError,
    check_federation_for_cluster,
    free_ports,
    ray_address_file,
    ray_environment,
)

RUN_FLWR = str(ROOT / "scripts" / "run_flwr.py")


# --------------------------------------------------------------------------------- fast tests


def _record_cluster(tmp_path: Path, address: str) -> dict[str, str]:
    """An environment whose Ray temp root is ``tmp_path``, holding the file ``ray start`` leaves."""
    f = tmp_path / "ray" / "ray_current_cluster"
    f.parent.mkdir(parents=True)
    f.write_text(address)
    return {"RAY_TMPDIR": str(tmp_path)}


def test_a_forgotten_ray_start_captures_ray_init_and_ray_address_local_does_not(
    tmp_path, monkeypatch
):
    """Ray 2.55's own resolver (what ``ray.init()`` without an address calls): with the file that
    ``ray start`` leaves, a plain run joins that cluster; with ``RAY_ADDRESS=local`` (what
    run_flwr.py sets when no --ray-address is given) it starts its own instance (None)."""
    from ray._private.services import canonicalize_bootstrap_address

    env = _record_cluster(tmp_path, "10.1.2.3:6379")
    monkeypatch.setenv("RAY_TMPDIR", env["RAY_TMPDIR"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address_file(env) == tmp_path / "ray" / "ray_current_cluster"
    assert canonicalize_bootstrap_address(None) == "10.1.2.3:6379"  # captured
    ray_vars, note = ray_environment(None, env, probe_timeout=0.5)
    assert ray_vars == {"RAY_ADDRESS": "local"}
    monkeypatch.setenv("RAY_ADDRESS", ray_vars["RAY_ADDRESS"])
    assert canonicalize_bootstrap_address(None) is None  # a new local instance
    # the user is told which cluster was not used; nothing answers at 10.1.2.3: named as gone
    assert note is not None
    assert str(tmp_path / "ray" / "ray_current_cluster") in note
    assert "10.1.2.3:6379 that is gone" in note and "--ray-address" not in note


def test_no_note_without_an_address_file(tmp_path):
    assert ray_environment(None, {"RAY_TMPDIR": str(tmp_path)}) == ({"RAY_ADDRESS": "local"}, None)


def test_the_cluster_asked_for_is_passed_on():
    assert ray_environment("10.0.0.5:6379", {}) == ({"RAY_ADDRESS": "10.0.0.5:6379"}, None)
    # the same address already in the environment is not a conflict
    assert ray_environment("10.0.0.5:6379", {"RAY_ADDRESS": "10.0.0.5:6379"})[0] == {
        "RAY_ADDRESS": "10.0.0.5:6379"
    }


def test_a_ray_address_in_the_environment_that_nobody_passed_is_refused():
    with pytest.raises(RayClusterError) as e:
        ray_environment(None, {"RAY_ADDRESS": "10.0.0.5:6379"})
    assert "--ray-address 10.0.0.5:6379" in str(e.value) and "unset RAY_ADDRESS" in str(e.value)
    with pytest.raises(RayClusterError, match="unset RAY_ADDRESS or pass the same address"):
        ray_environment("10.0.0.9:6379", {"RAY_ADDRESS": "10.0.0.5:6379"})


@pytest.mark.parametrize("key", ["init-args-num-cpus", "init-args-num-gpus"])
def test_resources_ray_refuses_on_a_cluster_are_refused_naming_ray_start(key):
    with pytest.raises(RayClusterError) as e:
        check_federation_for_cluster({key: "2", "verbose": "true"}, "10.0.0.5:6379")
    msg = str(e.value)
    assert f"{key}=2" in msg and f"ray start --num-{key.rsplit('-', 1)[1]} N" in msg
    assert "verbose" not in msg
    check_federation_for_cluster({"verbose": "true", "init-args-logging-level": "INFO"}, "x:1")


def test_the_serverapp_warns_about_a_cluster_nobody_named(caplog):
    from flwr_sheaf.engine import describe_ray, warn_if_unasked

    if "ray" not in sys.modules:  # Ray not started in this process: nothing to describe
        assert describe_ray() is None
    info = {
        "ray_address": "10.0.0.5:6379",
        "ray_nodes": 3,
        "existing_cluster": True,
        "joined_through": "/tmp/ray/ray_current_cluster",
    }
    with caplog.at_level("INFO", logger="flwr_sheaf"):
        warn_if_unasked(info)
        warn_if_unasked({**info, "joined_through": "RAY_ADDRESS"})
        warn_if_unasked({**info, "existing_cluster": False})
    warn, named = caplog.records
    assert warn.levelname == "WARNING" and "nobody named" in warn.getMessage()
    assert "/tmp/ray/ray_current_cluster" in warn.getMessage()
    assert "--ray-address 10.0.0.5:6379" in warn.getMessage()
    assert named.levelname == "INFO" and "named by RAY_ADDRESS" in named.getMessage()


def test_describing_the_cluster_never_costs_the_run_its_results(monkeypatch, caplog):
    """A Ray that fails to answer (e.g. its GCS gone at the end of a run) is logged, not raised."""
    import types

    from flwr_sheaf.engine import describe_ray

    def gone():
        raise ConnectionError("GCS unreachable")

    fake = types.SimpleNamespace(
        is_initialized=lambda: True,
        get_runtime_context=lambda: types.SimpleNamespace(gcs_address="10.0.0.5:6379"),
        nodes=gone,
        cluster_resources=dict,
    )
    monkeypatch.setitem(sys.modules, "ray", fake)
    with caplog.at_level("WARNING", logger="flwr_sheaf"):
        assert describe_ray() is None
    assert "GCS unreachable" in caplog.text


def _run_flwr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, RUN_FLWR, "--port", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_run_flwr_refuses_cluster_conflicts_before_starting_anything():
    (port,) = free_ports(1)  # nothing listens there
    proc = _run_flwr(
        "--ray-address", f"127.0.0.1:{port}", "--federation-config", "init-args-num-cpus=2"
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "init-args-num-cpus=2" in proc.stderr and "ray start --num-cpus N" in proc.stderr
    assert "flwr run" not in proc.stdout  # refused before `flwr run` was started
    proc = _run_flwr("--ray-address", f"127.0.0.1:{port}")
    assert proc.returncode == 2 and "no Ray cluster answers there" in proc.stderr, proc.stderr
    assert f"ray start --head --port {port}" in proc.stderr
    proc = _run_flwr("--ray-address", "ray://10.0.0.5:10001")
    assert proc.returncode == 2 and "not a Ray Client ray:// address" in proc.stderr
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = _run_flwr(env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert proc.returncode == 2 and f"--ray-address 127.0.0.1:{port}" in proc.stderr


# ------------------------------------------------------------------------------- engine test


class LocalRayCluster:
    """A Ray cluster of ``nodes`` nodes on this host, each with its own temp dir and ports.

    Every ``ray start`` runs in a new session (``start_new_session``); Ray's daemons (GCS, raylet,
    agents, workers) inherit it, so :meth:`stop` stops exactly the processes of these sessions
    (and any process naming this cluster's temp dir), never another Ray instance.
    """

    def __init__(self, root: Path, nodes: int = 2, cpus_per_node: int = 1):
        self.root, self.nodes, self.cpus = root, nodes, cpus_per_node
        self.sessions: list[int] = []
        self.temp_dirs: list[Path] = []
        self.address = ""
        self.log = ""
        self.left_by_the_tool: list[psutil.Process] = []

    def _start(self, extra: list[str], temp_dir: Path) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        agent, grpc, rt_env, metrics, node_mgr, obj_mgr = free_ports(6)
        cmd = [
            ray,
            "start",
            *extra,
            "--temp-dir",
            str(temp_dir),
            "--num-cpus",
            str(self.cpus),
            "--num-gpus",
            "0",
            "--object-store-memory",
            str(100 * 1024**2),
            "--node-manager-port",
            str(node_mgr),
            "--object-manager-port",
            str(obj_mgr),
            "--dashboard-agent-listen-port",
            str(agent),
            "--dashboard-agent-grpc-port",
            str(grpc),
            "--runtime-env-agent-port",
            str(rt_env),
            "--metrics-export-port",
            str(metrics),
            "--disable-usage-stats",
        ]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.sessions.append(proc.pid)
        self.temp_dirs.append(temp_dir)
        out, _ = proc.communicate(timeout=240)
        self.log += out
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")

    def start(self) -> LocalRayCluster:
        gcs, client, dashboard = free_ports(3)
        self._start(
            [
                "--head",
                "--port",
                str(gcs),
                "--include-dashboard",
                "false",
                "--dashboard-port",  # its API server runs even without the dashboard UI
                str(dashboard),
                "--ray-client-server-port",
                str(client),
            ],
            self.root / "node0",
        )
        self.address = f"127.0.0.1:{gcs}"
        for i in range(1, self.nodes):
            self._start(["--address", self.address], self.root / f"node{i}")
        return self

    def processes(self) -> list[psutil.Process]:
        """This cluster's live processes (by session, or naming one of its temp dirs)."""
        mine = []
        marks = [str(d) for d in self.temp_dirs]
        for p in psutil.process_iter(["cmdline"]):
            try:
                if os.getsid(p.pid) in self.sessions or any(
                    m in " ".join(p.info["cmdline"] or []) for m in marks
                ):
                    mine.append(p)
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        return mine

    def stop(self) -> list[psutil.Process]:
        """Stop each node as docs/tutorial.md says (``ray_cluster.py stop --temp-dir``), then SIGTERM
        and SIGKILL whatever of these sessions is left; returns any left alive after that."""
        for d in self.temp_dirs:
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "flwr_sheaf/tools/ray_cluster.py"),
                    "stop",
                    "--temp-dir",
                    str(d),
                ],
                timeout=120,
                check=False,
            )
        self.left_by_the_tool = [p for p in self.processes() if p.status() != psutil.STATUS_ZOMBIE]
        procs = self.processes()
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        return [p for p in self.processes() if p.status() != psutil.STATUS_ZOMBIE]

    def worker_node(self, worker_id: str) -> int | None:
        """Index of the node whose temp dir holds the log of Ray worker ``worker_id`` (hex)."""
        for i, d in enumerate(self.temp_dirs):
            if any(d.glob(f"session_*/logs/worker-{worker_id}-*")):
                return i
        return None


TIMELINE = r"""
import collections, json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
runs = collections.Counter(
    e["tid"].removeprefix("worker:") for e in ray.timeline() if e.get("cat") == "task::ClientAppActor.run"
)
print("TIMELINE " + json.dumps(dict(runs)))
"""


@pytest.mark.engine
def test_flwr_run_on_a_two_node_ray_cluster_runs_clientapps_on_both_nodes(tmp_path):
    # Ray's temp paths (its sockets) must stay short: a private dir directly under /tmp
    root = Path(tempfile.mkdtemp(prefix="fs-raycl-", dir="/tmp"))
    cluster = LocalRayCluster(root, nodes=2, cpus_per_node=1)
    out = tmp_path / "res"
    try:
        cluster.start()
        t0 = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                RUN_FLWR,
                "--num-supernodes",
                "4",
                "--cpus-per-client",
                "1",
                "--port",
                "0",  # free ports, picked by run_flwr.py
                "--timeout",
                "600",
                "--ray-address",
                cluster.address,
                "--run-config",
                f"zoo='tiny-4' num-pilots=64 local-epochs=1 graph='ring' num-server-rounds=1 "
                f"results-dir='{out}'",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=700,
        )
        wall = time.monotonic() - t0
        assert proc.returncode == 0 and "finished:completed" in proc.stdout, (
            proc.stdout[-3000:] + proc.stderr[-3000:]
        )
        assert f"RAY_ADDRESS={cluster.address}" in proc.stdout
        res = json.loads((out / "results.json").read_text())
        assert [r["round"] for r in res["rounds"]] == [1] and len(res["nodes"]) == 4
        # the ServerApp says where its ClientApps ran (results.json `engine`)
        assert res["engine"]["existing_cluster"] is True and res["engine"]["ray_nodes"] == 2
        assert res["engine"]["joined_through"] == "RAY_ADDRESS"
        assert res["engine"]["ray_address"].endswith(":" + cluster.address.rsplit(":", 1)[1])
        assert res["engine"]["ray_cpus"] == 2.0
        tl = subprocess.run(
            [sys.executable, "-c", TIMELINE, cluster.address],
            capture_output=True,
            text=True,
            timeout=180,
            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        )
        line = [x for x in tl.stdout.splitlines() if x.startswith("TIMELINE ")]
        assert line, tl.stdout[-2000:] + tl.stderr[-2000:]
        runs = json.loads(line[0].removeprefix("TIMELINE "))
        per_node = [0] * cluster.nodes
        for worker, n in runs.items():
            node = cluster.worker_node(worker)
            assert node is not None, f"worker {worker} has no log in this cluster's temp dirs"
            per_node[node] += n
        # one CPU per node, one per ClientApp: one actor per node, and each ran messages; every
        # node that trained in round 1 ran at least that message
        assert all(n > 0 for n in per_node), (per_node, runs)
        assert sum(per_node) >= res["rounds"][0]["num_trained"] > 0, (per_node, res["rounds"])
        print(f"ClientAppActor.run per Ray node: {per_node}; flwr run {wall:.0f} s")
    finally:
        left = cluster.stop()
        if not left:
            shutil.rmtree(root, ignore_errors=True)
    assert not left, f"processes of the test's Ray cluster still alive: {left}"
    # the documented stop (docs/tutorial.md) alone stopped every process of both `ray start` sessions
    assert not cluster.left_by_the_tool, cluster.left_by_the_tool
    assert cluster.sessions, cluster.log


@pytest.mark.engine
def test_a_forgotten_ray_start_does_not_capture_a_run_without_ray_address(tmp_path):
    """The file names a cluster that is gone (nothing listens there): joined, the run would fail.
    run_flwr.py gives the run its own Ray instance, completes it and names the file."""
    root = Path(tempfile.mkdtemp(prefix="fs-raytmp-", dir="/tmp"))  # short: Ray's socket paths
    try:
        (dead,) = free_ports(1)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(_record_cluster(root, f"127.0.0.1:{dead}"))
        out = tmp_path / "res"
        proc = subprocess.run(
            [
                sys.executable,
                RUN_FLWR,
                "--num-supernodes",
                "4",
                "--port",
                "0",  # free ports, picked by run_flwr.py
                "--timeout",
                "600",
                "--run-config",
                f"zoo='tiny-4' num-pilots=64 local-epochs=1 graph='ring' num-server-rounds=1 "
                f"results-dir='{out}'",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=700,
            env=env,
        )
        assert proc.returncode == 0 and "finished:completed" in proc.stdout, (
            proc.stdout[-3000:] + proc.stderr[-3000:]
        )
        assert str(root / "ray" / "ray_current_cluster") in proc.stdout
        assert f"127.0.0.1:{dead} that is gone" in proc.stdout  # a dead address is not offered
        assert "RAY_ADDRESS=local (a private local Ray instance)" in proc.stdout
        res = json.loads((out / "results.json").read_text())
        assert res["rounds"][0]["round"] == 1
        # a private instance: started by the simulation itself, one node
        assert res["engine"]["existing_cluster"] is False and res["engine"]["ray_nodes"] == 1
        assert res["engine"]["joined_through"] is None
    finally:
        shutil.rmtree(root, ignore_errors=True)
