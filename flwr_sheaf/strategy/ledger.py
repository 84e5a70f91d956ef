"""The run ledger: each round's record, which node failed where, the run's status (docs/guarantees.md)."""

from __future__ import annotations

import logging
import math
from typing import Any

from ..config import DEFAULTS
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
        """Record one node's failure in ``phase`` (``reason``'s last 500 characters) and in the
        current round's ``failed[phase]``."""
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

    def run_status(
        self, max_failed_fraction: float = DEFAULTS["max-failed-fraction"]
    ) -> dict[str, Any]:
        """Whether the run is ``completed``, ``degraded`` or ``failed`` (rules: docs/guarantees.md).

        Returns:
            ``status``, ``reasons`` (why failed), ``problems`` (why degraded besides failed replies)
            and the counts behind them (keys: docs/results-schema.md, ``degradation``).
        """
        rounds, failures = self.rounds, self.failures
        sampled, failed, idle, per_node = _train_counts(rounds)
        by_phase, nodes = _failure_rows(failures, per_node)
        rows = per_node.items()
        every = sorted(
            p for p, r in rows if 0 < len(r["train_failed_rounds"]) == r["rounds_sampled"]
        )
        fraction = failed / sampled if sampled else 0.0
        reasons: list[str] = []
        if fraction > max_failed_fraction:
            reasons.append(
                f"{failed} of {sampled} sampled train replies failed ({fraction:.0%} > max-failed-fraction="
                f"{max_failed_fraction})"
            )
        if idle and max_failed_fraction < 1.0:
            reasons.append(f"round(s) {idle} trained nobody (every sampled node failed)")
        nobody = [r.round for r in rounds if not r.sampled]
        problems: list[str] = []
        if rounds and len(nobody) == len(rounds):
            reasons.append(_NOBODY_DRAWN.format(n=len(rounds)))
        elif nobody:
            problems.append(_MOST_DRAWN_NOBODY.format(k=len(nobody), n=len(rounds), rounds=nobody))
        measured = _accuracy_measured(rounds, failures)
        if measured is False:  # failed evaluations: failed (report only: degraded); none: degraded
            line = _nothing_measured(failures)
            failed_evaluations = any(f["phase"] in _EVALUATION_PHASES for f in failures)
            (reasons if failed_evaluations and max_failed_fraction < 1.0 else problems).append(line)
        degraded = failures or failed or problems
        return {
            "status": "failed" if reasons else ("degraded" if degraded else "completed"),
            "reasons": reasons,
            "problems": problems,
            "max_failed_fraction": float(max_failed_fraction),
            "train_sampled": sampled,
            "train_failed": failed,
            "failed_fraction": fraction,
            "failures_by_phase": by_phase,
            "rounds_without_training": idle,
            "all_rounds_trained_nobody": bool(idle)
            and len(idle) == sum(bool(r.sampled) for r in rounds),
            "rounds_drawing_nobody": nobody,
            "accuracy_measured": measured,
            "nodes_failed_every_round": every,
            "nodes": {p: nodes[p] for p in sorted(nodes)},
        }


_NOBODY_DRAWN = (
    "no node was drawn to train in any of the {n} round(s), so nothing was trained: the "
    "participation probabilities (participation) are too small for num-server-rounds; raise them "
    "(notes/participation.md)"
)
_MOST_DRAWN_NOBODY = (
    "{k} of {n} rounds drew no node to train (rounds {rounds}): those rounds trained nothing; raise "
    "the participation probabilities (participation) for a run that trains every round "
    "(notes/participation.md)"
)

_EVALUATION_PHASES = ("evaluate", "evaluate_comm")
_ACCURACIES = (  # any finite one counts as measured
    "private_accuracy_mean",
    "communication_accuracy_mean",
    "communication_accuracy_degree_weighted",
)


def _accuracy_measured(rounds: list[RoundRecord], failures: list[dict]) -> bool | None:
    """Whether some evaluated round has a finite accuracy (None: no evaluation was asked)."""
    evaluated = [r for r in rounds if r.evaluation is not None]
    if not evaluated and not any(f["phase"] in _EVALUATION_PHASES for f in failures):
        return None
    return any(
        math.isfinite(v)
        for r in evaluated
        for v in (getattr(r.evaluation, k, float("nan")) for k in _ACCURACIES)
        if isinstance(v, (int, float))
    )


def _nothing_measured(failures: list[dict]) -> str:
    """The line of a run whose evaluations measured no accuracy."""
    bad = [f for f in failures if f["phase"] in _EVALUATION_PHASES]
    if not bad:
        return "no accuracy was measured: every evaluated round's accuracies are null"
    rounds = sorted({f["round"] for f in bad})
    return (
        f"no accuracy was measured: all evaluations failed ({len(bad)} evaluation failure(s) in "
        f"round(s) {rounds}; first, partition-id {bad[0]['partition-id']}: "
        f"{bad[0]['reason'][-200:]}); fix the nodes' evaluation errors (results.json 'failures')"
    )


def _train_counts(rounds: list[RoundRecord]) -> tuple[int, int, list[int], dict[int, dict]]:
    """``(sampled, failed, rounds that trained nobody, per sampled node's rounds)`` of the train phase."""
    sampled = failed = 0
    idle: list[int] = []
    per_node: dict[int, dict[str, Any]] = {}
    for r in rounds:
        bad = set(r.failed.get("train", [])) & set(r.sampled)
        n_failed = max(len(bad), len(r.sampled) - r.num_trained)
        sampled, failed = sampled + len(r.sampled), failed + n_failed
        if r.sampled and r.num_trained == 0:
            idle.append(r.round)
        for pid in r.sampled:
            row = per_node.setdefault(pid, {"rounds_sampled": 0, "train_failed_rounds": []})
            row["rounds_sampled"] += 1
            if pid in bad or (r.num_trained == 0 and not bad):
                row["train_failed_rounds"].append(r.round)
    return sampled, failed, idle, per_node


def _failure_rows(
    failures: list[dict], per_node: dict[int, dict]
) -> tuple[dict[str, int], dict[int, dict]]:
    """``(failures by phase, per failing partition-id: counts by phase, up to 3 reasons, its rounds)``."""
    by_phase: dict[str, int] = {}
    nodes: dict[int, dict] = {}
    for f in failures:
        by_phase[f["phase"]] = by_phase.get(f["phase"], 0) + 1
        row = nodes.setdefault(f["partition-id"], {"failures": {}, "reasons": []})
        row["failures"][f["phase"]] = row["failures"].get(f["phase"], 0) + 1
        if f["reason"] not in row["reasons"] and len(row["reasons"]) < 3:
            row["reasons"].append(f["reason"])
    for pid, row in nodes.items():
        row.update(per_node.get(pid, {"rounds_sampled": 0, "train_failed_rounds": []}))
    return by_phase, nodes
