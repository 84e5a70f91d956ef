"""FedProto's config section ``config.fedproto`` and run-config keys (read by FedProto and FedSAF) (docs/run-config.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import (
    Key,
    Section,
    check_common_dim,
    key_field,
    parse_dim_or_auto,
    parse_float,
    parse_str,
    register_keys,
    register_section,
    register_train_defaults,
)

__all__ = ["FedProtoConfig"]

# Tan et al. 2022, official code (yuetan031/FedProto, lib/update.py): SGD lr 0.01, momentum 0.5, no
# weight decay. Under the shared optimizer (momentum 0.9, lr 0.05) its latents collapse
# (notes/baselines.md, s0). Applied unless the run sets train-defaults=shared.
register_train_defaults("fedproto", {"lr": 0.01, "momentum": 0.5, "weight-decay": 0.0})

register_keys(
    Key(
        "fedproto-dim",
        "auto",
        parse_dim_or_auto,
        "common prototype dimension: `auto` (smallest stalk dimension), `none` (all d_i must agree) or D",
    ),
    Key("fedproto-lambda", 1.0, parse_float(0.0), "weight of FedProto's prototype distance"),
    Key(
        "fedproto-reduction",
        "mse",
        parse_str(("mse", "per_sample")),
        "`mse` (official code) or `per_sample`",
    ),
    Key(
        "fedproto-aggregation",
        "weighted",
        parse_str(("weighted", "unweighted")),
        "prototype aggregation",
    ),
    Key(
        "fedproto-missing",
        "carry",
        parse_str(("carry", "drop")),
        "a class nobody uploaded this round",
    ),
)


@dataclass(frozen=True)
class FedProtoConfig(Section):
    """FedProto (Tan et al. 2022) settings, shared by FedSAF (notes/baselines-prototypes.md).

    Attributes:
        dim: common prototype dimension: ``"auto"`` (smallest stalk dimension, resolved at
            discovery), ``"none"`` (no adapter: every d_i must agree) or a positive int D.
        lam: weight of the prototype distance.
        reduction: ``"mse"`` or ``"per_sample"``.
        aggregation: ``"weighted"`` (by class counts) or ``"unweighted"``.
        missing: ``"carry"`` or ``"drop"`` a class nobody uploaded.
    """

    dim: str | int = key_field("fedproto-dim")
    lam: float = key_field("fedproto-lambda")
    reduction: str = key_field("fedproto-reduction")
    aggregation: str = key_field("fedproto-aggregation")
    missing: str = key_field("fedproto-missing")

    def check_dims(self, dims: list[int], zoo: str) -> None:
        """``fedproto-dim = none`` needs equal stalk dimensions (:func:`~flwr_sheaf.config.check_common_dim`)."""
        check_common_dim("fedproto-dim", self.dim, dims, zoo)


register_section("fedproto", FedProtoConfig)
