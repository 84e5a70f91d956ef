"""Checks of the evaluation replies: why a phase-1 or phase-2 reply cannot be used (or None).

The evaluation (:class:`~flwr_sheaf.strategy.evaluation.GraphEvaluation`) calls these once per
reply, when it is parsed; a non-None answer is that node's recorded failure (``bad evaluation
reply: <why>``) and the rest of the round trusts the accepted replies. Plain functions of the reply's
metrics / arrays and what discovery reported (d_i, the pilot count K): no strategy, no state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..protocol import (
    COMM_ACCURACY,
    COMM_ACCURACY_PILOT_WHITENING,
    COMM_SRC,
    LOW_VARIANCE_FRACTION,
    METRICS,
    NON_EDGE_REPLY,
    NON_EDGE_SRC,
    PILOT_READING_ARRAYS,
    PRIVATE_ACCURACY,
    STALK_DIM,
    VAL_COMM_ACCURACY,
    VAL_COMM_ACCURACY_PILOT_WHITENING,
    VAL_PRIVATE_ACCURACY,
)
from ..sheaf.variants import edge_dim

__all__ = [
    "comm_problem",
    "phase1_arrays_problem",
    "phase1_metrics_problem",
    "transported_arrays_problem",
]

#: one receiver's non-edge plan: ``[(source, composed map (d_i, d_j), path source first), ...]``
Plan = list[tuple[int, np.ndarray, list[int]]]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fraction(v: Any) -> bool:
    """A number that is NaN (not measured) or in [0, 1]."""
    return _number(v) and (math.isnan(v) or 0.0 <= v <= 1.0)


def _not_fractions(m: Mapping[str, Any], keys: tuple[str, ...] | list[str]) -> str | None:
    for k in keys:
        bad = [v for v in m[k] if not _fraction(v)]
        if bad:
            return f"{k} = {bad[:5]} not in [0, 1] (or NaN)"
    return None


def phase1_metrics_problem(m: Mapping[str, Any], d: int) -> str | None:
    """A stalk dimension other than the discovered ``d``, a private accuracy that is NaN or outside
    [0, 1], or a low-variance fraction neither NaN nor in [0, 1] (``m``: the reply's metrics)."""
    if not _number(m[STALK_DIM]) or m[STALK_DIM] != d:
        return f"{STALK_DIM} = {m[STALK_DIM]!r}, but the node reported d={d} at discovery"
    for key in (PRIVATE_ACCURACY, VAL_PRIVATE_ACCURACY):  # measured on non-empty splits
        if not _fraction(m[key]) or math.isnan(m[key]):
            return (
                f"{key} = {m[key]!r} is not in [0, 1] (NaN: the node's test and validation "
                f"splits are non-empty, so its accuracy is always measured)"
            )
    if not _fraction(m[LOW_VARIANCE_FRACTION]):
        return f"{LOW_VARIANCE_FRACTION} = {m[LOW_VARIANCE_FRACTION]!r} is not in [0, 1] (or NaN)"
    return None


def phase1_arrays_problem(
    a: Mapping[str, Any], d: int, num_pilots: int, pilot_reading: bool
) -> str | None:
    """Raw evaluation arrays ``a`` (Flower ``Array`` values) of a node with stalk dimension ``d``:
    pilots not ``(K, d)``, latents not ``(M, d)`` with ``(M,)`` integer labels, NaN/inf in them, or
    (``pilot_reading``) the strong reading's arrays not shaped like the paper reading's."""
    pilots = a["pilots"].numpy()
    if pilots.shape != (num_pilots, d):
        return f"pilots of shape {pilots.shape}, expected ({num_pilots}, {d})"
    if not np.isfinite(pilots).all():
        return "NaN/inf pilots"
    for split in ("test", "val"):
        z, y = a[f"{split}-latents"].numpy(), a[f"{split}-labels"].numpy()
        if (
            z.ndim != 2
            or z.shape[1] != d
            or y.shape != (z.shape[0],)
            or not np.issubdtype(y.dtype, np.integer)
        ):
            return f"{split} latents {z.shape} / labels {y.shape} {y.dtype}: expected (M, {d}) and (M,) integers"
        if not np.isfinite(z).all():
            return f"NaN/inf {split} latents"
    if pilot_reading:  # the strong reading's arrays: same shapes as the paper reading's
        for name, like in zip(PILOT_READING_ARRAYS, ("pilots", "test-latents", "val-latents")):
            z = a[name].numpy()
            if z.shape != a[like].numpy().shape or not np.isfinite(z).all():
                return f"{name} of shape {z.shape} (expected {a[like].numpy().shape}) or NaN/inf entries"
    return None


def transported_arrays_problem(
    a: Mapping[str, Any], d: int, neighbour_dims: Mapping[int, int], num_pilots: int
) -> str | None:
    """Arrays ``a`` of a node under stringent privacy: raw ``pilots`` present, or per neighbour j
    (``{j: d_j}``) transported pilots not ``(K, d_e)`` / latents not ``(M, d_e)`` matching the labels
    / NaN or inf (d_e = :func:`~flwr_sheaf.sheaf.variants.edge_dim`)."""
    if "pilots" in a:
        return "raw pilots in a reply under privacy='stringent'"
    for j in sorted(neighbour_dims):
        width = edge_dim(d, neighbour_dims[j])
        shapes = {"pilots": (num_pilots, width)}
        for split in ("test", "val"):
            y = a[f"{split}-labels"].numpy()
            shapes[f"{split}-latents"] = (y.shape[0] if y.ndim == 1 else -1, width)
        for name, shape in shapes.items():
            key = f"{j}/{name}"
            if key not in a:
                return f"no {key!r}"
            x = a[key].numpy()
            if x.shape != shape:
                return f"{key} of shape {x.shape}, expected {shape}"
            if not np.isfinite(x).all():
                return f"NaN/inf in {key}"
    return None


def comm_problem(
    m: Mapping[str, Any],
    routed: tuple[int, ...],
    plan: Plan,
    edge_metric_keys: tuple[str, ...],
    pilot_reading: bool,
) -> str | None:
    """Why a phase-2 reply's metrics ``m`` cannot be used (or None): the strong reading missing
    (``pilot_reading``), per-edge lists of different lengths, sources other than the ``routed``
    neighbours, an accuracy neither NaN nor in [0, 1], or bad non-edge entries for the ``plan``."""
    return (
        _strong_reading_problem(m, pilot_reading)
        or _edge_problem(m, routed, edge_metric_keys)
        or _non_edge_problem(m, plan)
    )


def _strong_reading_problem(m: Mapping[str, Any], pilot_reading: bool) -> str | None:
    missing = [
        n
        for n in (COMM_ACCURACY_PILOT_WHITENING, VAL_COMM_ACCURACY_PILOT_WHITENING)
        if pilot_reading and n not in m
    ]
    return (
        f"the strong post-hoc reading was asked for, but the reply lacks {missing}"
        if missing
        else None
    )


def _edge_problem(
    m: Mapping[str, Any], routed: tuple[int, ...], edge_metric_keys: tuple[str, ...]
) -> str | None:
    lists = [COMM_SRC, COMM_ACCURACY, VAL_COMM_ACCURACY] + [n for n in edge_metric_keys if n in m]
    if any(not isinstance(m[k], list) for k in lists):
        return f"per-edge entries {lists} must be lists"
    if len({len(m[k]) for k in lists}) != 1:
        return f"per-edge lists of different lengths {[len(m[k]) for k in lists]}"
    if sorted(int(x) for x in m[COMM_SRC]) != sorted(routed) or len(set(m[COMM_SRC])) != len(
        m[COMM_SRC]
    ):
        return f"sources {list(m[COMM_SRC])}, but neighbours {list(routed)} were routed to it"
    return _not_fractions(m, lists[1:])


def _non_edge_problem(m: Mapping[str, Any], plan: Plan) -> str | None:
    if not plan:
        return None
    names = NON_EDGE_REPLY[METRICS]
    missing = [k for k in names if k not in m]
    if missing:
        return f"non-edge sources were routed to it, but the reply lacks {missing}"
    if any(not isinstance(m[k], list) for k in names) or len({len(m[k]) for k in names}) != 1:
        return f"non-edge entries {list(names)} must be lists of one length"
    if sorted(int(x) for x in m[NON_EDGE_SRC]) != sorted(j for j, _, _ in plan):
        return f"non-edge sources {list(m[NON_EDGE_SRC])}, but {[j for j, _, _ in plan]} were routed to it"
    return _not_fractions(m, names[1:])
