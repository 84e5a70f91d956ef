"""The method registry: one line per ``method`` value (its strategy builder and client handlers).

Adding a method (README "Adding a method"): its maths module, its loss plug-in and
:class:`~flwr_sheaf.client.handlers.ClientMethod` (``client/``), its strategy hooks
(``strategy/``), its config section if it has keys (``config.py``), and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from flwr.clientapp import ClientApp

from ..client.comfed import register_comfed_handlers
from ..client.fedmuscle import register_fedmuscle_handlers
from ..client.fedproto import register_fedproto_handlers
from ..client.fedsaf import register_fedsaf_handlers
from ..client.noncooperative import register_noncooperative_handlers
from ..client.sheaf import register_sheaf_handlers
from ..client.sheaf_fmtl import register_sheaf_fmtl_handlers
from ..client.task import TaskFactory
from ..config import ConfigError, RunConfig
from ..strategy.base import PeerStrategy
from ..strategy.comfed import ComFed
from ..strategy.fedmuscle import FedMuscle
from ..strategy.fedproto import FedProto
from ..strategy.fedsaf import FedSAF
from ..strategy.noncooperative import NonCooperative
from ..strategy.sheaf_fmtl import SheafFMTL, sheaf_fmtl_budget
from ..strategy.sheaf_frl import SheafFRL
from ..models.zoo import build_agent, count_parameters, zoo_specs
from ..topology import build_graph
from .scenario import agent_specs

__all__ = ["Method", "METHODS", "build_strategy", "register_all_handlers", "zoo_parameter_counts"]


@dataclass(frozen=True)
class Method:
    """A ``method`` value: how the ServerApp builds its strategy and how the ClientApp serves it.

    Attributes:
        name: the run-config value.
        strategy: ``strategy(config, num_nodes) -> PeerStrategy``.
        handlers: ``handlers(app, factory) -> app`` registering its ClientApp handlers.
    """

    name: str
    strategy: Callable[[RunConfig, int], PeerStrategy]
    handlers: Callable[[ClientApp, TaskFactory], ClientApp]


def _common(c: RunConfig) -> dict:
    """Constructor arguments every graph strategy takes from the run config."""
    return {"federation": c.federation, "train": c.train, "discovery_timeout": c.discovery_timeout}


def _fedsaf(structure: str) -> Callable[[RunConfig, int], PeerStrategy]:
    def build(c: RunConfig, n: int) -> PeerStrategy:
        other = {"gcsa": "rcsa", "rcsa": "gcsa"}[structure]
        if c.fedsaf.structure == other:
            raise ConfigError(f"fedsaf-structure={other!r} contradicts method={c.method!r}; use method='fedsaf-{other}'")
        saf = c.fedsaf if c.fedsaf.structure else replace(c.fedsaf, structure=structure)
        return FedSAF(n, fedproto=c.fedproto, fedsaf=saf, **_common(c))

    return build


def zoo_parameter_counts(zoo: str) -> dict[int, int]:
    """``{partition-id: n_i}`` trainable parameters of every agent of ``zoo`` (built on CPU, no node contacted).

    Raises:
        ConfigError: an unknown zoo (named).
    """
    try:
        specs = zoo_specs(zoo)
    except ValueError as exc:
        raise ConfigError(f"zoo={zoo!r}: {exc}") from None
    return {i: count_parameters(build_agent(s, seed=0)) for i, s in enumerate(specs)}


def _sheaf_fmtl(c: RunConfig, n: int) -> PeerStrategy:
    """Sheaf-FMTL with the zoo's parameter counts; its map memory is logged and checked here, before any node
    is contacted (the same graph the strategy builds at discovery from the zoo's class sets).

    Raises:
        ConfigError: the largest node's float16 maps exceed ``sheaf-fmtl-max-gib`` (sizes named).
    """
    counts = zoo_parameter_counts(c.scenario.zoo)
    specs = zoo_specs(c.scenario.zoo)
    sheaf_fmtl_budget(counts, build_graph(c.federation.graph, len(specs), class_sets=[s.classes for s in specs]),
                      c.sheaf_fmtl)
    return SheafFMTL(n, num_params=counts, sheaf_fmtl=c.sheaf_fmtl, **_common(c))


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("sheaf-frl", lambda c, n: SheafFRL(n, sheaf=c.sheaf, **_common(c)), register_sheaf_handlers),
    Method("non-cooperative", lambda c, n: NonCooperative(n, **_common(c)), register_noncooperative_handlers),
    Method("fedproto", lambda c, n: FedProto(n, fedproto=c.fedproto, **_common(c)), register_fedproto_handlers),
    Method("fedsaf-gcsa", _fedsaf("gcsa"), register_fedsaf_handlers),
    Method("fedsaf-rcsa", _fedsaf("rcsa"), register_fedsaf_handlers),
    Method("fedmuscle", lambda c, n: FedMuscle(n, fedmuscle=c.fedmuscle, **_common(c)), register_fedmuscle_handlers),
    Method("comfed", lambda c, n: ComFed(n, comfed=c.comfed, **_common(c)), register_comfed_handlers),
    Method("sheaf-fmtl", _sheaf_fmtl, register_sheaf_fmtl_handlers),
)}


def build_strategy(config: RunConfig) -> PeerStrategy:
    """The strategy of ``config.method`` on ``config.scenario``'s agents (nothing is sent yet).

    Raises:
        ConfigError: an unknown method (named, with the valid ones).
    """
    if config.method not in METHODS:
        raise ConfigError(f"method={config.method!r}: must be one of {sorted(METHODS)}")
    return METHODS[config.method].strategy(config, len(agent_specs(config.scenario)))


def register_all_handlers(app: ClientApp, factory: TaskFactory) -> ClientApp:
    """Register every method's handlers on ``app`` (methods sharing an action register it once)."""
    for handlers in dict.fromkeys(m.handlers for m in METHODS.values()):
        handlers(app, factory)
    return app
