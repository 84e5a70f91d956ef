"""Error texts that name the fix: shared by the strategies (kept out of them so they stay small).

- :func:`pilot_count_error`: nodes that report different pilot counts, each partition-id with its count;
- :func:`handler_hint`: a node's error reply ``No <category> function registered with name '<action>'``
  (Flower's ClientApp: the method's handlers were never registered) gets the function to call.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping

__all__ = ["handler_hint", "pilot_count_error"]

_MISSING = re.compile(r"No (\w+) function registered with name '([^']*)'")


def handler_hint(reason: str | None) -> str:
    """``"; <what to call>"`` when ``reason`` is Flower's missing-handler error, else ``""``."""
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


def _registering_function(action: str) -> str | None:
    """The dotted name of the function that registers the handlers of the registered method(s) whose
    message action is ``action`` (read from the method registry, so a researcher's own method is
    named too); the top-level ``flwr_sheaf.<name>`` when the package exports it; None if no method
    uses ``action``."""
    from .methods.registry import METHODS  # the registry sits above this module's users

    # the public facade (apps layer), read, not imported: Python imports ``flwr_sheaf/__init__``
    # before any of its modules, so it is loaded whenever this runs
    facade = sys.modules["flwr_sheaf"]

    for method in METHODS.values():
        if method.action != action:
            continue
        fn = method.handlers
        fn = getattr(fn, "func", fn)  # functools.partial (the RFedAGS baselines)
        name = getattr(fn, "__name__", None)
        if name is None:
            return None
        if getattr(facade, name, None) is fn:
            return f"flwr_sheaf.{name}"
        module = sys.modules.get(str(getattr(fn, "__module__", "")))
        if getattr(module, name, None) is fn:  # importable by that name (not a lambda, not nested)
            return f"{fn.__module__}.{name}"
        return None
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
