"""ClientApp handlers of the methods that train locally and evaluate post hoc (non-cooperative,
and, through the hooks, FedProto and FedSAF).

``register_local_handlers(app, factory, action, ...)`` adds under ``action``:

- ``query.<action>`` and ``evaluate.<action>`` / ``evaluate.<action>_comm``: the shared discovery
  and evaluation handlers (:mod:`flwr_sheaf.client.evaluation`). The strategies send
  ``whitening-fit = "train"``, so each node fits its whitening on its private training latents
  and every edge gets a Procrustes map on the shared pilots: the paper's post-hoc alignment
  (notes ``anchor-sfrl-reference.md`` s4, s5);
- ``train.<action>``: ``local-epochs`` epochs of the Sheaf-FRL training loop
  (:func:`flwr_sheaf.client.sheaf.train_sheaf`: same batching, SGD, clipping) with no pilots, so
  no gluing term; the batch objective is cross-entropy unless ``objective`` supplies another
  (FedProto, FedSAF). Weights and optimizer state persist in ``context.state`` under the action.

``register_noncooperative_handlers`` is the hook-free case: the paper's non-cooperative lower bound.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from .common import build, model_key
from .evaluation import register_evaluation_handlers, register_query_handler
from .sheaf import BatchLoss, SheafTrainConfig, cfg_rec_sgd, train_sheaf
from .task import LocalTask, TaskFactory, numpy_record, save_module_state

__all__ = ["register_local_handlers", "register_noncooperative_handlers", "Objective", "Upload", "ExtraMetrics"]

#: ``objective(msg, task, model) -> BatchLoss``: the batch objective for one ``train`` message.
Objective = Callable[[Message, LocalTask, nn.Module], BatchLoss]
#: ``upload(msg, task, model) -> (arrays, metrics)``: what a node adds to its train reply (trained weights).
Upload = Callable[[Message, LocalTask, nn.Module], tuple[Mapping[str, np.ndarray], Mapping[str, float]]]
#: ``extra_metrics(msg, task, model) -> {name: float}`` added to the ``evaluate.<action>`` reply.
ExtraMetrics = Callable[[Message, LocalTask, nn.Module], Mapping[str, float]]

#: Name of the ``ArrayRecord`` that carries a node's upload in its train reply.
UPLOAD_RECORD = "upload"


def register_local_handlers(app: ClientApp, factory: TaskFactory, action: str, objective: Objective | None = None,
                            upload: Upload | None = None, extra_metrics: ExtraMetrics | None = None) -> ClientApp:
    """Register local-training handlers (see the module docstring) on ``app``.

    Args:
        app: the ClientApp to extend (its other handlers are untouched).
        factory: builds the node's :class:`~flwr_sheaf.client.task.LocalTask` from its ``Context``.
        action: action name of the four messages.
        objective: batch objective factory (default: cross-entropy of ``model.private_logits``).
        upload: arrays and metrics added to the train reply (the arrays ride in the ``ArrayRecord``
            ``"upload"``), computed after training.
        extra_metrics: extra evaluation metrics (see
            :func:`~flwr_sheaf.client.evaluation.register_evaluation_handlers`).

    Returns:
        ``app`` (for chaining).
    """
    register_query_handler(app, factory, action)
    register_evaluation_handlers(app, factory, action, extra_metrics=extra_metrics)

    @app.train(action)
    def _train(msg: Message, context: Context) -> Message:
        cfg = SheafTrainConfig(msg.content["config"])
        task, model, opt = build(factory, context, action, sgd=cfg_rec_sgd(cfg))
        batch_loss = objective(msg, task, model) if objective is not None else None
        out = train_sheaf(task, model, opt, cfg, {}, [], batch_loss=batch_loss)
        save_module_state(context, model_key(action), model, opt)
        metrics = {"num-examples": int(task.x_train.shape[0]),
                   **{k: float(v) for k, v in out.items() if k != "gluing" and isinstance(v, float)}}
        content = {}
        if upload is not None:
            arrays, more = upload(msg, task, model)
            content[UPLOAD_RECORD] = numpy_record(dict(arrays))
            metrics.update({k: float(v) for k, v in more.items()})
        content["metrics"] = MetricRecord(metrics)
        return Message(RecordDict(content), reply_to=msg)

    return app


def register_noncooperative_handlers(app: ClientApp, factory: TaskFactory, action: str = "noncooperative") -> ClientApp:
    """Non-cooperative agents: cross-entropy only, no messages during training (paper's lower bound).

    Communication accuracy comes from the shared evaluation with post-hoc alignment (whitening on
    the private training latents, Procrustes on the final pilots), as
    :class:`~flwr_sheaf.strategy.noncooperative.NonCooperative` requests.
    """
    return register_local_handlers(app, factory, action)
