"""The method registry: every ``method`` value of the app is one :class:`Method` entry.

A method is one unit (a module or a small package under ``flwr_sheaf/methods/``, or a researcher's
own file): its action constant, its config section, its strategy and its client handlers, tied
together by the :class:`Method` it passes to :func:`register`. Nothing shared is edited to add one:
the app finds it here, and a method outside the package registers itself when its module is
imported (run-config key ``method-module``, :func:`import_method_modules`; or the Python entry
point group ``flwr_sheaf.methods``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any

from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Strategy

from ..config import ConfigError, RunConfig, Section, did_you_mean

__all__ = [
    "Method",
    "register",
    "get_method",
    "METHODS",
    "import_method_modules",
    "load_entry_points",
    "graph_args",
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
        action: the message action both sides use (``train.<action>``, ...); one constant per unit.
        strategy: ``strategy(config, num_nodes) -> Strategy`` (a strategy with the ``GraphStrategy``
            results interface: ``history``, ``node_results``, ``edge_results``, ``failures``,
            ``results_extra()``, ``checkpointer``).
        handlers: ``handlers(app, factory) -> app`` registering its ClientApp handlers.
        config: its own config section (a :class:`~flwr_sheaf.config.Section` whose keys it
            declares), parsed into ``RunConfig.method_section``; None = no keys of its own.
        num_nodes: ``num_nodes(config) -> N`` agents of the run (None: the CNN zoo's agents).
        task_factory: ``task_factory() -> factory`` of what its handlers compute on (None: the
            app's CNN-zoo :func:`~flwr_sheaf.apps.scenario.cnn_task_factory`).
        initial_arrays: ``initial_arrays(config) -> ArrayRecord`` of a method with a global
            parameter (RFedAGS's ``x_0``); None = no global model.
    """

    name: str
    action: str
    strategy: Callable[[RunConfig, int], Strategy]
    handlers: Callable[[ClientApp, Any], ClientApp]
    config: type[Section] | None = None
    num_nodes: Callable[[RunConfig], int] | None = None
    task_factory: Callable[[], Any] | None = None
    initial_arrays: Callable[[RunConfig], Any] | None = None


_METHODS: dict[str, Method] = {}
METHODS: Mapping[str, Method] = MappingProxyType(_METHODS)
"""Read-only view of the registered methods, by name."""


def _origin(method: Method) -> str:
    """The (last component of the) module that defines a method's handlers: a re-import of the same
    file under another package path keeps it."""
    return str(getattr(method.handlers, "__module__", "?")).rsplit(".", 1)[-1]


def register(method: Method) -> Method:
    """Add ``method`` to the registry (re-registering a name from the same module replaces its entry:
    a re-imported module).

    Raises:
        ValueError: another registered method already uses ``method.action`` with other handlers, or
            ``method.name`` is already registered from another module (a built-in is never replaced
            silently; pick another name).
    """
    old = _METHODS.get(method.name)
    if old is not None and _origin(old) != _origin(method):
        raise ValueError(
            f"method {method.name!r} is already registered (handlers from {_origin(old)!r}); "
            f"a method from {_origin(method)!r} cannot replace it: give it another name"
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
        raise ConfigError(
            f"method={name!r}: must be one of {sorted(_METHODS)}{did_you_mean(name, _METHODS)} "
            f"(a method of your own: "
            f"name its module in the run-config key method-module){broken}"
        )
    return _METHODS[name]


def import_method_modules(spec: str) -> list[str]:
    """Import the comma-separated modules of ``spec`` (run-config ``method-module``); each registers
    its methods on import. Returns the module names.

    Raises:
        ConfigError: a module that cannot be imported (named, with the error).
    """
    names = [s.strip() for s in str(spec).split(",") if s.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"method-module={spec!r}: cannot import {name!r}: {exc}") from None
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
    """Import ``method-module``, look ``method`` up and parse the run config with its section.

    Raises:
        ConfigError: an unknown key, method or module, or a bad value (named).
    """
    spec = run_config["method-module"] if "method-module" in run_config else ""
    import_method_modules(str(spec))
    name = run_config["method"] if "method" in run_config else RunConfig().method
    method = get_method(str(name))
    return RunConfig.from_run_config(run_config, method.config), method


def graph_args(config: RunConfig) -> dict[str, Any]:
    """Constructor arguments every graph strategy takes from the run config."""
    return {
        "federation": config.federation,
        "train": config.train,
        "discovery_timeout": config.discovery_timeout,
    }
