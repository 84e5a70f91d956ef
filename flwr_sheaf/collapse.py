"""Latent-collapse warning of a run (``results.json``'s ``latent_collapse``; docs/results-schema.md).

Each evaluated node reports ``low_variance_fraction``: the share of its latent dimensions whose
variance over its pilots is below ``1e-3`` (:func:`flwr_sheaf.sheaf.whitening.low_variance_fraction`,
docs/stability.md s3; the threshold equals the default ``whitening-eps``, so such a dimension is
below what the whitening resolves and carries nothing across an edge). A node above
:data:`COLLAPSE_WARN_FRACTION` has collapsed latents: its accuracies under-read the method
(FedProto under the shared optimizer: 55% of dimensions by round 5 on ``two-agent:32``,
docs/baselines.md s0). The run still completed as asked, so this is a warning, not a ``degraded``
status.
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

    Args:
        nodes: ``{partition-id: {"low_variance_fraction": float in [0, 1], ...}}``; nodes without the
            value, or with NaN / None (not measured), are skipped.
        threshold: the fraction above which a node counts as collapsed (default
            :data:`COLLAPSE_WARN_FRACTION`).

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
