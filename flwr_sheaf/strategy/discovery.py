"""Discovery: map Flower's opaque node ids to partition-ids with one ``query.<action>`` round trip.

:class:`Discovery` asks every SuperNode as it registers, checks each reply once (an error reply or
a malformed :class:`~flwr_sheaf.protocol.NodeInfo` is that node's failure) and returns the
discovered :class:`~flwr_sheaf.strategy.records.Node` per partition-id. The strategy calls it from
:meth:`flwr_sheaf.strategy.graph.GraphStrategy.discover` and then builds its graph
(``on_discovered``); discovery itself knows nothing of graphs or methods.

Interface (what the strategy relies on; the protocol inside may change):

- ``Discovery(num_nodes, action, config, discovery_timeout).run(grid, timeout)`` returns
  ``{partition-id: Node}`` for exactly the partition-ids ``0..num_nodes-1``;
- ``config`` is the ``ConfigRecord`` content of every query message (the strategy's
  ``query_config()`` plus its ``resume_check``);
- every failure is a ``RuntimeError`` whose message names the cause and the fix (the
  ``--federation-config`` to pass, the failed node's reason, the missing partition-ids).

A federation that is too small (nodes report ``num-partitions`` < N) fails at once instead of
waiting. SuperNodes beyond the scenario (partition-id >= N, or whose discovery handler failed while
more SuperNodes than agents registered) stay idle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from ..hints import handler_hint
from ..protocol import CONFIG, INFO, QUERY, NodeInfo, ProtocolError, message_type, reply_problem
from . import messaging
from .records import Node

__all__ = ["Discovery", "federation_fix", "federation_too_small", "parse_reply"]

log = logging.getLogger("flwr_sheaf")

#: seconds between two looks at the SuperLink's registered nodes while partition-ids are missing
POLL_SECONDS = 0.5


def federation_fix(num_nodes: int) -> str:
    """The ``flwr run`` option that gives the federation ``num_nodes`` SuperNodes."""
    return f'--federation-config "num-supernodes={num_nodes}"'


def parse_reply(r: Message) -> tuple[NodeInfo | None, str | None]:
    """``(NodeInfo, None)`` of a usable ``query.<action>`` reply, else ``(None, why)``: the error
    reply's reason (with :func:`~flwr_sheaf.hints.handler_hint`), a missing ``info`` record, or a
    malformed :class:`~flwr_sheaf.protocol.NodeInfo` (the missing key named)."""
    if r.has_error():
        return None, (r.error.reason or "") + handler_hint(r.error.reason)
    problem = reply_problem(r.content, {INFO: ()})
    if problem is not None:
        return None, problem
    try:
        return NodeInfo.from_record(r.content[INFO]), None
    except ProtocolError as exc:
        return None, str(exc)


def federation_too_small(info: NodeInfo, num_nodes: int) -> RuntimeError | None:
    """The error when a node reports ``num-partitions`` smaller than the scenario's ``num_nodes``
    agents (the federation has too few SuperNodes: the ``--federation-config`` to pass), else None."""
    if not 0 < info.num_partitions < num_nodes:
        return None
    return RuntimeError(
        f"this scenario has {num_nodes} agents but the federation has "
        f"num-partitions={info.num_partitions} SuperNodes (Flower's default local simulation has 2); "
        f"run: flwr run . --stream {federation_fix(num_nodes)} (in-process: LocalGrid(app, {num_nodes}))"
    )


class Discovery:
    """One discovery of ``num_nodes`` agents (module docstring).

    Args:
        num_nodes: agents (partition-ids ``0..num_nodes-1``) to find.
        action: message action (``"sheaf"`` -> ``query.sheaf``).
        config: entries of every query message's config record.
        discovery_timeout: seconds to wait for enough SuperNodes to register and answer.

    Attributes:
        found: ``{partition-id: Node}`` answered so far (partition-ids >= ``num_nodes`` included).
        asked: Flower node ids queried so far.
        errors: ``"node <id>: <reason>"`` of the nodes whose reply could not be used.
    """

    def __init__(
        self,
        num_nodes: int,
        action: str,
        config: Mapping[str, Any],
        discovery_timeout: float,
    ) -> None:
        self.num_nodes = int(num_nodes)
        self.action = action
        self.config = dict(config)
        self.discovery_timeout = float(discovery_timeout)
        self.found: dict[int, Node] = {}
        self.asked: set[int] = set()
        self.errors: list[str] = []

    @property
    def fix(self) -> str:
        """The ``flwr run`` option that gives the federation enough SuperNodes."""
        return federation_fix(self.num_nodes)

    def run(self, grid: Grid, timeout: float) -> dict[int, Node]:
        """Query nodes as they register until partition-ids ``0..num_nodes-1`` all answered.

        Args:
            grid: Flower's Grid.
            timeout: seconds per query round trip (at least 1 s, at most what is left of
                ``discovery_timeout``).

        Returns:
            ``{partition-id: Node}`` for ``0..num_nodes-1`` (extra SuperNodes stay idle).

        Raises:
            RuntimeError: the SuperNodes report ``num-partitions`` smaller than ``num_nodes`` (at
                once, naming the ``--federation-config`` to pass), a discovery handler failed and
                no spare SuperNode exists (its reason quoted), duplicate partition-ids, or
                partition-ids still missing after ``discovery_timeout`` (named, with the reasons
                of failed nodes).
        """
        deadline = time.monotonic() + self.discovery_timeout
        while True:
            new = [n for n in grid.get_node_ids() if n not in self.asked]
            if new:
                self.asked.update(new)
                msgs = [self.query(n) for n in new]
                wait = max(1.0, min(timeout, deadline - time.monotonic()))
                for r in messaging.send_and_receive(
                    grid, msgs, wait, messaging.in_flight_limit(grid)
                ):
                    self.accept(r)
                self.check_errors()
            if all(p in self.found for p in range(self.num_nodes)):
                break
            if time.monotonic() > deadline:
                raise self.timeout_error()
            time.sleep(POLL_SECONDS)
        return {p: n for p, n in self.found.items() if p < self.num_nodes}

    def query(self, node_id: int) -> Message:
        """The ``query.<action>`` message to Flower node ``node_id``."""
        return Message(
            RecordDict({CONFIG: ConfigRecord(dict(self.config))}),
            dst_node_id=node_id,
            message_type=message_type(QUERY, self.action),
        )

    def accept(self, r: Message) -> None:
        """Record one query reply: its node, or its failure in :attr:`errors`.

        Raises:
            RuntimeError: the node reports ``num-partitions`` < ``num_nodes``, or a partition-id
                another node already reported.
        """
        info, problem = parse_reply(r)
        if info is None:
            assert problem is not None  # no info means a problem was found
            self.errors.append(f"node {r.metadata.src_node_id}: {problem[-600:]}")
            if len(self.asked) > self.num_nodes:  # a spare SuperNode can stand in
                log.warning("discovery: %s (idle)", self.errors[-1])
            return
        too_small = federation_too_small(info, self.num_nodes)
        if too_small is not None:
            raise too_small
        if info.partition_id in self.found:
            raise RuntimeError(f"partition-id {info.partition_id} reported by two nodes")
        self.found[info.partition_id] = Node(r.metadata.src_node_id, info)

    def check_errors(self) -> None:
        """Fail when a node's reply was unusable and no spare SuperNode can stand in.

        Raises:
            RuntimeError: quoting the first failed node's reason (and up to three more).
        """
        errors = self.errors
        if not errors or len(self.asked) > self.num_nodes:
            return
        more = (
            f" (and {len(errors) - 1} more of the {len(self.asked)} nodes: "
            + "; ".join(e[:160] for e in errors[1:4])
            + (" ..." if len(errors) > 4 else "")
            + ")"
            if len(errors) > 1
            else ""
        )
        raise RuntimeError(f"discovery failed on {errors[0]}{more}")

    def timeout_error(self) -> RuntimeError:
        """The error after ``discovery_timeout``: too slow (every SuperNode registered, none failed:
        the timeout to set) or too few (the missing partition-ids and the option to pass)."""
        missing = sorted(set(range(self.num_nodes)) - set(self.found))
        found, timeout = len(self.found), self.discovery_timeout
        if len(self.asked) >= self.num_nodes and found and not self.errors:
            # every SuperNode registered and none failed: they answer too slowly, not too few
            rate = found / timeout
            need = self.num_nodes / max(rate, 1e-9)
            return RuntimeError(
                f"discovery answered {found} of {self.num_nodes} nodes in "
                f"discovery-timeout={timeout:.0f} s ({rate:.1f} nodes/s; "
                f"{len(missing)} still missing, from partition-id {missing[0]}): every "
                f"SuperNode is registered and none failed, so they are slow (many nodes "
                f"on few cores: set discovery-timeout to at least {1.5 * need:.0f}, 1.5x the "
                f"{need:.0f} s this rate needs) or stuck (see those SuperNodes' logs)"
            )
        return RuntimeError(
            f"the scenario has {self.num_nodes} agents but after {timeout:.0f} s no SuperNode "
            f"answered for partition-id(s) {missing} ({len(self.asked)} registered; failed: "
            f"{self.errors}); run with {self.fix}"
        )
