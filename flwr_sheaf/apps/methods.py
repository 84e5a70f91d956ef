"""The ``method`` run-config switch: builds the server-side strategy of each method."""

from __future__ import annotations

from collections.abc import Mapping

from ..strategy.base import PeerStrategy
from ..strategy.sheaf_frl import SheafFRL
from .scenario import Scenario, run_config_value

__all__ = ["METHODS", "build_strategy"]

METHODS = ("sheaf-frl",)

_TRAIN_KEYS = ("lambda", "local-epochs", "lr", "momentum", "weight-decay", "batch-size", "pilot-batch-size",
               "clip-norm", "seed")


def build_strategy(rc: Mapping, scenario: Scenario) -> PeerStrategy:
    """Strategy for ``rc["method"]``.

    Raises:
        ValueError: unknown method (named, with the valid ones).
    """
    method = str(run_config_value(rc, "method"))
    v = lambda k: run_config_value(rc, k)  # noqa: E731
    if method == "sheaf-frl":
        return SheafFRL(
            num_nodes=scenario.num_nodes,
            graph=str(v("graph")),
            train_config={k: v(k) for k in _TRAIN_KEYS},
            absent_policy=str(v("absent-policy")),
            lambda_warmup_rounds=int(v("lambda-warmup-rounds")),
            fraction_train=float(v("fraction-train")),
            seed=int(v("seed")),
            evaluate_every=int(v("evaluate-every")),
            num_rounds=int(v("num-server-rounds")),
        )
    raise ValueError(f"unknown method {method!r}; valid methods: {METHODS}")
