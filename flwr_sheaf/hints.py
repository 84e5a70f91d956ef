"""Error texts that name the fix: shared by the strategies (kept out of them so they stay small).

- :func:`pilot_count_error`: nodes that report different pilot counts, each partition-id with its count;
- :func:`handler_hint`: a node's error reply ``No <category> function registered with name '<action>'``
  (Flower's ClientApp: the method's handlers were never registered) gets the function to call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["HANDLER_FUNCTIONS", "handler_hint", "pilot_count_error"]

#: message action -> the function of the ``flwr_sheaf`` package that registers its ClientApp handlers.
HANDLER_FUNCTIONS: dict[str, str] = {
    "sheaf": "register_sheaf_handlers",
    "noncooperative": "register_noncooperative_handlers",
    "fedproto": "register_fedproto_handlers",
    "fedsaf": "register_fedsaf_handlers",
    "fedmuscle": "register_fedmuscle_handlers",
    "comfed": "register_comfed_handlers",
    "sheaf_fmtl": "register_sheaf_fmtl_handlers",
    "rfedags": "register_rfedags_handlers",
}
_MISSING = re.compile(r"No (\w+) function registered with name '([^']*)'")


def handler_hint(reason: str | None) -> str:
    """``"; <what to call>"`` when ``reason`` is Flower's missing-handler error, else ``""``."""
    m = _MISSING.search(reason or "")
    if m is None:
        return ""
    category, action = m.groups()
    from .rfedags.baselines import BASELINES

    fn = HANDLER_FUNCTIONS.get(action)
    fn = f"flwr_sheaf.{fn}" if fn else None
    if action in BASELINES:  # RFedAGS baselines: the action is the method name
        fn = "flwr_sheaf.client.rfedags.register_rfedags_baseline_handlers"
    call = (
        f"call {fn}(app, factory) on the ClientApp (or flwr_sheaf.apps.methods.register_all_handlers"
        f"(app, factory) for every method of the app)"
        if fn
        else f"register the method's handlers for '{category}.{action}' on the ClientApp "
        f"(flwr_sheaf.register_method_handlers(app, factory, ClientMethod(...)) with action '{action}')"
    )
    return f" [the ClientApp has no '{category}.{action}' handler: {call}]"


def pilot_count_error(counts: Mapping[int, int]) -> str:
    """The error text for nodes (``{partition-id: pilot count}``) that report different pilot counts."""
    values = sorted(set(counts.values()))
    each = ", ".join(f"partition-id {p}: {k}" for p, k in sorted(counts.items()))
    return (
        f"nodes report different pilot counts {values} ({each}): pilots must be shared, i.e. every node needs "
        f"the same dataset, seed, shift and num-pilots (check the run config and the data of the nodes whose "
        f"count differs)"
    )
