"""A run's ``results.json`` and ``accuracy.png`` (schema: docs/results-schema.md)."""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import RunConfig
from .engine import describe_ray, warn_if_unasked
from .methods.registry import METHODS, strategy_config, strategy_sections
from .rundir import ACCURACY_PNG, RESULTS_JSON, RunDir  # the file names write_results writes
from .strategy.ledger import RunFailedError, RunLedger
from .strategy.records import RoundRecord

if TYPE_CHECKING:
    from .rundir import DirLock
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
    "write_run",
]

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


def _ran(strategy: Any) -> dict[str, Any]:
    """``method`` (registry) and ``num-server-rounds`` (last ``start``) ``strategy`` ran with, if known."""
    ran = {
        "method": _method_name(strategy),
        "num-server-rounds": getattr(strategy, "requested_rounds", None),
    }
    return {k: v for k, v in ran.items() if v is not None}


#: how to apply a :func:`_ran` key
_RAN_FIX = {
    "method": "build that method's strategy",
    "num-server-rounds": "pass num_rounds=... to strategy.start",
}


def _method_name(strategy: Any) -> str | None:
    """The registered ``method`` whose action is the strategy's, when exactly one is (else None)."""
    names = [m.name for m in METHODS.values() if m.action == getattr(strategy, "action", None)]
    return names[0] if len(names) == 1 else None


#: ``{lock path: DirLock}`` that :func:`check_results_dir` claimed, until :func:`write_results`
_CLAIMED: dict[Path, DirLock] = {}


def check_results_dir(
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    strategy: Any = None,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """``out_dir`` checked as :func:`write_results` will, created, locked, and returned absolute.

    Call it before ``strategy.start``: a refusal comes before any training, and the lock is held
    until :func:`write_results` writes there. Warns of unapplied keys (``strategy``, ``config``).

    Raises:
        FileExistsError, NotADirectoryError, LockedError: as :func:`write_results`.
        ConfigError: a bad ``max-failed-fraction`` or ``keep-previous`` in ``config``.
    """
    from .rundir import DirLock, held_by_this_process

    out = _checked_out(out_dir, overwrite)  # nothing created or locked for a refused directory
    for key in ("max-failed-fraction", "keep-previous"):  # what write_results reads: now, not after
        _given_or_config(None, config or {}, key)
    out.mkdir(parents=True, exist_ok=True)
    claim = None if held_by_this_process(out) else DirLock(out, "out_dir").acquire()
    try:
        _checked_out(out_dir, overwrite)  # again under the lock: a run may have ended meanwhile
    except BaseException:
        if claim is not None:
            claim.release()
        raise
    if claim is not None:
        _CLAIMED[claim.path] = claim
    for line in config_not_applied(strategy, config):
        log.warning("%s", line)
    if not out.is_absolute():  # as the bundled app says it
        from .strategy.rounds import default_progress_handler

        default_progress_handler()  # shown before start sets it up
        log.info(
            "results-dir %r is relative: results go to %s (this process's working directory; under "
            "flwr run, where the local SuperLink was first started: give an absolute path to choose)",
            str(out_dir),
            out.resolve(),
        )
    return out.resolve()


def _checked_out(out_dir: str | Path, overwrite: bool) -> Path:
    """``out_dir`` expanded, after the checks :func:`check_results_dir` shares with writing."""
    from .config import KEYS

    KEYS["overwrite"](overwrite)  # a truthy "false" is not taken as asked
    if not isinstance(out_dir, (str, PathLike)):  # a run config's results-dir = 5
        raise TypeError(f"out_dir={out_dir!r}: expected a directory path (a str or Path)")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {str(out_dir)!r}: {out} exists and is not a directory")
    old = [p for p in (out / RESULTS_JSON, out / ACCURACY_PNG) if os.path.lexists(p)]  # a link too
    if old and not overwrite:
        raise FileExistsError(
            f"out_dir {str(out_dir)!r} already holds another run's results "
            f"({', '.join(p.name for p in old)}); use another directory, or pass overwrite=True to "
            f"replace them"
        )
    return out


def _parsed(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` is a parsed run config's ``to_dict()`` (it holds every key)."""
    from .config import KEYS

    return set(KEYS) <= set(config)


def config_not_applied(strategy: Any, config: Mapping[str, Any] | None) -> list[str]:
    """One warning per key of one's own app's ``config`` the strategy does not apply.

    A key of its sections (:func:`strategy_config`), ``method`` or ``num-server-rounds`` not as the
    strategy runs, or a misspelt flwr-sheaf key; empty without both arguments or when parsed.
    """
    import difflib
    from dataclasses import fields

    from .config import KEYS, METHOD_KEYS, ConfigError, lookup_key

    if strategy is None or not config or _parsed(config):
        return []
    used, out = {**_ran(strategy), **strategy_config(strategy)}, []
    for key in config:
        if key in used:
            try:  # as the key's parser reads it (1.0 == 1, ...)
                value = lookup_key(key)(config[key])
            except (ConfigError, KeyError, TypeError, ValueError):
                value = config[key]
            if value != used[key]:
                fix = next(  # the section field that holds key (lambda is SheafConfig's lam)
                    (
                        f"pass {type(sec).__name__}({f.name}=...) to the strategy"
                        for sec in strategy_sections(strategy)
                        for f in fields(sec)
                        if f.metadata.get("key") == key
                    ),
                    _RAN_FIX.get(key),
                )
                out.append(
                    f"run-config {key}={config[key]!r} is not applied: {type(strategy).__name__} runs "
                    f"with {key}={used[key]!r} (results.json's config records {used[key]!r}); to "
                    f"apply it, {fix}"
                )
        elif key not in KEYS and key not in METHOD_KEYS:
            close = difflib.get_close_matches(key, [*used, *KEYS, *METHOD_KEYS], n=1, cutoff=0.85)
            if close:
                out.append(
                    f"run-config key {key!r} is no flwr-sheaf key: did you mean {close[0]!r}? Nothing "
                    f"in flwr-sheaf reads {key!r}; fix its name in your pyproject.toml "
                    f"[tool.flwr.app.config] (and in --run-config)"
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
    """Write a run's ``results.json`` and ``accuracy.png`` into ``out_dir``; return the first.

    Schema: docs/results-schema.md (NaN and inf as null); figure: :func:`plot_rounds`.

    Args:
        strategy: a flwr-sheaf strategy whose ``start`` has run at least one round.
        out_dir: directory (created with its parents if missing).
        config: run-config values recorded as given, then the strategy's section keys
            (:func:`strategy_config`); ``method`` from the registry when absent.
        overwrite: move the files already there and another run's ``checkpoint.pkl`` into a new
            ``previous-<UTC time>/``.
        max_failed_fraction: the failed share of train replies past which ``status`` is ``failed``.
        wall_seconds: ``total_wall_seconds`` (default: the last round's ``elapsed_seconds``).
        extra: further top-level keys, written last.
        problems: lines that make the run ``degraded``.
        errors: what ended the run early, one line each (the run ``failed``).
        keep_previous: keep only the newest this many ``previous-*`` folders (None or 0: all;
            default: ``config``'s ``keep-previous``).

    An exception already in flight is raised instead of this function's own, with a note.

    Raises:
        TypeError: ``strategy`` is not a flwr-sheaf strategy, or ``wall_seconds`` no number.
        ValueError: the strategy has not run, ``extra`` names a key written here, or (a
            ``ConfigError``) a bad ``keep_previous`` / ``max_failed_fraction`` or a file that cannot
            be moved aside.
        FileExistsError: ``out_dir`` holds another run's files and ``overwrite`` is False.
        NotADirectoryError: ``out_dir`` exists and is not a directory.
        flwr_sheaf.rundir.LockedError: another live run holds ``out_dir``, or it was moved.
        OSError: the directory or files cannot be written.
    """
    inflight = sys.exc_info()[1]  # the exception propagating through the caller's finally / except
    problems, errors = ([x] if isinstance(x, str) else list(x) for x in (problems, errors))
    try:
        own_extra = _checked_own_extra(strategy, extra)
        out = _checked_out(out_dir, overwrite)
        foreign = _check_foreign_checkpoint(strategy, out, out_dir, overwrite)
        cfg = _recorded_config(strategy, config)
        max_failed_fraction = _given_or_config(max_failed_fraction, cfg, "max-failed-fraction")
        keep_previous = _given_or_config(keep_previous, cfg, "keep-previous")
        if wall_seconds is not None and (
            isinstance(wall_seconds, bool) or not isinstance(wall_seconds, numbers.Real)
        ):
            raise TypeError(f"wall_seconds={wall_seconds!r}: expected a number of seconds or None")
        ext, unapplied = dict(extra or {}), config_not_applied(strategy, config)
        if unapplied:  # beside the caller's warnings, or the method's results_extra ones
            ext["warnings"] = [*ext.get("warnings", own_extra.get("warnings", [])), *unapplied]
        given = {f"{type(strategy).__name__}.results_extra()": own_extra, "extra": ext}
        payload = _checked_payload(
            strategy, cfg, max_failed_fraction, wall_seconds, given, problems, errors
        )
        text = json.dumps(payload, indent=1, allow_nan=False)
        title = str(cfg.get("method", "")) or type(strategy).__name__
        return _write_files(out, foreign, text, payload["rounds"], title, overwrite, keep_previous)
    except Exception as exc:
        if inflight is None or exc is inflight:
            raise
        own = exc
    # outside the except block: the exception in flight keeps its own __context__
    raise _noted(inflight, own, out_dir)


def _noted(inflight: BaseException, own: Exception, out_dir: str | Path) -> BaseException:
    """``inflight`` with a note (and a logged error) saying what was not written and why (``own``)."""
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


def _given_or_config(given: Any, cfg: Mapping[str, Any], key: str) -> Any:
    """``given``, else ``cfg[key]``, else its default, checked by the key's parser (ConfigError)."""
    from .config import DEFAULTS, KEYS

    return KEYS[key](given if given is not None else cfg.get(key, DEFAULTS[key]))


def _checked_own_extra(strategy: GraphStrategy, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The strategy's checked ``results_extra()``; if it raises, the base class's (a problem)."""
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
    setattr(strategy, _EXTRA_PROBLEM, None)  # this write's own
    try:
        own_extra = strategy.results_extra()
    except Exception as e:  # noqa: BLE001 - a method's hook: its keys are lost, not the run's results
        problem = (
            f"{name}.results_extra raised {type(e).__name__}: {e}; results.json "
            "is written without the method's own keys (fix the hook)"
        )
        setattr(strategy, _EXTRA_PROBLEM, problem)
        log.warning("%s", problem, exc_info=True)
        try:
            own_extra = GraphStrategy.results_extra(strategy)
        except Exception:  # noqa: BLE001 - the base reads state the method broke: write without it
            own_extra = {}
    clash = sorted(set(own_extra) & set(_OWN_KEYS))
    if clash:
        raise ValueError(
            f"{name}.results_extra() returns keys {clash} that write_results "
            "writes itself; rename them in the strategy"
        )
    return own_extra


#: attribute of a strategy whose ``results_extra`` raised: the problem line (:func:`run_status`)
_EXTRA_PROBLEM = "_flwr_sheaf_results_extra_problem"


def _check_foreign_checkpoint(
    strategy: GraphStrategy, out: Path, out_dir: str | Path, overwrite: bool
) -> Path | None:
    """Another run's ``out/checkpoint.pkl`` (FileExistsError without ``overwrite``), else None."""
    from .rundir import CHECKPOINT_NAME

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
    """results.json's ``config``: ``config`` completed (unless parsed: overridden) by what ran,
    ``method`` first when absent."""
    cfg, parsed = dict(config or {}), _parsed(config or {})
    for key, value in strategy_config(strategy).items():
        if key not in cfg or not parsed:  # what ran
            cfg[key] = value
    cfg.update({k: v for k, v in ({} if parsed else _ran(strategy)).items() if k in cfg})
    if "method" not in cfg and (method := _method_name(strategy)) is not None:
        cfg = {"method": method, **cfg}
    return cfg


def _checked_payload(
    strategy: GraphStrategy,
    cfg: dict[str, Any],
    max_failed_fraction: float,
    wall_seconds: float | None,
    given: Mapping[str, Mapping[str, Any]],
    problems: Sequence[str],
    errors: Sequence[str],
) -> dict[str, Any]:
    """results.json's content as JSON values, checked against docs/results-schema.md; a value that
    cannot be written (null) or a payload outside the schema is a ``degradation.problems`` line."""
    from .devices import cpu_environment
    from .schema import ResultsFileError, check_results, to_json_value

    cfg, bad = to_json_value(cfg, "config")
    extra: dict[str, Any] = {}
    for where, values in given.items():
        values, more = to_json_value(values, where)
        extra.update(values)
        bad += more
    status = run_status(strategy, max_failed_fraction, problems, errors)
    ledger = strategy.ledger
    payload, more = to_json_value(
        {
            "config": cfg,
            "rounds": strategy.history,
            "nodes": {str(k): v for k, v in sorted(ledger.node_results.items())},
            "edges": list(ledger.edge_results),
            "failures": ledger.failures,
            "total_wall_seconds": (
                ledger.rounds[-1].elapsed_seconds if wall_seconds is None else float(wall_seconds)
            ),
            "status": status["status"],
            "degradation": status,
            "latent_collapse": next(iter(collapse_warnings(ledger.node_results)), None),
            "environment": cpu_environment(),
            **extra,
        },
        "results.json",
    )
    bad += more
    try:
        check_results(payload, "the results.json written")
    except ResultsFileError as e:
        bad.append(str(e).split("; it does not have")[0] + " (outside docs/results-schema.md)")
    if not bad:
        return payload
    log.warning("results.json: %s", "; ".join(bad))
    status = run_status(strategy, max_failed_fraction, [*problems, *bad], errors)
    payload["status"], payload["degradation"] = status["status"], to_json_value(status)[0]
    return payload


def _write_files(
    out: Path,
    foreign: Path | None,
    text: str,
    rounds: Sequence[Mapping],
    title: str,
    overwrite: bool = False,
    keep_previous: int = 0,
) -> Path:
    """Write ``results.json`` and ``accuracy.png`` into ``out`` under :meth:`RunDir.writing`."""
    from .rundir import RunDir, held_by_this_process

    held = held_by_this_process(out)
    # check_results_dir's claim: this write's own lock, released after it, files moved as without it
    claim = (
        _CLAIMED.pop(held.path) if held is not None and _CLAIMED.get(held.path) is held else None
    )
    names = [] if foreign is None else [foreign.name]
    with RunDir(out, "out_dir").writing(
        names, overwrite=overwrite, keep=keep_previous, claim=claim
    ) as where:
        path = where / RESULTS_JSON
        for name, write in (
            (RESULTS_JSON, lambda p: p.write_text(text)),
            (ACCURACY_PNG, lambda p: plot_rounds(rounds, p, title=title)),
        ):  # each whole or not at all, and never written through a link in its place
            tmp = where / f".tmp-{os.getpid()}-{name}"
            try:
                write(tmp)
                os.replace(tmp, where / name)
            finally:
                tmp.unlink(missing_ok=True)
    return path


def run_status(
    strategy: GraphStrategy,
    max_failed_fraction: float,
    problems: Sequence[str] = (),
    errors: Sequence[str] = (),
) -> dict[str, Any]:
    """The run's ``degradation`` as :func:`write_results` writes it: :func:`_ledger_status`, made
    ``degraded`` by ``problems`` and ``failed`` by ``errors`` or by rounds short of the last
    ``start``'s ``num_rounds`` (docs/results-schema.md)."""
    status = _ledger_status(strategy.ledger, max_failed_fraction)
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
    status["problems"] += [*problems, *([extra_problem] if extra_problem else [])]
    if not status["problems"]:
        del status["problems"]  # the key is written only when something degraded the run
    elif status["status"] == "completed":
        status["status"] = "degraded"
    return status


def plot_rounds(rounds: Sequence[Mapping], path: str | Path, title: str = "") -> None:
    """Save :func:`accuracy_figure` of ``rounds`` (``results.json``'s ``rounds``) as the PNG ``path``.

    Raises:
        OSError: ``path`` cannot be written.
    """
    accuracy_figure(rounds, title).savefig(path, dpi=110)


def accuracy_figure(rounds: Sequence[Mapping], title: str = "") -> Any:
    """Private and communication accuracy of ``rounds`` per server round (a matplotlib ``Figure``;
    missing or all-NaN series left out; with at most 3 points, large markers and their values)."""
    # matplotlib's object API, no pyplot: the caller's backend (a notebook's inline one) is left as it is
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 4.6), layout="constrained")
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
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # under the axes: never over the points and their values
        fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize="small")
    ax.set_title(title)
    return fig


# ------------------------------------------------------------------------------ latent collapse
#: Share of a node's latent dimensions below the variance threshold past which the run is warned
#: (a warning, not ``degraded``). Healthy runs stay at or below 0.125 (notes/stability.md).
COLLAPSE_WARN_FRACTION = 0.25
#: The variance below which a latent dimension counts as collapsed (``low_variance_fraction``'s default).
LOW_VARIANCE_THRESHOLD = 1e-3


def collapse_warnings(
    nodes: Mapping[Any, Mapping[str, Any]], threshold: float = COLLAPSE_WARN_FRACTION
) -> list[dict[str, Any]]:
    """results.json's ``latent_collapse`` warning: nodes whose latents collapsed.

    Args:
        nodes: ``results.json``'s ``nodes`` (``low_variance_fraction``, ``trained``,
            ``trained_rounds``); a missing or NaN fraction is skipped, an untrained node not counted.
        threshold: the fraction above which a node counts as collapsed.

    Returns:
        ``[]``, or one dict ``{"kind": "latent-collapse", "nodes": {partition-id (str): fraction},
        "threshold", "variance_below", "untrained_skipped", "message"}``.
    """
    bad: dict[str, float] = {}
    rounds: dict[str, Any] = {}
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
            rounds[str(pid)] = nodes[pid].get("trained_rounds")  # absent in older results
    if not bad:
        return []
    listed = ", ".join(
        f"{p}: {v:.0%}" + (f" after {rounds[p]} training round(s)" if rounds[p] else "")
        for p, v in bad.items()
    )
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
                f"{threshold:.0%} the accuracies under-read the method. A node that trained little "
                "reads like this from its initialisation (the zoo's latents start with pilot variance "
                "1e-5 to 1e-4 per dimension): give it more rounds, local-epochs or fraction-train; one "
                "that trained long: check its optimizer settings (train-defaults, lr, momentum; "
                "notes/baselines.md s0)"
            ),
        }
    ]


# ------------------------------------------------------------------ the bundled app's run
def write_run(
    strategy: Any,
    run: RunDir,
    config: RunConfig,
    wall_seconds: float,
    warnings: list[str],
    tracker: Any = None,
    stopped: Exception | None = None,
) -> Path:
    """Write the bundled app's run into ``run`` (:func:`write_results`); log its status.

    After ``stopped`` (what ``strategy.start`` raised) the completed rounds are written with status
    ``failed`` where possible and a note on ``stopped`` says where; the caller re-raises it.

    Raises:
        RunFailedError: the run's status is failed (:func:`_report`).
    """
    extra = _extra_results(config, run, warnings)
    problems: list[str] = []
    if tracker is not None:
        extra["tracking"] = tracker.describe()
        problems = list(tracker.problems)
    if strategy.sampled_discovery is not None:  # nodes whose description named no partition-id
        problems += strategy.sampled_discovery.problems
    done = strategy.ledger.rounds[-1].round if strategy.ledger.rounds else 0
    error = "" if stopped is None else f"{type(stopped).__name__}: {stopped}"
    if stopped is not None and not strategy.ledger.rounds:
        stopped.add_note(f"flwr-sheaf: no server round completed; nothing written to {run.path}")
        return run.path / RESULTS_JSON
    try:  # overwrite: the preflight refused another run's files and holds results-dir's lock
        path = write_results(
            strategy,
            run.path,
            config=config.to_dict(),
            overwrite=True,
            max_failed_fraction=config.max_failed_fraction,
            wall_seconds=wall_seconds,
            extra=extra,
            problems=problems,
            errors=[error] if error else [],
        )
    except Exception as werr:  # noqa: BLE001 - e.g. the same full disk: the first error is raised
        if stopped is None:
            raise
        log.error(
            "the run stopped (%s) and its results could not be written either: %s", error, werr
        )
        stopped.add_note(f"flwr-sheaf: the results of rounds 1-{done} could not be written: {werr}")
        return run.path / RESULTS_JSON
    if stopped is None:
        return _report(strategy, config, problems, path, wall_seconds)
    log.error(
        "the run FAILED after server round %d: %s; results of rounds 1-%d (status 'failed') written to %s",
        done,
        error,
        done,
        path,
    )
    stopped.add_note(f"flwr-sheaf: results of rounds 1-{done} (status 'failed') written to {path}")
    return run.path / RESULTS_JSON


def _extra_results(config: RunConfig, run: RunDir, warnings: list[str]) -> dict[str, Any]:
    """results.json's keys of the bundled app: warnings, previous run, resumed part, Ray cluster."""
    extra: dict[str, Any] = {"warnings": warnings} if warnings else {}
    if run.previous_run is not None:
        extra["previous_run"] = run.previous_run
    ckpt, trained_before = run.checkpointer, run.trained_before
    if ckpt is not None and ckpt.restored_round:
        extra["resumed"] = {
            "checkpoint": str(ckpt.resume_from),
            "after_round": ckpt.restored_round,
            "wall_seconds_before": ckpt.previous_wall_seconds,
            "nodes_trained_before": {p: r for p, r in sorted(trained_before.items()) if r},
            "resume_fresh_nodes": config.resume_fresh_nodes,
        }
    engine = describe_ray()  # the Ray cluster the ClientApps ran on (None without Ray)
    warn_if_unasked(engine)
    if engine is not None:
        extra["engine"] = engine
    return extra


def _report(strategy, config: RunConfig, problems: list[str], path: Path, wall: float) -> Path:
    """Log the written run's status and collapse warnings; return ``path`` (or RunFailedError)."""
    status = run_status(strategy, config.max_failed_fraction, problems)  # what write_results wrote
    for w in collapse_warnings(strategy.ledger.node_results):  # results.json's "latent_collapse"
        log.warning("%s", w["message"])
    if status["status"] == "completed":
        log.info("results written to %s (%.1f s)", path, wall)
        return path
    summary = _failure_summary(status)
    if status["status"] == "degraded":
        log.warning(
            "results written to %s (%.1f s); the run is DEGRADED, not clean: %s",
            path,
            wall,
            summary,
        )
        return path
    log.error(
        "results written to %s (%.1f s); the run FAILED (%s): %s",
        path,
        wall,
        "; ".join(status["reasons"]),
        summary,
    )
    fix = "fix the nodes' errors, or set max-failed-fraction (now "
    fix += f"{config.max_failed_fraction}; 1 = report only)"
    if status["train_failed"] == 0 and not status["failures_by_phase"]:
        fix = "see the reasons above"  # nobody drawn to train: no node's error to fix
    raise RunFailedError(
        f"the run failed ({'; '.join(status['reasons'])}): {summary}; results (status 'failed') in "
        f"{path}; {fix}"
    )


def _failure_summary(status: dict) -> str:
    """One line naming the failing partition-ids, their failed rounds and reasons (``results.json``'s ``degradation``)."""
    parts = [f"{status['train_failed']} of {status['train_sampled']} sampled train replies failed"]
    parts += status.get("problems", [])
    if status["rounds_without_training"]:
        parts.append(f"rounds that trained nobody: {status['rounds_without_training']}")
    if status["nodes_failed_every_round"]:
        parts.append(
            f"partition-ids that failed every round they were sampled in: {status['nodes_failed_every_round']}"
        )
    for pid, row in status["nodes"].items():
        parts.append(
            f"partition-id {pid}: {row['failures']} in rounds {row['train_failed_rounds'] or '-'} "
            f"({' | '.join(x[-200:] for x in row['reasons'])})"
        )
    return "; ".join(parts)


# ------------------------------------------------------------------ the status of a ledger
def _ledger_status(ledger: RunLedger, max_failed_fraction: float) -> dict[str, Any]:
    """Whether the run is ``completed``, ``degraded`` or ``failed`` (rules: docs/guarantees.md):
    ``status``, ``reasons`` (why failed), ``problems`` (why degraded besides failed replies) and the
    counts behind them (keys: docs/results-schema.md, ``degradation``)."""
    rounds, failures = ledger.rounds, ledger.failures
    sampled, failed, idle, per_node = _train_counts(rounds)
    by_phase, nodes = _failure_rows(failures, per_node)
    rows = per_node.items()
    every = sorted(p for p, r in rows if 0 < len(r["train_failed_rounds"]) == r["rounds_sampled"])
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
        reasons.append(
            f"no node was drawn to train in any of the {len(rounds)} round(s), so nothing was "
            "trained: the participation probabilities (participation) are too small for "
            "num-server-rounds; raise them (notes/participation.md)"
        )
    elif nobody:
        problems.append(
            f"{len(nobody)} of {len(rounds)} rounds drew no node to train (rounds {nobody}): those "
            "rounds trained nothing; raise the participation probabilities (participation) for a "
            "run that trains every round (notes/participation.md)"
        )
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


#: evaluation phases whose failures leave an evaluated round without accuracies
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
