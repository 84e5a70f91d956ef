"""The method registry: every ``method`` value of the app is one :class:`Method` entry (docs/own-method.md).

A method is one unit (a module or package under ``flwr_sheaf/methods/``, or a researcher's own
file) that registers its :class:`Method` with :func:`register` on import. Methods outside the
package are imported through the run-config key ``method-module`` (:func:`import_method_modules`)
or the entry point group ``flwr_sheaf.methods``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypedDict

from flwr.clientapp import ClientApp
from flwr.serverapp import strategy as flower_strategies
from flwr.serverapp.strategy import Strategy

from ..config import (
    ConfigError,
    FederationConfig,
    LocalTrainConfig,
    RunConfig,
    Section,
    did_you_mean,
    lookup_key,
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
        strategy: ``strategy(config, num_nodes) -> Strategy`` with the ``GraphStrategy`` results
            interface (``history``, ``node_results``, ``edge_results``, ``failures``,
            ``results_extra()``, ``checkpointer``).
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
    """Add ``method`` to the registry, keyed by the module (file) that registers it; re-registering a
    name from the same file (or a copy of it) replaces its entry.

    Raises:
        ValueError: ``method.name`` is already registered by another module (both named), or another
            method already uses ``method.action`` with other handlers.
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
        ConfigError: a module that cannot be imported, has a syntax error (file, line and text
            named) or raises on import (file and line named).
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
    """``GraphStrategy.__init__``'s keyword arguments for a method strategy.

    Args:
        action: the method's ``ACTION`` (default of ``common["action"]``; names the strategy in errors).
        common: the strategy's ``**common`` (:class:`GraphArgs`).
        evaluation: builds the strategy's evaluation component from the federation.

    Returns:
        ``common`` completed with ``action``, ``federation`` and ``evaluation``.

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
