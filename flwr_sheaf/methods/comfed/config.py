"""ComFed's config section ``config.comfed`` and run-config keys (docs/run-config.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import (
    Key,
    Section,
    check_common_dim,
    key_field,
    parse_dim_or_auto,
    parse_float,
    register_keys,
    register_section,
)

__all__ = ["ComFedConfig"]

register_keys(
    Key("comfed-lambda", 0.1, parse_float(0.0), "weight of ComFed's projected-prototype alignment"),
    Key(
        "comfed-dim",
        "auto",
        parse_dim_or_auto,
        "ComFed's shared space dimension r: `auto` (smallest stalk dimension: 64 on `paper-15`, d on `two-agent:<d>`) or r",
    ),
)


@dataclass(frozen=True)
class ComFedConfig(Section):
    """ComFed's learned projections into a shared space (notes/baselines-alignment.md, s7).

    Attributes:
        lam: weight of the alignment of projected class prototypes (>= 0).
        dim: shared dimension r: ``"auto"`` (smallest stalk dimension), ``"none"`` (all d_i equal: r = d) or an int.
    """

    lam: float = key_field("comfed-lambda")
    dim: str | int = key_field("comfed-dim")

    def check_dims(self, dims: list[int], zoo: str) -> None:
        """``comfed-dim = none`` needs equal stalk dimensions (:func:`~flwr_sheaf.config.check_common_dim`)."""
        check_common_dim("comfed-dim", self.dim, dims, zoo)


register_section("comfed", ComFedConfig)
