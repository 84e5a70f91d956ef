"""The ServerApp that ``flwr run`` loads: the run config's ``method`` picks the strategy."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from ..results import write_results
from .methods import build_strategy
from .scenario import Scenario, run_config_value

log = logging.getLogger("flwr_sheaf")

app = ServerApp()


def run_server(grid: Grid, run_config: dict) -> Path:
    """Run the configured method for ``num-server-rounds`` on ``grid`` and write its results.

    Returns:
        Path of the written ``results.json``.
    """
    if not log.handlers:  # our own progress lines only; leave the root logger to the host app
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[flwr-sheaf] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    rc = dict(run_config)
    scenario = Scenario.from_run_config(rc)
    strategy = build_strategy(rc, scenario)
    t0 = time.monotonic()
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=int(run_config_value(rc, "num-server-rounds")))
    wall = time.monotonic() - t0
    config = {**{k: run_config_value(rc, k) for k in ("method",)}, **rc}
    out = Path(str(run_config_value(rc, "results-dir"))).expanduser().resolve()
    extra = strategy.results_extra() if hasattr(strategy, "results_extra") else {}
    path = write_results(out, config, strategy.history, strategy.node_results, strategy.edge_results,
                         failures=strategy.failures, total_wall_seconds=wall, **extra)
    log.info("results written to %s (%.1f s)", path, wall)
    return path


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point."""
    run_server(grid, dict(context.run_config))
