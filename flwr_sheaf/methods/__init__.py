"""Every method of the app, one unit (sub-package) each, found through one registry (:mod:`.registry`).

Each unit holds its ``ACTION``, its strategy, its client plug-in and handlers, and the
:class:`~.registry.Method` it registers. A researcher's own method is the same shape in one file
(docs/own-method.md).
"""

import importlib as _importlib  # noqa: E402
import pkgutil as _pkgutil  # noqa: E402

from .registry import (
    METHODS,
    Method,
    get_method,
    graph_args,
    import_method_modules,
    key_readers,
    method_train_note,
    parse_run_config,
    register,
    run_config_warnings,
)

# every unit registers itself on import; ``_shared`` holds components, not a method
for _unit in sorted(
    m.name for m in _pkgutil.iter_modules(__path__) if m.ispkg and not m.name.startswith("_")
):
    _importlib.import_module(f"{__name__}.{_unit}")

__all__ = [
    "METHODS",
    "Method",
    "get_method",
    "graph_args",
    "import_method_modules",
    "key_readers",
    "method_train_note",
    "parse_run_config",
    "register",
    "run_config_warnings",
]
