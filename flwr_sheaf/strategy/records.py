"""The server's record types and the small helpers that fill them (plain values)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from flwr.app import ArrayRecord, RecordDict

from ..protocol import NodeInfo

__all__ = [
    "RoundRecord",
    "EvaluationSummary",
    "EvaluationResult",
    "MetricValues",
    "numeric_metrics",
    "Node",
    "record_bytes",
    "nanmean",
    "positive_int",
]


def nanmean(xs: Iterable[float | None]) -> float:
    """Mean ignoring None/NaN (NaN when nothing is left); ``math.fsum``, so independent of the
    values' order (replies arrive in any order); an overflowing sum is scaled by 2**-64 (exact);
    +inf with -inf gives NaN."""
    vals = [float(x) for x in xs if x is not None and not math.isnan(float(x))]
    if not vals:
        return float("nan")
    try:
        return math.fsum(vals) / len(vals)
    except OverflowError:  # an intermediate partial sum beyond the float range
        return math.ldexp(math.fsum(math.ldexp(v, -64) for v in vals) / len(vals), 64)
    except ValueError:  # -inf + inf
        return float("nan")


def positive_int(name: str, value: int) -> int:
    """``value`` as an int, or a ``ValueError`` naming ``name`` and the value (non-integral or < 1)."""
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def record_bytes(content: RecordDict) -> int:
    """Payload bytes of a RecordDict (arrays' buffers, 8 B per metric/config value, strings by
    length), not Flower's framing."""
    total = 0
    for rec in content.values():
        if isinstance(rec, ArrayRecord):
            total += rec.count_bytes()
            continue
        for v in rec.values():
            if isinstance(v, (bytes, str)):
                total += len(v)
            else:  # 8 B per number
                total += 8 * len(v) if isinstance(v, list) else 8
    return total


@dataclass(frozen=True)
class Node:
    """A discovered node: Flower's node id and what it reported (:class:`~flwr_sheaf.protocol.NodeInfo`)."""

    node_id: int
    info: NodeInfo

    @property
    def d(self) -> int:
        """Stalk dimension d_i."""
        return self.info.d


@dataclass
class EvaluationSummary:
    """One evaluated round's accuracies (paper Eq. 22, Fig. 2); NaN where nothing was measured.

    Attributes:
        private_accuracy_mean: mean over nodes of the private test accuracy.
        communication_accuracy_mean: mean over receivers of their mean over incoming edges.
        communication_accuracy_degree_weighted: ``sum_i deg_i A_i / sum_i deg_i`` = mean over
            directed edges (the paper's Fig. 2).
        val_*: the same on the validation splits (for model and lambda selection).
        low_variance_fraction_mean: mean share of latent dimensions with variance < 1e-3 (collapse).
    """

    private_accuracy_mean: float = float("nan")
    val_private_accuracy_mean: float = float("nan")
    communication_accuracy_mean: float = float("nan")
    communication_accuracy_degree_weighted: float = float("nan")
    val_communication_accuracy_mean: float = float("nan")
    val_communication_accuracy_degree_weighted: float = float("nan")
    low_variance_fraction_mean: float = float("nan")


@dataclass
class EvaluationResult:
    """One evaluated round's outcome (what :class:`GraphEvaluation` returns).

    Attributes:
        summary: the accuracies (:class:`EvaluationSummary`).
        extra: the method's extra round metrics (``prototype_accuracy_mean``, non-edge means, ...).
        nodes: per partition-id results; edges: per directed edge; non_edges: per non-edge pair.
    """

    summary: EvaluationSummary = field(default_factory=EvaluationSummary)
    extra: dict[str, Any] = field(default_factory=dict)
    nodes: dict[int, dict] = field(default_factory=dict)
    edges: list[dict] = field(default_factory=list)
    non_edges: list[dict] = field(default_factory=list)

    def metrics(self) -> dict[str, Any]:
        """Summary and extra metrics in one flat dict."""
        return {**vars(self.summary), **self.extra}


@dataclass
class RoundRecord:
    """What happened in one server round (:meth:`as_dict`: its ``results.json`` entry).

    Attributes:
        round: server round (1-based).
        sampled: partition-ids sent a train message.
        num_trained: nodes whose train reply was accepted.
        bytes_sent, bytes_received: protocol payload bytes (:func:`record_bytes`) of all phases.
        failed: ``{phase: [partition-id, ...]}`` of nodes that failed or did not answer in time.
        evaluation: the accuracies of an evaluated round, None otherwise.
        train: the method's aggregated training metrics (names with ``_``; e.g. ``ce``, ``gluing_loss``).
        evaluate: the method's extra evaluation metrics (e.g. ``prototype_accuracy_mean``).
        wall_seconds: this round's wall time; elapsed_seconds: since the first round started.
    """

    round: int
    sampled: list[int] = field(default_factory=list)
    num_trained: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    failed: dict[str, list[int]] = field(default_factory=dict)
    evaluation: EvaluationSummary | None = None
    train: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = float("nan")
    elapsed_seconds: float = float("nan")

    def as_dict(self) -> dict[str, Any]:
        """The round's ``results.json`` entry."""
        return {
            "round": self.round,
            "sampled": list(self.sampled),
            "num_sampled": len(self.sampled),
            "num_trained": self.num_trained,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "failed": {k: list(v) for k, v in self.failed.items()},
            **self.train,
            **(asdict(self.evaluation) if self.evaluation is not None else {}),
            **self.evaluate,
            "wall_seconds": self.wall_seconds,
            "elapsed_seconds": self.elapsed_seconds,
        }


MetricValues = dict[str, int | float | list[int] | list[float]]
"""What ``MetricRecord(...)`` takes (``dict`` is invariant, so ``dict[str, float]`` is not accepted)."""


def numeric_metrics(d: Mapping[str, Any]) -> MetricValues:
    """The int/float entries (not bools) of a metrics mapping, as floats (for ``MetricRecord``)."""
    return {
        k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
