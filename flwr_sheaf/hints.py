"""Error texts that name the fix: shared by the strategies (kept out of them so they stay small).

- :func:`pilot_count_error`: nodes that report different pilot counts, each partition-id with its count;
- :func:`handler_hint`: a node's error reply ``No <category> function registered with name '<action>'``
  (Flower's ClientApp: the method's handlers were never registered) gets the function to call.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

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


#: message action -> the function that registers its handlers on a ClientApp; filled by
#: :func:`flwr_sheaf.methods.registry.register` (a researcher's own method too), read here, so this
#: low layer never imports the registry above it.
HANDLER_REGISTRARS: dict[str, Callable[..., Any]] = {}


def _registering_function(action: str) -> str | None:
    """The dotted name of the function that registers the handlers of the registered method(s) whose
    message action is ``action`` (:data:`HANDLER_REGISTRARS`); the top-level ``flwr_sheaf.<name>``
    when the package exports it; None if no method uses ``action`` or the function has no importable
    name (a lambda, a nested function)."""
    fn = HANDLER_REGISTRARS.get(action)
    if fn is None:
        return None
    fn = getattr(fn, "func", fn)  # functools.partial (the RFedAGS baselines)
    name = getattr(fn, "__name__", None)
    if name is None:
        return None
    # the public facade (apps layer), read, not imported: Python imports ``flwr_sheaf/__init__``
    # before any of its modules, so it is loaded whenever this runs
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
