"""FedSAF: FedProto plus structural alignment, GCSA or RCSA (two ``method`` values, one action)."""

from collections.abc import Callable
from dataclasses import replace

ACTION = "fedsaf"

from ...config import ConfigError, RunConfig  # noqa: E402
from ..fedproto.config import FedProtoConfig  # noqa: E402
from ..registry import Method, graph_args, register  # noqa: E402
from .client import register_fedsaf_handlers  # noqa: E402
from .config import FedSAFConfig  # noqa: E402
from .strategy import FedSAF  # noqa: E402

#: the swept weights the summary of a FedSAF run prints
REPORT_KEYS = ("fedsaf-lambda", "fedsaf-gamma")


def _build(structure: str) -> Callable[[RunConfig, int], FedSAF]:
    def build(c: RunConfig, n: int) -> FedSAF:
        other = {"gcsa": "rcsa", "rcsa": "gcsa"}[structure]
        own = c.section(FedSAFConfig)
        if own.structure == other:
            raise ConfigError(
                f"fedsaf-structure={other!r} contradicts method={c.method!r}; "
                f"use method='fedsaf-{other}'"
            )
        saf = own if own.structure else replace(own, structure=structure)
        return FedSAF(n, fedproto=c.section(FedProtoConfig), fedsaf=saf, **graph_args(c))

    return build


GCSA = register(
    Method("fedsaf-gcsa", ACTION, _build("gcsa"), register_fedsaf_handlers, report_keys=REPORT_KEYS)
)
RCSA = register(
    Method("fedsaf-rcsa", ACTION, _build("rcsa"), register_fedsaf_handlers, report_keys=REPORT_KEYS)
)
