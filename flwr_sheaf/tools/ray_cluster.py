"""Which Ray cluster a ``flwr run`` simulation runs on: an existing one only when asked for.

Flower 1.42 calls ``ray.init()`` without an address in the simulation process, so Ray 2.55 joins
the cluster in ``RAY_ADDRESS`` (``local``: a new instance), else the one named by the file
:func:`ray_address_file` that every ``ray start`` leaves, else starts a private instance: one
forgotten ``ray start`` silently captures every later simulation, and a run on a cluster cannot pass
``init-args-num-cpus``/``init-args-num-gpus`` (Ray refuses them after the SuperLink has started,
and ``flwr run`` still exits 0; the pitfalls, measured: docs/running.md, "A Ray cluster"). This
module decides up front, for ``scripts/run_flwr.py`` (which loads this file by path): the
``RAY_ADDRESS`` a run gets (the ``--ray-address`` cluster, or a private ``local`` instance), the
federation settings Ray refuses on a cluster, and whether the cluster answers.
"""

from __future__ import annotations

import importlib.util
import os
import socket
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
    "parse_address",
    "ray_address_file",
    "ray_environment",
]

#: Federation-config keys (Flower 1.42 ``--federation-config``) that ``ray.init`` refuses when it
#: connects to an existing cluster, with the per-node ``ray start`` option that replaces each.
CLUSTER_CONFLICTS = {
    "init-args-num-cpus": "ray start --num-cpus N",
    "init-args-num-gpus": "ray start --num-gpus N",
}


class RayClusterError(ValueError):
    """A run's Ray cluster settings that cannot work; the message names the setting and the fix."""


def parse_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a Ray cluster address ``host:port`` (the GCS address that
    ``ray start --head`` prints, e.g. ``10.0.0.5:6379``).

    Raises:
        RayClusterError: not ``host:port`` (e.g. a Ray Client ``ray://`` address, which Flower's
            backend cannot use: its ``runtime_env`` and actors need a driver inside the cluster).
    """
    if "://" in address:
        raise RayClusterError(
            f"--ray-address {address!r}: give the cluster's GCS address host:port (what "
            "`ray start --head` prints after `ray start --address=`), not a Ray Client ray:// "
            "address; run `flwr run` on a machine that can reach every Ray node (docs/running.md)"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RayClusterError(
            f"--ray-address {address!r}: expected host:port of the Ray head's GCS, e.g. "
            "10.0.0.5:6379 (the --port of `ray start --head`)"
        )
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Check that something accepts TCP connections at the cluster's GCS ``host:port``.

    Raises:
        RayClusterError: nothing answers (no cluster there, a firewall, or a wrong port), naming
            the address and how to start the head.
    """
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise RayClusterError(
            f"--ray-address {address}: no Ray cluster answers there ({exc}); start its head with "
            f"`ray start --head --port {port}` on {host} (and open that port to this machine), "
            "or drop --ray-address to run on a private local Ray instance (docs/running.md)"
        ) from exc


def check_federation_for_cluster(federation: dict[str, str], address: str) -> None:
    """Refuse federation-config keys that Ray refuses on an existing cluster.

    Args:
        federation: the ``--federation-config`` items as ``{key: value}`` strings.
        address: the cluster's address (for the message).

    Raises:
        RayClusterError: one of :data:`CLUSTER_CONFLICTS` is set; the message names the key, its
            value and the ``ray start`` option of each node that declares it instead.
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
    ray_address: str | None, env: dict[str, str] | None = None
) -> tuple[dict[str, str], str | None]:
    """The Ray variables for a simulation's environment, and a note for the user (or None).

    Args:
        ray_address: the cluster asked for (``host:port``), or None for a private local instance.
        env: the environment the simulation would otherwise inherit (default ``os.environ``).

    Returns:
        ``({"RAY_ADDRESS": ray_address or "local"}, note)``: ``local`` makes ``ray.init()`` start
        its own instance whatever ``ray start`` left behind (see the module docstring); ``note``
        names an existing cluster this run does *not* join and how to join it, when one is recorded
        in :func:`ray_address_file`.

    Raises:
        RayClusterError: ``RAY_ADDRESS`` is set in ``env`` (to something other than ``local``) but
            ``ray_address`` was not given, or differs from it: which cluster to use is ambiguous.
    """
    env = dict(os.environ) if env is None else env
    inherited = env.get("RAY_ADDRESS", "")
    if ray_address is not None:
        parse_address(ray_address)
        if inherited and inherited not in ("local", ray_address):
            raise RayClusterError(
                f"RAY_ADDRESS={inherited} is set in the environment and --ray-address "
                f"{ray_address} was given: unset RAY_ADDRESS or pass the same address"
            )
        return {"RAY_ADDRESS": ray_address}, None
    if inherited and inherited != "local":
        raise RayClusterError(
            f"RAY_ADDRESS={inherited} is set in the environment: the simulation would join that Ray "
            f"cluster although --ray-address was not given; pass --ray-address {inherited} to run "
            "on it, or `unset RAY_ADDRESS` to run on a private local Ray instance"
        )
    note = None
    f = ray_address_file(env)
    if f.is_file():
        recorded = f.read_text().strip()
        note = (
            f"note: {f} (left by `ray start`) names a Ray cluster at {recorded}; a plain `flwr run` "
            "would join it. This run starts its own local Ray instance (RAY_ADDRESS=local); to "
            f"run on that cluster pass --ray-address {recorded}"
        )
    return {"RAY_ADDRESS": "local"}, note
