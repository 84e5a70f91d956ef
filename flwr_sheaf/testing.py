"""An in-process Grid: runs strategies against ClientApps without Ray or a SuperLink.

It mirrors the simulation engine's semantics that matter to strategies (Flower 1.42):

- node ids are opaque 64-bit-like integers (deliberately not ``0..N-1``);
- each node's ``Context`` has ``node_config = {"partition-id": i, "num-partitions": N}``;
- ``context.state`` is committed only when the handler returns normally; an exception becomes an
  error reply (code 2, as Flower's ``CLIENT_APP_RAISED_EXCEPTION``) and the state is rolled back;
- a ``drop`` predicate emulates nodes that never answer; ``send_and_receive`` then waits for the
  ``timeout``, and raises without one (the real engine would wait forever).

Relies on Flower internals (``flwr.supercore``), hence the ``flwr>=1.42,<1.43`` pin.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.app.user_config import UserConfigValue
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["LocalGrid", "set_task_identity"]

CLIENT_APP_RAISED_EXCEPTION = 2


def set_task_identity(run_id: int = 1, node_id: int = 1, task_id: int = 1) -> None:
    """Set Flower's process-wide task identity so ``Message(...)`` can be built outside a run."""
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = task_id


class LocalGrid(Grid):
    """A Flower ``Grid`` that delivers messages to a ``ClientApp`` in this process.

    Args:
        num_nodes: number of simulated SuperNodes (partition-ids ``0..num_nodes-1``).
        run_config: the run config every node's ``Context`` sees (the app's ``run_config``).
        drop: optional predicate ``drop(message) -> bool``; a dropped message gets no reply.
        wait_cap: seconds actually slept when replies are missing (``min(timeout, wait_cap)``;
            default 0: the wait is only recorded in :attr:`waits`).
        node_config: extra node-config entries: a mapping, or ``node_config(partition_id)``.
        run_id: Flower run id of every node's ``Context`` (a new ``flwr run`` gets a new one).

    Attributes:
        contexts: ``{node_id: Context}``, the committed per-node state.
        delivered: every delivered instruction message, in order.
        replies: every reply pulled by the server, in order.
        waits: the ``timeout`` of every ``send_and_receive`` that had unanswered messages.

    Raises:
        ValueError: ``num_nodes < 1``.
    """

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_config: Mapping[str, UserConfigValue] | None = None,
        drop: Callable[[Message], bool] | None = None,
        wait_cap: float = 0.0,
        node_config: Mapping[str, UserConfigValue]
        | Callable[[int], Mapping[str, UserConfigValue]]
        | None = None,
        run_id: int = 1,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        set_task_identity()
        self._run = Run.create_empty(run_id)
        self.run_id = int(run_id)
        self.run_config = dict(run_config or {})
        self._extra_node_config = node_config
        self.app = client_app
        self.drop = drop or (lambda m: False)
        self.wait_cap = float(wait_cap)
        self.waits: list[float] = []
        self.node_ids = [1_000_003 + 7919 * i for i in range(num_nodes)]
        self.contexts = {nid: self.fresh_context(i) for i, nid in enumerate(self.node_ids)}
        self.delivered: list[Message] = []
        self.replies: list[Message] = []  # every reply pulled, in order (for tests)
        self._replies: dict[str, Message] = {}

    def fresh_context(self, partition_id: int) -> Context:
        """A fresh SuperNode's ``Context`` (assign it in :attr:`contexts` to restart node i)."""
        extra = self._extra_node_config
        extra = extra(partition_id) if callable(extra) else extra
        return Context(
            run_id=self.run_id,
            node_id=self.node_ids[partition_id],
            node_config={
                "partition-id": partition_id,
                "num-partitions": len(self.node_ids),
                **(extra or {}),
            },
            state=RecordDict(),
            run_config=dict(self.run_config),
        )

    def partition_of(self, node_id: int) -> int:
        """Partition-id of a node id (test convenience)."""
        return self.node_ids.index(node_id)

    # Grid API -----------------------------------------------------------------
    def set_run(self, run: Run | int) -> None:
        """Grid API: use ``run`` (a ``Run``, or an empty run with that ``int`` id)."""
        self._run = run if isinstance(run, Run) else Run.create_empty(run)

    @property
    def run(self) -> Run:
        """Grid API: the current run."""
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        """Grid API (deprecated in Flower 1.42): an instruction ``Message``."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Grid API: the simulated node ids (``1_000_003 + 7919 i`` for partition-id i)."""
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Grid API: deliver each message to its node's ClientApp now (unless dropped); returns the
        ids (``ValueError``: a message to an unknown node id)."""
        ids = []
        for msg in messages:
            mid = uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            dst = msg.metadata.dst_node_id
            if dst not in self.contexts:
                raise ValueError(f"message to unknown node_id {dst}")
            if self.drop(msg):
                continue
            self.delivered.append(msg)
            ctx = copy.deepcopy(self.contexts[dst])
            try:
                reply = self.app(msg, ctx)
                self.contexts[dst] = ctx  # commit on success only, as Flower does
            except Exception as exc:  # noqa: BLE001 - emulate the engine's error reply
                reply = Message(
                    Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=repr(exc)), reply_to=msg
                )
            self._replies[mid] = reply
        return ids

    def pull_messages(self, message_ids=None, *, reply_to_message_ids=None):
        """Grid API (1.42 and 1.43 signatures): the replies to ``message_ids`` that exist, once each."""
        ids = reply_to_message_ids if reply_to_message_ids is not None else message_ids
        out = [self._replies.pop(i) for i in list(ids or []) if i in self._replies]
        self.replies.extend(out)
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        """Deliver, then collect the replies; with missing replies, wait ``timeout`` as Flower does
        (``RuntimeError`` without a timeout: the engine would hang forever)."""
        ids = list(self.push_messages(list(messages)))
        out = self.pull_messages(ids)
        if len(out) < len(ids):
            if timeout is None:
                raise RuntimeError(
                    f"{len(ids) - len(out)} message(s) unanswered and send_and_receive has no "
                    f"timeout: Flower's grid would wait forever"
                )
            self.waits.append(float(timeout))
            time.sleep(min(float(timeout), self.wait_cap))
        return out
