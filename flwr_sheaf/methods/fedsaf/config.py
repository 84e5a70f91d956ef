"""FedSAF's config section ``config.fedsaf`` and run-config keys (docs/run-config.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import (
    Key,
    Section,
    key_field,
    parse_float,
    parse_str,
    register_keys,
    register_section,
)

__all__ = ["FedSAFConfig"]

register_keys(
    Key("fedsaf-lambda", 1.0, parse_float(0.0), "FedSAF prototype-level weight"),
    Key("fedsaf-gamma", 1.0, parse_float(0.0), "FedSAF instance-level weight"),
    Key(
        "fedsaf-structure",
        "",
        parse_str(("", "gcsa", "rcsa", "mse", "cosine")),
        "empty = the method's own (`fedsaf-gcsa`: GCSA, `fedsaf-rcsa`: RCSA); `mse` / `cosine` = coordinate-alignment ablation",
    ),
)


@dataclass(frozen=True)
class FedSAFConfig(Section):
    """FedSAF's structural alignment weights and structure (notes/baselines-prototypes.md).

    Attributes:
        lam, gamma: prototype-level and instance-level weights (>= 0).
        structure: ``""`` (the method's own: GCSA or RCSA), ``"gcsa"``, ``"rcsa"``, ``"mse"`` or
            ``"cosine"`` (the coordinate ablations). The app refuses a structure that contradicts the
            method (``method=fedsaf-gcsa`` with ``rcsa``).
    """

    lam: float = key_field("fedsaf-lambda")
    gamma: float = key_field("fedsaf-gamma")
    structure: str = key_field("fedsaf-structure")


register_section("fedsaf", FedSAFConfig)
