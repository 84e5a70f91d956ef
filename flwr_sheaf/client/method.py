"""What a method adds to the shared ClientApp handlers (:class:`ClientMethod`)."""

from __future__ import annotations

from flwr.app import Context, Message

from .loop import CrossEntropy, LossPlugin
from .task import LocalTask

__all__ = ["ClientMethod"]


class ClientMethod:
    """What a method adds to the shared handlers (override what differs; defaults = non-cooperative;
    a hook raising on a bad message makes the node's error reply; docs/own-method.md).

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
        """The phase-1 arrays actually sent, from the default numpy ``arrays`` (default: unchanged;
        stringent privacy sends transported ones, notes/variants-privacy.md)."""
        return arrays

    def edge_metrics(
        self, msg: Message, context: Context, task: LocalTask, j: int, arrays: dict
    ) -> dict[str, float]:
        """Extra per-incoming-edge metrics from neighbour j's routed ``arrays`` (default none)."""
        return {}
