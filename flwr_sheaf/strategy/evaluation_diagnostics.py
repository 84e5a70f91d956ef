"""The sheaf diagnostics between the two evaluation phases, and the non-edge plan
(:func:`sheaf_diagnostics`; docs/variants-diagnostics.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import networkx as nx
import numpy as np
import torch
from flwr.app import Message

from ..config import FederationConfig
from ..protocol import ARRAYS, array_record
from ..sheaf.diagnostics import graph_algebraic_connectivity, laplacian_spectrum, sample_non_edges
from ..sheaf.network import NetworkSheaf
from .evaluation_view import EvaluationView
from .records import nanmean

__all__ = ["NonEdgePlan", "sheaf_diagnostics"]

#: ``{receiver: [(source, composed map (d_i, d_j), path source first), ...]}``
NonEdgePlan = dict[int, list[tuple[int, np.ndarray, list[int]]]]


def sheaf_diagnostics(
    view: EvaluationView,
    federation: FederationConfig,
    phase1: Mapping[int, Message],
    holds_raw_pilots: bool = True,
) -> NonEdgePlan:
    """Sheaf diagnostics of ``view``'s evaluated round; returns the non-edge plan (docs/variants-diagnostics.md).

    On the subgraph induced by the accepted phase-1 nodes every edge's map is refitted by
    Procrustes on their pilots (Eq. 18). Recorded in the round: ``sheaf_edge_tv`` (per oriented
    edge), ``sheaf_tv_mean``, ``sheaf_tv_max``; with ``diagnostics-eigenvalues = k > 0`` the k
    smallest eigenvalues of the sheaf Laplacian (Eq. 6) and its near-kernel
    (:func:`~flwr_sheaf.sheaf.diagnostics.laplacian_spectrum`); with ``non-edge-pairs = P > 0``
    up to P non-adjacent pairs, each planned in both directions with the maps composed along a
    shortest path (:meth:`~flwr_sheaf.sheaf.network.NetworkSheaf.transport_map`).

    Without raw pilots (``holds_raw_pilots`` False under stringent privacy, or a reply without
    ``pilots``) nothing is computed and ``sheaf_diagnostics_skipped`` / ``non_edges_skipped`` say
    why. ``phase1``: the accepted replies ``{partition-id: reply}``; the server computes with
    ``torch-threads`` threads (when > 0; restored afterwards).
    """
    threads = torch.get_num_threads()
    if view.train.torch_threads > 0:
        torch.set_num_threads(view.train.torch_threads)
    try:
        return _diagnostics(view, federation, phase1, holds_raw_pilots)
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


def _diagnostics(
    view: EvaluationView,
    fed: FederationConfig,
    phase1: Mapping[int, Message],
    holds_raw_pilots: bool,
) -> NonEdgePlan:
    rec = view.record.evaluate
    present = sorted(phase1)
    why = _skip_reason(view, phase1, holds_raw_pilots)
    if why is not None:
        rec["sheaf_diagnostics_skipped"] = why
        if fed.non_edge_pairs > 0:
            rec["non_edges_skipped"] = why
        return {}
    if not present:
        return {}
    pilots = {
        p: torch.from_numpy(
            np.asarray(array_record(phase1[p].content, ARRAYS)["pilots"].numpy(), dtype=np.float64)
        )
        for p in present
    }
    assert view.graph is not None  # built before any evaluation
    sub = view.graph.subgraph(present)
    sheaf = NetworkSheaf(sub, {p: view.nodes[p].d for p in present})
    sheaf.fit_maps(pilots)
    tv = sheaf.edge_total_variation(pilots)
    rec["sheaf_edge_tv"] = [[int(h), int(t), v] for (h, t), v in tv.items()]
    rec["sheaf_tv_mean"] = nanmean(tv.values())
    rec["sheaf_tv_max"] = max(tv.values()) if tv else float("nan")
    if fed.diagnostics_eigenvalues > 0:
        _spectrum(view, fed.diagnostics_eigenvalues, sheaf, sub, rec)
    if fed.non_edge_pairs <= 0:
        return {}
    return _non_edge_plan(view, fed.non_edge_pairs, sheaf, sub, present, rec)


def _spectrum(
    view: EvaluationView, k: int, sheaf: NetworkSheaf, sub: nx.Graph, rec: dict[str, Any]
) -> None:
    try:
        spec = laplacian_spectrum(
            sheaf.maps,
            sheaf.dims,
            sheaf.edges,
            k,
            seed=int(np.random.SeedSequence([view.seed, view.server_round]).generate_state(1)[0]),
        )
    # a numerical failure is recorded, never a crashed server
    except torch.linalg.LinAlgError as exc:
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
