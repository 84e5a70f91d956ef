"""Print the headline numbers of a ``results.json``: ``python -m flwr_sheaf.report PATH`` (the file or
its results directory), and for a run of the main job's scenario whether it lies inside the expected
band (:mod:`flwr_sheaf.expected`, README.md "Expected results")."""

from __future__ import annotations

import sys

from .expected import band_lines
from .methods.registry import METHODS
from .schema import ResultsFileError, check_results, read_results

__all__ = ["ResultsFileError", "read_results", "summary_lines", "main"]


def summary_lines(results: dict) -> list[str]:
    """Human-readable lines of a parsed ``results.json``: status warnings, then the final evaluated
    round's accuracies (paper Eq. 22), the method's own
    :attr:`~flwr_sheaf.methods.registry.Method.report_lines`, diagnostics, bytes, wall time and
    :func:`flwr_sheaf.expected.band_lines`; ``"no evaluated round in results"`` when none.

    Raises:
        ResultsFileError: ``results`` does not have the schema (:func:`flwr_sheaf.schema.check_results`).
    """
    check_results(results)
    collapse = results.get("latent_collapse")
    status = _status_lines(results) + (
        [f"WARNING: {collapse.get('message', 'latent collapse')}"] if collapse else []
    )
    rounds = [r for r in results["rounds"] if r.get("private_accuracy_mean") is not None]
    cfg = results.get("config") or {}
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
        *[  # the second reading (run-config posthoc-readings = both)
            f"communication accuracy degree-weighted, whitening fitted on {on}: {fmt(last[k])}"
            for k, on in (
                ("communication_accuracy_pilot_whitening_degree_weighted", "the pilots"),
                (
                    "communication_accuracy_train_whitening_degree_weighted",
                    "private training latents (the paper's reading)",
                ),
            )
            if last.get(k) is not None
        ],
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
                f"{', '.join('n/a' if e is None else f'{e:.1e}' for e in last.get('sheaf_laplacian_eigenvalues') or [])} | pilot TV per edge "
                f"{fmt(last.get('sheaf_tv_mean'))}"
            ]
            if last.get("sheaf_near_kernel_dim") is not None
            else []
        ),
        f"latent dimensions with variance < 1e-3 (mean over agents): {fmt(last.get('low_variance_fraction_mean'))}",
        f"bytes sent in the last round: {last.get('bytes_sent')} | ServerApp wall time {results.get('total_wall_seconds') or 0:.1f} s",
        *band_lines(results),
    ]


def _evaluated_lines(results: dict, last: dict) -> list[str]:
    """How many of the final round's evaluated nodes ever trained (a WARNING if some never did)."""
    if last.get("evaluated") is None or last.get("evaluated_trained") is None:
        return []
    n, k = len(last["evaluated"]), last["evaluated_trained"]
    mode = (results.get("evaluation") or {}).get("evaluate-nodes", "?")
    line = f"evaluated nodes that ever trained: {k} of {n} (evaluate-nodes={mode})"
    if k < n:
        line = (
            f"WARNING: {line}: the accuracies of the {n - k} untrained node(s) are those of "
            "untrained models; set evaluate-nodes=trained (notes/participation.md)"
        )
    return [line]


def _status_lines(results: dict) -> list[str]:
    """First line of a degraded or failed run: status and failure counts (docs/guarantees.md)."""
    status = results.get("status", "completed")  # no status: the band's line says it (expected.py)
    if status == "completed":
        return []
    deg = results.get("degradation") or {}
    detail = "; ".join(f"{k}: {v}" for k, v in deg.items() if not isinstance(v, (dict, list)) or v)
    return [f"RUN {str(status).upper()}: {detail[:600] or 'see failures in results.json'}"]


def main(argv: list[str] | None = None) -> int:
    """``python -m flwr_sheaf.report RESULTS_JSON_OR_DIR``: prints :func:`summary_lines`; returns
    0, or 2 on a usage error or a bad file (:func:`read_results`'s message on stderr)."""
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
