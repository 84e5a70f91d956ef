"""Every method of the app, one unit each, found through one registry (:mod:`.registry`).

Built-in units: ``sheaf_frl``, ``noncooperative``, ``fedproto``, ``fedsaf``, ``fedmuscle``,
``comfed``, ``sheaf_fmtl``, ``rfedags``. Each holds its ``ACTION`` (shared by its strategy and its
handlers), its strategy, its client plug-in and handlers, and the :class:`~.registry.Method` entry
it registers. A researcher's own method is the same shape in one file (docs/own-method.md).
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

# every unit of this package registers itself on import (a new unit edits nothing here)
# every unit (a sub-package); ``_shared`` holds components, not a method
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
