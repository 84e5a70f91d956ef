"""What the server refuses, the node never commits: the ClientApp mod :func:`refuse_what_the_server_refuses`.

Flower commits ``context.state`` only when the ClientApp returns normally. This mod applies the
server's check of train replies (:func:`flwr_sheaf.protocol.train_reply_problem`, plus NaN/inf array
entries) to every successful ``train`` reply and raises :class:`RefusedReplyError` instead, so the
node keeps its last accepted state (docs/reliability-run-files.md).
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Message

from ..protocol import METRICS, NUM_EXAMPLES, train_reply_problem

__all__ = ["RefusedReplyError", "refuse_what_the_server_refuses"]


class RefusedReplyError(RuntimeError):
    """A train reply the server would refuse (its problem named); raised so the node's state is rolled back."""


def refuse_what_the_server_refuses(
    msg: Message, context: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    """Flower ClientApp mod: raise instead of returning a train reply the server would refuse (module docstring).

    Replies to other messages, error replies and replies without ``metrics/num-examples`` (the
    server records those as malformed) pass unchanged.

    Raises:
        RefusedReplyError: the reply's problem, the partition-id and the server round named.
    """
    reply = call_next(msg, context)
    if (
        not msg.metadata.message_type.startswith("train.")
        or reply.has_error()
        or METRICS not in reply.content
        or NUM_EXAMPLES not in reply.content[METRICS]
    ):
        return reply
    problem = train_reply_problem(reply.content, arrays=True)
    if problem is not None:
        raise RefusedReplyError(
            f"partition-id {context.node_config.get('partition-id')}, "
            f"{msg.metadata.message_type} of round {msg.metadata.group_id}: {problem}; the server "
            f"would refuse this reply, so this node keeps its state from before the round"
        )
    return reply
