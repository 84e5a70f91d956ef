"""Latent-collapse warning of a run (``results.json``'s ``latent_collapse``; docs/results-schema.md).

A node whose ``low_variance_fraction`` (share of latent dimensions with pilot variance below
``1e-3``, docs/stability.md s3) exceeds :data:`COLLAPSE_WARN_FRACTION` has collapsed latents: its
accuracies under-read the method. The run still completed as asked: a warning, not ``degraded``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["COLLAPSE_WARN_FRACTION", "LOW_VARIANCE_THRESHOLD", "collapse_warnings"]

#: Share of a node's latent dimensions below the variance threshold past which the run is warned.
#: Healthy runs here stay at or below 0.125 (Sheaf-FRL main job 0.017, lambda = 1: 0.125,
#: docs/stability.md); FedProto under momentum 0.9 reaches 0.55 (docs/baselines.md s0).
COLLAPSE_WARN_FRACTION = 0.25
#: The variance below which a latent dimension counts as collapsed (``low_variance_fraction``'s default).
LOW_VARIANCE_THRESHOLD = 1e-3


def collapse_warnings(
    nodes: Mapping[Any, Mapping[str, Any]], threshold: float = COLLAPSE_WARN_FRACTION
) -> list[dict[str, Any]]:
    """The ``latent-collapse`` warning of a run whose nodes' latents collapsed, from the last
    evaluation's per-node results (``strategy.ledger.node_results`` / ``results.json``'s ``nodes``).

    ``nodes``: ``{partition-id: {"low_variance_fraction": float in [0, 1], ...}}`` (a missing, NaN or
    None value is skipped); a node above ``threshold`` counts as collapsed.

    Returns:
        ``[]``, or one dict ``{"kind": "latent-collapse", "nodes": {partition-id (str): fraction},
        "threshold": threshold, "variance_below": 1e-3, "message": str}`` naming every collapsed node
        in partition-id order.
    """
    bad: dict[str, float] = {}
    order = sorted(nodes, key=lambda p: (0, int(p), "") if str(p).isdigit() else (1, 0, str(p)))
    for pid in order:
        v = nodes[pid].get("low_variance_fraction")
        if v is None or not isinstance(v, (int, float)) or math.isnan(v):
            continue
        if v > threshold:
            bad[str(pid)] = float(v)
    if not bad:
        return []
    listed = ", ".join(f"{p}: {v:.0%}" for p, v in bad.items())
    return [
        {
            "kind": "latent-collapse",
            "nodes": bad,
            "threshold": threshold,
            "variance_below": LOW_VARIANCE_THRESHOLD,
            "message": (
                f"latent collapse on {len(bad)} of {len(nodes)} node(s) (partition-id: share of latent "
                f"dimensions with pilot variance < {LOW_VARIANCE_THRESHOLD:g}): {listed}; above "
                f"{threshold:.0%} the accuracies under-read the method: check its optimizer settings "
                "(train-defaults, lr, momentum; docs/baselines.md s0)"
            ),
        }
    ]
