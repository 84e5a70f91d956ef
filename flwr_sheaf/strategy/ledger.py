"""The run ledger: each round's record, which node failed where, the run's status (docs/guarantees.md)."""

from __future__ import annotations

import logging
from typing import Any

from .records import EvaluationResult, RoundRecord

__all__ = ["RunFailedError", "RunLedger"]

log = logging.getLogger("flwr_sheaf")


class RunFailedError(RuntimeError):
    """A run past its ``max-failed-fraction``, raised after ``results.json`` is written."""


class RunLedger:
    """Records, failures, status and last results of one run.

    Attributes:
        rounds: the completed rounds' records, restored ones included.
        failures: ``{"round", "phase", "partition-id", "reason"}`` per recorded failure.
        current: the record of the round being built (None before :meth:`begin_round`).
        last_evaluation: the last evaluated round's result (``nodes``, ``edges``, ``non_edges``).
    """

    def __init__(self) -> None:
        self.rounds: list[RoundRecord] = []
        self.failures: list[dict] = []
        self.current: RoundRecord = None  # type: ignore[assignment]  # set by begin_round
        self.last_evaluation = EvaluationResult()

    def __getstate__(self) -> dict[str, Any]:
        """What a checkpoint stores: everything but the round being built (rebuilt per round)."""
        return {k: v for k, v in vars(self).items() if k != "current"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a checkpointed ledger; no round is being built."""
        vars(self).update(state)
        self.current = None  # type: ignore[assignment]

    def begin_round(self, server_round: int) -> RoundRecord:
        """Open the record of ``server_round``."""
        self.current = RoundRecord(round=server_round)
        return self.current

    def end_round(self, wall_seconds: float, elapsed_seconds: float) -> RoundRecord:
        """Close the current round with its wall and elapsed time, appended to :attr:`rounds`."""
        self.current.wall_seconds = wall_seconds
        self.current.elapsed_seconds = elapsed_seconds
        self.rounds.append(self.current)
        return self.current

    def record_failure(self, server_round: int, phase: str, pid: int, reason: str) -> None:
        """Record ``pid``'s failure in ``phase`` (``reason``'s last 500 chars) and in ``failed``."""
        self.failures.append(
            {"round": server_round, "phase": phase, "partition-id": pid, "reason": reason[-500:]}
        )
        failed = self.current.failed.setdefault(phase, [])
        if pid not in failed:
            failed.append(pid)
            failed.sort()
        log.warning(
            "round %d %s: partition-id %d failed: %s", server_round, phase, pid, reason[-300:]
        )

    @property
    def node_results(self) -> dict[int, dict]:
        """Per partition-id results of the last evaluation (``d``, private accuracy, ...)."""
        return self.last_evaluation.nodes

    @property
    def edge_results(self) -> list[dict]:
        """Per directed edge (``src`` -> ``dst`` receiver) communication accuracy of the last evaluation."""
        return self.last_evaluation.edges

    @property
    def non_edge_results(self) -> list[dict]:
        """Per directed non-edge pair of the last evaluation."""
        return self.last_evaluation.non_edges
