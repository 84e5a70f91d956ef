"""The round loop behind :meth:`flwr_sheaf.strategy.graph.GraphStrategy.start` (Flower's ``Strategy.start``).

:func:`run_rounds`: discovery, a checkpointed run's state put back (docs/resume.md), then per server
round :func:`train_round`, in evaluated rounds (:func:`evaluates`) the strategy's ``evaluate_round``,
the ServerApp-side ``evaluate_fn`` and :func:`close_round` (record, progress line, checkpoint, round
callbacks). It keeps no state of its own between calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from ..config import KEYS, FederationConfig
from ..rundir import Checkpointer
from .evaluation import GraphEvaluation
from .exchange import Exchange
from .ledger import RunLedger
from .records import Node, RoundRecord, positive_int

__all__ = [
    "RoundHost",
    "check_start",
    "close_round",
    "default_progress_handler",
    "evaluates",
    "run_rounds",
    "train_round",
]

log = logging.getLogger("flwr_sheaf")


class RoundHost(Protocol):
    """What the round loop uses of its strategy (:class:`~flwr_sheaf.strategy.graph.GraphStrategy`
    is one): the loop is handed this narrow view, never imports the strategy's class."""

    ledger: RunLedger
    exchange: Exchange
    checkpointer: Checkpointer | None
    evaluation: GraphEvaluation | None
    federation: FederationConfig | None
    round_callbacks: list[Callable[[dict[str, Any]], None]]
    requested_rounds: int | None
    extra_train_config: dict
    extra_evaluate_config: dict

    @property
    def nodes(self) -> Mapping[int, Node]: ...  # noqa: D102
    def summary(self) -> None: ...  # noqa: D102
    def discover(self, grid: Grid, timeout: float) -> None: ...  # noqa: D102
    def configure_train(  # noqa: D102
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...
    def aggregate_train(  # noqa: D102
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]: ...
    def evaluate_round(  # noqa: D102
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        timeout: float,
    ) -> MetricRecord | None: ...
    def log_round(self, rec: RoundRecord) -> None: ...  # noqa: D102


def default_progress_handler() -> bool:
    """Give the ``flwr_sheaf`` logger a ``[flwr-sheaf] <message>`` stderr handler at INFO when
    logging is not configured (no handler on it nor on the root logger; an app that configures
    logging keeps its own). Returns whether one was added."""
    if log.handlers or logging.getLogger().handlers:
        return False
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[flwr-sheaf] %(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)
    log.propagate = False
    return True


#: ``(server round, global arrays) -> MetricRecord | None``: Flower's ServerApp-side evaluation
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


def check_start(
    num_rounds: int, train_config: ConfigRecord | None, evaluate_config: ConfigRecord | None
) -> int:
    """``num_rounds`` as an int, after checking ``start``'s arguments.

    Raises:
        ValueError: ``num_rounds < 1`` (or not an integer); ``train_config`` / ``evaluate_config``
            naming run-config keys (named: they belong on the strategy's config sections).
    """
    num_rounds = positive_int("num_rounds", num_rounds)
    for name, cfg in (("train_config", train_config), ("evaluate_config", evaluate_config)):
        owned = sorted(set(cfg or {}) & set(KEYS))
        if owned:
            raise ValueError(
                f"{name} keys {owned} are run-config keys: set them on the strategy's config "
                f"sections (flwr_sheaf.config), not per call"
            )
    return num_rounds


def evaluates(s: RoundHost, server_round: int, num_rounds: int) -> bool:
    """Every ``evaluate-every`` rounds and always the last one (``evaluate-every = 0``, no
    federation or no evaluation component: never)."""
    if s.evaluation is None or s.federation is None:
        return False
    every = s.federation.evaluate_every
    return every > 0 and (server_round % every == 0 or server_round == num_rounds)


def _serverapp_evaluate(evaluate_fn: EvaluateFn | None, server_round: int, result: Result) -> None:
    if evaluate_fn is not None:
        res = evaluate_fn(server_round, result.arrays)
        if res is not None:
            result.evaluate_metrics_serverapp[server_round] = res


def run_rounds(
    s: RoundHost,
    grid: Grid,
    initial_arrays: ArrayRecord | None,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord | None,
    evaluate_config: ConfigRecord | None,
    evaluate_fn: EvaluateFn | None,
) -> Result:
    """Discovery and ``num_rounds`` server rounds of ``s`` (arguments and errors: ``GraphStrategy.start``).

    Returns:
        Flower's ``Result``: the final arrays and per-round train/evaluate MetricRecords.
    """
    n = check_start(num_rounds, train_config, evaluate_config)
    s.extra_train_config = dict(train_config or {})
    s.extra_evaluate_config = dict(evaluate_config or {})
    s.requested_rounds = n  # a run whose rounds fall short of it is failed
    default_progress_handler()  # progress lines of one's own app, unless logging is configured
    s.summary()
    result = Result(arrays=initial_arrays if initial_arrays is not None else ArrayRecord())
    _serverapp_evaluate(evaluate_fn, 0, result)
    s.discover(grid, timeout)
    first, wall0 = 1, 0.0
    # resume: the state after the checkpointed round (docs/resume.md)
    if s.checkpointer is not None:
        first, restored = s.checkpointer.restore(s, n)
        wall0 = s.checkpointer.previous_wall_seconds
        if restored is not None:
            result.arrays = restored
    t0 = time.monotonic() - wall0
    for rnd in range(first, n + 1):
        t_round = time.monotonic()
        s.ledger.begin_round(rnd)
        train_round(s, grid, rnd, result, timeout)
        if evaluates(s, rnd, n):
            metrics = s.evaluate_round(
                rnd, result.arrays, ConfigRecord(s.extra_evaluate_config), grid, timeout
            )
            if metrics is not None:
                result.evaluate_metrics_clientapp[rnd] = metrics
        _serverapp_evaluate(evaluate_fn, rnd, result)
        close_round(s, rnd, n, result.arrays, t_round, t0)
    return result


def train_round(
    s: RoundHost, grid: Grid, server_round: int, result: Result, timeout: float
) -> None:
    """``configure_train`` -> one round trip -> ``aggregate_train``; the new arrays and the train
    metrics go into ``result`` (a round in which no sampled node trained is logged)."""
    msgs = list(
        s.configure_train(server_round, result.arrays, ConfigRecord(s.extra_train_config), grid)
    )
    new_arrays, train_metrics = s.aggregate_train(
        server_round, s.exchange.round_trip(grid, msgs, timeout)
    )
    rec = s.ledger.current
    if rec.sampled and rec.num_trained == 0:
        log.warning(
            "round %d: none of the %d sampled node(s) trained (failed: %s)",
            server_round,
            len(rec.sampled),
            rec.failed.get("train", []),
        )
    if new_arrays is not None:
        result.arrays = new_arrays
    if train_metrics is not None:
        result.train_metrics_clientapp[server_round] = train_metrics


def close_round(
    s: RoundHost,
    server_round: int,
    num_rounds: int,
    arrays: ArrayRecord,
    t_round: float,
    t0: float,
) -> None:
    """Time and append the round's record, log it, write the checkpoint when due (with the run's wall
    time since ``t0``), then call the round callbacks (a callback that raises ends the run, with
    this round saved)."""
    now = time.monotonic()
    rec = s.ledger.end_round(now - t_round, now - t0)
    s.log_round(rec)
    if s.checkpointer is not None and s.checkpointer.due(server_round, num_rounds):
        s.checkpointer.save(s, server_round, arrays, time.monotonic() - t0)
    for callback in s.round_callbacks:
        callback(rec.as_dict())
