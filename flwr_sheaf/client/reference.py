"""A ClientApp carrying flwr-sheaf handlers travels by reference, not by value, when pickled.

Flower's Ray engine pickles the ClientApp with every message (by value: 74 KB and 40-100 ms of CPU,
benchmarks/records/performance-ray.md). :func:`travel_by_reference` makes a module-global app pickle
as ``(module, attribute)``; any other app is pickled by value with one warning.
"""

from __future__ import annotations

import copyreg
import functools
import hashlib
import importlib
import logging
import os
import sys
import weakref
from pathlib import Path
from typing import Any

__all__ = [
    "ClientAppReferenceError",
    "travel_by_reference",
    "global_name",
    "load_global",
    "reduce_app",
]

log = logging.getLogger("flwr_sheaf")

#: apps registered by :func:`travel_by_reference` -> module names to look in first (the callers').
_APPS: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
#: app -> its ``(module, attribute)`` once found (None: searched, not a module global).
_FOUND: weakref.WeakKeyDictionary[Any, tuple[str, str] | None] = weakref.WeakKeyDictionary()
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()
#: apps with at least one registration made while a calling module was being imported
_AT_IMPORT: weakref.WeakSet[Any] = weakref.WeakSet()
_TYPES: set[type] = set()


class ClientAppReferenceError(RuntimeError):
    """The ClientApp that arrived as ``module:attribute`` is not the app that was sent."""


def _initializing(module: str) -> bool:
    """Whether module ``module`` is being imported right now (its top-level code is running)."""
    spec = getattr(sys.modules.get(module), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _handlers(app: Any) -> tuple[str, ...]:
    """The app's registered ``category.action`` handler names (Flower 1.42's ``_registered_funcs``)."""
    funcs = getattr(app, "_registered_funcs", None)
    return tuple(sorted(funcs)) if isinstance(funcs, dict) else ()


def _plain_call(app: Any) -> bool:
    """Whether ``app`` dispatches with Flower's own ``ClientApp.__call__`` (no late registration)."""
    from flwr.clientapp import ClientApp

    return isinstance(app, ClientApp) and type(app).__call__ is ClientApp.__call__


def _module_file(module: str) -> str:
    """The file of loaded module ``module``, or ``"?"``."""
    return str(getattr(sys.modules.get(module), "__file__", None) or "?")


def _caller_modules(depth: int = 12) -> tuple[str, ...]:
    """Module names of the calling frames, innermost first."""
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
    return next((attr for attr, value in list(namespace.items()) if value is obj), None)


def global_name(obj: Any, hints: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """``(module, attribute)`` under which ``obj`` is a module-level global, or None.

    Looks in the ``hints`` modules first, then in every loaded module but ``__main__`` (cached,
    re-checked on every call).
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
    names = [n for n in (*hints, *list(sys.modules)) if n != "__main__"]
    other = (n for n in names if not n.startswith("__mp_main__"))  # another process's __main__
    found = next(((n, where) for n in other if (where := _lookup(n, obj)) is not None), None)
    try:
        _FOUND[obj] = found
    except TypeError:
        pass
    return found


def _import_root(module: str, file: str) -> str | None:
    """The directory that must be on ``sys.path`` to import ``module`` from ``file``, or None."""
    if file in ("", "?"):
        return None
    root = Path(file).parent
    if Path(file).name == "__init__.py":
        root = root.parent
    for _ in module.split(".")[1:]:
        root = root.parent
    return str(root)


def _digest(file: str) -> str:
    """A digest of ``file`` and the ``.py`` files beside it ("" if unreadable), cached per
    modification times (two copies of a template differ in task.py, not client_app.py)."""
    try:
        st, folder = os.stat(file), os.stat(os.path.dirname(file) or ".")
    except OSError:
        return ""
    return _digest_of(file, st.st_mtime_ns, st.st_size, folder.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _digest_of(file: str, *stamps: int) -> str:
    parts = []
    for path in sorted({file, *map(str, Path(file).parent.glob("*.py"))}):
        try:
            with open(path, "rb") as f:
                parts.append(f"{os.path.basename(path)}:{hashlib.sha256(f.read()).hexdigest()}")
        except OSError:  # an unreadable neighbour is left out
            if path == file:
                return ""
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def load_global(
    module: str, attr: str, file: str = "?", handlers: int = 0, digest: str = ""
) -> Any:
    """``module.attr`` after importing ``module``: the receiving end of :func:`reduce_app`.

    Args:
        file: the module's file where the app was pickled (for messages).
        handlers: how many handlers the sender's app had (a plain ``ClientApp`` must have as many).
        digest: the sender's digest of ``file`` (a module imported from another file must match).

    Raises:
        ModuleNotFoundError: the module (or one it imports) cannot be imported here; fix named.
        AttributeError: the module has no such attribute.
        ClientAppReferenceError: ``module`` imported from another file with other bytes, or its
            app lacks handlers the sender's app had.
    """
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing and missing != module and not module.startswith(missing + "."):
            msg = (
                f"the ClientApp {module}:{attr} (from {file}) travels to each worker by reference, "
                f"and importing {module!r} here fails: it imports {missing!r}, which this process "
                f"cannot import ({exc}); install {missing!r} on every machine that runs ClientApps"
            )
        else:
            root = _import_root(module, file)
            where = f"PYTHONPATH={root}" if root else "PYTHONPATH=<the directory holding it>"
            msg = (
                f"the ClientApp {module}:{attr} travels to each worker by reference (module and "
                f"name), and this worker cannot import {module!r} (defined in {file} where the run "
                f"started; {exc}): make it importable where the workers start: set {where} "
                "in the environment of `flwr run` (of `ray start` on every node of a Ray cluster), "
                "or install its package on every machine (`pip install -e .`)"
            )
        raise ModuleNotFoundError(msg, name=module) from exc
    try:
        app = getattr(mod, attr)
    except AttributeError:
        raise AttributeError(
            f"{module!r} has no attribute {attr!r}: the ClientApp pickled as {module}:{attr} is not "
            "defined in this process's copy of the module (the same app code must be installed on "
            "every machine)"
        ) from None
    _check_same_module(module, attr, file, digest, str(getattr(mod, "__file__", None) or ""))
    here = _handlers(app)
    if len(here) < handlers and _plain_call(app):
        raise ClientAppReferenceError(
            f"the ClientApp {module}:{attr} arrived with {len(here)} of the {handlers} handlers it "
            f"had where the run started (here: {list(here) or 'none'}): the others were registered "
            f"after {module!r} was imported, and a worker only imports the module ({file}), so it "
            f"never registers them. Register every "
            f"handler at module level in {file}, right after the app is created (e.g. "
            f"`app = ClientApp()` then `register_sheaf_handlers(app, factory)`), not in a function, "
            "a notebook cell or `if __name__ == '__main__'`"
        )
    return app


def _check_same_module(module: str, attr: str, file: str, digest: str, here: str) -> None:
    """Raise :class:`ClientAppReferenceError` when ``here`` is not ``file`` and its bytes differ."""
    if not digest or not here or os.path.realpath(here) == os.path.realpath(file):
        return
    if _digest(here) == digest:  # the same code installed at another path (another machine)
        return
    root = _import_root(module, here) or os.path.dirname(here)
    raise ClientAppReferenceError(  # short: discovery quotes a reason's last 600 characters
        f"ClientApp {module}:{attr}: this worker imported {here}, not this run's {file}: another "
        f"app's package of the same name, in {root}, the folder the local SuperLink was started "
        f"from. Stop that SuperLink (kill its flower-superlink pid; `flwr stop` stops runs only) and "
        f"`flwr run` again from this app's folder, or rename one package (a relative results-dir "
        f"resolves in that folder too)"
    )


def reduce_app(app: Any) -> tuple:
    """The pickle reduction of ``app``: ``(load_global, (module, attribute, file, handlers,
    digest))`` for a marked module-global app registered at import; else by value, warned once."""
    hints = _APPS.get(app) if _is_weakrefable(app) else None
    if hints is not None:
        where = global_name(app, hints)
        if where is not None and app in _AT_IMPORT:
            module, attr = where
            file = _module_file(module)
            return load_global, (module, attr, file, len(_handlers(app)), _digest(file))
        if app not in _WARNED:
            _WARNED.add(app)
            if where is not None:
                module, attr = where
                log.warning(
                    "the ClientApp %s:%s got its flwr-sheaf handlers after %s was imported (in a "
                    "function, a notebook cell or `if __name__ == '__main__'`), so a process that "
                    "imports the module would get the app without them: Flower's Ray engine pickles "
                    "it by value with every message instead (%s: every handler and what it "
                    "holds, e.g. a model its task factory closes over). Register the handlers at "
                    "module level in %s, right after the app is created",
                    module,
                    attr,
                    module,
                    _by_value_size(app),
                    _module_file(module),
                )
            else:
                log.warning(
                    "this ClientApp is not a module-level object (defined in __main__ or inside a "
                    "function), so Flower's Ray engine pickles it by value with every message "
                    "(every handler, and what the handlers hold, each time): define it at module "
                    "level (e.g. `app = ClientApp()` in client_app.py), as `flwr run` loads it"
                )
    reduced: tuple = app.__reduce_ex__(4)  # by value, as without this module
    return reduced


def _by_value_size(app: Any) -> str:
    """How large ``app`` pickles by value, e.g. ``"1.1 MB a message"`` (or ``"size unknown"``)."""
    try:
        import cloudpickle

        size = len(cloudpickle.dumps(app))  # by value: reduce_app warns once, not again here
    except Exception:  # noqa: BLE001 - a message detail: never the cause of a failure
        return "size unknown"
    return f"{size / 1e6:.1f} MB a message" if size >= 100_000 else f"{size / 1e3:.1f} KB a message"


def _copy_app(app: Any, memo: dict | None = None) -> Any:
    """``copy.copy`` (``memo`` None) or ``copy.deepcopy`` of a ClientApp: a new, marked app (else
    :func:`reduce_app` in ``copyreg`` would make the copy the module's app itself)."""
    import copy

    cls: Any = type(app)
    new = cls.__new__(cls)
    if memo is None:
        new.__dict__.update(app.__dict__)
    else:
        memo[id(app)] = new
        new.__dict__.update(copy.deepcopy(app.__dict__, memo))
    if _is_weakrefable(app) and app in _APPS:
        _mark(new, _APPS[app])
    return new


def _is_weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _mark(app: Any, hints: tuple[str, ...] = ()) -> None:
    """Remember the calling modules for ``app``; registered at import if one is being imported."""
    callers = _caller_modules(depth=14)
    _APPS[app] = callers + _APPS.get(app, hints)
    if any(_initializing(name) for name in callers):
        _AT_IMPORT.add(app)


def travel_by_reference(app: Any) -> Any:
    """Make ``app`` (a ``flwr.clientapp.ClientApp``) pickle as its import path (module docstring).

    The first call for a class registers :func:`reduce_app` in ``copyreg.dispatch_table`` and gives
    the class ``__copy__``/``__deepcopy__`` that make real copies; other instances pickle as before.
    Returns ``app``.
    """
    _mark(app)
    cls = type(app)
    if cls not in _TYPES:
        copyreg.pickle(cls, reduce_app)
        if "__copy__" not in vars(cls):  # copy consults __copy__ before copyreg
            cls.__copy__ = _copy_app  # type: ignore[attr-defined]
        if "__deepcopy__" not in vars(cls):
            cls.__deepcopy__ = _copy_app  # type: ignore[attr-defined]
        _TYPES.add(cls)
    return app
