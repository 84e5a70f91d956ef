"""Print the headline numbers of a ``results.json``: ``python -m flwr_sheaf.report PATH`` (the file or
its results directory), and for a run of the main job's scenario whether it lies inside the expected
band (:mod:`flwr_sheaf.expected`, README.md "Expected results")."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .expected import METRICS, band_lines
from .methods.registry import METHODS

__all__ = ["ResultsFileError", "read_results", "results_problems", "summary_lines", "main"]

#: Per-round keys the report (and the methods' own report lines) print as numbers: each is a number
#: or null in a results.json (docs/results-schema.md); anything else is named by results_problems.
NUMBER_KEYS = (
    *METRICS,
    "communication_accuracy_non_edges",
    "communication_accuracy_non_edges_direct",
    "sheaf_tv_mean",
    "low_variance_fraction_mean",
    "comfed_communication_accuracy_degree_weighted",
    "gap",
    "distance_to_optimum",
)


class ResultsFileError(ValueError):
    """A ``results.json`` that cannot be read or does not have the schema (docs/results-schema.md);
    the message names the file and what is wrong."""


#: What an evaluated round (one with a ``private_accuracy_mean``) must hold: the report reads them.
_EVALUATED_KEYS = ("communication_accuracy_degree_weighted", "communication_accuracy_mean")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def results_problems(results: Any) -> list[str]:
    """What in a parsed ``results.json`` does not have the schema the report reads: one string per
    problem (``"rounds[9] (round 10): private_accuracy_mean = '0.83' is a str, expected a number or
    null"``), ``[]`` when none.

    Checked: the top level is an object; ``rounds`` is a list of objects, each with an integer
    ``round`` and the :data:`NUMBER_KEYS` it has numbers or null, an evaluated one (a
    ``private_accuracy_mean``) with both communication accuracies (number or null); ``config`` (when
    present) an object, not null; ``status`` (when present) a string; ``total_wall_seconds`` (when present) a number.
    """
    if not isinstance(results, Mapping):
        return [f"the top level is a {type(results).__name__}, expected an object"]
    out = []
    if "rounds" not in results:
        out.append("it has no 'rounds' (every results.json has the list of its server rounds)")
    elif not isinstance(results["rounds"], list):
        out.append(f"'rounds' is a {type(results['rounds']).__name__}, expected a list")
    else:
        for i, r in enumerate(results["rounds"]):
            if not isinstance(r, Mapping):
                out.append(f"rounds[{i}] is a {type(r).__name__}, expected an object")
                continue
            n = r.get("round")
            if not (isinstance(n, int) and not isinstance(n, bool)):
                out.append(f"rounds[{i}]: round = {n!r} is not an integer")
            if (
                r.get("private_accuracy_mean") is not None
            ):  # an evaluated round: what the report reads
                lacks = [k for k in _EVALUATED_KEYS if k not in r]
                if lacks:
                    out.append(
                        f"rounds[{i}] (round {n}) is evaluated (private_accuracy_mean) but has no "
                        f"{', '.join(map(repr, lacks))} (every evaluated round records it, null when "
                        "not measured)"
                    )
            for k in NUMBER_KEYS:
                v = r.get(k)
                if v is not None and not _is_number(v):
                    out.append(
                        f"rounds[{i}] (round {n}): {k} = {v!r} is a {type(v).__name__}, "
                        "expected a number or null"
                    )
    for key, kind, ok in (
        ("config", "an object", lambda v: isinstance(v, Mapping)),
        ("status", "a string", lambda v: isinstance(v, str)),
        ("total_wall_seconds", "a number", _is_number),
    ):
        if key == "config" and key in results and results[key] is None:
            out.append(
                "config is null, expected an object (every run records its effective config)"
            )
        elif key in results and results[key] is not None and not ok(results[key]):
            out.append(f"{key} = {results[key]!r} is not {kind}")
    return out


def read_results(path: str | Path) -> dict:
    """Read and check a ``results.json`` (the file, or its results directory).

    Returns:
        The parsed file (:func:`results_problems` found nothing).

    Raises:
        ResultsFileError: the file does not exist or cannot be read, is not valid JSON (truncated
            or damaged), or does not have the schema; the message names the file, what is wrong
            and what to do.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise ResultsFileError(f"{path} does not exist (give a results.json or its results-dir)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ResultsFileError(f"{path} cannot be read: {e}") from e
    try:
        results = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultsFileError(
            f"{path} is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}; the file has "
            f"{len(text)} characters): it is truncated or damaged (a run killed while writing it, or "
            "an edit); rerun the run, or restore the file from a copy"
        ) from e
    bad = results_problems(results)
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ResultsFileError(
            f"{path} does not have the results.json schema (docs/results-schema.md): {shown}; "
            "it was edited or written by something else: rerun the run, or fix the entries named"
        )
    return results


def summary_lines(results: dict) -> list[str]:
    """Human-readable lines of a parsed ``results.json``: a degraded or failed status and a
    ``latent_collapse`` warning first, then the final evaluated round's private and communication
    accuracy (paper Eq. 22), how many evaluated nodes ever trained, the method's own
    :attr:`~flwr_sheaf.methods.registry.Method.report_lines`, the non-edge and sheaf-Laplacian
    readings when recorded, the collapse diagnostic, bytes, wall time and the verdict against the
    main job's expected band (:func:`flwr_sheaf.expected.band_lines`); ``"no evaluated round in
    results"`` when nothing was evaluated.

    Raises:
        ResultsFileError: ``results`` does not have the schema (:func:`results_problems`).
        KeyError: an evaluated round lacks a mandatory key.
    """
    bad = results_problems(results)
    if bad:
        raise ResultsFileError(f"results.json does not have the schema: {'; '.join(bad[:5])}")
    collapse = results.get("latent_collapse")
    status = _status_lines(results) + (
        [f"WARNING: {collapse.get('message', 'latent collapse')}"]
        if isinstance(collapse, dict)
        else []
    )
    rounds = [r for r in results["rounds"] if r.get("private_accuracy_mean") is not None]
    cfg = results.get("config", {})
    entry = METHODS.get(str(cfg.get("method", "?")))  # the method's own keys and lines, if known
    own_lines = entry.report_lines if entry is not None and entry.report_lines else None
    if not rounds:
        return status + (
            (own_lines(results, None) if own_lines else []) or ["no evaluated round in results"]
        )
    last = rounds[-1]
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    weights = entry.report_keys if entry is not None else ()
    # only what the results record (one's own app writes the keys of its strategy's sections only)
    known = [k for k in ("method", *weights, "shift", "zoo", "dataset") if k in cfg]
    return status + [
        *([" | ".join(f"{k} {cfg[k]}" for k in known)] if known else []),
        f"final round {last['round']}: private accuracy {fmt(last['private_accuracy_mean'])} | "
        f"communication accuracy degree-weighted {fmt(last['communication_accuracy_degree_weighted'])} "
        f"(mean over receivers {fmt(last['communication_accuracy_mean'])})",
        *_evaluated_lines(results, last),
        *(own_lines(results, last) if own_lines else []),
        *(
            [
                f"non-edges ({last.get('non_edge_pairs_measured')} directed pairs): communication accuracy after "
                f"multi-hop transport {fmt(last['communication_accuracy_non_edges'])} | direct Procrustes "
                f"{fmt(last.get('communication_accuracy_non_edges_direct'))}"
            ]
            if last.get("communication_accuracy_non_edges") is not None
            else []
        ),
        *(
            [
                f"sheaf Laplacian: near-kernel {last['sheaf_near_kernel_dim']} of at most "
                f"{last.get('sheaf_kernel_dim_bound')} global sections | smallest eigenvalues "
                f"{', '.join(f'{e:.1e}' for e in last.get('sheaf_laplacian_eigenvalues') or [])} | pilot TV per edge "
                f"{fmt(last.get('sheaf_tv_mean'))}"
            ]
            if last.get("sheaf_near_kernel_dim") is not None
            else []
        ),
        f"latent dimensions with variance < 1e-3 (mean over agents): {fmt(last.get('low_variance_fraction_mean'))}",
        f"bytes sent in the last round: {last.get('bytes_sent')} | ServerApp wall time {results.get('total_wall_seconds', 0):.1f} s",
        *band_lines(results),
    ]


def _evaluated_lines(results: dict, last: dict) -> list[str]:
    """How many of the final evaluated round's nodes ever trained (``evaluated_trained`` of
    ``evaluated``, run-config ``evaluate-nodes``), a WARNING when some never did; nothing for results
    that do not record it."""
    if not isinstance(last.get("evaluated"), list) or last.get("evaluated_trained") is None:
        return []
    n, k = len(last["evaluated"]), last["evaluated_trained"]
    mode = (results.get("evaluation") or {}).get("evaluate-nodes", "?")
    line = f"evaluated nodes that ever trained: {k} of {n} (evaluate-nodes={mode})"
    if k < n:
        line = (
            f"WARNING: {line}: the accuracies of the {n - k} untrained node(s) are those of "
            "untrained models; set evaluate-nodes=trained (docs/participation.md)"
        )
    return [line]


def _status_lines(results: dict) -> list[str]:
    """First lines for a run that did not complete cleanly (``status`` degraded or failed, docs/reliability-failures.md):
    the status, the failure counts and the nodes that failed, so a degraded run is never read as a clean one."""
    status = results.get("status", "completed")  # no status: the band's line says it (expected.py)
    if status == "completed":
        return []
    deg = results.get("degradation") or {}
    detail = "; ".join(f"{k}: {v}" for k, v in deg.items() if not isinstance(v, (dict, list)) or v)
    return [f"RUN {str(status).upper()}: {detail[:600] or 'see failures in results.json'}"]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: ``python -m flwr_sheaf.report RESULTS_JSON_OR_DIR`` prints :func:`summary_lines`
    (``argv``: default ``sys.argv[1:]``); returns 0, or 2 on a usage error or a missing, unreadable
    or malformed file (:func:`read_results`'s message on stderr)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m flwr_sheaf.report RESULTS_JSON_OR_DIR", file=sys.stderr)
        return 2
    try:
        results = read_results(argv[0])
    except ResultsFileError as e:
        print(f"flwr_sheaf.report: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
