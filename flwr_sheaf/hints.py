"""Strategies' error texts that name the fix (:func:`pilot_count_error`, :func:`handler_hint`)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["handler_hint", "pilot_count_error"]

_MISSING = re.compile(r"No (\w+) function registered with name '([^']*)'")


def handler_hint(reason: str | None) -> str:
    """What to call if ``reason`` is Flower's ``No <category> function registered``, else ``""``."""
    m = _MISSING.search(reason or "")
    if m is None:
        return ""
    category, action = m.groups()
    fn = _registering_function(action)
    call = (
        f"call {fn}(app, factory) on the ClientApp (or flwr_sheaf.apps.methods.register_all_handlers"
        f"(app, factory) for every method of the app)"
        if fn
        else f"register the method's handlers for '{category}.{action}' on the ClientApp "
        f"(flwr_sheaf.register_method_handlers(app, factory, ClientMethod(...)) with action '{action}')"
    )
    return f" [the ClientApp has no '{category}.{action}' handler: {call}]"


#: message action -> the function registering its handlers (filled by
#: :func:`flwr_sheaf.methods.registry.register`, so this layer never imports the registry).
HANDLER_REGISTRARS: dict[str, Callable[..., Any]] = {}


def _registering_function(action: str) -> str | None:
    """The importable dotted name of the function registering ``action``'s handlers, or None."""
    fn = HANDLER_REGISTRARS.get(action)
    if fn is None:
        return None
    fn = getattr(fn, "func", fn)  # functools.partial (the RFedAGS baselines)
    name = getattr(fn, "__name__", None)
    if name is None:
        return None
    # the facade is read, not imported: ``flwr_sheaf/__init__`` is loaded before any of its modules
    if getattr(sys.modules.get("flwr_sheaf"), name, None) is fn:
        return f"flwr_sheaf.{name}"
    module = sys.modules.get(str(getattr(fn, "__module__", "")))
    if getattr(module, name, None) is fn:  # importable by that name (not a lambda, not nested)
        return f"{fn.__module__}.{name}"
    return None


def pilot_count_error(counts: Mapping[int, int]) -> str:
    """The error text for nodes (``{partition-id: pilot count}``) that report different pilot counts."""
    values = sorted(set(counts.values()))
    each = ", ".join(f"partition-id {p}: {k}" for p, k in sorted(counts.items()))
    return (
        f"nodes report different pilot counts {values} ({each}): pilots must be shared, i.e. every node needs "
        f"the same dataset, seed, shift and num-pilots (check the run config and the data of the nodes whose "
        f"count differs)"
    )
