"""Sheaf-FMTL strategy: relays the neighbours' projected parameters ``P_ji theta_j`` (notes/baselines-sheaf-fmtl.md, s8)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Unpack

import numpy as np
from flwr.app import Message

from ...config import DEFAULTS, ConfigError
from ...protocol import array_record, pack_arrays
from ...strategy.evaluation import GraphEvaluation
from ...strategy.graph import GraphStrategy
from .._shared.protocol import UPLOAD
from ..registry import GraphArgs, strategy_args
from . import (
    ACTION,
    SHEAF_FMTL_DIMS,
    SHEAF_FMTL_NEIGHBOURS,
    SHEAF_FMTL_NUM_PARAMS,
    SHEAF_FMTL_PROJECTIONS,
)
from .config import SheafFMTLConfig
from .maths import GIB, check_map_budget, edge_dim, map_bytes_per_node

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["SheafFMTL", "sheaf_fmtl_budget"]

log = logging.getLogger("flwr_sheaf")


def sheaf_fmtl_budget(
    num_params: Mapping[int, int], graph: nx.Graph, cfg: SheafFMTLConfig
) -> dict[int, int]:
    """Per-node float16 map bytes ``sum_j d_ij n_i * 2``, logged; refuses an over-budget config.

    Returns ``{partition-id: bytes}`` of ``num_params`` ``{partition-id: n_i}`` on ``graph``.

    Raises:
        ConfigError: the largest node's maps exceed ``sheaf-fmtl-max-gib`` (sizes and keys named).
    """
    per_node = map_bytes_per_node(num_params, graph.edges, cfg.gamma)
    worst = max(per_node, key=lambda p: per_node[p])
    log.info(
        "Sheaf-FMTL maps (float16, gamma=%g): %s GiB per partition-id; max %.3f GiB (partition-id %d), "
        "total %.3f GiB",
        cfg.gamma,
        {p: round(b / GIB, 4) for p, b in sorted(per_node.items())},
        per_node[worst] / GIB,
        worst,
        sum(per_node.values()) / GIB,
    )
    try:
        check_map_budget(per_node, cfg.max_gib, cfg.gamma)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return per_node


class SheafFMTL(GraphStrategy):
    """Sheaf-FMTL on Flower messages (evaluation: post hoc, as in the paper).

    The server holds no maps and no parameters: from each n_i it fixes every ``d_ij`` (F0) after
    discovery. A bad upload is that node's recorded failure (its previous projections stay).

    Args:
        num_nodes: agents.
        num_params: ``{partition-id: n_i}`` trainable parameters of every agent (the node checks its own).
        sheaf_fmtl: lambda, gamma, eta and the map budget.
        **common: federation, train, graph, action (pair with
            :func:`~flwr_sheaf.methods.sheaf_fmtl.client.register_sheaf_fmtl_handlers`),
            discovery_timeout (:class:`~flwr_sheaf.methods.registry.GraphArgs`).

    Raises:
        ValueError: ``num_params`` does not cover ``0..num_nodes-1`` with positive counts.
        ConfigError: (at discovery) the maps exceed ``sheaf-fmtl-max-gib`` on the built graph.
    """

    def __init__(
        self,
        num_nodes: int,
        *,
        num_params: Mapping[int, int],
        sheaf_fmtl: SheafFMTLConfig | None = None,
        **common: Unpack[GraphArgs],
    ) -> None:
        super().__init__(num_nodes, **strategy_args(ACTION, common, GraphEvaluation.posthoc))
        counts = {int(p): int(n) for p, n in num_params.items()}
        if sorted(counts) != list(range(num_nodes)) or min(counts.values(), default=0) < 1:
            raise ValueError(
                f"num_params must give a positive count for partition-ids 0..{num_nodes - 1}, got {counts}"
            )
        self.num_params = counts
        self.sheaf_fmtl = sheaf_fmtl or SheafFMTLConfig()
        self.dims: dict[tuple[int, int], int] = {}
        self.map_bytes: dict[int, int] = {}
        # sender -> {receiver: P_sr theta_s}
        self.projections: dict[int, dict[int, np.ndarray]] = {}

    def on_discovered(self) -> None:
        """Validate the graph, fix every d_ij (F0) and check the map budget on it."""
        super().on_discovered()
        assert self.graph is not None  # built by super().on_discovered()
        self.map_bytes = sheaf_fmtl_budget(self.num_params, self.graph, self.sheaf_fmtl)
        for a, b in self.graph.edges:
            d = edge_dim(self.num_params[a], self.num_params[b], self.sheaf_fmtl.gamma)
            self.dims[(a, b)] = self.dims[(b, a)] = d

    def method_config(self, server_round: int) -> dict:
        """:class:`SheafFMTLConfig` (every node)."""
        return self.sheaf_fmtl.to_dict()

    def node_payload(self, server_round: int, pid: int) -> tuple[dict, dict]:
        """The neighbours' latest ``P_ji theta_j`` (record) and the node's edges, d_ij and n_i (config)."""
        assert self.graph is not None  # built in on_discovered
        nbrs = sorted(self.graph.neighbors(pid))
        cfg = {
            SHEAF_FMTL_NEIGHBOURS: nbrs,
            SHEAF_FMTL_DIMS: [self.dims[(pid, j)] for j in nbrs],
            SHEAF_FMTL_NUM_PARAMS: self.num_params[pid],
        }
        got = {str(j): self.projections[j][pid] for j in nbrs if pid in self.projections.get(j, {})}
        return ({SHEAF_FMTL_PROJECTIONS: pack_arrays(got)} if got else {}), cfg

    def accept_train(
        self, server_round: int, ok: dict[int, Message]
    ) -> tuple[dict[int, Message], dict]:
        """Store each node's projections ``{j: (d_ij,)}`` (wrong keys, lengths or NaN/inf: recorded failure)."""
        accepted, sent = {}, 0
        assert self.graph is not None  # built in on_discovered
        for pid, r in ok.items():
            nbrs = sorted(self.graph.neighbors(pid))
            rec = array_record(r.content, UPLOAD) if UPLOAD in r.content else None
            got = {k: np.asarray(rec[k].numpy()) for k in rec} if rec is not None else {}
            bad = [] if rec is not None else ["no upload"]
            if rec is not None and sorted(got) != sorted(str(j) for j in nbrs):
                bad.append(f"keys {sorted(got)} instead of the neighbours {nbrs}")
            for j in nbrs:
                v = got.get(str(j))
                if v is not None and (
                    v.shape != (self.dims[(pid, j)],) or not np.isfinite(v).all()
                ):
                    bad.append(
                        f"projection for {j} of shape {v.shape} (expected ({self.dims[(pid, j)]},)) or NaN/inf"
                    )
            if bad:
                self.record_failure(server_round, "train", pid, "; ".join(bad))
                continue
            self.projections[pid] = {j: got[str(j)].astype(np.float32) for j in nbrs}
            sent += sum(v.size for v in got.values())
            accepted[pid] = r
        return accepted, {"projected_floats": sent}

    def results_extra(self) -> dict:
        """Sheaf-FMTL's settings, the edge dimensions and each node's map memory."""
        return {
            **super().results_extra(),
            "sheaf_fmtl": {
                **self.sheaf_fmtl.to_dict(),
                "num_params": {str(p): n for p, n in sorted(self.num_params.items())},
                "edge_dims": sorted([a, b, d] for (a, b), d in self.dims.items() if a < b),
                "map_gib": {str(p): b / GIB for p, b in sorted(self.map_bytes.items())},
            },
        }


def _main(argv: list[str]) -> None:
    """``python -m flwr_sheaf.methods.sheaf_fmtl.strategy [zoo] [gamma] [graph]``: print the per-node map memory."""
    from ...models.zoo import zoo_specs
    from ...topology import build_graph
    from . import zoo_parameter_counts

    zoo = argv[0] if argv else DEFAULTS["zoo"]
    gamma = float(argv[1]) if len(argv) > 1 else DEFAULTS["sheaf-fmtl-gamma"]
    spec = argv[2] if len(argv) > 2 else DEFAULTS["graph"]
    specs = zoo_specs(zoo)
    counts = zoo_parameter_counts(zoo)
    per = map_bytes_per_node(
        counts, build_graph(spec, len(specs), class_sets=[s.classes for s in specs]).edges, gamma
    )
    print(
        f"zoo={zoo} gamma={gamma:g} graph={spec}: float16 map GiB per partition-id (n_i parameters)"
    )
    for p in sorted(per):
        print(f"  {p:3d}  n_i={counts[p]:8d}  {per[p] / GIB:.4f}")
    print(f"  max {max(per.values()) / GIB:.4f}  total {sum(per.values()) / GIB:.4f}")


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
