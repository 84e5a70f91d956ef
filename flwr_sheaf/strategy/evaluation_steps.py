"""The plain functions of an evaluated round (paper Eq. 22, Fig. 2; no strategy, no state).

Reply checks (why a reply cannot be used, or None: that node's failure), the sheaf diagnostics
between the two phases with the non-edge plan (notes/variants-diagnostics.md), and the rows and
means of the accepted replies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import Message

from ..config import FederationConfig, LocalTrainConfig
from ..protocol import (
    ARRAYS,
    COMM_ACCURACY,
    COMM_SRC,
    DEVICE_INDEX,
    LOW_VARIANCE_FRACTION,
    METRICS,
    NON_EDGE_ACCURACY,
    NON_EDGE_DIRECT_ACCURACY,
    NON_EDGE_REPLY,
    NON_EDGE_SRC,
    PRIVATE_ACCURACY,
    STALK_DIM,
    VAL_COMM_ACCURACY,
    VAL_NON_EDGE_ACCURACY,
    VAL_NON_EDGE_DIRECT_ACCURACY,
    VAL_PRIVATE_ACCURACY,
    EdgeConfig,
    array_record,
    as_float,
    as_int,
    as_list,
    device_name,
    metric_record,
)
from ..sheaf.diagnostics import graph_algebraic_connectivity, laplacian_spectrum, sample_non_edges
from ..sheaf.network import NetworkSheaf
from ..sheaf.variants import edge_dim
from .discovery import edge_config
from .exchange import Exchange
from .ledger import RunLedger
from .records import EvaluationSummary, Node, RoundRecord, nanmean

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "EvaluationView",
    "NonEdgePlan",
    "comm_problem",
    "edge_rows",
    "extra_means",
    "node_rows",
    "non_edge_rows",
    "phase1_arrays_problem",
    "phase1_metrics_problem",
    "sheaf_diagnostics",
    "summarise_accuracies",
    "transported_arrays_problem",
]

#: one receiver's non-edge plan: ``[(source, composed map (d_i, d_j), path source first), ...]``
Plan = list[tuple[int, np.ndarray, list[int]]]
NonEdgePlan = dict[int, Plan]
"""The round's non-edge plan ``{receiver: Plan}`` (:func:`sheaf_diagnostics`)."""


@dataclass(frozen=True)
class EvaluationView:
    """What an evaluated round sees of the strategy (read-only; built by
    :func:`flwr_sheaf.strategy.graph.evaluation_view`).

    Attributes:
        nodes, graph: ``{partition-id: Node}`` (d_i = ``nodes[i].d``) and the agents' graph.
        num_nodes, num_pilots, seed, train: N, K, the run's seed, the local-training settings.
        evaluators: this round's evaluated partition-ids.
        payload, node_payload: ``(records, config entries)`` of every phase-1 message; ``pid ->``
            those only node ``pid`` gets.
        exchange, ledger: messages and the run's records (this round's: ``ledger.current``).
        owner: the strategy's class name (named in recorded reasons).
        trained: ``{partition-id: rounds it trained in}``, this round included.
        mode: run-config ``evaluate-nodes`` resolved (``trained``, ``panel`` or ``drawn``).
    """

    server_round: int
    nodes: Mapping[int, Node]
    graph: nx.Graph | None
    num_nodes: int
    num_pilots: int
    seed: int
    train: LocalTrainConfig
    evaluators: list[int]
    payload: tuple[dict, dict]
    node_payload: Callable[[int], tuple[dict, dict]]
    exchange: Exchange
    ledger: RunLedger
    owner: str
    trained: Mapping[int, int] = field(default_factory=dict)
    mode: str = "drawn"

    @property
    def record(self) -> RoundRecord:
        """The evaluated round's record (``ledger.current``)."""
        return self.ledger.current

    def edge_config(self, pid: int) -> EdgeConfig:
        """Node ``pid``'s incident edges (:func:`edge_config`)."""
        assert self.graph is not None, "the graph is built at discovery"
        return edge_config(self.graph, self.nodes, pid)

    def record_failure(self, phase: str, pid: int, reason: str) -> None:
        """Record node ``pid``'s failure in ``phase`` of this round."""
        self.ledger.record_failure(self.server_round, phase, pid, reason)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fraction(v: Any) -> bool:
    """A number that is NaN (not measured) or in [0, 1]."""
    return _number(v) and (math.isnan(v) or 0.0 <= v <= 1.0)


def _not_fractions(m: Mapping[str, Any], keys: tuple[str, ...] | list[str]) -> str | None:
    for k in keys:
        bad = [v for v in m[k] if not _fraction(v)]
        if bad:
            return f"{k} = {bad[:5]} not in [0, 1] (or NaN)"
    return None


def phase1_metrics_problem(m: Mapping[str, Any], d: int) -> str | None:
    """Why phase-1 metrics ``m`` are unusable: wrong stalk dimension, bad accuracy or fraction."""
    if not _number(m[STALK_DIM]) or m[STALK_DIM] != d:
        return f"{STALK_DIM} = {m[STALK_DIM]!r}, but the node reported d={d} at discovery"
    for key in (PRIVATE_ACCURACY, VAL_PRIVATE_ACCURACY):  # measured on non-empty splits
        if not _fraction(m[key]) or math.isnan(m[key]):
            return (
                f"{key} = {m[key]!r} is not in [0, 1] (NaN: the node's test and validation "
                f"splits are non-empty, so its accuracy is always measured)"
            )
    if not _fraction(m[LOW_VARIANCE_FRACTION]):
        return f"{LOW_VARIANCE_FRACTION} = {m[LOW_VARIANCE_FRACTION]!r} is not in [0, 1] (or NaN)"
    if DEVICE_INDEX in m and not (type(m[DEVICE_INDEX]) is int and m[DEVICE_INDEX] >= -2):
        return f"{DEVICE_INDEX} = {m[DEVICE_INDEX]!r} is not an integer >= -2 (-1: cpu, N: cuda:N)"
    return None


def phase1_arrays_problem(
    a: Mapping[str, Any], d: int, num_pilots: int, second: tuple[str, ...] = ()
) -> str | None:
    """Why raw evaluation arrays ``a`` are unusable: pilots not ``(K, d)``, latents not ``(M, d)``
    with ``(M,)`` integer labels, NaN/inf, or the ``second`` reading's arrays shaped otherwise."""
    pilots = a["pilots"].numpy()
    if pilots.shape != (num_pilots, d):
        return f"pilots of shape {pilots.shape}, expected ({num_pilots}, {d})"
    if not np.isfinite(pilots).all():
        return "NaN/inf pilots"
    for split in ("test", "val"):
        z, y = a[f"{split}-latents"].numpy(), a[f"{split}-labels"].numpy()
        bad = z.ndim != 2 or z.shape[1] != d or y.shape != (z.shape[0],)
        if bad or not np.issubdtype(y.dtype, np.integer):
            return f"{split} latents {z.shape} / labels {y.shape} {y.dtype}: expected (M, {d}) and (M,) integers"
        if not np.isfinite(z).all():
            return f"NaN/inf {split} latents"
    for name, like in zip(second, ("pilots", "test-latents", "val-latents")):
        z, want = a[name].numpy(), a[like].numpy().shape
        if z.shape != want or not np.isfinite(z).all():
            return f"{name} of shape {z.shape} (expected {want}) or NaN/inf entries"
    return None


def transported_arrays_problem(
    a: Mapping[str, Any], d: int, neighbour_dims: Mapping[int, int], num_pilots: int
) -> str | None:
    """Why stringent-privacy arrays ``a`` are unusable: raw pilots, or per neighbour ``{j: d_j}``
    transported pilots not ``(K, d_e)`` / latents not ``(M, d_e)`` / NaN or inf."""
    if "pilots" in a:
        return "raw pilots in a reply under privacy='stringent'"
    for j in sorted(neighbour_dims):
        width = edge_dim(d, neighbour_dims[j])
        shapes = {"pilots": (num_pilots, width)}
        for split in ("test", "val"):
            y = a[f"{split}-labels"].numpy()
            shapes[f"{split}-latents"] = (y.shape[0] if y.ndim == 1 else -1, width)
        for name, shape in shapes.items():
            key = f"{j}/{name}"
            if key not in a:
                return f"no {key!r}"
            x = a[key].numpy()
            if x.shape != shape:
                return f"{key} of shape {x.shape}, expected {shape}"
            if not np.isfinite(x).all():
                return f"NaN/inf in {key}"
    return None


def comm_problem(
    m: Mapping[str, Any],
    routed: tuple[int, ...],
    plan: Plan,
    edge_metric_keys: tuple[str, ...],
    second: tuple[str, ...] = (),
) -> str | None:
    """Why phase-2 metrics ``m`` are unusable: ``second`` reading missing, per-edge lists of different
    lengths, sources other than ``routed``, a bad accuracy, or bad non-edge entries for ``plan``."""
    missing = [n for n in second if n not in m]
    if missing:
        return f"the second reading (posthoc-readings = both) was asked for, but the reply lacks {missing}"
    return _edge_problem(m, routed, edge_metric_keys) or _non_edge_problem(m, plan)


def _edge_problem(
    m: Mapping[str, Any], routed: tuple[int, ...], edge_metric_keys: tuple[str, ...]
) -> str | None:
    lists = [COMM_SRC, COMM_ACCURACY, VAL_COMM_ACCURACY] + [n for n in edge_metric_keys if n in m]
    if any(not isinstance(m[k], list) for k in lists):
        return f"per-edge entries {lists} must be lists"
    if len({len(m[k]) for k in lists}) != 1:
        return f"per-edge lists of different lengths {[len(m[k]) for k in lists]}"
    src = m[COMM_SRC]
    if sorted(int(x) for x in src) != sorted(routed) or len(set(src)) != len(src):
        return f"sources {list(src)}, but neighbours {list(routed)} were routed to it"
    return _not_fractions(m, lists[1:])


def _non_edge_problem(m: Mapping[str, Any], plan: Plan) -> str | None:
    if not plan:
        return None
    names = NON_EDGE_REPLY[METRICS]
    missing = [k for k in names if k not in m]
    if missing:
        return f"non-edge sources were routed to it, but the reply lacks {missing}"
    if any(not isinstance(m[k], list) for k in names) or len({len(m[k]) for k in names}) != 1:
        return f"non-edge entries {list(names)} must be lists of one length"
    if sorted(int(x) for x in m[NON_EDGE_SRC]) != sorted(j for j, _, _ in plan):
        return f"non-edge sources {list(m[NON_EDGE_SRC])}, but {[j for j, _, _ in plan]} were routed to it"
    return _not_fractions(m, names[1:])


def sheaf_diagnostics(
    view: EvaluationView,
    federation: FederationConfig,
    phase1: Mapping[int, Message],
    holds_raw_pilots: bool = True,
) -> NonEdgePlan:
    """Sheaf diagnostics of ``view``'s round; returns the non-edge plan (notes/variants-diagnostics.md).

    Maps refitted by Procrustes (Eq. 18) on the accepted nodes' pilots; recorded: ``sheaf_edge_tv``,
    ``sheaf_tv_mean``, ``sheaf_tv_max``, with ``diagnostics-eigenvalues = k > 0`` the sheaf
    Laplacian's (Eq. 6) spectrum, with ``non-edge-pairs = P > 0`` up to P non-adjacent pairs planned
    both ways along a shortest path. Without raw pilots, ``*_skipped`` say why.
    """
    rec = view.record.evaluate
    why = _skip_reason(view, phase1, holds_raw_pilots)
    if why is not None:
        rec["sheaf_diagnostics_skipped"] = why
        if federation.non_edge_pairs > 0:
            rec["non_edges_skipped"] = why
        return {}
    present = sorted(phase1)
    if not present:
        return {}
    threads = torch.get_num_threads()
    if view.train.torch_threads > 0:
        torch.set_num_threads(view.train.torch_threads)
    try:
        raw = {p: array_record(phase1[p].content, ARRAYS)["pilots"].numpy() for p in present}
        pilots = {p: torch.from_numpy(np.asarray(a, dtype=np.float64)) for p, a in raw.items()}
        assert view.graph is not None  # built before any evaluation
        sub = view.graph.subgraph(present)
        sheaf = NetworkSheaf(sub, {p: view.nodes[p].d for p in present})
        sheaf.fit_maps(pilots)
        tv = sheaf.edge_total_variation(pilots)
        rec["sheaf_edge_tv"] = [[int(h), int(t), v] for (h, t), v in tv.items()]
        rec["sheaf_tv_mean"] = nanmean(tv.values())
        rec["sheaf_tv_max"] = max(tv.values()) if tv else float("nan")
        if federation.diagnostics_eigenvalues > 0:
            _spectrum(view, federation.diagnostics_eigenvalues, sheaf, sub, rec)
        if federation.non_edge_pairs <= 0:
            return {}
        return _non_edge_plan(view, federation.non_edge_pairs, sheaf, sub, present, rec)
    finally:
        torch.set_num_threads(threads)


def _skip_reason(
    view: EvaluationView, phase1: Mapping[int, Message], holds_raw_pilots: bool
) -> str | None:
    lacking = [p for p in sorted(phase1) if "pilots" not in phase1[p].content[ARRAYS]]
    if not holds_raw_pilots:
        return (
            f"{view.owner} does not hold the nodes' raw pilots (stringent privacy): the maps "
            f"cannot be composed or refitted at the server"
        )
    if lacking:
        return f"the phase-1 replies of partition-ids {lacking[:10]} carry no pilots: the maps cannot be refitted"
    return None


def _spectrum(
    view: EvaluationView, k: int, sheaf: NetworkSheaf, sub: nx.Graph, rec: dict[str, Any]
) -> None:
    seed = int(np.random.SeedSequence([view.seed, view.server_round]).generate_state(1)[0])
    try:
        spec = laplacian_spectrum(sheaf.maps, sheaf.dims, sheaf.edges, k, seed=seed)
    except torch.linalg.LinAlgError as exc:  # recorded, never a crashed server
        rec["sheaf_diagnostics_skipped"] = f"eigensolver failed: {exc}"
        return
    rec.update(
        {
            "sheaf_laplacian_eigenvalues": spec.eigenvalues,
            "sheaf_near_kernel_dim": spec.near_kernel_dim,
            "sheaf_near_kernel_exact": spec.near_kernel_exact,
            "sheaf_near_kernel_tolerance": spec.tolerance,
            "sheaf_kernel_dim_bound": spec.kernel_bound,
            "sheaf_laplacian_size": spec.n,
            "sheaf_eigensolver": spec.solver,
            "sheaf_eigen_residual": spec.max_residual,
            "graph_algebraic_connectivity": graph_algebraic_connectivity(sub),
        }
    )


def _non_edge_plan(
    view: EvaluationView,
    num_pairs: int,
    sheaf: NetworkSheaf,
    sub: nx.Graph,
    present: list[int],
    rec: dict[str, Any],
) -> NonEdgePlan:
    import networkx as nx

    plan: NonEdgePlan = {}
    pairs = sample_non_edges(view.graph, present, num_pairs, view.seed, view.server_round)
    if not pairs:
        rec["non_edges_skipped"] = (
            "no non-adjacent pair of evaluated nodes joined by a path of evaluated nodes"
        )
    for a, b in pairs:
        path = [int(v) for v in nx.shortest_path(sub, a, b)]
        for src_path in (path, path[::-1]):  # source first
            plan.setdefault(src_path[-1], []).append(
                (src_path[0], sheaf.transport_map(src_path).numpy(), src_path)
            )
    return plan


def node_rows(phase1: Mapping[int, Message], node_metric_names: tuple[str, ...]) -> dict[int, dict]:
    """Per partition-id: ``d``, private accuracies, ``low_variance_fraction``, ``device`` (when
    reported) and each of ``node_metric_names`` (``-`` -> ``_``; NaN when absent)."""
    nodes: dict[int, dict[str, Any]] = {}
    for pid, r in phase1.items():
        m = metric_record(r.content, METRICS)
        row = nodes[pid] = {
            "d": as_int(m[STALK_DIM], STALK_DIM),
            "private_accuracy": as_float(m[PRIVATE_ACCURACY], PRIVATE_ACCURACY),
            "val_private_accuracy": as_float(m[VAL_PRIVATE_ACCURACY], VAL_PRIVATE_ACCURACY),
            "low_variance_fraction": as_float(m[LOW_VARIANCE_FRACTION], LOW_VARIANCE_FRACTION),
        }
        if DEVICE_INDEX in m:
            row["device"] = device_name(as_int(m[DEVICE_INDEX], DEVICE_INDEX))
        for name in node_metric_names:
            row[name.replace("-", "_")] = as_float(m[name], name) if name in m else float("nan")
    return nodes


def edge_rows(ok: Mapping[int, Message], edge_metric_keys: tuple[str, ...]) -> list[dict]:
    """Per directed edge ``src`` -> ``dst``: communication accuracies and ``edge_metric_keys``."""
    edges = []
    for dst, r in ok.items():
        m = metric_record(r.content, METRICS)
        cols = [as_list(m[key], key) for key in (COMM_SRC, COMM_ACCURACY, VAL_COMM_ACCURACY)]
        for k, (src, acc, vacc) in enumerate(zip(*cols)):
            row = {"src": int(src), "dst": int(dst), "communication_accuracy": float(acc)}
            row["val_communication_accuracy"] = float(vacc)
            for n in edge_metric_keys:
                row[n.replace("-", "_")] = float(as_list(m[n], n)[k]) if n in m else float("nan")
            edges.append(row)
    return edges


#: a phase-2 reply's non-edge lists -> the non-edge row's keys
_NON_EDGE_COLUMNS = {
    NON_EDGE_ACCURACY: "communication_accuracy",
    VAL_NON_EDGE_ACCURACY: "val_communication_accuracy",
    NON_EDGE_DIRECT_ACCURACY: "communication_accuracy_direct",
    VAL_NON_EDGE_DIRECT_ACCURACY: "val_communication_accuracy_direct",
}


def non_edge_rows(ok: Mapping[int, Message], plan_of: NonEdgePlan) -> list[dict]:
    """Per planned directed non-edge pair: ``src``, ``dst``, ``hops``, ``path`` and accuracies."""
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
    """The round's extra metrics: ``<name>_mean`` of node metrics, ``<name>_degree_weighted`` of
    edge metrics (Fig. 2) and, for ``non_edges`` not None, their means, count and mean hops."""
    extra: dict[str, Any] = {
        f"{name.replace('-', '_')}_mean": nanmean(n[name.replace("-", "_")] for n in nodes.values())
        for name in node_metric_names
    }
    for name in edge_metric_keys:  # degree-weighted = mean over directed edges (Fig. 2)
        key = name.replace("-", "_")
        extra[f"{key}_degree_weighted"] = nanmean(e[key] for e in edges)
    if non_edges is not None:  # mean over measured directed non-edge pairs
        for key in _NON_EDGE_COLUMNS.values():
            name = key.replace("accuracy", "accuracy_non_edges", 1)  # ..._accuracy_non_edges...
            extra[name] = nanmean(e[key] for e in non_edges)
        extra["non_edge_pairs_measured"] = len(non_edges)
        extra["non_edge_hops_mean"] = nanmean(e["hops"] for e in non_edges)
    return extra


def summarise_accuracies(nodes: Mapping[int, dict], edges: list[dict]) -> EvaluationSummary:
    """Round summary (Eq. 22, Fig. 2; fields: :class:`EvaluationSummary`) of the rows."""
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
