"""FedSAF: FedProto plus structural alignment, GCSA or RCSA (two ``method`` values, one action)."""

from collections.abc import Callable
from dataclasses import replace

ACTION = "fedsaf"

from ...config import ConfigError, RunConfig  # noqa: E402
from ..registry import Method, graph_args, register  # noqa: E402
from .client import register_fedsaf_handlers  # noqa: E402
from .strategy import FedSAF  # noqa: E402


def _build(structure: str) -> Callable[[RunConfig, int], FedSAF]:
    def build(c: RunConfig, n: int) -> FedSAF:
        other = {"gcsa": "rcsa", "rcsa": "gcsa"}[structure]
        if c.fedsaf.structure == other:
            raise ConfigError(
                f"fedsaf-structure={other!r} contradicts method={c.method!r}; "
                f"use method='fedsaf-{other}'"
            )
        saf = c.fedsaf if c.fedsaf.structure else replace(c.fedsaf, structure=structure)
        return FedSAF(n, fedproto=c.fedproto, fedsaf=saf, **graph_args(c))

    return build


GCSA = register(Method("fedsaf-gcsa", ACTION, _build("gcsa"), register_fedsaf_handlers))
RCSA = register(Method("fedsaf-rcsa", ACTION, _build("rcsa"), register_fedsaf_handlers))
