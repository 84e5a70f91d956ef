"""What a method adds to the shared ClientApp handlers: :class:`ClientMethod`, the hooks that
:mod:`flwr_sheaf.client.handlers` (train, query) and :mod:`flwr_sheaf.client.evaluation` (evaluate,
evaluate_comm) call. Its own module, below both, so neither imports the other for it.
"""

from __future__ import annotations

from flwr.app import Context, Message

from .loop import CrossEntropy, LossPlugin
from .task import LocalTask

__all__ = ["ClientMethod"]


class ClientMethod:
    """What a method adds to the shared handlers (override what differs; defaults = non-cooperative).

    Hooks (each may raise ``ConfigError`` / ``ProtocolError`` / ``ValueError`` on a bad message; the
    node then replies with an error and keeps its state): :meth:`plugin`, :meth:`after_train`,
    :meth:`evaluation_metrics`. docs/own-method.md lists the files a method touches.

    Args:
        action: the message action (``train.<action>`` etc.); also the ``context.state`` prefix.
    """

    def __init__(self, action: str) -> None:
        self.action = action

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:
        """The loss plug-in of one ``train`` message (default: cross-entropy)."""
        return CrossEntropy()

    def after_train(
        self, msg: Message, context: Context, task: LocalTask, plugin: LossPlugin
    ) -> tuple[dict, dict]:
        """Records and metrics added to the train reply after training (default: none); ``plugin`` is
        this round's trained loss plug-in (a method with its own parameters saves them here)."""
        return {}, {}

    def evaluation_metrics(self, msg: Message, task: LocalTask) -> dict[str, float]:
        """Extra metrics of the ``evaluate`` reply (model in eval mode with trained weights)."""
        return {}

    #: names of the extra phase-1 arrays the strategy routes to neighbours (see :meth:`evaluation_arrays`).
    routed_arrays: tuple[str, ...] = ()

    def evaluation_arrays(self, msg: Message, context: Context, task: LocalTask) -> dict:
        """Extra arrays of the ``evaluate`` reply (names in :attr:`routed_arrays`; default none)."""
        return {}

    def evaluation_reply(
        self, msg: Message, context: Context, task: LocalTask, arrays: dict
    ) -> dict:
        """The phase-1 arrays actually sent, from the default ``arrays`` (:data:`EVAL_ARRAYS`,
        :meth:`evaluation_arrays` and, with the second reading, its :data:`SECOND_READING` arrays;
        numpy; the model's whitening is then the one the last reading fitted); default: unchanged (Sheaf-FRL's stringent privacy sends
        per-neighbour transported arrays instead, notes/variants-privacy.md)."""
        return arrays

    def edge_metrics(
        self, msg: Message, context: Context, task: LocalTask, j: int, arrays: dict
    ) -> dict[str, float]:
        """Extra per-incoming-edge metrics of ``evaluate_comm`` from neighbour j's routed ``arrays`` (default none)."""
        return {}
