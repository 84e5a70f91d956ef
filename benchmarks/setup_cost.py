"""Cross-device set-up costs against the number of agents N (benchmarks/records/performance.md, "Cross-device").

Prints, for each N: the per-node cost of building a node's task after the first (the scenario's
data step is shared; the node's model is built), the time to build the ``class-overlap-knn:4``
graph, and, where the per-agent 80/10/10 splits cannot all be non-empty, the time the ServerApp
takes to refuse the run before any message.

    python benchmarks/setup_cost.py --agents 1000 10000 --dataset fashion-mnist
    python benchmarks/setup_cost.py --agents 10000 --discovery   # + the ServerApp's discovery, timed
"""

from __future__ import annotations

import argparse
import time

from flwr_sheaf.apps.scenario import check_scenario, scenario_task
from flwr_sheaf.config import ConfigError, ScenarioConfig
from flwr_sheaf.models.zoo import zoo_specs
from flwr_sheaf.topology import build_graph


def main() -> None:
    """Measure and print (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--partitioner", default="cross-device")
    ap.add_argument("--nodes", type=int, default=200, help="nodes timed per N")
    ap.add_argument(
        "--discovery",
        action="store_true",
        help="also time the ServerApp's discovery through the in-process grid (every node answers "
        "its query message: task built, stalk protocol checked) and stop after it",
    )
    args = ap.parse_args()
    for n in args.agents:
        sc = ScenarioConfig.from_mapping(
            {
                "zoo": f"tiny-{n}",
                "dataset": args.dataset,
                "num-pilots": 100,
                "partitioner": args.partitioner,
            }
        )
        t = time.perf_counter()
        scenario_task(sc, 0)
        first = time.perf_counter() - t
        t = time.perf_counter()
        for pid in range(1, min(n, args.nodes + 1)):
            scenario_task(sc, pid)
        per_node = (time.perf_counter() - t) / max(1, min(n, args.nodes + 1) - 1)
        t = time.perf_counter()
        build_graph("class-overlap-knn:4", n, [s.classes for s in zoo_specs(f"tiny-{n}")])
        knn = time.perf_counter() - t
        t = time.perf_counter()
        try:  # what run_server checks before any message, with the default (label-shift) splits
            check_scenario(
                ScenarioConfig.from_mapping(
                    {"zoo": f"tiny-{n}", "dataset": args.dataset, "num-pilots": 100}
                )
            )
            refusal = "label-shift splits feasible"
        except ConfigError:
            refusal = f"label-shift refused before any message in {time.perf_counter() - t:.1f} s"
        print(
            f"N={n}: first node (shared data step) {first:.2f} s, then {1000 * per_node:.1f} ms per node "
            f"({args.partitioner}); class-overlap-knn:4 graph {knn:.1f} s; {refusal}",
            flush=True,
        )
        if args.discovery:
            discovery(n, args.dataset, args.partitioner)


class _Discovered(Exception):
    """Raised after discovery to stop the run there."""


def discovery(n: int, dataset: str, partitioner: str) -> None:
    """Run the ServerApp on ``LocalGrid(app, n)`` (cross-device run config, 1% participation) up to
    the end of discovery; print its wall and CPU seconds and this process's peak RSS."""
    import resource

    from flwr_sheaf.apps.client_app import app
    from flwr_sheaf.apps.server_app import run_server
    from flwr_sheaf.strategy.graph import GraphStrategy
    from flwr_sheaf.testing import LocalGrid

    rc = {
        "zoo": f"tiny-{n}",
        "dataset": dataset,
        "partitioner": partitioner,
        "graph": "class-overlap-knn:4",
        "num-pilots": 200,
        "fraction-train": 0.01,
        "num-server-rounds": 1,
        "torch-threads": 1,
        "results-dir": f"/tmp/setup-cost-discovery-{n}",
        "overwrite": True,
    }
    orig = GraphStrategy.discover
    took: list[float] = []

    def timed(self, *a, **k):
        cpu, wall = time.process_time(), time.perf_counter()
        orig(self, *a, **k)
        took[:] = [time.perf_counter() - wall, time.process_time() - cpu]
        raise _Discovered

    GraphStrategy.discover = timed  # type: ignore[method-assign]
    try:
        run_server(LocalGrid(app, n, run_config=rc), rc)
    except _Discovered:
        pass
    finally:
        GraphStrategy.discover = orig  # type: ignore[method-assign]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"N={n}: discovery {took[0]:.1f} s wall, {took[1]:.1f} CPU-s "
        f"({1000 * took[1] / n:.1f} ms per node); peak RSS {rss:.2f} GiB",
        flush=True,
    )


if __name__ == "__main__":
    main()
