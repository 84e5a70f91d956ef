"""The rows of an evaluated round and their means (paper Eq. 22, Fig. 2).

From the accepted replies: one row per evaluated node (:func:`node_rows`), per directed edge
(:func:`edge_rows`) and per directed non-edge pair (:func:`non_edge_rows`); then the round's summary
(:func:`summarise_accuracies`) and the extra means (:func:`extra_means`). Plain functions of checked
replies (:mod:`flwr_sheaf.strategy.evaluation_checks`): no strategy, no state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Message

from ..protocol import (
    COMM_ACCURACY,
    COMM_SRC,
    LOW_VARIANCE_FRACTION,
    METRICS,
    NON_EDGE_ACCURACY,
    NON_EDGE_DIRECT_ACCURACY,
    NON_EDGE_SRC,
    PRIVATE_ACCURACY,
    STALK_DIM,
    VAL_COMM_ACCURACY,
    VAL_NON_EDGE_ACCURACY,
    VAL_NON_EDGE_DIRECT_ACCURACY,
    VAL_PRIVATE_ACCURACY,
    as_float,
    as_int,
    as_list,
    metric_record,
)
from .records import EvaluationSummary, nanmean

__all__ = ["edge_rows", "extra_means", "node_rows", "non_edge_rows", "summarise_accuracies"]


def node_rows(phase1: Mapping[int, Message], node_metric_names: tuple[str, ...]) -> dict[int, dict]:
    """Per partition-id: ``d``, ``private_accuracy``, ``val_private_accuracy``,
    ``low_variance_fraction`` and each of ``node_metric_names`` (``-`` -> ``_``; NaN when absent)."""
    nodes = {}
    for pid, r in phase1.items():
        m = metric_record(r.content, METRICS)
        nodes[pid] = {
            "d": as_int(m[STALK_DIM], STALK_DIM),
            "private_accuracy": as_float(m[PRIVATE_ACCURACY], PRIVATE_ACCURACY),
            "val_private_accuracy": as_float(m[VAL_PRIVATE_ACCURACY], VAL_PRIVATE_ACCURACY),
            "low_variance_fraction": as_float(m[LOW_VARIANCE_FRACTION], LOW_VARIANCE_FRACTION),
        }
        for name in node_metric_names:
            nodes[pid][name.replace("-", "_")] = (
                as_float(m[name], name) if name in m else float("nan")
            )
    return nodes


def edge_rows(ok: Mapping[int, Message], edge_metric_keys: tuple[str, ...]) -> list[dict]:
    """Per directed edge (``src`` -> ``dst``, the receiver): test and validation communication
    accuracy and each of ``edge_metric_keys`` (NaN when absent)."""
    edges = []
    for dst, r in ok.items():
        m = metric_record(r.content, METRICS)
        for k, (src, acc, vacc) in enumerate(
            zip(
                as_list(m[COMM_SRC], COMM_SRC),
                as_list(m[COMM_ACCURACY], COMM_ACCURACY),
                as_list(m[VAL_COMM_ACCURACY], VAL_COMM_ACCURACY),
            )
        ):
            edges.append(
                {
                    "src": int(src),
                    "dst": int(dst),
                    "communication_accuracy": float(acc),
                    "val_communication_accuracy": float(vacc),
                    **{
                        n.replace("-", "_"): float(as_list(m[n], n)[k]) if n in m else float("nan")
                        for n in edge_metric_keys
                    },
                }
            )
    return edges


#: a phase-2 reply's non-edge lists -> the non-edge row's keys
_NON_EDGE_COLUMNS = {
    NON_EDGE_ACCURACY: "communication_accuracy",
    VAL_NON_EDGE_ACCURACY: "val_communication_accuracy",
    NON_EDGE_DIRECT_ACCURACY: "communication_accuracy_direct",
    VAL_NON_EDGE_DIRECT_ACCURACY: "val_communication_accuracy_direct",
}


def non_edge_rows(
    ok: Mapping[int, Message], plan_of: Mapping[int, list[tuple[int, np.ndarray, list[int]]]]
) -> list[dict]:
    """Per directed non-edge pair planned for a receiver: ``src``, ``dst``, ``hops``, ``path``, the
    multi-hop and the direct communication accuracies (test and validation)."""
    non_edges = []
    for dst in sorted(ok):
        plan = {j: path for j, _, path in plan_of.get(dst, [])}
        if not plan:
            continue
        m = metric_record(ok[dst].content, METRICS)
        col = {key: as_list(m[key], key) for key in _NON_EDGE_COLUMNS}
        for k, src in enumerate(as_list(m[NON_EDGE_SRC], NON_EDGE_SRC)):
            path = plan[int(src)]
            row = {"src": int(src), "dst": int(dst), "hops": len(path) - 1, "path": list(path)}
            non_edges.append(
                {**row, **{name: float(col[key][k]) for key, name in _NON_EDGE_COLUMNS.items()}}
            )
    return non_edges


def extra_means(
    nodes: Mapping[int, dict],
    edges: list[dict],
    non_edges: list[dict] | None,
    node_metric_names: tuple[str, ...],
    edge_metric_keys: tuple[str, ...],
) -> dict[str, Any]:
    """The round's extra metrics: ``<name>_mean`` over nodes of each node metric,
    ``<name>_degree_weighted`` (mean over directed edges, Fig. 2) of each edge metric and, when
    non-edge pairs were asked for (``non_edges`` not None), their means, count and mean hops."""
    extra: dict[str, Any] = {
        f"{name.replace('-', '_')}_mean": nanmean(n[name.replace("-", "_")] for n in nodes.values())
        for name in node_metric_names
    }
    for name in edge_metric_keys:  # degree-weighted = mean over directed edges (Fig. 2)
        key = name.replace("-", "_")
        extra[f"{key}_degree_weighted"] = nanmean(e[key] for e in edges)
    if non_edges is not None:  # mean over measured directed non-edge pairs
        for key, name in (
            ("communication_accuracy", "communication_accuracy_non_edges"),
            ("val_communication_accuracy", "val_communication_accuracy_non_edges"),
            ("communication_accuracy_direct", "communication_accuracy_non_edges_direct"),
            ("val_communication_accuracy_direct", "val_communication_accuracy_non_edges_direct"),
        ):
            extra[name] = nanmean(e[key] for e in non_edges)
        extra["non_edge_pairs_measured"] = len(non_edges)
        extra["non_edge_hops_mean"] = nanmean(e["hops"] for e in non_edges)
    return extra


def summarise_accuracies(nodes: Mapping[int, dict], edges: list[dict]) -> EvaluationSummary:
    """Round summary (paper Eq. 22, Fig. 2) of the ``nodes`` rows and the directed ``edges`` rows
    (``dst`` = receiver): ``private_accuracy_mean``; ``communication_accuracy_mean`` (mean over
    receivers of their mean over incoming edges, the reference code's); ``..._degree_weighted``
    (``sum_i deg_i A_i / sum_i deg_i`` = mean over directed edges, the paper's Fig. 2); the same with
    ``val_``; ``low_variance_fraction_mean``.
    """
    out = {
        "private_accuracy_mean": nanmean(n["private_accuracy"] for n in nodes.values()),
        "val_private_accuracy_mean": nanmean(n["val_private_accuracy"] for n in nodes.values()),
        "low_variance_fraction_mean": nanmean(
            n.get("low_variance_fraction", float("nan")) for n in nodes.values()
        ),
    }
    for prefix, key in (("", "communication_accuracy"), ("val_", "val_communication_accuracy")):
        per_recv: dict[int, list[float]] = {}
        for e in edges:
            per_recv.setdefault(e["dst"], []).append(e[key])
        out[f"{prefix}communication_accuracy_mean"] = nanmean(nanmean(v) for v in per_recv.values())
        out[f"{prefix}communication_accuracy_degree_weighted"] = nanmean(e[key] for e in edges)
    return EvaluationSummary(**out)
