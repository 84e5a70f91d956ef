"""Server-side cost of the sheaf diagnostics and multi-hop plan on a large synthetic sheaf (notes/variants-diagnostics.md).

Builds a sheaf shaped like the 1,000-agent simulation without training anything: ``random-regular:4``
graph on N agents, stalk dimensions of the ``tiny-<N>`` zoo (16, 24, 24, 32, 32 cycled), K random
pilots per agent (float64), and times what :func:`flwr_sheaf.strategy.evaluation_steps.sheaf_diagnostics`
does per evaluated round: Procrustes refit of every edge (Eq. 18), per-edge total variation, the
non-edge draw and composition along shortest paths, and the Laplacian spectrum (Eq. 6; dense up to
4,096 stalk dimensions, LOBPCG above). One torch thread.

Usage::

    python benchmarks/diagnostics_cost.py [--agents 1000] [--eigenvalues 6] [--pilots 64] [--pairs 20]
"""

from __future__ import annotations

import argparse
import time

import networkx as nx
import torch

from flwr_sheaf.sheaf.diagnostics import laplacian_spectrum, sample_non_edges
from flwr_sheaf.sheaf.network import NetworkSheaf
from flwr_sheaf.topology import build_graph


def main() -> None:
    """Parse the options, build the sheaf, print one line of timings (seconds) and the spectrum."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--eigenvalues", type=int, default=6)
    ap.add_argument("--pilots", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.agents
    g = build_graph("random-regular:4", n)
    dims = {i: (16, 24, 24, 32, 32)[i % 5] for i in range(n)}
    gen = torch.Generator().manual_seed(0)
    pilots = {
        i: torch.randn(args.pilots, d, generator=gen, dtype=torch.float64) for i, d in dims.items()
    }
    t0 = time.perf_counter()
    sheaf = NetworkSheaf(g, dims)
    sheaf.fit_maps(pilots)
    t1 = time.perf_counter()
    sheaf.edge_total_variation(pilots)
    t2 = time.perf_counter()
    pairs = sample_non_edges(g, range(n), args.pairs, 0, 1)
    for a, b in pairs:
        path = nx.shortest_path(g, a, b)
        sheaf.transport_map(path)
        sheaf.transport_map(path[::-1])
    t3 = time.perf_counter()
    spec = laplacian_spectrum(sheaf.maps, sheaf.dims, sheaf.edges, args.eigenvalues)
    t4 = time.perf_counter()
    print(
        f"agents {n} edges {g.number_of_edges()} n {spec.n}: refit {t1 - t0:.1f} s, TV {t2 - t1:.1f} s, "
        f"{len(pairs)} non-edge pairs {t3 - t2:.2f} s, spectrum {t4 - t3:.1f} s ({spec.solver}, residual "
        f"{spec.max_residual:.1e}); eigenvalues {[round(e, 4) for e in spec.eigenvalues]}, "
        f"near-kernel {spec.near_kernel_dim} (exact: {spec.near_kernel_exact})"
    )


if __name__ == "__main__":
    main()
