"""The ``method`` run-config switch: builds the server-side strategy of each method.

Every method runs on the same scenario (agents, data, graph) and writes the same ``results.json``
schema (:func:`flwr_sheaf.apps.server_app.run_server`); the ClientApp
(:mod:`flwr_sheaf.apps.client_app`) carries every method's handlers under its own action.

=================== ====================================================== ==========
``method``          strategy                                               action
=================== ====================================================== ==========
``sheaf-frl``       :class:`~flwr_sheaf.strategy.sheaf_frl.SheafFRL`        ``sheaf``
``fedproto``        :class:`~flwr_sheaf.strategy.fedproto.FedProto`         ``fedproto``
``fedsaf-gcsa``     :class:`~flwr_sheaf.strategy.fedsaf.FedSAF` (GCSA)      ``fedsaf``
``fedsaf-rcsa``     :class:`~flwr_sheaf.strategy.fedsaf.FedSAF` (RCSA)      ``fedsaf``
``non-cooperative`` :class:`~flwr_sheaf.strategy.noncooperative.NonCooperative` ``noncooperative``
=================== ====================================================== ==========

Method keys: ``fedproto-dim`` (common prototype dimension D of the pooling adapter; 0 = none, all
stalk dimensions must agree), ``fedproto-lambda``, ``fedproto-reduction`` (``mse`` | ``per_sample``),
``fedproto-aggregation`` (``weighted`` | ``unweighted``), ``fedproto-missing`` (``carry`` | ``drop``);
FedSAF also uses ``fedsaf-lambda``, ``fedsaf-gamma`` and ``fedsaf-structure`` (empty = the method's
GCSA/RCSA; ``mse`` or ``cosine`` = the coordinate-alignment ablation).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..strategy.base import PeerStrategy
from ..strategy.fedproto import FedProto
from ..strategy.fedsaf import FedSAF
from ..strategy.noncooperative import NonCooperative
from ..strategy.sheaf_frl import SheafFRL, parse_participation
from .scenario import Scenario, run_config_value

__all__ = ["METHODS", "build_strategy"]

METHODS = ("sheaf-frl", "fedproto", "fedsaf-gcsa", "fedsaf-rcsa", "non-cooperative")

#: Local-training keys every method forwards (same SGD, batches and budget for every method).
_LOCAL_KEYS = ("local-epochs", "lr", "momentum", "weight-decay", "batch-size", "clip-norm", "seed", "max-steps-per-epoch")
_TRAIN_KEYS = ("lambda", "pilot-batch-size", *_LOCAL_KEYS)


def build_strategy(rc: Mapping, scenario: Scenario) -> PeerStrategy:
    """Strategy for ``rc["method"]``.

    Raises:
        ValueError: unknown method (named, with the valid ones).
    """
    method = str(run_config_value(rc, "method"))
    v = lambda k: run_config_value(rc, k)  # noqa: E731
    common = dict(num_nodes=scenario.num_nodes, graph=str(v("graph")), fraction_train=float(v("fraction-train")),
                  participation=parse_participation(v("participation"), scenario.num_nodes, int(v("seed"))),
                  seed=int(v("seed")), evaluate_every=int(v("evaluate-every")), num_rounds=int(v("num-server-rounds")))
    local = {k: v(k) for k in _LOCAL_KEYS}
    if method == "sheaf-frl":
        return SheafFRL(train_config={k: v(k) for k in _TRAIN_KEYS}, absent_policy=str(v("absent-policy")),
                        reweight_q_min=float(v("reweight-q-min")),
                        lambda_warmup_rounds=int(v("lambda-warmup-rounds")), **common)
    if method == "non-cooperative":
        return NonCooperative(train_config=local, **common)
    if method in ("fedproto", "fedsaf-gcsa", "fedsaf-rcsa"):
        proto = dict(feature_dim=int(v("fedproto-dim")) or None, aggregation=str(v("fedproto-aggregation")),
                     missing=str(v("fedproto-missing")), **common)
        if method == "fedproto":
            return FedProto(train_config={**local, "fedproto-lambda": float(v("fedproto-lambda")),
                                          "fedproto-reduction": str(v("fedproto-reduction"))}, **proto)
        return FedSAF(structure=str(v("fedsaf-structure")) or method.removeprefix("fedsaf-"),
                      lam=float(v("fedsaf-lambda")), gamma=float(v("fedsaf-gamma")), train_config=local, **proto)
    raise ValueError(f"unknown method {method!r}; valid methods: {METHODS}")
