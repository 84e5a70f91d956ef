"""The results files of a run: ``results.json`` and ``accuracy.png`` (schema: docs/results-schema.md).

:func:`write_results` is the one way to write them, for the bundled app (``flwr run .``, whose
ServerApp calls it after the last round) and for one's own Flower app (call it on the strategy after
``strategy.start(...)`` returns). :func:`plot_rounds` draws the accuracy figure from per-round dicts.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .strategy.graph import GraphStrategy

log = logging.getLogger("flwr_sheaf")

__all__ = [
    "write_results",
    "check_results_dir",
    "plot_rounds",
    "accuracy_figure",
    "strategy_config",
    "RESULTS_JSON",
    "ACCURACY_PNG",
    "COLLAPSE_WARN_FRACTION",
    "LOW_VARIANCE_THRESHOLD",
    "collapse_warnings",
]

#: File names :func:`write_results` writes in its directory.
RESULTS_JSON = "results.json"
ACCURACY_PNG = "accuracy.png"
#: Top-level keys of ``results.json`` that :func:`write_results` fills itself (``extra`` may not name them).
_OWN_KEYS = (
    "config",
    "rounds",
    "nodes",
    "edges",
    "failures",
    "total_wall_seconds",
    "status",
    "degradation",
    "latent_collapse",
    "environment",
)


def _clean(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def strategy_config(strategy: Any) -> dict[str, Any]:
    """``{run-config key: value}`` of the :class:`~flwr_sheaf.config.Section` attributes of
    ``strategy`` and of the components it holds, first found wins (empty when it holds none): what
    ``results.json``'s ``config`` records for a strategy built in one's own app (no run config)."""
    from .config import Section

    out: dict[str, Any] = {}
    owners = [strategy, *(v for v in vars(strategy).values() if hasattr(v, "__dict__"))]
    for owner in owners:
        for value in vars(owner).values():
            if isinstance(value, Section):
                for key, v in value.to_dict().items():
                    out.setdefault(key, v)
    return out


def _method_name(strategy: Any) -> str | None:
    """The registered ``method`` whose action is the strategy's, when exactly one is (else None)."""
    from .methods.registry import METHODS

    names = [m.name for m in METHODS.values() if m.action == getattr(strategy, "action", None)]
    return names[0] if len(names) == 1 else None


def check_results_dir(out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """``out_dir`` with ``~`` expanded (not created), after checking that :func:`write_results` may
    write there (call it before ``strategy.start``, so a refusal comes before any training).

    Raises:
        FileExistsError: ``out_dir`` holds a ``results.json`` or ``accuracy.png`` and ``overwrite``
            is False (the files named, with the fix).
        NotADirectoryError: ``out_dir`` exists and is not a directory.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {str(out_dir)!r}: {out} exists and is not a directory")
    old = [p for p in (out / RESULTS_JSON, out / ACCURACY_PNG) if p.exists()]
    if old and not overwrite:
        raise FileExistsError(
            f"out_dir {str(out_dir)!r} already holds another run's results "
            f"({', '.join(p.name for p in old)}); use another directory, or pass overwrite=True to "
            f"replace them"
        )
    return out


def write_results(
    strategy: GraphStrategy,
    out_dir: str | Path,
    *,
    config: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    max_failed_fraction: float | None = None,
    wall_seconds: float | None = None,
    extra: Mapping[str, Any] | None = None,
    problems: Sequence[str] = (),
    errors: Sequence[str] = (),
    keep_previous: int | None = None,
) -> Path:
    """Write a finished run's ``results.json`` and ``accuracy.png`` into ``out_dir``; returns the JSON's path.

    The same files as the bundled app (``flwr run .``), from any :class:`~flwr_sheaf.GraphStrategy`
    after ``strategy.start(...)`` returns: ``results.json`` (every key: docs/results-schema.md; NaN
    and inf as null) and ``accuracy.png`` (:func:`plot_rounds`).

    Args:
        strategy: a flwr-sheaf strategy whose ``start`` has run at least one round.
        out_dir: directory (created with its parents if missing).
        config: run-config values recorded as given, then the strategy's section keys
            (:func:`strategy_config`); ``method`` from the registry when absent.
        overwrite: move the ``results.json`` / ``accuracy.png`` already in ``out_dir`` and another
            run's ``checkpoint.pkl`` into a new ``previous-<UTC time>/`` (logged; refused otherwise),
            never replace them; while this process already holds ``out_dir``'s lock (the bundled
            app's preflight, which moved another run's files aside itself) the files there are this
            run's and are replaced. The directory's lock is held, and re-checked, while writing.
        max_failed_fraction: the failed share of train replies past which ``status`` is ``failed``
            (default: ``config``'s ``max-failed-fraction``, else 0.5; docs/reliability-failures.md).
        wall_seconds: ``total_wall_seconds`` (default: the last round's ``elapsed_seconds``).
        extra: further top-level keys (JSON-serialisable), written last.
        problems: what else did not go as asked (the run is written ``degraded``; :func:`run_status`).
        errors: what ended the run early (the run is written ``failed``).
        keep_previous: keep only the newest this many ``previous-*`` folders of ``out_dir`` after
            moving files aside (the older ones are removed, each logged); None or 0 = keep every one
            (default: ``config``'s ``keep-previous``, else 0; docs/reliability-run-files.md).

    Called while an exception propagates (``finally``/``except``, e.g. after a discovery error), an
    error of ``write_results`` itself (no completed round, another run's files, ...) never hides
    it: that exception is re-raised with a note saying what was not written and why.

    Returns:
        Path of ``results.json``.

    Raises:
        TypeError: ``strategy`` is not a flwr-sheaf strategy (e.g. Flower's ``FedAvg``), or a value
            that JSON cannot serialise (nothing is written then).
        ValueError: the strategy has not run (no round in its history: call ``strategy.start``
            first), or ``extra`` names a key written here (named).
        FileExistsError: ``out_dir`` already holds a ``results.json`` or ``accuracy.png``, or another
            run's ``checkpoint.pkl``, and ``overwrite`` is False (the files named).
        NotADirectoryError: ``out_dir`` exists and is not a directory.
        flwr_sheaf.locks.LockedError: another live run holds ``out_dir``'s lock (its pid and host named).
        OSError: the directory or files cannot be written.
    """
    inflight = sys.exc_info()[1]  # the exception propagating through the caller's finally / except
    try:
        own_extra = _checked_own_extra(strategy, extra)
        out = check_results_dir(out_dir, overwrite=overwrite)
        foreign = _check_foreign_checkpoint(strategy, out, out_dir, overwrite)
        cfg = _recorded_config(strategy, config)
        max_failed_fraction = _given_or_config(
            max_failed_fraction, cfg, "max-failed-fraction", float
        )
        keep_previous = _given_or_config(keep_previous, cfg, "keep-previous", int)
        status = run_status(strategy, max_failed_fraction, problems, errors)
        payload = _payload(strategy, cfg, status, wall_seconds, {**own_extra, **(extra or {})})
        # serialised before anything is written: a TypeError writes nothing
        text = json.dumps(_clean(payload), indent=1)
        title = str(cfg.get("method", "")) or type(strategy).__name__
        return _write_files(out, foreign, text, payload["rounds"], title, overwrite, keep_previous)
    except Exception as exc:
        if inflight is None or exc is inflight:
            raise
        own = exc
    # outside the except block: raising the exception in flight keeps its own __context__ (the
    # error it was raised while handling), instead of write_results' error posing as its cause
    raise _noted(inflight, own, out_dir)


def _given_or_config(
    given: Any, cfg: Mapping[str, Any], key: str, kind: Callable[[Any], Any]
) -> Any:
    """``given`` when not None, else run-config ``key`` of ``cfg``, else its default (``kind`` of it;
    an empty value is 0)."""
    from .config import DEFAULTS

    return given if given is not None else kind(cfg.get(key, DEFAULTS[key]) or 0)


def _noted(inflight: BaseException, own: Exception, out_dir: str | Path) -> BaseException:
    """``inflight`` (the caller's exception that :func:`write_results` met) with a note, and a logged
    error, saying what ``write_results`` did not write and why (``own``)."""
    inflight.add_note(
        f"flwr-sheaf: write_results(out_dir={str(out_dir)!r}) could not write this run's results "
        f"either ({type(own).__name__}: {own})"
    )
    log.error(
        "write_results: %s: %s (not written; the run's own error %s: %s is raised)",
        type(own).__name__,
        own,
        type(inflight).__name__,
        inflight,
    )
    return inflight


def _checked_own_extra(strategy: GraphStrategy, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The strategy's own ``results_extra()``, after :func:`write_results`' checks of ``strategy``
    and of the keys (its TypeError and ValueError)."""
    from .strategy.graph import GraphStrategy

    if not isinstance(strategy, GraphStrategy):
        raise TypeError(
            f"write_results needs a flwr-sheaf strategy (a flwr_sheaf.GraphStrategy: a registered "
            f"method's strategy), got {type(strategy).__name__}"
        )
    name = type(strategy).__name__
    if not strategy.ledger.rounds:
        raise ValueError(
            f"{name} has no completed round (its history is empty): run it first with "
            f"strategy.start(grid=grid, num_rounds=...), then call write_results(strategy, out_dir)"
        )
    clash = sorted(set(extra or {}) & set(_OWN_KEYS))
    if clash:
        raise ValueError(f"extra keys {clash} are written by write_results itself; rename them")
    own_extra = _own_results_extra(strategy)
    clash = sorted(set(own_extra) & set(_OWN_KEYS))
    if clash:
        raise ValueError(
            f"{name}.results_extra() returns keys {clash} that write_results "
            "writes itself; rename them in the strategy"
        )
    return own_extra


#: attribute of a strategy whose ``results_extra`` raised: the problem line (:func:`run_status`)
_EXTRA_PROBLEM = "_flwr_sheaf_results_extra_problem"


def _own_results_extra(strategy: GraphStrategy) -> dict[str, Any]:
    """``strategy.results_extra()``; when the method's override raises, the base
    :meth:`GraphStrategy.results_extra`'s keys only (participation, action, evaluation, ...; none if
    that raises too), the error logged and kept on the strategy as a problem (the run ``degraded``,
    the hook and the exception named: :func:`run_status`), so that results.json is still written."""
    from .strategy.graph import GraphStrategy

    setattr(strategy, _EXTRA_PROBLEM, None)  # this write's own
    try:
        return strategy.results_extra()
    except Exception as e:  # noqa: BLE001 - a method's hook: its keys are lost, not the run's results
        problem = (
            f"{type(strategy).__name__}.results_extra raised {type(e).__name__}: {e}; results.json "
            "is written without the method's own keys (fix the hook)"
        )
        setattr(strategy, _EXTRA_PROBLEM, problem)
        log.warning("%s", problem, exc_info=True)
    try:
        return GraphStrategy.results_extra(strategy)
    except Exception:  # noqa: BLE001 - the base reads state the method broke: write without it
        return {}


def _check_foreign_checkpoint(
    strategy: GraphStrategy, out: Path, out_dir: str | Path, overwrite: bool
) -> Path | None:
    """``out/checkpoint.pkl`` when it exists and is not the strategy's own checkpointer's file, or
    None; refused (FileExistsError) without ``overwrite``: results.json beside it would be read, and
    resumed, as that run's."""
    from .strategy.checkpoint import CHECKPOINT_NAME

    ckpt, own = out / CHECKPOINT_NAME, getattr(strategy, "checkpointer", None)
    if not ckpt.exists() or (
        own is not None and Path(own.path).expanduser().resolve() == ckpt.resolve()
    ):
        return None
    if not overwrite:
        raise FileExistsError(
            f"out_dir {str(out_dir)!r} holds another run's checkpoint ({ckpt}): results.json beside "
            f"it would be read, and resume=true would continue it, as that run's. Use another out_dir, "
            f"or pass overwrite=True to move it into {out}/previous-<time>/"
        )
    return ckpt


def _recorded_config(strategy: GraphStrategy, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """results.json's ``config``: ``config`` as given, then every key of the strategy's config
    sections not in it (:func:`strategy_config`); ``method`` first, from the registry, when absent
    and the strategy's action names exactly one registered method."""
    cfg = dict(config or {})
    for key, value in strategy_config(strategy).items():
        cfg.setdefault(key, value)
    if "method" not in cfg and (method := _method_name(strategy)) is not None:
        cfg = {"method": method, **cfg}
    return cfg


def _payload(
    strategy: GraphStrategy,
    cfg: dict[str, Any],
    status: dict[str, Any],
    wall_seconds: float | None,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """results.json's content (every key: docs/results-schema.md): ``cfg``, the strategy's history
    and ledger, ``status`` (:func:`run_status`), the ServerApp's CPU
    (:func:`~flwr_sheaf.devices.cpu_environment`), then ``extra``."""
    from .devices import cpu_environment

    return {
        "config": cfg,
        "rounds": strategy.history,
        "nodes": {str(k): v for k, v in sorted(strategy.ledger.node_results.items())},
        "edges": list(strategy.ledger.edge_results),
        "failures": strategy.ledger.failures,
        "total_wall_seconds": (
            strategy.ledger.rounds[-1].elapsed_seconds
            if wall_seconds is None
            else float(wall_seconds)
        ),
        "status": status["status"],
        "degradation": status,
        "latent_collapse": next(iter(collapse_warnings(strategy.ledger.node_results)), None),
        "environment": cpu_environment(),
        **extra,
    }


def _write_files(
    out: Path,
    foreign: Path | None,
    text: str,
    rounds: Sequence[Mapping],
    title: str,
    overwrite: bool = False,
    keep_previous: int = 0,
) -> Path:
    """Write ``text`` as ``out/results.json`` and the figure of ``rounds`` as ``out/accuracy.png``
    under ``out``'s lock (:class:`flwr_sheaf.locks.DirLock`, its identity re-checked first), after
    moving another run's ``foreign`` checkpoint and (``overwrite`` without the lock held by this
    process before the call) the files already there into ``previous-<UTC time>/`` (logged)."""
    from .locks import DirLock, held_by_this_process

    out.mkdir(parents=True, exist_ok=True)
    held = held_by_this_process(out)
    lock = held or DirLock(out, "out_dir").acquire()
    try:
        lock.verify()
        names = [] if foreign is None else [foreign.name]
        if overwrite and held is None:  # the files of an earlier write_results: moved, not replaced
            names = [n for n in (RESULTS_JSON, ACCURACY_PNG) if (out / n).exists()] + names
        if names:
            from .preflight import move_aside

            moved = move_aside(out, names, keep=keep_previous)
            if moved is not None:
                log.warning(
                    "overwrite=True: moved the earlier %s from %s into %s (nothing deleted)",
                    ", ".join(moved[1]),
                    out,
                    moved[0],
                )
        path = out / RESULTS_JSON
        path.write_text(text)
        plot_rounds(rounds, out / ACCURACY_PNG, title=title)
    finally:
        if held is None:
            lock.release()
    return path


def run_status(
    strategy: GraphStrategy,
    max_failed_fraction: float,
    problems: Sequence[str] = (),
    errors: Sequence[str] = (),
) -> dict[str, Any]:
    """The run's ``status`` and ``degradation`` as :func:`write_results` writes them: the strategy's
    :meth:`~flwr_sheaf.strategy.ledger.RunLedger.run_status`, made ``degraded`` (if it was ``completed``) by
    ``problems`` outside the nodes' replies, which are listed under ``"problems"`` after the ledger's
    own (rounds that drew nobody, nothing measured); made ``failed``
    by ``errors`` (what ended the run early) and by rounds short of the ``num_rounds`` the strategy's
    last ``start`` was given (``rounds_requested``, ``rounds_completed``), each among ``"reasons"``."""
    status = dict(strategy.ledger.run_status(max_failed_fraction))
    status["reasons"] = list(status.get("reasons", []))
    requested = getattr(strategy, "requested_rounds", None)
    if requested is not None:
        last = strategy.ledger.rounds[-1].round if strategy.ledger.rounds else 0
        status["rounds_requested"], status["rounds_completed"] = int(requested), int(last)
        if last < requested:
            status["reasons"].append(
                f"the run stopped after server round {last} of {requested} (strategy.start did not "
                f"finish)"
            )
    status["reasons"] += [str(e) for e in errors]
    if status["reasons"]:
        status["status"] = "failed"
    extra_problem = getattr(strategy, _EXTRA_PROBLEM, None)  # results_extra raised
    status["problems"] = list(status.get("problems", [])) + list(problems)
    status["problems"] += [extra_problem] if extra_problem else []
    if not status["problems"]:
        del status["problems"]  # the key is written only when something degraded the run
    elif status["status"] == "completed":
        status["status"] = "degraded"
    return status


def plot_rounds(rounds: Sequence[Mapping], path: str | Path, title: str = "") -> None:
    """Plot private and communication accuracy of ``rounds`` (``results.json``'s ``rounds`` dicts)
    against server rounds to the PNG ``path`` (:func:`accuracy_figure`).

    Raises:
        OSError: ``path`` cannot be written.
    """
    accuracy_figure(rounds, title).savefig(path, dpi=110)


def accuracy_figure(rounds: Sequence[Mapping], title: str = "") -> Any:
    """The accuracy figure of ``rounds`` (a matplotlib ``Figure``; series missing or all NaN are left
    out). Readable with few evaluated rounds (one, in a cross-device run that evaluates only at the
    end): with at most 3 evaluated points the markers are large and each value is written beside it;
    the x axis spans every round +- 0.5 with a tick per round (up to 10 rounds, else whole numbers)."""
    # matplotlib's object API, no pyplot: the caller's backend (a notebook's inline one) is left as it is
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    r = [x["round"] for x in rounds]
    for key, label in [
        ("private_accuracy_mean", "private (mean)"),
        ("communication_accuracy_degree_weighted", "communication (degree-weighted)"),
        ("communication_accuracy_mean", "communication (mean over receivers)"),
    ]:
        ys = [float("nan") if y is None else y for y in (x.get(key) for x in rounds)]
        points = [(a, y) for a, y in zip(r, ys) if not (isinstance(y, float) and math.isnan(y))]
        if not points:
            continue
        few = len(points) <= 3  # a line through 1-3 points is hardly visible: big markers, values
        (line,) = ax.plot(r, ys, marker="o", ms=8 if few else 3, label=label)
        for a, y in points if few else ():
            ax.annotate(
                f"{y:.3f}",
                (a, y),
                textcoords="offset points",
                xytext=(8, 4),
                color=line.get_color(),
            )
    ax.set_xlabel("server round")
    if r:
        ax.set_xlim(min(r) - 0.5, max(r) + 0.5)
    if 0 < len(r) <= 10:
        ax.set_xticks(sorted(set(r)))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing to plot when no round was evaluated
        ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------ latent collapse
# results.json's ``latent_collapse`` (docs/results-schema.md): a node whose ``low_variance_fraction``
# (share of latent dimensions with pilot variance below 1e-3, docs/stability.md s3) exceeds
# COLLAPSE_WARN_FRACTION has collapsed latents: its accuracies under-read the method. The run still
# completed as asked: a warning, not ``degraded``.

#: Share of a node's latent dimensions below the variance threshold past which the run is warned.
#: Healthy runs here stay at or below 0.125 (Sheaf-FRL main job 0.017, lambda = 1: 0.125,
#: docs/stability.md); FedProto under momentum 0.9 reaches 0.55 (docs/baselines.md s0).
COLLAPSE_WARN_FRACTION = 0.25
#: The variance below which a latent dimension counts as collapsed (``low_variance_fraction``'s default).
LOW_VARIANCE_THRESHOLD = 1e-3


def collapse_warnings(
    nodes: Mapping[Any, Mapping[str, Any]], threshold: float = COLLAPSE_WARN_FRACTION
) -> list[dict[str, Any]]:
    """The ``latent-collapse`` warning of a run whose nodes' latents collapsed, from the last
    evaluation's per-node results (``strategy.ledger.node_results`` / ``results.json``'s ``nodes``).

    ``nodes``: ``{partition-id: {"low_variance_fraction": float in [0, 1], "trained": bool, ...}}`` (a
    missing, NaN or None value is skipped); a node above ``threshold`` counts as collapsed. A node
    whose ``trained`` is False never trained (cross-device sampling): its latents are the untrained
    initialisation's, which says nothing of the optimizer, so it is not counted (the warning, when it
    fires, says how many such nodes were left out; ``untrained_skipped``).

    Returns:
        ``[]``, or one dict ``{"kind": "latent-collapse", "nodes": {partition-id (str): fraction},
        "threshold": threshold, "variance_below": 1e-3, "message": str}`` naming every collapsed node
        in partition-id order.
    """
    bad: dict[str, float] = {}
    untrained = 0
    order = sorted(nodes, key=lambda p: (0, int(p), "") if str(p).isdigit() else (1, 0, str(p)))
    for pid in order:
        v = nodes[pid].get("low_variance_fraction")
        if v is None or not isinstance(v, (int, float)) or math.isnan(v):
            continue
        if nodes[pid].get("trained") is False:  # never trained: nothing to blame on the optimizer
            untrained += 1
            continue
        if v > threshold:
            bad[str(pid)] = float(v)
    if not bad:
        return []
    listed = ", ".join(f"{p}: {v:.0%}" for p, v in bad.items())
    skipped = (
        f" ({untrained} evaluated node(s) that never trained are not counted)" if untrained else ""
    )
    return [
        {
            "kind": "latent-collapse",
            "nodes": bad,
            "threshold": threshold,
            "variance_below": LOW_VARIANCE_THRESHOLD,
            "untrained_skipped": untrained,
            "message": (
                f"latent collapse on {len(bad)} of {len(nodes) - untrained} node(s){skipped} "
                "(partition-id: share of latent "
                f"dimensions with pilot variance < {LOW_VARIANCE_THRESHOLD:g}): {listed}; above "
                f"{threshold:.0%} the accuracies under-read the method: check its optimizer settings "
                "(train-defaults, lr, momentum; docs/baselines.md s0)"
            ),
        }
    ]
