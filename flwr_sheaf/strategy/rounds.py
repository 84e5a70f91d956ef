"""The round loop behind :meth:`flwr_sheaf.strategy.graph.GraphStrategy.start` (stateless).

:func:`run_rounds`: discovery, a checkpointed run's state put back (docs/resume.md), then per round
:func:`train_round`, in evaluated rounds ``evaluate_round``, ``evaluate_fn`` and :func:`close_round`.
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
    """What the round loop uses of its strategy (:class:`~flwr_sheaf.strategy.graph.GraphStrategy`)."""

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
    """Give the ``flwr_sheaf`` logger a ``[flwr-sheaf]`` stderr handler at INFO unless logging is
    configured (a handler on it or on the root logger). Returns whether one was added."""
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
        ValueError: ``num_rounds`` not a positive integer; a config naming run-config keys.
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
    """Every ``evaluate-every`` rounds and the last (never with 0, no federation or no evaluation)."""
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
    """Discovery and ``num_rounds`` server rounds of ``s`` (arguments, result: ``GraphStrategy.start``)."""
    n = check_start(num_rounds, train_config, evaluate_config)
    s.extra_train_config = dict(train_config or {})
    s.extra_evaluate_config = dict(evaluate_config or {})
    s.requested_rounds = n
    default_progress_handler()
    s.summary()
    result = Result(arrays=initial_arrays if initial_arrays is not None else ArrayRecord())
    _serverapp_evaluate(evaluate_fn, 0, result)
    s.discover(grid, timeout)
    first, wall0 = 1, 0.0
    if s.checkpointer is not None:  # resume (docs/resume.md)
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
            cfg = ConfigRecord(s.extra_evaluate_config)
            metrics = s.evaluate_round(rnd, result.arrays, cfg, grid, timeout)
            if metrics is not None:
                result.evaluate_metrics_clientapp[rnd] = metrics
        _serverapp_evaluate(evaluate_fn, rnd, result)
        close_round(s, rnd, n, result.arrays, t_round, t0)
    return result


def train_round(
    s: RoundHost, grid: Grid, server_round: int, result: Result, timeout: float
) -> None:
    """``configure_train`` -> round trip -> ``aggregate_train``, into ``result``."""
    cfg = ConfigRecord(s.extra_train_config)
    msgs = list(s.configure_train(server_round, result.arrays, cfg, grid))
    replies = s.exchange.round_trip(grid, msgs, timeout)
    new_arrays, train_metrics = s.aggregate_train(server_round, replies)
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
    s: RoundHost, server_round: int, num_rounds: int, arrays: ArrayRecord, t_round: float, t0: float
) -> None:
    """Record and log the round, checkpoint it when due, then call the round callbacks."""
    now = time.monotonic()
    rec = s.ledger.end_round(now - t_round, now - t0)
    s.log_round(rec)
    if s.checkpointer is not None and s.checkpointer.due(server_round, num_rounds):
        s.checkpointer.save(s, server_round, arrays, time.monotonic() - t0)
    for callback in s.round_callbacks:
        callback(rec.as_dict())
