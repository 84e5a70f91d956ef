"""Cross-device set-up costs against the number of agents N (docs/performance.md, "Cross-device").

Prints, for each N: the per-node cost of building a node's task after the first (the scenario's
data step is shared; the node's model is built), the time to build the ``class-overlap-knn:4``
graph, and, where the per-agent 80/10/10 splits cannot all be non-empty, the time the ServerApp
takes to refuse the run before any message.

    python benchmarks/setup_cost.py --agents 1000 10000 --dataset fashion-mnist
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


if __name__ == "__main__":
    main()
