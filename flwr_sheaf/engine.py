"""Which Ray cluster a simulation's ClientApps ran on (``results.json``'s ``engine``): Flower's
address-less ``ray.init()`` joins one named by ``RAY_ADDRESS`` or a ``ray start`` address file
(docs/ray-cluster.md)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import psutil

__all__ = ["describe_ray", "ray_address_file", "warn_if_unasked"]

log = logging.getLogger("flwr_sheaf")


def ray_address_file(env: dict[str, str] | None = None) -> Path:
    """The file where ``ray start`` records the cluster ``ray.init()`` joins (Ray 2.55)."""
    env = dict(os.environ) if env is None else env
    root = env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp"
    return Path(root) / "ray" / "ray_current_cluster"


def _gcs_started_here() -> bool:
    """Whether a ``gcs_server`` descends from this process (a private Ray instance)."""
    try:
        return any(p.name() == "gcs_server" for p in psutil.Process().children(recursive=True))
    except psutil.Error:
        return False


def describe_ray() -> dict[str, Any] | None:
    """The Ray cluster this process is connected to, or None when Ray is not in use here.

    Returns:
        ``{"ray_address": "host:port" (the GCS), "ray_nodes": int (alive), "ray_cpus": float,
        "ray_gpus": float, "existing_cluster": bool (joined, not started here), "joined_through":
        "RAY_ADDRESS", the address file's path, or None}``; None when Ray does not answer (warned).
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        gcs = str(ray.get_runtime_context().gcs_address)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        total = ray.cluster_resources()
    except Exception as exc:  # noqa: BLE001 - a report must never cost the run its results
        log.warning(
            "could not describe the Ray cluster of this run: %s: %s", type(exc).__name__, exc
        )
        return None
    existing = not _gcs_started_here()
    how = None
    if existing:
        env_addr = os.environ.get("RAY_ADDRESS", "")
        f = ray_address_file()
        if env_addr and env_addr != "local":
            how = "RAY_ADDRESS"
        elif f.is_file():
            how = str(f)
    return {
        "ray_address": gcs,
        "ray_nodes": len(nodes),
        "ray_cpus": float(total.get("CPU", 0.0)),
        "ray_gpus": float(total.get("GPU", 0.0)),
        "existing_cluster": existing,
        "joined_through": how,
    }


def warn_if_unasked(info: dict[str, Any] | None) -> None:
    """Log where the ClientApps ran; a warning with the fix on a cluster nobody named."""
    if not info or not info["existing_cluster"]:
        return
    where = f"the existing Ray cluster at {info['ray_address']} ({info['ray_nodes']} node(s))"
    if info["joined_through"] == "RAY_ADDRESS":
        log.info("ClientApps ran on %s, named by RAY_ADDRESS", where)
        return
    log.warning(
        "ClientApps ran on %s, which nobody named: Ray joined it through %s, left by a `ray start` "
        "on this machine. To run on a private Ray instance use scripts/run_flwr.py (or export "
        "RAY_ADDRESS=local before flwr run); to run on that cluster on purpose, "
        "scripts/run_flwr.py --ray-address %s (docs/ray-cluster.md, 'A Ray cluster')",
        where,
        info["joined_through"] or "an address Ray found",
        info["ray_address"],
    )
