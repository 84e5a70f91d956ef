"""The ServerApp that ``flwr run`` loads: the run config's ``method`` picks the strategy."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..methods import method_train_note, parse_run_config, run_config_warnings
from ..results import write_run
from ..rundir import open_run
from ..strategy.messaging import simulated
from ..tracking import Tracker
from .scenario import num_nodes, prepare_scenario

log = logging.getLogger("flwr_sheaf")

app = ServerApp()


def run_server(grid: Grid, run_config: Mapping) -> Path:
    """Validate the run config, run its method on ``grid``, write and return ``results.json``.

    Every key and value is checked (and the graph built) before any message is sent. Checkpoints
    and resume: docs/resume.md; tracking: docs/tracking.md; statuses: docs/guarantees.md.

    Raises:
        ConfigError, NoCheckpointError, LockedError, RunFailedError: as :func:`parse_run_config`,
            :func:`prepare_scenario`, :func:`open_run` and :func:`write_run` raise them.
        Exception: whatever ``strategy.start`` raised, re-raised after ``results.json`` is written.
    """
    if not log.handlers:  # our own progress lines only; leave the root logger to the host app
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[flwr-sheaf] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    config, method = parse_run_config(run_config)  # imports method-module first
    note = method_train_note(run_config, config.method)
    if note:  # the method's own optimizer settings (notes/baselines.md s0): said, never silent
        log.info("%s", note)
    n = num_nodes(config, method)
    strategy: Any = method.strategy(config, n)
    # before any message: what the run config means, the scenario's data
    warnings = run_config_warnings(run_config, config, method, strategy)
    for line in warnings:
        log.warning("%s", line)
    prepare_scenario(config, method, strategy, n)
    with open_run(config, strategy, simulated(grid)) as run:
        tracker = Tracker.from_config(config)  # None unless `tracking` names a tracker
        if tracker is not None:
            strategy.round_callbacks.append(tracker.log_round)
        initial = method.initial_arrays(config) if method.initial_arrays is not None else None
        stopped: Exception | None = None
        t0 = time.monotonic()
        try:
            strategy.start(
                grid=grid,
                initial_arrays=initial,
                num_rounds=config.num_server_rounds,
                timeout=config.round_timeout,
            )
        except Exception as exc:  # the rounds done so far are still written, status failed
            stopped = exc
        finally:
            if tracker is not None:
                tracker.close()
        wall = time.monotonic() - t0
        path = write_run(strategy, run, config, wall, warnings, tracker, stopped)
        if stopped is not None:
            raise stopped
        return path


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point."""
    run_server(grid, dict(context.run_config))
