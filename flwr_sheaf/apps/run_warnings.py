"""Run-config values the run will not use, or defaults that likely surprise: said before any message.

:func:`run_config_warnings` returns one line per method-section key changed but read by no part of
the selected method, tracker key set without its tracker, and ``graph`` left at ``class-overlap``
on 4 to 6 agents (docs/running.md, "Small federations"); values are compared before ``preset``, so
a preset never warns. The ServerApp logs each line and records it in ``results.json``'s ``warnings``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import KEYS, METHOD_KEYS, RunConfig
from ..methods import Method
from ..results import strategy_config

__all__ = ["run_config_warnings", "changed_keys"]

#: Keys of the tracker each one configures.
_TRACKER_KEYS = {"tracking-dir": "", "wandb-project": "wandb", "wandb-mode": "wandb"}
#: Agents below which the default graph is checked (building it then costs nothing).
_SMALL = 7


def changed_keys(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: parsed value}`` of the known keys whose value in ``run_config`` differs from the key's
    default (values a key's parser refuses are left to the config check)."""
    known = {**METHOD_KEYS, **KEYS}
    out: dict[str, Any] = {}
    for k, v in run_config.items():
        if k not in known:
            continue
        try:
            value = known[k](v)
        except (ValueError, TypeError):
            continue
        if value != known[k](known[k].default):
            out[k] = value
    return out


def _method_section_keys(config: RunConfig) -> set[str]:
    """Keys of every method section: the registered ones of :class:`RunConfig` and the methods' own."""
    return set(METHOD_KEYS).union(*(s.to_dict() for s in config.sections.values()))


def run_config_warnings(
    run_config: Mapping[str, Any], config: RunConfig, method: Method, strategy: Any, num_nodes: int
) -> list[str]:
    """The warnings of the module docstring for this run, one line each naming the key, its value and
    what to do (empty when none apply): ``run_config`` as given, ``config`` its parse, the selected
    ``method``, the built ``strategy`` (the sections it holds are what it reads) and ``num_nodes``.
    """
    changed = changed_keys(run_config)
    out: list[str] = []
    read = set(strategy_config(strategy))
    if config.method_section is not None:
        read |= set(config.method_section.to_dict())
    for key in sorted((set(changed) & _method_section_keys(config)) - read):
        default = (METHOD_KEYS.get(key) or KEYS[key]).default
        out.append(
            f"{key}={changed[key]!r} (default {default!r}) is not read by method={config.method!r}: "
            f"it is ignored (a key of another method? set method= to the method it belongs to)"
        )
    trackers = {t.strip() for t in config.tracking.split(",") if t.strip()}
    for key, tracker in _TRACKER_KEYS.items():
        if key not in changed:
            continue
        if not tracker and not trackers:
            out.append(
                f"{key}={changed[key]!r} is ignored: tracking is off (tracking={config.tracking!r}); "
                f"set tracking='tensorboard' (or 'wandb') to track the run there"
            )
        elif tracker and tracker not in trackers:
            out.append(
                f"{key}={changed[key]!r} is ignored: tracking={config.tracking!r} does not include "
                f"{tracker!r}; add it to use W&B"
            )
    if (
        "graph" not in changed
        and method.task_factory is None
        and 4 <= num_nodes < _SMALL
        and config.federation.graph == KEYS["graph"].default
    ):
        out.append(_small_graph_warning(config, num_nodes))
    return [w for w in out if w]


def _small_graph_warning(config: RunConfig, num_nodes: int) -> str:
    """The default graph's shape on a small zoo, when it leaves a node with one neighbour."""
    from ..models.zoo import zoo_specs
    from ..topology import build_graph

    specs = zoo_specs(config.scenario.zoo)
    try:
        graph = build_graph(config.federation.graph, num_nodes, [s.classes for s in specs])
    except ValueError:
        return ""  # the config check names the problem
    degrees = sorted(d for _, d in graph.degree())
    if degrees[0] > 1:
        return ""
    return (
        f"graph not set: the default graph={config.federation.graph!r} (density 0.4) on "
        f"{num_nodes} agents keeps {graph.number_of_edges()} of {num_nodes * (num_nodes - 1) // 2} "
        f"pairs, degrees {degrees} (nodes with a single neighbour); set graph='ring' or "
        f"graph='complete' for a small federation (or a denser graph='class-overlap:<density>')"
    )
