"""Tests that start a SuperLink or SuperNodes pick free ports (issue #28: the suite failed at load
with fixed ports taken by another job's SuperLink, ``port(s) [29591] already in use``)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

from flwr_sheaf.tools.flwr_cli import free_port_block

ROOT = Path(__file__).resolve().parents[1]

#: what starts Flower processes from a test: the run script, the deployment tool, the GPU session
STARTERS = ("run_flwr.py", "LocalDeployment", "gpu_session.sh")
#: a number in the range the suite's fixed ports came from (29291 .. 39791)
PORTLIKE = re.compile(r"(?<![\d.])([23]\d{4})(?![\d.])")


def fixed_ports(text: str) -> list[int]:
    """Port-like numbers (20000..39999) in a test source that starts Flower processes."""
    if not any(s in text for s in STARTERS):
        return []
    return [int(m.group(1)) for m in PORTLIKE.finditer(text)]


def test_the_scan_sees_each_way_a_fixed_port_was_given():
    # oracle for the scan itself: the forms the suite used before (issue #28)
    run = "run_flwr.py"
    assert fixed_ports(run + '"--port",\n        str(29591 + 100 * i),') == [29591]
    assert fixed_ports(run + '"--port",\n        "29691",') == [29691]
    assert fixed_ports("LocalDeployment(d, num_supernodes=N, port=29720, unregistered=1)") == [
        29720
    ]
    assert fixed_ports('gpu_session.sh "PORT": "29591",') == [29591]
    assert fixed_ports(run + '[("rfedags", 29791), ("rfedavg", 29891)]') == [29791, 29891]
    assert fixed_ports(run + '"--port",\n        "0", seed=290698, lr=0.29591') == []


def test_no_test_starts_flower_on_a_fixed_port():
    found = {
        p.name: fixed_ports(p.read_text())
        for p in sorted((ROOT / "tests").glob("test_*.py"))
        if p.name != Path(__file__).name
    }
    assert {k: v for k, v in found.items() if v} == {}


def test_free_port_block_returns_ports_that_can_be_bound():
    base = free_port_block(3)
    socks = []
    try:
        for port in range(base, base + 3):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", port))  # raises if taken
    finally:
        for s in socks:
            s.close()


def test_stop_processes_keeps_the_exit_status_of_a_stopped_child():
    # the deployment tool reads a SuperNode's Popen.returncode (wait_online's "exited with code"):
    # a killed child must read -9 / -15 (the signal), not 0 (psutil reaping it first made it 0)
    import signal
    import subprocess
    import sys

    from flwr_sheaf.tools.flwr_cli import stop_processes

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    killed, stopped = subprocess.Popen(sleeper), subprocess.Popen(sleeper)
    assert stop_processes([killed], first=signal.SIGKILL) == 1
    assert stop_processes([stopped]) == 1
    assert (killed.returncode, stopped.returncode) == (-signal.SIGKILL, -signal.SIGTERM)
