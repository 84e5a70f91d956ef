"""Results files shared by every method: ``results.json`` and an accuracy-vs-round PNG."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["write_results", "plot_rounds"]


def _clean(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_results(
    results_dir: str | Path,
    config: Mapping,
    rounds: Sequence[Mapping],
    nodes: Mapping[int, Mapping],
    edges: Sequence[Mapping],
    **extra,
) -> Path:
    """Write ``results.json`` (+ ``accuracy.png``) under ``results_dir`` and return the JSON path.

    Schema: ``config`` (the run config), ``rounds`` (one entry per server round with at least
    ``round``, ``private_accuracy_mean``, ``communication_accuracy_mean``,
    ``communication_accuracy_degree_weighted``, ``gluing_loss``, ``bytes_sent``, ``wall_seconds``),
    ``nodes`` (per partition-id: ``d``, ``private_accuracy``, ...), ``edges`` (per directed edge:
    ``src``, ``dst``, ``communication_accuracy``), plus method-specific keys (graph methods:
    ``communication_accuracy_non_edges[_direct]`` and the ``sheaf_*`` diagnostics per evaluated
    round, top-level ``non_edges``; docs/variants.md). NaN and inf become null; mapping keys become
    strings. The two communication averages are those of paper Eq. 22 / Fig. 2 (docs/reference.md, s6).

    Args:
        results_dir: directory (created if missing).
        config: JSON-serialisable run config.
        rounds: per-round dicts (each with an int ``round``).
        nodes: ``{partition-id: dict}``.
        edges: per directed edge dicts.
        **extra: further top-level keys (JSON-serialisable).

    Returns:
        Path of ``results.json``.

    Raises:
        TypeError: a value that JSON cannot serialise.
        OSError: the directory or files cannot be written.
    """
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": dict(config),
        "rounds": list(rounds),
        "nodes": {str(k): v for k, v in sorted(nodes.items())},
        "edges": list(edges),
        **extra,
    }
    path = out / "results.json"
    path.write_text(json.dumps(_clean(payload), indent=1))
    plot_rounds(rounds, out / "accuracy.png", title=str(config.get("method", "")))
    return path


def plot_rounds(rounds: Sequence[Mapping], path: str | Path, title: str = "") -> None:
    """Plot private and communication accuracy against server rounds to ``path`` (PNG, matplotlib
    Agg backend). Series that are missing or all NaN in ``rounds`` are left out.

    Args:
        rounds: per-round dicts with ``round`` and the accuracy keys of :func:`write_results`.
        path: output file.
        title: figure title.

    Raises:
        OSError: ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    r = [x["round"] for x in rounds]
    for key, label in [
        ("private_accuracy_mean", "private (mean)"),
        ("communication_accuracy_degree_weighted", "communication (degree-weighted)"),
        ("communication_accuracy_mean", "communication (mean over receivers)"),
    ]:
        ys = [x.get(key) for x in rounds]
        if any(y is not None and not (isinstance(y, float) and math.isnan(y)) for y in ys):
            ax.plot(
                r, [float("nan") if y is None else y for y in ys], marker="o", ms=3, label=label
            )
    ax.set_xlabel("server round")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing to plot when no round was evaluated
        ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
