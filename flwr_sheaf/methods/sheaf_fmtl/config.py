"""Sheaf-FMTL's config section ``config.sheaf_fmtl`` and run-config keys (docs/run-config.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import (
    Key,
    Section,
    key_field,
    parse_float,
    register_keys,
    register_section,
)

__all__ = ["SheafFMTLConfig"]

register_keys(
    Key(
        "sheaf-fmtl-lambda",
        0.01,
        parse_float(0.0),
        "weight lambda of Sheaf-FMTL's parameter-space sheaf Laplacian term (notes/baselines-sheaf-fmtl.md, s8)",
    ),
    Key(
        "sheaf-fmtl-gamma",
        1e-4,
        parse_float(0.0, 1.0, lo_open=True),
        "Sheaf-FMTL map compression: d_ij = max(1, floor(gamma min(n_i, n_j))) (the paper: 1e-3; notes/deviations-methods.md)",
    ),
    Key(
        "sheaf-fmtl-eta",
        0.01,
        parse_float(0.0),
        "Sheaf-FMTL personalisation rate eta of the restriction-map step",
    ),
    Key(
        "sheaf-fmtl-max-gib",
        1.0,
        parse_float(0.0, lo_open=True),
        "refuse a run whose largest node's float16 Sheaf-FMTL maps exceed this many GiB (checked before any node is contacted)",
    ),
)


@dataclass(frozen=True)
class SheafFMTLConfig(Section):
    """Sheaf-FMTL's parameter-space restriction maps (notes/baselines-sheaf-fmtl.md, s8).

    Attributes:
        lam: lambda >= 0 of the sheaf Laplacian term (F1, F2).
        gamma: in (0, 1]: ``d_ij = max(1, floor(gamma min(n_i, n_j)))`` (F0).
        eta: personalisation rate >= 0 of the map step (F2).
        max_gib: budget > 0 for the largest node's float16 maps (checked before any node is contacted).
    """

    lam: float = key_field("sheaf-fmtl-lambda")
    gamma: float = key_field("sheaf-fmtl-gamma")
    eta: float = key_field("sheaf-fmtl-eta")
    max_gib: float = key_field("sheaf-fmtl-max-gib")


register_section("sheaf_fmtl", SheafFMTLConfig)
