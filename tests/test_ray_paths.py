"""The Ray paths hold (issue 34, cases 2, 7 and 10): what answers at a Ray address, the ClientApp by
reference in a worker, and the small refusals of ``--ray-address``; all fast (no Ray started).

- Case 2: an HTTP server (or another gRPC server) at ``--ray-address`` is refused within seconds,
  naming what listens there (Ray's own GCS handshake is the probe; a fake GCS answering it passes),
  and a ``flwr run`` that outlives ``--timeout`` ends in a message, not a traceback.
- Case 7: a worker that cannot import the app's module is told the module, its file and the
  ``PYTHONPATH`` to set; an app whose handlers were registered after its module was imported
  travels by value (working) instead of arriving empty; one that arrives short of handlers is named
  as such; ``copy``/``deepcopy`` of a marked app are real copies (not the app itself).
- Case 10: ``--ray-address auto`` (the advice given for ``RAY_ADDRESS=auto``) is accepted; a stale
  ``ray_current_cluster`` is named as gone, not offered as ``--ray-address``; a port outside
  1..65535 is refused naming the flag.
- The shared-machine recipe of docs/ray-cluster.md: its own ``--temp-dir``, free ports, and the tool
  that stops exactly that cluster (``flwr_sheaf/tools/ray_cluster.py stop``), never ``ray stop``.
"""

from __future__ import annotations

import copy
import http.server
import importlib.metadata
import importlib.util
import os
import pickle
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures
from pathlib import Path

import cloudpickle
import grpc
import psutil
import pytest

import flwr_sheaf.client.reference as reference
import flwr_sheaf.tools.ray_cluster as ray_cluster
from flwr_sheaf.client.reference import travel_by_reference
from flwr_sheaf.tools.ray_cluster import (
    RayClusterError,
    check_reachable,
    parse_address,
    ray_environment,
)

#: the gRPC method of Ray 2.55's GCS handshake (ray/core/generated/gcs_service_pb2_grpc.py)
GCS_HANDSHAKE = "/ray.rpc.NodeInfoGcsService/GetClusterId"

ROOT = Path(__file__).resolve().parents[1]
RUN_FLWR = ROOT / "scripts" / "run_flwr.py"
TOOL = ROOT / "flwr_sheaf" / "tools" / "ray_cluster.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_server():
    """An HTTP server on a free port (what a wrong port often is: a dashboard, a web app)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def _grpc_server(handlers: dict) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    if handlers:
        service, _, method = GCS_HANDSHAKE.strip("/").partition("/")
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    service,
                    {method: grpc.unary_unary_rpc_method_handler(handlers[method])},
                ),
            )
        )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.fixture
def fake_gcs():
    """A gRPC server answering Ray's GCS handshake (``GetClusterId``) as a Ray 2.55 GCS does."""
    server, port = _grpc_server({"GetClusterId": lambda req, ctx: b"\x12\x03abc"})
    yield port
    server.stop(0)


# ------------------------------------------------------------------------ case 2: what answers


def test_an_http_server_at_the_ray_address_is_refused_in_seconds_naming_it(http_server):
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(RUN_FLWR), "--port", "0", "--timeout", "20"]
        + ["--ray-address", f"127.0.0.1:{http_server}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    wall = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"--ray-address 127.0.0.1:{http_server}: something listens there" in proc.stderr
    assert "not a Ray cluster's GCS" in proc.stderr and "it answers HTTP" in proc.stderr
    assert "ray start --head --port N" in proc.stderr
    assert "+ " not in proc.stdout  # `flwr run` was never started
    assert wall < 60, wall  # seconds (Python start-up included), not the 20 s --timeout


def test_cross_device_refuses_a_non_ray_address_before_its_first_run(
    http_server, tmp_path, monkeypatch, capsys
):
    monkeypatch.syspath_prepend(str(ROOT / "simulations"))
    import cross_device

    out = tmp_path / "cd"
    args = ["--agents", "10,20", "--dataset", "mnist-bundled", "--timeout", "5", "--out", str(out)]
    rc = cross_device.main([*args, "--ray-address", f"127.0.0.1:{http_server}"])
    assert rc == 2
    assert "not a Ray cluster's GCS" in capsys.readouterr().err
    assert not out.exists()  # refused before any run (none recorded as failed in summary.json)


def test_the_probe_tells_a_ray_gcs_from_other_grpc_servers_and_silence(fake_gcs):
    check_reachable(f"127.0.0.1:{fake_gcs}")  # answers Ray's handshake: passes
    other, port = _grpc_server({})  # a gRPC server, but not Ray's GCS
    try:
        with pytest.raises(RayClusterError, match="a gRPC server that is not a Ray GCS"):
            check_reachable(f"127.0.0.1:{port}")
    finally:
        other.stop(0)
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        t0 = time.monotonic()
        with pytest.raises(RayClusterError, match="no answer to Ray's GCS handshake within 1 s"):
            check_reachable(f"127.0.0.1:{silent.getsockname()[1]}", timeout=1.0)
        assert time.monotonic() - t0 < 10


def test_a_web_proxy_in_the_environment_does_not_hide_a_live_gcs(fake_gcs, monkeypatch):
    # a shared machine often sets a proxy for the web; Ray's own gRPC channels ignore it
    for var in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there
    for var in ("no_proxy", "NO_PROXY", "RAY_grpc_enable_http_proxy"):
        monkeypatch.delenv(var, raising=False)
    check_reachable(f"127.0.0.1:{fake_gcs}")


def test_a_gcs_the_handshake_cannot_reach_has_a_documented_way_through(http_server, monkeypatch):
    # a Ray that renamed the handshake (or a GCS speaking TLS) would be refused as "not a Ray GCS":
    # the message names the Ray version and the variable that keeps only the TCP check
    with pytest.raises(RayClusterError) as refused:
        check_reachable(f"127.0.0.1:{http_server}")
    version = importlib.metadata.version("ray")
    assert f"another Ray than this one's {version}" in str(refused.value)
    assert "FLWR_SHEAF_SKIP_GCS_PROBE=1" in str(refused.value)
    monkeypatch.setenv("FLWR_SHEAF_SKIP_GCS_PROBE", "1")
    check_reachable(f"127.0.0.1:{http_server}")  # accepts connections: enough when asked so
    monkeypatch.delenv("FLWR_SHEAF_SKIP_GCS_PROBE")
    monkeypatch.setenv("RAY_USE_TLS", "1")  # this plain-text probe cannot speak TLS
    check_reachable(f"127.0.0.1:{http_server}")
    closed = _free_port()
    with pytest.raises(RayClusterError, match="Connection refused|nothing"):
        check_reachable(f"127.0.0.1:{closed}")


def test_a_remote_address_is_not_described_by_a_local_process(http_server):
    # the same port number on this machine says nothing about another host
    here = ray_cluster.describe_listener("127.0.0.1", http_server)
    assert f"(pid {os.getpid()}) listens on port {http_server}" in here
    remote = ray_cluster.describe_listener("192.0.2.1", http_server, timeout=0.2)  # TEST-NET-1
    assert "listens on port" not in remote


def _load_run_flwr():
    spec = importlib.util.spec_from_file_location("_run_flwr_under_test", RUN_FLWR)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flwr_run_past_its_timeout_ends_in_a_message_not_a_traceback(monkeypatch, capsys):
    run_flwr = _load_run_flwr()
    stopped = []

    class Hang:  # `flwr run` outlives --timeout
        def __init__(self, cmd, *a, **kw):
            assert cmd[1:2] == ["run"]
            self.cmd = cmd

        def wait(self, timeout=None):
            raise subprocess.TimeoutExpired(self.cmd, timeout)

    monkeypatch.setattr(run_flwr.subprocess, "Popen", Hang)
    monkeypatch.setattr(run_flwr, "stop_processes", lambda procs: stopped.extend(procs) or 1)
    monkeypatch.setattr(run_flwr, "find_flwr", lambda env: "flwr")
    monkeypatch.setattr(run_flwr, "run_status", lambda flwr, env: "running")
    monkeypatch.setattr(run_flwr, "stop_superlink", lambda port, known=None: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc = run_flwr.main(["--port", "0", "--timeout", "7", "--num-supernodes", "2"])
    err = capsys.readouterr().err
    assert rc == 1
    assert (
        "flwr run did not finish within --timeout 7 s and was stopped (run status: running" in err
    )
    assert "A larger run needs a larger --timeout" in err
    assert [type(p) for p in stopped] == [Hang]  # the CLI stopped, not left running


def test_the_advice_after_an_interruption_resumes_only_a_run_that_kept_its_node_state(tmp_path):
    run_flwr = _load_run_flwr()
    out = tmp_path / "out"
    out.mkdir()
    given = "zoo='tiny-4' overwrite=true"  # its own overwrite/resume is replaced, not doubled
    assert run_flwr.rerun_advice(out, "", "bash scripts/main.sh", given).endswith(
        ": bash scripts/main.sh \"zoo='tiny-4'\""
    )  # nothing written yet: the same command
    (out / "checkpoint.pkl").write_bytes(b"x")
    kept = run_flwr.rerun_advice(out, str(tmp_path / "state"), "bash scripts/main.sh", given)
    assert kept == (
        "to continue it from its last checkpoint: bash scripts/main.sh \"zoo='tiny-4' resume=true\""
    )
    lost = run_flwr.rerun_advice(out, "", "bash scripts/main.sh", given)
    assert "resume=true cannot continue it" in lost and "node-state-dir=<dir>" in lost
    assert (
        """bash scripts/main.sh "zoo='tiny-4' overwrite=true" (moves its checkpoint.pkl""" in lost
    )


# --------------------------------------------------------------- case 10: --ray-address refusals


def test_an_http_url_is_named_as_one_and_a_privileged_port_is_not_advised():
    # attack (minor): http://... was called "not a Ray Client ray:// address"
    for url in ("http://127.0.0.1:8265", "https://head:8265"):
        with pytest.raises(RayClusterError) as e:
            parse_address(url)
        scheme = url.split(":")[0]
        assert f"--ray-address {url!r}: an {scheme}:// URL" in str(e.value)
        assert "ray://" not in str(e.value) and "without http://" in str(e.value)
    with pytest.raises(RayClusterError, match="not a Ray Client ray:// address"):
        parse_address("ray://10.0.0.5:10001")  # the Ray Client form keeps its own message
    # nothing listens on port 1 (below 1024): the advice is a free port, not `--port 1`
    with pytest.raises(RayClusterError) as e:
        ray_cluster.check_reachable("127.0.0.1:1", timeout=2.0)
    msg = str(e.value)
    assert "ray start --head --port 1`" not in msg and "ray start --head --port N`" in msg, msg
    assert "ray_cluster.py free-ports 1" in msg and "port 1 is below 1024" in msg
    port = ray_cluster.free_ports(1)[0]  # an unprivileged port: that port is advised as before
    with pytest.raises(RayClusterError, match=rf"`ray start --head --port {port}` on 127.0.0.1"):
        ray_cluster.check_reachable(f"127.0.0.1:{port}", timeout=2.0)


@pytest.mark.parametrize("port", ["99999", "0", "65536"])
def test_a_port_outside_the_tcp_range_is_refused_naming_the_flag(port):
    with pytest.raises(RayClusterError) as e:
        parse_address(f"127.0.0.1:{port}")
    assert f"--ray-address '127.0.0.1:{port}': port {port} is not a TCP port (1..65535)" in str(
        e.value
    )
    proc = subprocess.run(
        [sys.executable, str(RUN_FLWR), "--port", "0", "--ray-address", f"127.0.0.1:{port}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "is not a TCP port (1..65535)" in proc.stderr


def _recorded(tmp_path: Path, address: str) -> dict[str, str]:
    f = tmp_path / "ray" / "ray_current_cluster"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(address)
    return {"RAY_TMPDIR": str(tmp_path)}


def test_ray_address_auto_advice_is_accepted(tmp_path, fake_gcs):
    env = {**_recorded(tmp_path, f"127.0.0.1:{fake_gcs}"), "RAY_ADDRESS": "auto"}
    with pytest.raises(RayClusterError) as e:  # auto nobody passed: refused, with advice
        ray_environment(None, env)
    advice = re.search(r"pass --ray-address (\S+)", str(e.value))
    assert advice and advice.group(1) == "auto", str(e.value)
    assert f"127.0.0.1:{fake_gcs}" in str(e.value)
    # the advice works: `auto` is the recorded cluster, passed on as host:port
    assert ray_environment("auto", env) == ({"RAY_ADDRESS": f"127.0.0.1:{fake_gcs}"}, None)
    # no cluster recorded: auto is refused naming the file, and `auto` is not advised
    bare = {"RAY_TMPDIR": str(tmp_path / "none"), "RAY_ADDRESS": "auto"}
    with pytest.raises(RayClusterError) as e:
        ray_environment(None, bare)
    assert "--ray-address auto" not in str(e.value) and "unset RAY_ADDRESS" in str(e.value)
    with pytest.raises(RayClusterError, match="no Ray cluster is recorded on this machine"):
        ray_environment("auto", {"RAY_TMPDIR": str(tmp_path / "none")})


def test_a_stale_ray_session_file_is_named_as_gone_not_offered(tmp_path, fake_gcs):
    dead = _free_port()  # nothing listens there
    _, note = ray_environment(None, _recorded(tmp_path, f"127.0.0.1:{dead}"))
    assert note is not None
    assert f"127.0.0.1:{dead} that is gone" in note and "stale" in note
    assert "--ray-address" not in note  # a dead address is not offered to the user
    assert f"rm {tmp_path / 'ray' / 'ray_current_cluster'}" in note
    _, note = ray_environment(None, _recorded(tmp_path, f"127.0.0.1:{fake_gcs}"))
    assert note is not None and f"pass --ray-address 127.0.0.1:{fake_gcs}" in note


def test_ray_address_auto_with_a_stale_recorded_cluster_advises_unset_not_the_dead_address(
    tmp_path,
):
    # issue 34, F10: advising `--ray-address auto` (the dead address) was then refused by the probe
    dead = _free_port()  # nothing listens there
    env = {**_recorded(tmp_path, f"127.0.0.1:{dead}"), "RAY_ADDRESS": "auto"}
    with pytest.raises(RayClusterError) as e:
        ray_environment(None, env, probe_timeout=2.0)
    msg = str(e.value)
    assert f"at 127.0.0.1:{dead} is gone" in msg and "stale file" in msg, msg
    assert f"rm {tmp_path / 'ray' / 'ray_current_cluster'}" in msg
    assert "`unset RAY_ADDRESS`" in msg and "--ray-address" not in msg, msg


# --------------------------------------------------------------- case 7: the app by reference


def _app_module(tmp_path: Path, name: str, body: str, monkeypatch) -> object:
    """Import a ClientApp module written to ``tmp_path`` (removed from ``sys.modules`` after)."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    mod = importlib.import_module(name)
    return mod


def _as_a_worker(blob: bytes, name: str, tmp_path: Path, monkeypatch, importable: bool):
    """Unpickle ``blob`` as a fresh worker would: the module not yet imported (and, unless
    ``importable``, not on the path)."""
    monkeypatch.delitem(sys.modules, name)
    if not importable:
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    return cloudpickle.loads(blob)


AT_IMPORT = """
from flwr.clientapp import ClientApp
from flwr_sheaf.client.reference import travel_by_reference

app = travel_by_reference(ClientApp())

@app.query("mine")
def query(msg, context):
    return msg
"""


def test_a_worker_that_cannot_import_the_apps_module_is_told_module_file_and_fix(
    tmp_path, monkeypatch
):
    mod = _app_module(tmp_path, "fs_case7_app", AT_IMPORT, monkeypatch)
    blob = cloudpickle.dumps(mod.app)
    assert len(blob) < 400  # by reference
    with pytest.raises(ModuleNotFoundError) as e:
        _as_a_worker(blob, "fs_case7_app", tmp_path, monkeypatch, importable=False)
    msg = str(e.value)
    assert "cannot import 'fs_case7_app'" in msg
    assert str(tmp_path / "fs_case7_app.py") in msg
    assert f"PYTHONPATH={tmp_path}" in msg and "ray start" in msg


def test_handlers_registered_after_import_still_reach_the_worker(tmp_path, monkeypatch, caplog):
    late = "from flwr.clientapp import ClientApp\n\napp = ClientApp()\n"
    mod = _app_module(tmp_path, "fs_case7_late", late, monkeypatch)
    travel_by_reference(mod.app)  # what register_*_handlers does, here after the import

    @mod.app.train("mine")
    def train(msg, context):
        return msg

    with caplog.at_level("WARNING", logger="flwr_sheaf"):
        blob = cloudpickle.dumps(mod.app)
    # the warning says what each message now carries (the size of this very pickle)
    assert f"{len(blob) / 1e3:.1f} KB a message" in caplog.text, caplog.text
    app = _as_a_worker(blob, "fs_case7_late", tmp_path, monkeypatch, importable=True)
    # by reference the worker would import the module and get an app without the handler
    assert "train.mine" in app._registered_funcs


def test_an_app_short_of_handlers_in_the_worker_is_named_so(tmp_path, monkeypatch):
    mod = _app_module(tmp_path, "fs_case7_part", AT_IMPORT, monkeypatch)

    @mod.app.train("mine")  # after the import: a worker's import lacks it
    def train(msg, context):
        return msg

    blob = cloudpickle.dumps(mod.app)
    with pytest.raises(reference.ClientAppReferenceError) as e:
        _as_a_worker(blob, "fs_case7_part", tmp_path, monkeypatch, importable=True)
    msg = str(e.value)
    assert "arrived with 1 of the 2 handlers" in msg and "['query.mine']" in msg
    assert str(tmp_path / "fs_case7_part.py") in msg and "at module level" in msg


def test_copy_and_deepcopy_of_the_app_are_copies(tmp_path, monkeypatch):
    from flwr.clientapp import ClientApp

    mod = _app_module(tmp_path, "fs_case7_copy", AT_IMPORT, monkeypatch)
    local = travel_by_reference(ClientApp())  # not a module global
    for app in (mod.app, local):
        shallow, deep = copy.copy(app), copy.deepcopy(app)
        assert shallow is not app and deep is not app and type(deep) is type(app)
        assert set(deep._registered_funcs) == set(app._registered_funcs)
        assert copy.deepcopy({"app": app})["app"] is not app

        @deep.train("only_on_the_copy")
        def train(msg, context):
            return msg

        # a handler added to the deep copy never reaches the original
        assert "train.only_on_the_copy" not in app._registered_funcs
    # the module's app still travels by reference: a worker gets the module's app itself
    assert pickle.loads(pickle.dumps(mod.app)) is mod.app


def test_a_module_level_copy_of_the_app_travels_by_reference_and_any_other_copy_warns(
    tmp_path, monkeypatch, caplog
):
    # before: `app2 = copy.deepcopy(app)` at module level pickled by value (55.6 KB a message of the
    # bundled app) with no warning
    body = AT_IMPORT + "\nimport copy\ncopied = copy.deepcopy(app)\nshallow = copy.copy(app)\n"
    mod = _app_module(tmp_path, "fs_case7_copies", body, monkeypatch)
    blobs = {name: cloudpickle.dumps(getattr(mod, name)) for name in ("copied", "shallow")}
    for name, blob in blobs.items():
        assert len(blob) < 500 and b"fs_case7_copies" in blob  # module and name, not the handlers
        worker = _as_a_worker(blob, "fs_case7_copies", tmp_path, monkeypatch, importable=True)
        assert worker is vars(sys.modules["fs_case7_copies"])[name]
        assert set(worker._registered_funcs) == {"query.mine"}
    with caplog.at_level("WARNING", logger="flwr_sheaf"):
        later = copy.deepcopy(mod.app)  # inside a function: no module global, pickled by value
        cloudpickle.dumps(later)
    assert "this ClientApp is not a module-level object" in caplog.text


# ------------------------------------------------------------ the shared-machine recipe (docs)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its new parent has not reaped yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_stop_tool_stops_exactly_the_processes_of_its_temp_dir(tmp_path):
    # the other clusters' temp dirs extend this one's name (ray-ab) or lie inside it (ray-a/node2):
    # a prefix match would stop them too
    mine, other, nested = tmp_path / "ray-a", tmp_path / "ray-ab", tmp_path / "ray-a" / "node2"
    for d in (mine, other, nested):
        (d / "session_latest").mkdir(parents=True)  # what `ray start --temp-dir` makes
    (mine / "ray_current_cluster").write_text("127.0.0.1:1")
    # a stand-in raylet: a program under a ray/ directory, naming its temp dir, with a "worker"
    raylet = tmp_path / "site" / "ray" / "raylet.py"
    raylet.parent.mkdir(parents=True)
    raylet.write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(raylet), f"--temp-dir={d}", f"--log-dir={d}/session_1"]
        )
        for d in (mine, other, nested)
    ]
    # a process of this user that names the temp dir but is no Ray process (a `tail` of a log)
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", f"{mine}/session_latest/logs"]
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # each has started its child (a "worker")
            if all(psutil.Process(p.pid).children() for p in procs):
                break
            time.sleep(0.1)
        found = {p.pid for p in ray_cluster.cluster_processes(mine)}
        child = psutil.Process(procs[0].pid).children()[0].pid
        assert found == {procs[0].pid, child}
        out = subprocess.run(
            [sys.executable, str(TOOL), "stop", "--temp-dir", str(mine)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and f"stopped 2 Ray process(es) of {mine}" in out.stdout
        assert procs[0].wait(timeout=10) is not None and _ended(child)
        assert procs[1].poll() is None and procs[2].poll() is None  # other clusters': untouched
        assert bystander.poll() is None  # not a Ray process: untouched
        empty = tmp_path / "not-a-ray-dir"
        empty.mkdir()
        refused = subprocess.run(
            [sys.executable, str(TOOL), "stop", "--temp-dir", str(empty)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and "no Ray session in it" in refused.stderr
    finally:
        bystander.kill()
        bystander.wait()
        for p in procs:
            p.kill()
            p.wait()
        assert (
            ray_cluster.stop_cluster(other)[1] == [] and ray_cluster.stop_cluster(nested)[1] == []
        )


def test_free_ports_are_bindable_outside_the_ephemeral_range_and_bounded(capsys):
    # before: ports from bind(0), i.e. inside the range an outgoing connection may take, and
    # `free-ports 70000` ended in OSError: Too many open files
    # and outside Ray's default worker ports, which `ray start` refuses to give a component (the
    # two-node cluster test failed with "port number 10847 that is used by other components")
    lo, hi = ray_cluster._ephemeral_range()
    wlo, whi = ray_cluster.RAY_WORKER_PORTS
    ports = ray_cluster.free_ports(200)
    assert len(set(ports)) == 200
    assert all(1024 <= p <= 65535 and not lo <= p <= hi and not wlo <= p <= whi for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))  # raises if taken
    for n in (0, ray_cluster.MAX_FREE_PORTS + 1, 70000):
        assert ray_cluster.main(["free-ports", str(n)]) == 2
        assert (
            f"free-ports {n}: ask for 1 to {ray_cluster.MAX_FREE_PORTS} ports"
            in capsys.readouterr().err
        )


def test_the_stop_tool_refuses_rays_shared_default_temp_dir(tmp_path, monkeypatch, capsys):
    # /tmp/ray (or $RAY_TMPDIR/ray) holds the session of every private Ray instance of the machine:
    # stopping "its" cluster would stop everyone's simulation. Refused before any process is looked
    # up: stop_cluster/cluster_processes must not even be called.
    def must_not_run(*args, **kwargs):
        raise AssertionError("a process would have been signalled")

    monkeypatch.setattr(ray_cluster, "stop_cluster", must_not_run)
    monkeypatch.setattr(ray_cluster, "cluster_processes", must_not_run)
    fake = tmp_path / "rtmp"
    (fake / "ray" / "session_latest").mkdir(parents=True)  # looks like a live Ray temp dir
    monkeypatch.setenv("RAY_TMPDIR", str(fake))
    for shared in (fake / "ray", fake, "/tmp/ray", "/tmp", "/", "/tmp/ray/"):
        assert ray_cluster.main(["stop", "--temp-dir", str(shared)]) == 2, shared
        err = capsys.readouterr().err
        assert f"--temp-dir {shared}: this is Ray's shared default temp dir" in err, err
        assert "$RAYDIR" in err and "nothing was stopped" in err
    # a private dir next to it (the recipe's /tmp/ray-$USER-XXXX shape) is not the shared one
    private = tmp_path / "ray-me-abcd"
    assert ray_cluster.shared_temp_dir_problem(private) is None
    assert ray_cluster.shared_temp_dir_problem("/tmp/ray-me-abcd") is None
    assert ray_cluster.shared_temp_dir_problem(fake / "ray" / "x") is None


def _recipe() -> str:
    section = (ROOT / "docs" / "ray-cluster.md").read_text()
    return section[section.index("```bash") : section.index("```", section.index("```bash") + 7)]


def test_the_docs_ray_cluster_recipe_is_safe_on_a_shared_machine():
    recipe = _recipe()
    starts = [ln for ln in recipe.splitlines() if ln.strip().startswith("ray start")]
    assert starts and all("--temp-dir" in ln for ln in starts), starts
    # Ray's fixed defaults, which another user's cluster may hold: picked free on every node
    assert all(re.search(r"--dashboard-agent-listen-port \$\w+", ln) for ln in starts), starts
    head = next(ln for ln in starts if "--head" in ln)
    for flag in ("--port", "--dashboard-port", "--ray-client-server-port"):
        assert re.search(rf"{flag} \$\w+", head), (flag, head)  # picked, not a fixed default
    assert "flwr_sheaf/tools/ray_cluster.py free-ports" in recipe
    assert re.search(r"flwr_sheaf/tools/ray_cluster.py stop --temp-dir \S+", recipe)
    assert not re.search(r"^\s*ray stop", recipe, re.M)
    out = subprocess.run(
        [sys.executable, str(TOOL), "free-ports", "3"], capture_output=True, text=True, timeout=60
    )
    ports = [int(p) for p in out.stdout.split()]
    assert out.returncode == 0 and len(set(ports)) == 3 and all(1 <= p <= 65535 for p in ports)
