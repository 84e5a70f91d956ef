"""Deployment-engine tests: one SuperLink + SuperNodes as separate OS processes (flwr_sheaf.tools.deploy_local).

Marked ``engine`` (CI runs them; skip locally with ``-m "not engine"``). One module-scoped
deployment (TLS, SuperNode authentication, 3 registered SuperNodes + 1 whose key is not
registered, every SuperNode with its own node-config ``state-dir``) serves the engine tests; the
kill test runs last: a whole run over TLS with authentication, a SuperNode SIGKILLed in round 2 and
restarted (it trains again from its persisted state in the same run), then a second ``flwr run``
that resumes the first from its checkpoint (docs/resume.md).

Every ClientApp message starts a fresh ``flwr-clientapp`` process (Flower 1.42 ``subprocess``
isolation), so the scenario is the smallest the app accepts: ``tiny-3`` zoo on a ring, 32 pilots,
one local step per round, evaluation only in the last round.
"""

from __future__ import annotations

import importlib
import json
import math
import ssl
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from flwr_sheaf.tools.deploy_local import (
    LocalDeployment,
    check_run_config,
    make_node_key,
    make_tls,
    to_run_config,
)

N = 3
SMALL = "zoo='tiny-3' graph='ring' num-pilots=32 local-epochs=1 max-steps-per-epoch=1 discovery-timeout=180"


# ------------------------------------------------------------------ fast checks (no processes)


def test_generated_certificates_chain_to_the_ca_and_name_the_hosts(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

    paths = make_tls(tmp_path, ["127.0.0.1", "superlink.example.org"])
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    cert = x509.load_pem_x509_certificate(paths["cert"].read_bytes())
    cert.verify_directly_issued_by(ca)  # raises unless signed by the CA's key
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert sans.get_values_for_type(x509.DNSName) == ["superlink.example.org"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert isinstance(cert.public_key().curve, ec.SECP384R1)
    assert oct(paths["key"].stat().st_mode & 0o777) == "0o600"
    other = make_tls(tmp_path / "other", ["127.0.0.1"])
    with pytest.raises(Exception):  # noqa: B017 - cryptography raises several types; a different CA does not vouch for this certificate
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(other["ca"].read_bytes()))


def test_the_package_installs_the_tool_with_its_extra():
    """pyproject: the console entry point resolves to the tool's ``main``; its dependencies are the
    ``deploy`` extra (also in ``dev``), not hard dependencies of the package."""
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())[
        "project"
    ]
    module, _, attr = project["scripts"]["flwr-sheaf-deploy"].partition(":")
    entry = getattr(importlib.import_module(module), attr)
    assert entry.__module__ == "flwr_sheaf.tools.deploy_local" and entry.__name__ == "main"
    names = {
        extra: {r.split(">")[0].split("=")[0].strip() for r in reqs}
        for extra, reqs in project["optional-dependencies"].items()
    }
    assert {"cryptography", "psutil"} <= names["deploy"] & names["dev"]
    hard = {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in project["dependencies"]}
    assert not hard & {"cryptography", "psutil"}
    with pytest.raises(SystemExit) as ex:
        entry(["--help"])
    assert ex.value.code == 0


def test_a_missing_dependency_names_the_deploy_extra(monkeypatch, tmp_path):
    # None in sys.modules makes `import psutil` raise ImportError, as on a machine without it
    monkeypatch.setitem(sys.modules, "psutil", None)
    for mod in ("flwr_sheaf.tools.deploy_local", "flwr_sheaf.tools.flwr_cli"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    for mod in ("flwr_sheaf.tools.flwr_cli", "flwr_sheaf.tools.deploy_local"):
        with pytest.raises(
            ImportError, match=r"needs 'psutil'.*pip install 'flwr-sheaf\[deploy\]'"
        ):
            importlib.import_module(mod)
    # every cryptography module, also those already imported (a cached submodule would be found)
    for name in [m for m in sys.modules if m.split(".")[0] == "cryptography"] + ["cryptography"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        ImportError, match=r"needs 'cryptography'.*pip install 'flwr-sheaf\[deploy\]'"
    ):
        make_tls(tmp_path, ["127.0.0.1"])
    with pytest.raises(ImportError, match=r"needs 'cryptography'.*flwr-sheaf\[deploy\]"):
        make_node_key(tmp_path, "site-0")


def test_node_keys_are_what_flower_reads(tmp_path):
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    priv, pub = make_node_key(tmp_path, "site-0")
    key = load_ssh_private_key(priv.read_bytes(), None)  # what flower-supernode does
    # what `flwr supernode register` sends is the same public key
    assert try_load_public_key(pub) == public_key_to_bytes(key.public_key())
    assert oct(priv.stat().st_mode & 0o777) == "0o600"


def test_run_config_is_checked_against_the_federation_before_anything_starts():
    parsed = check_run_config("zoo='tiny-3' graph='ring' lambda=0.5 results-dir='a b'", 3)
    assert parsed == {"zoo": "tiny-3", "graph": "ring", "lambda": 0.5, "results-dir": "a b"}
    from flwr.common.config import parse_config_args

    assert parse_config_args([to_run_config(parsed)]) == parsed  # round trip through flwr's parser
    with pytest.raises(ValueError, match=r"zoo='paper-15' has 15 agents but --num-supernodes is 3"):
        check_run_config("", 3)
    with pytest.raises(ValueError, match=r"zoo='tiny-4' has 4 agents but --num-supernodes is 3"):
        check_run_config("zoo='tiny-4' graph='ring'", 3)
    with pytest.raises(ValueError, match="lamda"):
        check_run_config("zoo='tiny-3' lamda=1", 3)


# ------------------------------------------------------------------ engine: one shared deployment


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    """A running TLS + authenticated federation: 3 registered SuperNodes, 1 intruder."""
    d = LocalDeployment(tmp_path_factory.mktemp("deploy"), num_supernodes=N, port=0, unregistered=1)
    try:
        t0 = time.monotonic()
        d.start(online_timeout=240)
        d.startup_seconds = time.monotonic() - t0
        yield d
    finally:
        d.stop()


def _results(dep, name: str) -> dict:
    return json.loads((dep.workdir / name / "results.json").read_text())


@pytest.mark.engine
def test_superlink_speaks_tls_with_the_generated_ca_only(dep):
    # TLS is really on: the SuperLink's certificate verifies against the generated CA only.
    url = f"https://{dep.address}/health"
    with urllib.request.urlopen(
        url, context=ssl.create_default_context(cafile=str(dep.tls["ca"])), timeout=10
    ) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(url, context=ssl.create_default_context(), timeout=10)


@pytest.mark.engine
def test_supernode_with_unregistered_key_is_refused(dep):
    intruder = next(n for n in dep.nodes if not n.registered)
    deadline = time.monotonic() + 60
    while intruder.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    log = intruder.log.read_text()
    assert intruder.proc.returncode != 0, log[-2000:]
    assert "Exit Code: 305" in log and "Failed to activate SuperNode" in log, log[
        -2000:
    ]  # Flower: activation refused
    # Only the registered keys are known to the SuperLink, and all of them are online.
    status = dep.nodes_status()
    assert status == {n.node_id: "online" for n in dep.nodes if n.registered}, status


def _state_meta(path: Path) -> dict:
    from flwr_sheaf.client.state import read_state

    return read_state(path)[0]


def _without_wall_times(rounds: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k not in ("wall_seconds", "elapsed_seconds")} for r in rounds
    ]


@pytest.mark.engine
def test_run_over_tls_with_a_supernode_killed_restarted_and_the_run_resumed(dep):
    """One run over TLS with authenticated SuperNodes (R = 6 rounds, evaluation in the last): round 1
    complete on every node; the victim SIGKILLed when its round-2 train message arrives, restarted
    at once with the same key and ``state-dir`` (refused by Flower until the SuperLink holds it
    offline), and training again later in the same run from its persisted round-1 state. Then a
    second ``flwr run`` with ``resume=true num-server-rounds=R+1`` continues from the round-R checkpoint.

    When the victim is back depends on Flower's heartbeat (it is accepted again only once the SuperLink
    holds it offline, ~60 s after the kill) against the speed of the others' rounds: round 3 or later;
    R leaves room for a fast machine."""
    timeout, R = 75.0, 6
    victim = next(n for n in dep.nodes if n.registered and n.partition_id == N - 1)
    if victim.proc.poll() is not None:
        pytest.fail(f"{victim.name} is not running: {victim.log.read_text()[-2000:]}")
    for n in dep.nodes:  # every SuperNode runs with its own node-config state-dir
        assert n.state_dir == dep.state_dir / n.name
    already = victim.log.read_text().count("Receiving: train.")
    out = dep.workdir / "run-c"
    # checkpoint-every=R: the server checkpoints after round R (what the resume needs) and every node
    # keeps its last R + 1 state files, so the victim's first file after its return is still there.
    rc = f"{SMALL} evaluate-every={R} checkpoint-every={R} round-timeout={timeout} results-dir='{out}'"
    run_id = dep.submit(f"{rc} num-server-rounds={R}")
    follower = dep.follow_log(run_id, dep.logs / "run-c.log")
    # SIGKILL the victim as soon as its second train message of this run arrives (round 2): its
    # ClientApp process is still starting, so no round-2 reply (and no round-2 state) can exist.
    deadline = time.monotonic() + 600
    while victim.log.read_text().count("Receiving: train.") < already + 2:
        assert time.monotonic() < deadline, "round 2 never reached the victim"
        time.sleep(0.05)
    dep.kill_supernode(victim)
    killed_log = victim.log.read_text()
    vdir = victim.state_dir / f"partition-{victim.partition_id}"
    assert sorted(p.name for p in vdir.glob("round-*.state")) == ["round-1.state"]
    t_kill = time.monotonic()
    attempts = dep.restart_supernode(
        victim, timeout=240
    )  # same key: same registered node id (checked)
    restart_seconds = time.monotonic() - t_kill
    status = dep.wait_run(run_id, timeout=900, follower=follower)
    follower.kill()
    assert status == "finished:completed", (dep.logs / "run-c.log").read_text()[-3000:]
    assert (
        killed_log.count("Sending: train.") == killed_log.count("Receiving: train.") - 1
    )  # no round-2 reply
    restarted_log = victim.log.read_text()[len(killed_log) :]
    assert f"SuperNode ID: {victim.node_id}" in restarted_log
    print(f"victim accepted again {restart_seconds:.1f} s after the kill, attempt {attempts}")
    # the first attempt waits until the SuperLink holds the node offline, so it is accepted at once;
    # one retry allowed for a heartbeat racing the status read (docs/deployment.md)
    assert 1 <= attempts <= 2

    res = _results(dep, "run-c")
    rounds = {r["round"]: r for r in res["rounds"]}
    assert sorted(rounds) == list(range(1, R + 1))
    assert rounds[1]["failed"]["train"] == [] and rounds[1]["num_trained"] == N
    assert rounds[1]["sampled"] == list(range(N))
    assert rounds[1]["ce"] is not None and math.isfinite(rounds[1]["ce"]) and rounds[1]["ce"] > 0
    # round 1 has no pilots yet; in round 2 every directed ring edge (6 on 3 nodes) carried its pilots
    assert rounds[1]["edges_relayed"] == 0 and rounds[2]["edges_relayed"] == 2 * N
    assert (
        rounds[2]["failed"]["train"] == [victim.partition_id] and rounds[2]["num_trained"] == N - 1
    )
    # The victim is back for good from round `back` on (3, or 4 when Flower marked it offline only
    # after round 3's messages had gone out): absent in between, on every node afterwards.
    back = next((r for r in range(3, R + 1) if rounds[r]["num_trained"] == N), None)
    assert back is not None, (
        f"the restarted victim never trained again in rounds 3..{R}: {res['failures']}"
    )
    for rnd in range(3, back):
        assert rounds[rnd]["failed"]["train"] == [victim.partition_id]
    for rnd in range(back, R + 1):
        assert rounds[rnd]["failed"].get("train", []) == [] and rounds[rnd]["num_trained"] == N
    failed = {(f["round"], f["phase"], f["partition-id"]) for f in res["failures"]}
    assert failed == {
        (r, "train", victim.partition_id) for r in range(2, back)
    }  # the others never failed
    # It reloaded its round-1 state: the state it wrote in round `back` continues round 1 of this
    # Flower run (from initialisation it would say previous-round 0, after a round-2 reply 2).
    meta = _state_meta(vdir / f"round-{back}.state")
    assert (meta["run-id"], meta["round"], meta["previous-round"]) == (run_id, back, 1)
    for n in dep.nodes:
        if n.registered and n is not victim:
            m = _state_meta(n.state_dir / f"partition-{n.partition_id}" / f"round-{R}.state")
            assert (m["run-id"], m["previous-round"]) == (run_id, R - 1)
    for pid in range(N):
        acc = res["nodes"][str(pid)]["private_accuracy"]
        assert acc is not None and math.isfinite(acc) and 0.0 <= acc <= 1.0

    # Second flwr run: resume the finished run from its round-R checkpoint for one more round.
    t0 = time.monotonic()
    run2, status2 = dep.run(
        f"{rc} num-server-rounds={R + 1} resume=true", timeout=600, log=dep.logs / "run-d.log"
    )
    print(f"resumed run: {time.monotonic() - t0:.1f} s")
    assert status2 == "finished:completed", (dep.logs / "run-d.log").read_text()[-3000:]
    res2 = _results(dep, "run-c")
    assert [r["round"] for r in res2["rounds"]] == list(range(1, R + 2))
    assert res2["resumed"]["after_round"] == R
    assert _without_wall_times(res2["rounds"][:R]) == _without_wall_times(res["rounds"])
    assert (
        res2["rounds"][R]["num_trained"] == N and res2["rounds"][R]["failed"].get("train", []) == []
    )
    assert res2["failures"] == res["failures"]
    for n in dep.nodes:  # every node continued its round-R state in the new Flower run
        if n.registered:
            m = _state_meta(n.state_dir / f"partition-{n.partition_id}" / f"round-{R + 1}.state")
            assert m["run-id"] == run2 and m["run-id"] != run_id and m["previous-round"] == R
