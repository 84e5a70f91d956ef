"""Non-cooperative strategy with post-hoc alignment (the paper's lower bound), and the base of the
methods that train locally between server rounds (FedProto, FedSAF).

Per server round: ``train.<action>`` to the sampled nodes with the training config (plus whatever
:meth:`NonCooperative.train_records` adds: nothing here, global prototypes for FedProto); the
replies' metrics are averaged into ``history``; :meth:`NonCooperative.accept_uploads` lets a
subclass consume what the nodes uploaded. Evaluation is :class:`GraphStrategy`'s, with
``whitening-fit = "train"``: each node fits its whitening on its private training latents, every
edge gets a Procrustes map on the shared pilots (notes ``anchor-sfrl-reference.md`` s4, "post-hoc
baselines"), and communication accuracy follows the same transport as Sheaf-FRL.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import networkx as nx
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from .graph import GraphStrategy, nanmean

__all__ = ["NonCooperative"]

log = logging.getLogger("flwr_sheaf")


class NonCooperative(GraphStrategy):
    """Local training only; communication accuracy by post-hoc alignment.

    Args:
        num_nodes: number of agents (partition-ids ``0..num_nodes-1``).
        graph: graph (or spec) on which communication accuracy is measured (no training traffic).
        train_config: values of every ``train.<action>`` config (``local-epochs``, ``lr``, ...; see
            :class:`flwr_sheaf.client.sheaf.SheafTrainConfig`).
        action: message action name (default ``"noncooperative"``; pair with
            :func:`flwr_sheaf.client.noncooperative.register_noncooperative_handlers`).
        evaluate_config: extra evaluate values; ``whitening-fit`` defaults to ``"train"``.
        **kwargs: :class:`GraphStrategy` / :class:`PeerStrategy` options.

    Subclass hooks: :meth:`train_records`, :meth:`accept_uploads`, :attr:`node_metric_names`.
    """

    #: Phase-1 evaluate metrics copied per node into ``node_results`` (``-`` -> ``_``) and averaged
    #: into the round record as ``<name>_mean``.
    node_metric_names: tuple[str, ...] = ()

    def __init__(self, num_nodes: int, graph: nx.Graph | str = "class-overlap", train_config: Mapping | None = None,
                 action: str = "noncooperative", evaluate_config: Mapping | None = None, **kwargs) -> None:
        super().__init__(num_nodes=num_nodes, graph=graph, action=action,
                         evaluate_config={"whitening-fit": "train", **dict(evaluate_config or {})}, **kwargs)
        self.train_config = dict(train_config or {})

    # ------------------------------------------------------------------ hooks
    def train_records(self, server_round: int) -> dict:
        """Records added to every ``train`` message of this round (besides ``config``)."""
        return {}

    def accept_uploads(self, server_round: int, replies: Mapping[int, Message]) -> dict:
        """Consume the successful train replies (keyed by partition-id); returns round metrics."""
        return {}

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """One ``train.<action>`` message per sampled node (config + :meth:`train_records`)."""
        self.ensure_discovered(grid)
        self.begin_round(server_round)
        sampled = self.sample(server_round)
        self._round["sampled"] = sampled
        extra = self.train_records(server_round)
        cfg = {**self.train_config, **dict(config or {}), "server-round": server_round}
        return [self.message(pid, RecordDict({**extra, "config": ConfigRecord(cfg)}), "train", server_round)
                for pid in sampled]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the nodes' numeric train metrics into the round record; no arrays (no global model)."""
        ok = self.split_replies(server_round, "train", replies, self._round.get("sampled", []))
        names = sorted({k for r in ok.values() for k, v in r.content["metrics"].items()
                        if isinstance(v, (int, float)) and k != "num-examples"})
        metrics = {k.replace("-", "_"): nanmean(float(r.content["metrics"][k]) for r in ok.values()
                                                 if k in r.content["metrics"]) for k in names}
        metrics.update({"num_trained": len(ok), "gluing_loss": float("nan")})
        metrics.update(self.accept_uploads(server_round, ok))
        self._round.update(metrics)
        return None, MetricRecord({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})

    # ------------------------------------------------------------------ evaluate
    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """:class:`GraphStrategy`'s summary plus the :attr:`node_metric_names` per node and their means."""
        phase1 = dict(self.eval_phase1)
        out = super().aggregate_evaluate(server_round, replies)
        if not phase1 or not self.node_metric_names:
            return out
        means = {}
        for name in self.node_metric_names:
            key = name.replace("-", "_")
            for pid, r in phase1.items():
                m = r.content["metrics"]
                self.node_results[pid][key] = float(m[name]) if name in m else float("nan")
            means[f"{key}_mean"] = nanmean(self.node_results[p][key] for p in phase1)
        self.history[-1].update(means)
        return MetricRecord({**(dict(out) if out is not None else {}), **means})

    def results_extra(self) -> dict:
        """Method-specific keys of ``results.json``."""
        return {"evaluation": {"protocol": "post-hoc alignment", **self.evaluate_config}}
