"""A ClientApp carrying flwr-sheaf handlers travels by reference, not by value, when pickled.

Flower's Ray engine pickles the ClientApp with **every message** (docs/performance-ray.md: the
bundled app by value was 74 KB and 40-100 ms of CPU a message). A ClientApp is a module-level object
(Flower loads it as ``module:attribute``), so :func:`travel_by_reference` (called by every
``register_*_handlers``) makes ``pickle`` / ``cloudpickle`` / Ray serialise it as ``(module,
attribute)``; an app that is not a module global is pickled by value as before, with one warning.
"""

from __future__ import annotations

import copyreg
import importlib
import logging
import sys
import weakref
from typing import Any

__all__ = ["travel_by_reference", "global_name", "load_global", "reduce_app"]

log = logging.getLogger("flwr_sheaf")

#: apps registered by :func:`travel_by_reference` -> module names to look in first (the callers').
_APPS: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
#: app -> its ``(module, attribute)`` once found (None: searched, not a module global).
_FOUND: weakref.WeakKeyDictionary[Any, tuple[str, str] | None] = weakref.WeakKeyDictionary()
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()
_TYPES: set[type] = set()


def _caller_modules(depth: int = 12) -> tuple[str, ...]:
    """Module names of the calling frames (innermost first, flwr-sheaf's own registration modules
    included: the bundled app lives in one of them)."""
    names: list[str] = []
    frame = sys._getframe(1)
    while frame is not None and len(names) < depth:
        name = frame.f_globals.get("__name__")
        if isinstance(name, str) and name not in names:
            names.append(name)
        frame = frame.f_back  # type: ignore[assignment]
    return tuple(names)


def _lookup(module: str, obj: Any) -> str | None:
    """The attribute of module ``module`` (if loaded) that is ``obj``, or None."""
    mod = sys.modules.get(module)
    namespace = getattr(mod, "__dict__", None)
    if not isinstance(namespace, dict):
        return None
    for attr, value in list(namespace.items()):
        if value is obj:
            return attr
    return None


def global_name(obj: Any, hints: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """``(module, attribute)`` under which ``obj`` is a module-level global, or None.

    Looks in the ``hints`` modules first, then once in every loaded module; the answer is cached per
    object and re-checked (``getattr(module, attribute) is obj``) on every call. ``__main__`` never
    counts: another process has a different one.
    """
    try:
        known = obj in _FOUND
    except TypeError:  # not weak-referenceable
        known = False
    if known:
        cached = _FOUND[obj]
        if cached is None:
            return None
        module, attr = cached
        if getattr(sys.modules.get(module), attr, None) is obj:
            return cached
    found = None
    for name in (*hints, *list(sys.modules)):
        if name == "__main__" or name.startswith("__mp_main__"):
            continue
        where = _lookup(name, obj)
        if where is not None:
            found = (name, where)
            break
    try:
        _FOUND[obj] = found
    except TypeError:
        pass
    return found


def load_global(module: str, attr: str) -> Any:
    """``module.attr`` after importing ``module``: the receiving end of :func:`reduce_app`.

    Raises:
        ImportError: the module cannot be imported in this process (its directory not on the path).
        AttributeError: the module has no such attribute (a different version of the app's code).
    """
    mod = importlib.import_module(module)
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise AttributeError(
            f"{module!r} has no attribute {attr!r}: the ClientApp pickled as {module}:{attr} is not "
            "defined in this process's copy of the module (the same app code must be installed on "
            "every machine)"
        ) from None


def reduce_app(app: Any) -> tuple:
    """The pickle reduction of ``app``: ``(load_global, (module, attribute))`` for an app marked by
    :func:`travel_by_reference` that is a module global; else the default (by value)."""
    hints = _APPS.get(app) if _is_weakrefable(app) else None
    if hints is not None:
        where = global_name(app, hints)
        if where is not None:
            return load_global, where
        if app not in _WARNED:
            _WARNED.add(app)
            log.warning(
                "this ClientApp is not a module-level object (defined in __main__ or inside a "
                "function), so Flower's Ray engine pickles it by value with every message (every "
                "handler, and what the handlers hold, each time): define it at module level (e.g. `app = ClientApp()` in "
                "client_app.py), as `flwr run` loads it"
            )
    reduced: tuple = app.__reduce_ex__(4)  # by value, as without this module
    return reduced


def _is_weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def travel_by_reference(app: Any) -> Any:
    """Make ``app`` (a ``flwr.clientapp.ClientApp``) pickle as its import path (module docstring).

    The first call for a class registers :func:`reduce_app` for it in ``copyreg.dispatch_table``
    (consulted by ``pickle``, ``cloudpickle`` and Ray's serialiser before ``__reduce_ex__``); other
    instances of that class are unaffected. The modules of the calling frames are remembered as the
    first places to look for the app.

    Returns:
        ``app``.
    """
    _APPS[app] = _caller_modules() + _APPS.get(app, ())
    cls = type(app)
    if cls not in _TYPES:
        copyreg.pickle(cls, reduce_app)
        _TYPES.add(cls)
    return app
