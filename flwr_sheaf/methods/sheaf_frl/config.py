"""Sheaf-FRL's config section ``config.sheaf`` and run-config keys (docs/run-config.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import (
    Key,
    Section,
    key_field,
    parse_float,
    parse_int,
    parse_spec,
    parse_str,
    register_keys,
    register_section,
)

__all__ = ["SheafConfig"]


def _check_pilot_strategy(text: str) -> None:
    from ...sheaf.pilots import parse_pilot_strategy

    parse_pilot_strategy(text)


def _pilot_forms() -> tuple[str, ...]:
    from ...sheaf.pilots import PILOT_STRATEGY_FORMS

    return PILOT_STRATEGY_FORMS


register_keys(
    Key("lambda", 0.1, parse_float(0.0), "gluing weight; lambda_i = lambda / d_i (Eq. 16)"),
    Key(
        "lambda-warmup-rounds",
        0,
        parse_int(0),
        "lambda ramps linearly over the first W rounds (0 = off)",
    ),
    Key(
        "absent-policy",
        "cached",
        parse_str(("cached", "drop", "drop-reweighted")),
        "pilots of a neighbour that did not train: `cached`, `drop`, `drop-reweighted` (notes/participation.md)",
    ),
    Key(
        "reweight-q-min",
        0.05,
        parse_float(0.0, 1.0, lo_open=True),
        "floor of q_j for `drop-reweighted` (weights <= 1/q_min)",
    ),
    Key(
        "sheaf-variant",
        "auto",
        parse_str(("auto", "heterogeneous", "homogeneous")),
        "`heterogeneous` (Alg. 1), `homogeneous` (Alg. 2: O(d) maps, one SVD per edge; all d_i equal) or `auto` "
        "(homogeneous iff all d_i are equal) (notes/variants-privacy.md)",
    ),
    Key(
        "privacy",
        "standard",
        parse_str(("standard", "stringent")),
        "`standard` (pilots shared) or `stringent` (Alg. 3/4: only transported pilots leave a node; notes/variants-privacy.md)",
    ),
    Key(
        "pilot-strategy",
        "all",
        parse_spec(_check_pilot_strategy, _pilot_forms),
        "pilots used by the gluing each round: `all`, `uniform:K`, `stratified-class:K`, `stratified-cluster:K`, "
        "`prototype-class`, `prototype-cluster:K`, `dynamic:P+R`, `adaptive:K` (notes/variants-pilots.md)",
    ),
    Key(
        "pilot-normalisation",
        "none",
        parse_str(("none", "parseval")),
        "`parseval`: restriction maps fitted on the polar factors of the pilot matrices (paper App. B; notes/variants-pilots.md)",
    ),
    Key(
        "map-refit",
        "epoch",
        parse_str(("epoch", "step")),
        "when a node refits its restriction maps: `epoch` (on all pilots, each local epoch) or `step` (also on each "
        "step's pilot minibatch, Alg. 1 line 11; notes/stability.md)",
    ),
)


@dataclass(frozen=True)
class SheafConfig(Section):
    """Sheaf-FRL's gluing (paper Eq. 16, Alg. 1) and its partial-participation policy: one field per
    key above (``lam``: ``lambda``; ``sheaf_variant = "auto"`` is resolved at discovery).
    """

    lam: float = key_field("lambda")
    lambda_warmup_rounds: int = key_field("lambda-warmup-rounds")
    pilot_batch_size: int = key_field("pilot-batch-size")
    absent_policy: str = key_field("absent-policy")
    reweight_q_min: float = key_field("reweight-q-min")
    sheaf_variant: str = key_field("sheaf-variant")
    privacy: str = key_field("privacy")
    pilot_strategy: str = key_field("pilot-strategy")
    pilot_normalisation: str = key_field("pilot-normalisation")
    map_refit: str = key_field("map-refit")

    def lam_at(self, server_round: int) -> float:
        """Lambda of Eq. 16 used in ``server_round`` (linear warm-up ``lambda min(1, r / W)``, notes/stability.md)."""
        w = self.lambda_warmup_rounds
        return self.lam * min(1.0, server_round / w) if w > 0 else self.lam


register_section("sheaf", SheafConfig)
