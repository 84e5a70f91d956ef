"""The ServerApp that ``flwr run`` loads: the run config's ``method`` picks the strategy."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from types import CodeType
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..config import (
    KEYS,
    METHOD_KEYS,
    ConfigError,
    FederationConfig,
    LocalTrainConfig,
    RunConfig,
    ScenarioConfig,
    Section,
    method_train_changes,
)
from ..engine import describe_ray, warn_if_unasked
from ..methods import METHODS, Method, parse_run_config
from ..protocol import RESUME_FRESH, RESUME_ROUND, RESUME_STATE_ROUNDS
from ..results import collapse_warnings, run_status, strategy_config, write_results
from ..rundir import (
    check_node_state_dir,
    claim_node_state_dir,
    preflight,
    resume_without_node_state,
)
from ..strategy.checkpoint import Checkpointer
from ..strategy.ledger import RunFailedError
from ..strategy.messaging import simulated
from ..tracking import Tracker, check_trackers
from .methods import num_nodes
from .scenario import check_scenario, sampled_discovery

log = logging.getLogger("flwr_sheaf")

app = ServerApp()

#: Keys of the tracker each one configures.
_TRACKER_KEYS = {"tracking-dir": "", "wandb-project": "wandb", "wandb-mode": "wandb"}
#: Agents below which the default graph is checked (building it then costs nothing).
_SMALL = 7


def _changed_keys(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: parsed value}`` of the known keys whose value in ``run_config`` differs from the key's
    default (values a key's parser refuses are left to the config check)."""
    known = {**METHOD_KEYS, **KEYS}
    out: dict[str, Any] = {}
    for k, v in run_config.items():
        if k not in known:
            continue
        try:
            value = known[k](v)
        except (ValueError, TypeError):
            continue
        if value != known[k](known[k].default):
            out[k] = value
    return out


#: Keys of the app's own sections, read by every method (not listed by :func:`key_readers`).
APP_SECTION_KEYS = frozenset(
    f.metadata["key"]
    for cls in (ScenarioConfig, FederationConfig, LocalTrainConfig)
    for f in fields(cls)
)


#: Keys of the app's federation section that only the per-round client evaluation reads.
_CLIENT_EVALUATION_KEYS = frozenset(
    (
        "evaluate-every",
        "fraction-evaluate",
        "evaluate-nodes",
        "non-edge-pairs",
        "diagnostics-eigenvalues",
        "posthoc-readings",
    )
)


def _code_names(code: CodeType) -> set[str]:
    """Global names a code object and the functions nested in it refer to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _code_names(const)
    return names


def _builder_sections(builder: Any) -> set[type[Section]]:
    """The config-section classes a method's strategy builder refers to (``c.section(SheafConfig)``
    in ``lambda c, n: SheafFRL(n, sheaf=c.section(SheafConfig), ...)``): the :class:`Section`
    subclasses among the global names of its code (a ``functools.partial`` unwrapped)."""
    fn = getattr(builder, "func", builder)
    code, env = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is None:
        return set()
    found = (env.get(name) for name in _code_names(code))
    return {c for c in found if isinstance(c, type) and issubclass(c, Section)}


def key_readers() -> dict[str, list[str]]:
    """``{run-config key: sorted names of the registered methods that read it}`` for the keys of the
    methods' config sections, built from the method registry: a method reads its own section
    (:attr:`Method.config`) and the registered sections its strategy builder refers to.

    Returns:
        Each method-section key with the names of its methods (keys of the app's own sections --
        scenario, federation, train -- are not listed: every method reads them).
    """
    out: dict[str, set[str]] = {}
    for method in METHODS.values():
        sections = _builder_sections(method.strategy)
        if method.config is not None:
            sections.add(method.config)
        for cls in sections:
            for f in fields(cls):
                key = f.metadata.get("key")
                if key and key not in APP_SECTION_KEYS:
                    out.setdefault(key, set()).add(method.name)
    return {k: sorted(v) for k, v in out.items()}


def run_config_warnings(
    run_config: Mapping[str, Any], config: RunConfig, method: Method, strategy: Any, num_nodes: int
) -> list[str]:
    """Run-config values the run will not use, or defaults that likely surprise, said before any
    message: one line per method-section key changed but read by no part of the selected method,
    tracker key set without its tracker, ``graph`` left at ``class-overlap`` on 4 to 6 agents
    (docs/own-app.md), and ``evaluate-nodes`` set to ``panel`` or ``drawn`` at
    ``fraction-evaluate = 1`` (both then evaluate every node); values are compared before ``preset``, so a preset
    never warns. The ServerApp logs each line and records it in ``results.json``'s ``warnings``.

    Args:
        run_config: the run config as given.
        config: its parse.
        method: the selected method.
        strategy: the built strategy (the sections it holds are what it reads).
        num_nodes: the number of agents.

    Returns:
        One line each naming the key, its value and what to do (empty when none apply).
    """
    changed = _changed_keys(run_config)
    out: list[str] = []
    read = set(strategy_config(strategy))
    if config.method_section is not None:
        read |= set(config.method_section.to_dict())
    # keys of every method section: the registered ones of RunConfig and the methods' own
    section_keys = set(METHOD_KEYS).union(*(s.to_dict() for s in config.sections.values()))
    readers = key_readers()
    for key in sorted((set(changed) & section_keys) - read):
        default = (METHOD_KEYS.get(key) or KEYS[key]).default
        others = [m for m in readers.get(key, []) if m != config.method]
        where = (
            f"it is read by method={' / '.join(repr(m) for m in others)}: set method= to "
            f"{'that method' if len(others) == 1 else 'one of them'}, or drop {key}"
            if others
            else f"no registered method reads it: drop {key}"
        )
        out.append(
            f"{key}={changed[key]!r} (default {default!r}) is not read by method={config.method!r} "
            f"and is ignored; {where}"
        )
    if getattr(strategy, "evaluation", True) is None:  # a method without client evaluation
        for key in sorted(set(changed) & _CLIENT_EVALUATION_KEYS):
            out.append(
                f"{key}={changed[key]!r} (default {KEYS[key].default!r}) is not read by "
                f"method={config.method!r} and is ignored: the method evaluates no node; drop {key}"
            )
    trackers = {t.strip() for t in config.tracking.split(",") if t.strip()}
    for key, tracker in _TRACKER_KEYS.items():
        if key not in changed:
            continue
        if not tracker and not trackers:
            out.append(
                f"{key}={changed[key]!r} is ignored: tracking is off (tracking={config.tracking!r}); "
                f"set tracking='tensorboard' (or 'wandb') to track the run there"
            )
        elif tracker and tracker not in trackers:
            out.append(
                f"{key}={changed[key]!r} is ignored: tracking={config.tracking!r} does not include "
                f"{tracker!r}; add it to use W&B"
            )
    if (
        "graph" not in changed
        and method.task_factory is None
        and 4 <= num_nodes < _SMALL
        and config.federation.graph == KEYS["graph"].default
    ):
        out.append(_small_graph_warning(config, num_nodes))
    mode, fraction = config.federation.evaluate_nodes, config.federation.fraction_evaluate
    if "evaluate-nodes" in changed and mode in ("panel", "drawn") and fraction >= 1.0:
        out.append(
            f"evaluate-nodes={mode!r} evaluates every node at fraction-evaluate={fraction:g}, as "
            f"{'drawn' if mode == 'panel' else 'panel'} does: a panel (the same nodes every round) "
            "and a draw per round differ only below 1; set fraction-evaluate (e.g. 0.1)"
        )
    return [w for w in out if w]


def _small_graph_warning(config: RunConfig, num_nodes: int) -> str:
    """The default graph's shape on a small zoo, when it leaves a node with one neighbour."""
    from ..models.zoo import zoo_specs
    from ..topology import build_graph

    specs = zoo_specs(config.scenario.zoo)
    try:
        graph = build_graph(config.federation.graph, num_nodes, [s.classes for s in specs])
    except ValueError:
        return ""  # the config check names the problem
    degrees = sorted(d for _, d in graph.degree())
    if degrees[0] > 1:
        return ""
    return (
        f"graph not set: the default graph={config.federation.graph!r} (density 0.4) on "
        f"{num_nodes} agents keeps {graph.number_of_edges()} of {num_nodes * (num_nodes - 1) // 2} "
        f"pairs, degrees {degrees} (nodes with a single neighbour); set graph='ring' or "
        f"graph='complete' for a small federation (or a denser graph='class-overlap:<density>')"
    )


def run_server(grid: Grid, run_config: Mapping) -> Path:
    """Validate the run config, run the configured method on ``grid`` and write its results.

    Every key and value is checked (and the graph built on the zoo's agents) before any message is
    sent; ``results.json`` records every key's effective value. A checkpoint goes to ``results-dir``
    after every ``checkpoint-every`` rounds; ``resume`` / ``resume-from`` continue a stopped run from
    its checkpoint (docs/resume.md). With ``tracking`` set, every round's numbers also go to
    TensorBoard and/or Weights & Biases (:class:`flwr_sheaf.tracking.Tracker`, docs/tracking.md).

    Returns:
        Path of the written ``results.json``.

    Raises:
        ConfigError: an unknown key, a bad value, an unknown method or method module (named); resuming with a
            different run config (keys named) or past ``num-server-rounds``; a ``tracking`` tracker
            whose package is not installed (the pip extra named).
        NoCheckpointError: resuming without a checkpoint (a ``ConfigError`` and a ``FileNotFoundError``;
            a finished ``checkpoint-every=0`` run named as such).
        Exception: whatever ``strategy.start`` raised (a node-independent error, e.g. a
            :class:`~flwr_sheaf.strategy.checkpoint.CheckpointWriteError`), re-raised after the completed
            rounds' ``results.json`` is written with ``status: failed`` (a note on the exception names
            the file; docs/guarantees.md).
        RunFailedError: (after ``results.json`` is written, with ``status: failed``) more than
            ``max-failed-fraction`` of the sampled train replies failed, or a round trained nobody; the
            message names the partition-ids, rounds and reasons (docs/guarantees.md).
        ConfigError: (preflight, flwr_sheaf.rundir) a results-dir or node-state-dir that cannot be
            written (or a symbolic-link loop), ``overwrite`` with ``resume``, a results-dir holding another
            run's results (without resume / overwrite), a node-state-dir holding another run's node
            state, or either in use by another run (its lock named).
    """
    if not log.handlers:  # our own progress lines only; leave the root logger to the host app
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[flwr-sheaf] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    config, method = parse_run_config(run_config)  # imports method-module first
    changed = method_train_changes(run_config)
    if changed:  # the method's own optimizer settings (notes/baselines.md s0): said, never silent
        log.info(
            "%s trains with its own settings (train-defaults='method'): %s; a value you set other than "
            "the package default is kept, train-defaults='shared' gives the package's",
            config.method,
            ", ".join(f"{k} {new} (package default {old})" for k, (old, new) in changed.items()),
        )
    n = num_nodes(config, method)
    strategy = method.strategy(config, n)
    warnings = run_config_warnings(run_config, config, method, strategy, n)
    for line in warnings:
        log.warning("%s", line)
    # before any message: the CNN-zoo scenario's data checked for every agent, and
    # discovery='sampled' refused or set
    if method.task_factory is None:
        check_scenario(config.scenario)
    sampled_discovery(config, method, strategy, n)
    check_trackers(config.tracking)  # a tracker whose package is missing: before any message
    # directories writable, results-dir free and locked, an overwritten run's files moved aside:
    # before any message
    with preflight(config, simulated(grid)) as pre:
        if not Path(config.results_dir).expanduser().is_absolute():
            log.info(
                "results-dir=%r is relative: results go to %s (the ServerApp's working directory; "
                "under flwr run, where the local SuperLink was first started: give an absolute path "
                "to choose)",
                config.results_dir,
                Path(config.results_dir).expanduser().resolve(),
            )
        return _run(grid, config, method, strategy, warnings, pre.previous_run)


def _run(
    grid: Grid, config: RunConfig, method, strategy, warnings: list[str], previous_run=None
) -> Path:
    """:func:`run_server` after the preflight: resume checks, the rounds, results.json, the status."""
    out = Path(config.results_dir).expanduser().resolve()
    ckpt, trained_before = _prepare_resume(config, strategy, out, simulated(grid))  # no message yet
    tracker = Tracker.from_config(config)  # None unless `tracking` names a tracker
    if tracker is not None:
        strategy.round_callbacks.append(tracker.log_round)
    t0 = time.monotonic()
    stopped = _start(grid, config, method, strategy, tracker)
    wall = time.monotonic() - t0
    extra = _extra_results(config, ckpt, trained_before, warnings, previous_run)
    problems: list[str] = []
    if tracker is not None:
        extra["tracking"] = tracker.describe()
        problems = list(tracker.problems)
    if strategy.sampled_discovery is not None:  # nodes whose description named no partition-id
        problems += strategy.sampled_discovery.problems
    if stopped is not None:
        _write_stopped(strategy, out, config, wall, extra, problems, stopped)
        raise stopped
    path = _write(strategy, out, config, wall, extra, problems)
    return _report(strategy, config, problems, path, wall)


def _prepare_resume(
    config: RunConfig, strategy, out: Path, simulation: bool = False
) -> tuple[Checkpointer, dict[int, int]]:
    """The run's :class:`~flwr_sheaf.strategy.checkpoint.Checkpointer` (set on ``strategy``) and,
    when resuming, ``{partition-id: last round it trained}`` of the checkpoint; the node state
    directory is checked and claimed for this run, and ``strategy.resume_check`` set so that every
    node finds its state (client/state.py).

    Raises:
        ConfigError / NoCheckpointError: as :meth:`Checkpointer.check` and
            :func:`~flwr_sheaf.rundir.check_node_state_dir` (another run's node state); in
            Flower's simulation engine (``simulation``) without ``node-state-dir``, nodes that
            trained before (their state lived in memory only: said once, what works named).
    """
    resume_from = config.resume_from or (out if config.resume else None)
    ckpt = strategy.checkpointer = Checkpointer(
        out, config.to_dict(), config.checkpoint_every, resume_from
    )
    checked = ckpt.check(strategy, config.num_server_rounds)
    if checked is None:
        return ckpt, {}
    if config.node_state_dir:  # the node state is this run's (rundir.py)
        state_root = Path(config.node_state_dir).expanduser().resolve()
        check_node_state_dir(state_root, config.node_state_dir, config.to_dict(), True)
        claim_node_state_dir(state_root, config.to_dict(), out)
    trained_before = _last_trained(checked["state"]["ledger"].rounds, strategy.num_nodes)
    if simulation and not config.node_state_dir and any(trained_before.values()):
        # else every node refuses the resume query alone, each with Flower's traceback
        raise ConfigError(
            resume_without_node_state(out, str(checked["config"].get("node-state-dir", "")))
        )
    strategy.resume_check = {
        RESUME_STATE_ROUNDS: [trained_before.get(p, 0) for p in range(strategy.num_nodes)],
        RESUME_ROUND: int(checked["round"]),
        RESUME_FRESH: config.resume_fresh_nodes,
    }
    return ckpt, trained_before


def _start(grid: Grid, config: RunConfig, method, strategy, tracker) -> Exception | None:
    """Run the rounds; the exception ``strategy.start`` raised (the rounds done so far are still
    written, with status failed), or None. The tracker is closed either way."""
    initial = method.initial_arrays(config) if method.initial_arrays is not None else None
    try:
        strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=config.num_server_rounds,
            timeout=config.round_timeout,
        )
    except Exception as exc:
        return exc
    finally:
        if tracker is not None:
            tracker.close()
    return None


def _extra_results(
    config: RunConfig, ckpt: Checkpointer, trained_before, warnings, previous_run
) -> dict[str, Any]:
    """What results.json records besides the rounds: the run's warnings, the moved-aside previous
    run, the resumed part (checkpoint, round, nodes trained before) and the Ray cluster used."""
    extra: dict[str, Any] = {"warnings": warnings} if warnings else {}
    if previous_run is not None:
        extra["previous_run"] = previous_run
    if ckpt.restored_round:
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
    """Log the written run's status (and its latent-collapse warnings) and return ``path``.

    Raises:
        RunFailedError: the run's status is failed (reasons and failed nodes named).
    """
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


def _write(strategy, out: Path, config: RunConfig, wall, extra, problems, errors=()) -> Path:
    """:func:`~flwr_sheaf.results.write_results` of the bundled app's run (completed or stopped).

    ``overwrite=True``: the preflight already refused another run's results in results-dir (without
    resume / overwrite) and holds its lock, so the files there are this run's (or its resumed part's).
    """
    return write_results(
        strategy,
        out,
        config=config.to_dict(),
        overwrite=True,
        max_failed_fraction=config.max_failed_fraction,
        wall_seconds=wall,
        extra=extra,
        problems=problems,
        errors=errors,
    )


def _write_stopped(strategy, out: Path, config: RunConfig, wall, extra, problems, exc) -> None:
    """After ``start`` raised: write the completed rounds' ``results.json`` (status ``failed``, the
    error among its reasons) where possible, and say where in the error's notes; then the caller
    re-raises ``exc``."""
    done = strategy.ledger.rounds[-1].round if strategy.ledger.rounds else 0
    error = f"{type(exc).__name__}: {exc}"
    if not strategy.ledger.rounds:
        exc.add_note(f"flwr-sheaf: no server round completed; nothing written to {out}")
        return
    try:
        path = _write(strategy, out, config, wall, extra, problems, errors=[error])
    except Exception as werr:  # noqa: BLE001 - e.g. the same full disk: the first error is raised
        log.error(
            "the run stopped (%s) and its results could not be written either: %s", error, werr
        )
        exc.add_note(f"flwr-sheaf: the results of rounds 1-{done} could not be written: {werr}")
        return
    log.error(
        "the run FAILED after server round %d: %s; results of rounds 1-%d (status 'failed') written to %s",
        done,
        error,
        done,
        path,
    )
    exc.add_note(f"flwr-sheaf: results of rounds 1-{done} (status 'failed') written to {path}")


def _last_trained(rounds, num_nodes: int) -> dict[int, int]:
    """``{partition-id: last round whose train reply was accepted}`` of a checkpoint's round records."""
    out: dict[int, int] = {}
    for r in rounds:
        if r.num_trained == 0:
            continue
        for pid in set(r.sampled) - set(r.failed.get("train", [])):
            if pid < num_nodes:
                out[pid] = max(out.get(pid, 0), int(r.round))
    return out


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


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point."""
    run_server(grid, dict(context.run_config))
