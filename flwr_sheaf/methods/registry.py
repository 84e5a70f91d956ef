"""The method registry: every ``method`` value of the app is one :class:`Method` entry (docs/own-method.md).

A method is one unit (under ``flwr_sheaf/methods/``, or one's own file imported by the run-config
key ``method-module`` or the entry point group ``flwr_sheaf.methods``) calling :func:`register`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from importlib.metadata import entry_points
from pathlib import Path
from types import CodeType, MappingProxyType
from typing import TYPE_CHECKING, Any, TypedDict

from flwr.clientapp import ClientApp
from flwr.serverapp import strategy as flower_strategies
from flwr.serverapp.strategy import Strategy

from ..config import (
    KEYS,
    METHOD_KEYS,
    ConfigError,
    FederationConfig,
    LocalTrainConfig,
    RunConfig,
    ScenarioConfig,
    Section,
    did_you_mean,
    lookup_key,
    method_train_changes,
)
from ..hints import HANDLER_REGISTRARS

if TYPE_CHECKING:
    import networkx as nx

    from ..strategy.evaluation import GraphEvaluation

__all__ = [
    "Method",
    "register",
    "get_method",
    "METHODS",
    "import_method_modules",
    "load_entry_points",
    "graph_args",
    "GraphArgs",
    "strategy_args",
    "parse_run_config",
    "ENTRY_POINT_GROUP",
    "key_readers",
    "strategy_config",
    "strategy_sections",
    "run_config_warnings",
    "method_train_note",
]

log = logging.getLogger("flwr_sheaf")

#: Python entry-point group of installed packages that provide methods (value: a module to import).
ENTRY_POINT_GROUP = "flwr_sheaf.methods"


@dataclass(frozen=True)
class Method:
    """One ``method`` value: how the ServerApp builds its strategy and how the ClientApp serves it.

    Attributes:
        name: the run-config value (``method = "<name>"``).
        action: the message action both sides use (``train.<action>``, ...).
        strategy: ``strategy(config, num_nodes) -> Strategy`` with ``GraphStrategy``'s results
            interface.
        handlers: ``handlers(app, factory) -> app`` registering its ClientApp handlers.
        config: its own config section (parsed into ``RunConfig.method_section``); None = none.
        num_nodes: ``num_nodes(config) -> N`` agents of the run (None: the CNN zoo's agents).
        task_factory: ``task_factory() -> factory`` of what its handlers compute on (None: the
            app's :func:`~flwr_sheaf.apps.scenario.cnn_task_factory`).
        initial_arrays: ``initial_arrays(config) -> ArrayRecord`` of a global parameter (RFedAGS's
            ``x_0``); None = no global model.
        report_keys: run-config keys the results summary prints after ``method`` (its swept weights).
        report_lines: ``report_lines(results, last) -> lines`` added after the final round's
            accuracies (``last``: the last evaluated round, None when none was); None = no lines.
    """

    name: str
    action: str
    strategy: Callable[[RunConfig, int], Strategy]
    handlers: Callable[[ClientApp, Any], ClientApp]
    config: type[Section] | None = None
    num_nodes: Callable[[RunConfig], int] | None = None
    task_factory: Callable[[], Any] | None = None
    initial_arrays: Callable[[RunConfig], Any] | None = None
    report_keys: tuple[str, ...] = ()
    report_lines: Callable[[Mapping[str, Any], Mapping[str, Any] | None], list[str]] | None = None


_METHODS: dict[str, Method] = {}
METHODS: Mapping[str, Method] = MappingProxyType(_METHODS)
"""Read-only view of the registered methods, by name."""


#: ``name: (module, file)`` that registered each method (a module's identity is its file).
_ORIGINS: dict[str, tuple[str, str]] = {}


def _caller_origin(depth: int = 2) -> tuple[str, str]:
    """``(module name, resolved file)`` of the module calling :func:`register` (``depth`` frames up)."""
    frame = sys._getframe(depth)
    name = str(frame.f_globals.get("__name__", "?"))
    file = frame.f_globals.get("__file__") or frame.f_code.co_filename
    try:
        file = str(Path(file).resolve())
    except (OSError, RuntimeError):
        file = str(file)
    return name, file


def _same_source(a: str, b: str) -> bool:
    """Whether two files hold the same source (the same method file copied, e.g. into a Flower app)."""
    try:
        return Path(a).read_bytes() == Path(b).read_bytes()
    except OSError:
        return False


def register(method: Method) -> Method:
    """Add ``method`` to the registry, keyed by the module (file) that registers it (re-registering
    a name from the same file, or a copy of it, replaces its entry).

    Raises:
        ValueError: ``method.name`` is registered by another module, or ``method.action`` is used by
            another method with other handlers.
    """
    origin = _caller_origin()
    old = _ORIGINS.get(method.name)
    if (
        method.name in _METHODS
        and old is not None
        and old[1] != origin[1]
        and not _same_source(old[1], origin[1])
    ):
        builtin = old[0].startswith(f"{__package__}.")
        raise ValueError(
            f"method {method.name!r} is already registered by module {old[0]!r} ({old[1]})"
            f"{' (a built-in method)' if builtin else ''}; module {origin[0]!r} ({origin[1]}) "
            f"cannot register it again: give your method another name"
        )
    for other in _METHODS.values():
        if (
            other.name != method.name
            and other.action == method.action
            and other.handlers != method.handlers
        ):
            raise ValueError(
                f"method {method.name!r}: action {method.action!r} is already used by "
                f"{other.name!r}"
            )
    _METHODS[method.name] = method
    _ORIGINS[method.name] = origin
    HANDLER_REGISTRARS[method.action] = method.handlers
    return method


def get_method(name: str) -> Method:
    """The registered method ``name``.

    Raises:
        ConfigError: an unknown method (named, with the registered ones).
    """
    if name not in _METHODS:
        load_entry_points()
    if name not in _METHODS:
        broken = "".join(
            f"; entry point {k!r} of {ENTRY_POINT_GROUP} failed to load: {v}"
            for k, v in _entry_point_errors.items()
        )
        flower = {
            s.lower(): s for s in flower_strategies.__all__ if s not in ("Result", "Strategy")
        }
        hint = (  # a close spelling of another idea (fedprox ~ rfedproj) would mislead
            f" ({flower[name.lower()]} is Flower's own strategy, flwr.serverapp.strategy."
            f"{flower[name.lower()]}, for one shared model; it is not a flwr-sheaf method, whose "
            f"agents keep their own models)"
            if name.lower() in flower
            else did_you_mean(name, _METHODS)
        )
        raise ConfigError(
            f"method={name!r}: must be one of {sorted(_METHODS)}{hint} (a method of your own: "
            f"name its module in the run-config key method-module){broken}"
        )
    return _METHODS[name]


def _module_file(name: str) -> str | None:
    """The file of module ``name`` (None if it cannot be found)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def import_method_modules(spec: str) -> list[str]:
    """Import the comma-separated modules of ``spec`` (run-config ``method-module``); returns their names.

    Raises:
        ConfigError: a module that cannot be imported, has a syntax error or raises on import.
    """
    names = [s.strip() for s in str(spec).split(",") if s.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except SyntaxError as exc:
            text = (exc.text or "").strip()
            raise ConfigError(
                f"method-module={spec!r}: syntax error in {name!r} at {exc.filename}, line "
                f"{exc.lineno}: {exc.msg}" + (f": {text!r}" if text else "")
            ) from None
        except ImportError as exc:
            raise ConfigError(f"method-module={spec!r}: cannot import {name!r}: {exc}") from None
        except ConfigError as exc:
            raise ConfigError(f"method-module={spec!r}: importing {name!r}: {exc}") from None
        except Exception as exc:  # the module's own code raised while it was imported
            frames = traceback.extract_tb(exc.__traceback__)
            own = _module_file(name)
            where = next((f for f in reversed(frames) if f.filename == own), frames[-1])
            raise ConfigError(
                f"method-module={spec!r}: importing {name!r} raised at {where.filename}, line "
                f"{where.lineno}: {type(exc).__name__}: {exc}"
            ) from None
    return names


_entry_points_loaded = False
#: ``entry point name: error`` of the plug-ins that failed to load (named by :func:`get_method`).
_entry_point_errors: dict[str, str] = {}


def load_entry_points() -> None:
    """Import every module of the installed ``flwr_sheaf.methods`` entry points (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:  # a broken third-party plug-in must not take the app down
            _entry_point_errors[ep.name] = f"{type(exc).__name__}: {exc}"
            log.warning("entry point %s of %s failed to load: %s", ep.name, ENTRY_POINT_GROUP, exc)


def parse_run_config(run_config: Mapping[str, Any]) -> tuple[RunConfig, Method]:
    """Import ``method-module``, look ``method`` up and parse the run config with its section (and,
    for a method with its own problem, its agent count: :attr:`RunConfig.agents`).

    Raises:
        ConfigError: an unknown key, method or module, or a bad value (named).
    """
    if "method-module" in run_config:
        import_method_modules(lookup_key("method-module")(run_config["method-module"]))
    name = (
        lookup_key("method")(run_config["method"]) if "method" in run_config else RunConfig().method
    )
    method = get_method(name)
    if method.num_nodes is None:
        return RunConfig.from_run_config(run_config, method.config), method
    # a method with its own problem (RFedAGS): agent-dependent checks run against its agent count
    config = RunConfig.from_run_config(run_config, method.config, agents=0)
    return dataclasses.replace(config, agents=int(method.num_nodes(config))), method


class GraphArgs(TypedDict, total=False):
    """Keyword arguments every method strategy passes on to :class:`~flwr_sheaf.strategy.graph.GraphStrategy`.

    Attributes:
        federation: graph spec, participation, evaluation period, seed (default ``FederationConfig()``).
        train: local SGD settings (default: :class:`~flwr_sheaf.config.LocalTrainConfig`'s).
        graph: an explicit ``networkx.Graph`` on partition-ids (overrides ``federation.graph``).
        action: message action (default: the method's ``ACTION``).
        discovery_timeout: seconds to wait for SuperNodes.
    """

    federation: FederationConfig | None
    train: LocalTrainConfig | None
    graph: nx.Graph | None
    action: str
    discovery_timeout: float


def graph_args(config: RunConfig) -> GraphArgs:
    """Constructor arguments every graph strategy takes from the run config."""
    return {
        "federation": config.federation,
        "train": config.train,
        "discovery_timeout": config.discovery_timeout,
    }


def strategy_args(
    action: str, common: GraphArgs, evaluation: Callable[[FederationConfig], GraphEvaluation]
) -> dict[str, Any]:
    """``common`` (a strategy's ``**common``, :class:`GraphArgs`) completed with ``action`` (its
    default), ``federation`` and ``evaluation(federation)``: ``GraphStrategy.__init__``'s kwargs.

    Raises:
        TypeError: a key :class:`GraphArgs` does not declare (named, with the closest one).
    """
    for key in common:
        if key not in GraphArgs.__annotations__:
            raise TypeError(
                f"{action} strategy: unexpected keyword argument {key!r}"
                f"{did_you_mean(key, GraphArgs.__annotations__)} (accepted: num_nodes, the method's "
                f"own arguments and {', '.join(GraphArgs.__annotations__)})"
            )
    federation = common.get("federation") or FederationConfig()
    return {
        **common,
        "action": common.get("action", action),
        "federation": federation,
        "evaluation": evaluation(federation),
    }


# ------------------------------------------------------------------ what a run config means
def strategy_sections(strategy: Any) -> list[Any]:
    """The :class:`~flwr_sheaf.config.Section` attributes of ``strategy`` and of its components."""
    owners = [strategy, *(v for v in vars(strategy).values() if hasattr(v, "__dict__"))]
    return [v for o in owners for v in vars(o).values() if isinstance(v, Section)]


def strategy_config(strategy: Any) -> dict[str, Any]:
    """``{run-config key: value}`` of :func:`strategy_sections` (first found wins): what
    ``results.json``'s ``config`` records for a strategy built in one's own app."""
    out: dict[str, Any] = {}
    for section in strategy_sections(strategy):
        for key, v in section.to_dict().items():
            out.setdefault(key, v)
    return out


#: Keys of the tracker each one configures.
_TRACKER_KEYS = {"tracking-dir": "", "wandb-project": "wandb", "wandb-mode": "wandb"}


def _changed_keys(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: parsed value}`` of the known keys ``run_config`` sets off their default."""
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
    """The :class:`Section` subclasses among the global names of a strategy builder's code
    (``c.section(SheafConfig)``; a ``functools.partial`` unwrapped)."""
    fn = getattr(builder, "func", builder)
    code, env = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is None:
        return set()
    found = (env.get(name) for name in _code_names(code))
    return {c for c in found if isinstance(c, type) and issubclass(c, Section)}


def key_readers() -> dict[str, list[str]]:
    """``{method-section key: sorted names of the registered methods that read it}``: a method's
    own section and those its strategy builder refers to (the app's sections are not listed)."""
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
    run_config: Mapping[str, Any], config: RunConfig, method: Method, strategy: Any
) -> list[str]:
    """Lines naming run-config values the run will not use, or that likely surprise, and the fix:
    each changed method-section key ``strategy``'s sections do not hold, tracker key without its
    tracker, :attr:`RunConfig.warnings`, and ``evaluate-nodes`` ``panel``/``drawn`` at
    ``fraction-evaluate = 1`` (``run_config`` as given, before ``preset``; ``config`` its parse).
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
    trackers = set(config.tracking.split(",")) - {""}  # the key's parser joined its names
    for key, tracker in ((k, t) for k, t in _TRACKER_KEYS.items() if k in changed):
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
    out += config.warnings  # the config's own (RunConfig.check: a small zoo's default graph)
    mode, fraction = config.federation.evaluate_nodes, config.federation.fraction_evaluate
    if "evaluate-nodes" in changed and mode in ("panel", "drawn") and fraction >= 1.0:
        out.append(
            f"evaluate-nodes={mode!r} evaluates every node at fraction-evaluate={fraction:g}, as "
            f"{'drawn' if mode == 'panel' else 'panel'} does: a panel (the same nodes every round) "
            "and a draw per round differ only below 1; set fraction-evaluate (e.g. 0.1)"
        )
    return [w for w in out if w]


def method_train_note(run_config: Mapping[str, Any], method: str) -> str | None:
    """The line logged when ``method`` trains with its own optimizer settings, else None."""
    changed = method_train_changes(run_config)
    if not changed:
        return None
    return (
        f"{method} trains with its own settings (train-defaults='method'): "
        + ", ".join(f"{k} {new} (package default {old})" for k, (old, new) in changed.items())
        + "; a value you set other than the package default is kept, train-defaults='shared' "
        "gives the package's"
    )
