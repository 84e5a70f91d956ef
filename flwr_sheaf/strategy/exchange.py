"""Messages to the discovered nodes and their replies, checked once (failures into the ledger)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from ..protocol import message_type, reply_problem
from . import messaging
from .ledger import RunLedger
from .records import Node, record_bytes

__all__ = ["Exchange", "merge_extra"]


def merge_extra(owned: Mapping[str, Any], extra: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``owned`` plus the caller's ``extra`` config entries, which may not override it.

    Raises:
        ValueError: ``extra`` names keys the strategy sends itself (named, with ``name``).
    """
    clash = sorted(set(extra) & set(owned))
    if clash:
        raise ValueError(
            f"{name} keys {clash} are set by the strategy itself; pass other keys only"
        )
    return {**owned, **extra}


class Exchange:
    """Messages to partition-ids and their checked replies.

    Args:
        action: the strategy's message action (``<category>.<action>``).
        ledger: where payload bytes and failures are recorded (its current round).

    Attributes:
        nodes: the discovered nodes by partition-id (set by :meth:`connect`).
        pid_of_node: Flower node id -> partition-id of the discovered nodes.
    """

    def __init__(self, action: str, ledger: RunLedger) -> None:
        self.action = action
        self.ledger = ledger
        self.nodes: Mapping[int, Node] = {}
        self.pid_of_node: dict[int, int] = {}
        self._dst_of_message: dict[str, int] = {}

    def connect(self, nodes: Mapping[int, Node]) -> None:
        """Address the discovered ``nodes`` (``{partition-id: Node}``)."""
        self.nodes = nodes
        self.pid_of_node = {n.node_id: p for p, n in nodes.items()}

    def message(
        self,
        pid: int,
        content: RecordDict,
        category: str,
        server_round: int,
        action: str | None = None,
    ) -> Message:
        """Instruction message ``<category>.<action>`` to partition ``pid``; its payload counts as sent.

        Raises:
            KeyError: ``pid`` was not discovered.
        """
        self.ledger.current.bytes_sent += record_bytes(content)
        return Message(
            content,
            dst_node_id=self.nodes[pid].node_id,
            message_type=message_type(category, action or self.action),
            group_id=str(server_round),
        )

    def round_trip(self, grid: Grid, msgs: list[Message], timeout: float) -> list[Message]:
        """Send ``msgs`` and wait up to ``timeout``; each destination is remembered by message id,
        so a reply the SuperLink writes for a node it considers gone still names that node."""
        if not msgs:
            return []
        replies = messaging.send_and_receive(grid, msgs, timeout, messaging.in_flight_limit(grid))
        self._dst_of_message = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs}
        return replies

    def split_replies(
        self,
        server_round: int,
        phase: str,
        replies: Iterable[Message],
        expected: Iterable[int],
        required: Mapping[str, Iterable[str]] | None = None,
    ) -> dict[int, Message]:
        """Successful replies by partition-id; error, malformed (lacking ``required``) and missing
        replies are that node's failure in ``phase``."""
        ledger, ok = self.ledger, {}
        for r in replies:
            pid = self.pid_of_node.get(r.metadata.src_node_id)
            # e.g. the SuperLink's "node unavailable" error reply: map it by what it answers
            if pid is None:
                dst = self._dst_of_message.get(r.metadata.reply_to_message_id)
                pid = None if dst is None else self.pid_of_node.get(dst)
            if pid is None:
                continue
            if r.has_error():
                ledger.record_failure(server_round, phase, pid, r.error.reason or "")
                continue
            ledger.current.bytes_received += record_bytes(r.content)
            problem = reply_problem(r.content, required or {})
            if problem is not None:
                ledger.record_failure(server_round, phase, pid, f"malformed reply: {problem}")
                continue
            ok[pid] = r
        errored = set(ledger.current.failed.get(phase, []))
        for pid in sorted(set(expected) - set(ok) - errored):
            ledger.record_failure(server_round, phase, pid, "no reply within the timeout")
        ledger.current.failed.setdefault(phase, [])
        return ok
