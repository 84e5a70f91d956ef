"""FedMuscle's config section ``config.fedmuscle`` and run-config keys (docs/run-config.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import (
    Key,
    Section,
    check_common_dim,
    key_field,
    parse_dim_or_auto,
    parse_float,
    parse_int,
    register_keys,
    register_section,
)

__all__ = ["FedMuscleConfig"]

register_keys(
    Key("fedmuscle-lambda", 1.0, parse_float(0.0), "weight of FedMuscle's contrastive pilot loss"),
    Key(
        "fedmuscle-task-epochs",
        4,
        parse_int(0),
        "FedMuscle cycle: this many task-only local epochs, then one contrastive epoch",
    ),
    Key(
        "fedmuscle-temperature",
        0.1,
        parse_float(0.0, lo_open=True),
        "temperature tau of FedMuscle's contrastive loss",
    ),
    Key(
        "fedmuscle-dim",
        "auto",
        parse_dim_or_auto,
        "FedMuscle's common representation dimension: `auto` (smallest stalk dimension), `none` or D",
    ),
)


@dataclass(frozen=True)
class FedMuscleConfig(Section):
    """FedMuscle's contrastive alignment on the shared pilots (notes/baselines-alignment.md, s6).

    Attributes:
        lam: weight of the contrastive loss (>= 0).
        task_epochs: task-only local epochs per cycle (the paper: 4); the next epoch adds the loss.
        temperature: tau > 0 (the paper: 0.1).
        dim: common representation dimension (``"auto"``, ``"none"`` or an int D), as ``fedproto-dim``.
        pilot_batch_size: pilot rows per contrastive step (>= 2).
    """

    lam: float = key_field("fedmuscle-lambda")
    task_epochs: int = key_field("fedmuscle-task-epochs")
    temperature: float = key_field("fedmuscle-temperature")
    dim: str | int = key_field("fedmuscle-dim")
    pilot_batch_size: int = key_field("pilot-batch-size")

    def check_dims(self, dims: list[int], zoo: str) -> None:
        """``fedmuscle-dim = none`` needs equal stalk dimensions (:func:`~flwr_sheaf.config.check_common_dim`)."""
        check_common_dim("fedmuscle-dim", self.dim, dims, zoo)


register_section("fedmuscle", FedMuscleConfig)
