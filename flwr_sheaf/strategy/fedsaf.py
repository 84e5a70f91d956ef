"""FedSAF strategy (structural alignment on FedProto's global prototypes; notes C.3).

The server side is FedProto's (prototype exchange, validation, aggregation, evaluation); only
the nodes' objective differs, chosen by ``structure``: ``"gcsa"`` / ``"rcsa"`` (FedSAF), or the
coordinate ablations ``"mse"`` / ``"cosine"``; weights ``lam`` (prototype level) and ``gamma``
(instance level). Pair with :func:`flwr_sheaf.client.fedsaf.register_fedsaf_handlers`.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..baselines.fedsaf import STRUCTURES
from .fedproto import FedProto

__all__ = ["FedSAF"]


class FedSAF(FedProto):
    """FedSAF (``L_sup + lam L_proto + gamma L_inst``) over FedProto's protocol.

    Args:
        structure: one of ``"gcsa"``, ``"rcsa"``, ``"mse"``, ``"cosine"``.
        lam, gamma: weights ``>= 0`` of the prototype-level and instance-level terms.
        action: message action (default ``"fedsaf"``).
        train_config, **kwargs: as :class:`FedProto`.

    Raises:
        ValueError: unknown structure or negative weights (named), and :class:`FedProto`'s errors.
    """

    def __init__(self, num_nodes: int, structure: str = "gcsa", lam: float = 1.0, gamma: float = 1.0,
                 train_config: Mapping | None = None, action: str = "fedsaf", **kwargs) -> None:
        if structure not in STRUCTURES:
            raise ValueError(f"FedSAF structure must be one of {STRUCTURES}, got {structure!r}")
        for name, v in (("fedsaf-lambda", lam), ("fedsaf-gamma", gamma)):
            if not float(v) >= 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        cfg = {**dict(train_config or {}), "fedsaf-structure": structure, "fedsaf-lambda": float(lam),
               "fedsaf-gamma": float(gamma)}
        super().__init__(num_nodes=num_nodes, train_config=cfg, action=action, **kwargs)
        self.structure = structure

    def results_extra(self) -> dict:
        """FedProto's extras plus the structure and weights."""
        out = super().results_extra()
        out["fedsaf"] = {k: self.train_config[k] for k in ("fedsaf-structure", "fedsaf-lambda", "fedsaf-gamma")}
        return out
