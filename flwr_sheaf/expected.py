"""What the main job should give: the expected band of its final round, and a run's verdict against it.

The band (``flwr_sheaf/expected_results.json``, written by ``scripts/expected_band.py``) is, per
headline number, the prediction interval for one more run from ``n`` seeds, Bonferroni over the three
numbers (:func:`prediction_interval`; benchmarks/records/expected-band.md). Judged: a completed run
of the reference configuration on the CPU; otherwise :func:`band_lines` says why not.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from .schema import ResultsFileError, check_results

__all__ = [
    "REFERENCE_PATH",
    "METRICS",
    "load_reference",
    "prediction_interval",
    "outside",
    "reference_mismatch",
    "not_judged",
    "band_lines",
]

#: The stored reference (package data).
REFERENCE_PATH = Path(__file__).with_name("expected_results.json")
#: The headline numbers compared: ``results.json``'s final-round keys and how the report names them.
METRICS = {
    "private_accuracy_mean": "private",
    "communication_accuracy_degree_weighted": "communication (degree-weighted)",
    "communication_accuracy_mean": "communication (receivers)",
}
#: Keys free to differ besides RESUME_MUTABLE_KEYS: the seed (the band is over seeds) and
#: ``train-defaults`` (Sheaf-FRL's effective ``lr``, ``momentum``, ``weight-decay`` are compared).
_FREE = frozenset({"seed", "train-defaults"})


@lru_cache(maxsize=1)
def load_reference() -> dict[str, Any]:
    """The stored reference: ``rule``, ``probability``, ``seeds``, ``cpu``, ``runs``, ``config``,
    ``per_seed`` (``{seed: {metric: [value per round]}}``), ``final_round``, ``band`` (``{metric:
    {"mean", "sd", "low", "high", "min", "max"}}``), ``cpu_variants`` and ``cpu_check``.

    Raises:
        FileNotFoundError: the package data file is missing (a broken install).
    """
    return json.loads(REFERENCE_PATH.read_text())


def prediction_interval(
    values: Sequence[float], probability: float, numbers: int = len(METRICS)
) -> tuple[float, float]:
    """The band of one headline number, where one more run lands with probability
    ``1 - (1 - probability) / numbers`` (Bonferroni): ``mean +- t(1 - (1 - probability) / (2 *
    numbers), n - 1) * sd * sqrt(1 + 1/n)`` (normal prediction interval, sample ``sd``).

    Args:
        values: the runs' final-round values, ``n >= 2``.
        probability: the joint probability, in ``(0, 1)``.
        numbers: how many numbers are judged together.

    Raises:
        ValueError: fewer than 2 values, or a probability outside ``(0, 1)``.
    """
    from scipy.stats import t

    n = len(values)
    if n < 2 or not 0.0 < probability < 1.0:
        raise ValueError(
            f"a prediction interval needs >= 2 values and a probability in (0, 1), got {n} "
            f"value(s) and probability {probability!r}"
        )
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = (
        float(t.ppf(1.0 - (1.0 - probability) / (2 * numbers), n - 1)) * sd * math.sqrt(1 + 1 / n)
    )
    return mean - half, mean + half


def outside(
    values: Mapping[str, float | None], reference: Mapping[str, Any] | None = None
) -> list[str]:
    """The headline numbers (:data:`METRICS` keys) of ``values`` outside the reference's band
    (a missing or null one counts as outside); ``[]`` when the run is inside."""
    band = (reference or load_reference())["band"]
    out = []
    for k in METRICS:
        v = values.get(k)
        if v is None or not band[k]["low"] <= v <= band[k]["high"]:
            out.append(k)
    return out


def reference_mismatch(
    config: Mapping[str, Any], reference: Mapping[str, Any] | None = None
) -> list[str]:
    """Why a run's ``config`` is not the reference scenario: one string per differing key
    (``"lambda = 0.3 (reference: 0.1)"``, by effective value; a key the reference lacks must be at
    its default), then one for the keys it does not record; ``[]`` when it is.
    """
    from .config import DEFAULTS, RESUME_MUTABLE_KEYS, effective_values

    ref = dict((reference or load_reference())["config"])
    skip = RESUME_MUTABLE_KEYS | _FREE
    given = dict(config)
    eff = effective_values(given)
    ref_eff = effective_values(ref)
    out, missing = [], []
    for k in sorted(ref):
        if k in skip:
            continue
        if k not in given:
            missing.append(k)
        elif eff.get(k) != ref_eff.get(k):
            out.append(f"{k} = {given[k]!r} (reference: {ref[k]!r})")
    for k in sorted(set(given) - set(ref) - skip):
        if k in DEFAULTS and eff.get(k) != effective_values({}).get(k):
            out.append(f"{k} = {given[k]!r} (reference: the default {DEFAULTS[k]!r})")
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        out.append(f"{len(missing)} key(s) not recorded: {shown}")
    return out


def not_judged(results: Mapping[str, Any]) -> list[str]:
    """Why a parsed ``results.json``'s numbers are not judged whatever its config, one string per
    reason (``"the run ended 'degraded', not completed"``); ``[]`` for a completed run whose
    ``device`` and nodes' recorded devices are on the CPU (docs/devices.md).
    """
    why = []
    status = results.get("status")
    if status is None:
        why.append(
            "results.json records no status (every run writes one: docs/results-schema.md), "
            "so nothing says the run completed"
        )
    elif status != "completed":
        why.append(
            f"the run ended {status!r}, not completed (see its failures and degradation in results.json)"
        )
    device = results.get("config", {}).get("device", "auto")
    if device not in ("auto", "cpu"):
        cuda = isinstance(device, str) and device.startswith("cuda")
        why.append(
            f"device={device!r}: the band was measured on CPUs (device=cpu or auto)"
            + (" and CUDA kernels give other digits (docs/devices.md)" if cuda else "")
            + "; run with device=cpu to compare"
        )
        return why
    ran = {p: v.get("device") for p, v in results.get("nodes", {}).items()}
    off_cpu = sorted((p for p, d in ran.items() if d is not None and d != "cpu"), key=_pid_order)
    if off_cpu:
        shown = ", ".join(f"{p} on {ran[p]}" for p in off_cpu[:5])
        more = f" and {len(off_cpu) - 5} more" if len(off_cpu) > 5 else ""
        why.append(
            f"device={device!r} resolved to a non-CPU device on {len(off_cpu)} node(s) (partition-id "
            f"{shown}{more}): the band was measured on CPUs and CUDA kernels give other digits "
            "(docs/devices.md); run with device=cpu to compare"
        )
    elif str(device) == "auto" and not any(d is not None for d in ran.values()):
        why.append(
            "device='auto' and results.json records no node's resolved device (written by an older "
            "flwr-sheaf, or no node evaluated), so it cannot tell whether the run computed on CPUs, "
            "where the band was measured; run with device=cpu to compare"
        )
    return why


def _pid_order(p: str) -> tuple[int, int, str]:
    return (0, int(p), "") if p.isdigit() else (1, 0, p)


def band_lines(results: Mapping[str, Any], reference: Mapping[str, Any] | None = None) -> list[str]:
    """The report's lines on the expected band for a parsed ``results.json`` (``reference``: default
    :func:`load_reference`): ``"expected band (...): INSIDE"`` / ``"... OUTSIDE"`` and one line per
    metric, or one line ``"expected band: not judged: ..."`` / ``"...: no reference for ..."``.
    """
    try:
        ref = reference or load_reference()
    except FileNotFoundError:
        return [
            f"expected band: {REFERENCE_PATH} is missing: a broken install (reinstall: bash scripts/setup.sh)"
        ]
    try:
        check_results(results)
    except ResultsFileError as e:
        shown = str(e).split("; it does not have")[0].removeprefix("results.json: ")
        return [f"expected band: not judged: results.json is malformed ({shown})"]
    why = not_judged(results)
    if why:
        return [
            f"expected band: not judged: {'; '.join(why)}; the band is for a completed run of the "
            "main job on the CPU"
        ]
    why = reference_mismatch(results.get("config") or {}, ref)
    if why:
        shown = "; ".join(why[:4]) + (f"; and {len(why) - 4} more" if len(why) > 4 else "")
        return [
            f"expected band: no reference for this config ({shown}); it exists for the main job only"
        ]
    final = int(ref["final_round"])
    last = [r for r in results["rounds"] if r.get("round") == final]
    if not last or last[0].get("private_accuracy_mean") is None:
        return [
            f"expected band: no evaluated round {final} in results (the band is for round {final})"
        ]
    unmeasured = [name for key, name in METRICS.items() if last[0].get(key) is None]
    if unmeasured:
        return [
            f"expected band: not judged: round {final} did not measure the {', '.join(unmeasured)} "
            "accuracy (null in results.json)"
        ]
    bad = outside(last[0], ref)
    seeds, p = len(ref["per_seed"]), float(ref["probability"])
    lines = []
    for key, name in METRICS.items():
        b, v = ref["band"][key], last[0].get(key)
        shown = "n/a" if v is None else f"{v:.3f}"
        lines.append(
            f"  {name} {shown}: {'OUTSIDE' if key in bad else 'inside'} [{b['low']:.3f}, {b['high']:.3f}] "
            f"(mean {b['mean']:.3f}, sd {b['sd']:.3f} over {seeds} seeds)"
        )
    env = results.get("environment")
    env = env if isinstance(env, Mapping) else {}
    ran = ", ".join(str(env[k]) for k in ("cpu", "machine", "cpu_capability") if env.get(k))
    lines.append(
        f"  this run's CPU: {ran or 'not recorded'}; the band: {seeds} seeds on "
        f"{ref['cpu'].get('cpu', 'unknown')}, {p:.0%} of correct runs land inside on any CPU"
    )
    head = f"expected band (main job, round {final}): " + (
        "INSIDE: this install reproduces the reference"
        if not bad
        else f"OUTSIDE: a correct install on any CPU lands inside with probability {p:.0%}; "
        "check the install (bash scripts/setup.sh) and the code version"
    )
    return [head, *lines]
