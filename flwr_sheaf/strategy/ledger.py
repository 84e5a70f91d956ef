"""The run ledger: what happened in each server round, which node failed where, and the run's status.

:class:`RunLedger` (``strategy.ledger``) is written by the round loop, the messages and the
evaluation, and read by ``results.json``, the checkpoint and the ServerApp: one
:class:`~flwr_sheaf.strategy.records.RoundRecord` per completed round, one failure entry per node
and phase, the run's status (docs/guarantees.md) and the last evaluation's rows. It holds
no Flower object and knows nothing of graphs or methods.
"""

from __future__ import annotations

import logging
from typing import Any

from .records import EvaluationResult, RoundRecord

__all__ = ["RunFailedError", "RunLedger"]

log = logging.getLogger("flwr_sheaf")


class RunFailedError(RuntimeError):
    """A run past its ``max-failed-fraction`` (:func:`flwr_sheaf.results.run_status`): the ServerApp raises it
    after ``results.json`` is written, so Flower records the run as failed (docs/guarantees.md)."""


class RunLedger:
    """Records, failures, status and last results of one run (module docstring).

    Attributes:
        rounds: the completed rounds' records, restored ones included.
        failures: ``{"round", "phase", "partition-id", "reason"}`` per recorded failure.
        current: the record of the round being built (None before the first
            :meth:`begin_round`; every writer runs inside a round).
        last_evaluation: the last evaluated round's result (``nodes``, ``edges``, ``non_edges``).
    """

    def __init__(self) -> None:
        self.rounds: list[RoundRecord] = []
        self.failures: list[dict] = []
        # None until begin_round; every writer runs inside a round (declared non-Optional for type checkers)
        self.current: RoundRecord = None  # type: ignore[assignment]
        self.last_evaluation = EvaluationResult()

    def __getstate__(self) -> dict[str, Any]:
        """What a checkpoint stores: everything but the round being built (rebuilt per round)."""
        return {k: v for k, v in vars(self).items() if k != "current"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a checkpointed ledger; no round is being built."""
        vars(self).update(state)
        self.current = None  # type: ignore[assignment]

    def begin_round(self, server_round: int) -> RoundRecord:
        """Open the record of ``server_round`` (the round loop does it; tests that step rounds by hand too)."""
        self.current = RoundRecord(round=server_round)
        return self.current

    def end_round(self, wall_seconds: float, elapsed_seconds: float) -> RoundRecord:
        """Close the current round: its wall time and the run's elapsed time, appended to :attr:`rounds`."""
        self.current.wall_seconds = wall_seconds
        self.current.elapsed_seconds = elapsed_seconds
        self.rounds.append(self.current)
        return self.current

    def record_failure(self, server_round: int, phase: str, pid: int, reason: str) -> None:
        """Record one node's failure in ``phase`` (the last 500 characters of ``reason``), also in the
        current round's ``failed[phase]`` (sorted, once per node)."""
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
        """Per directed non-edge pair of the last evaluation
        (:func:`~flwr_sheaf.strategy.evaluation_steps.non_edge_rows`)."""
        return self.last_evaluation.non_edges
