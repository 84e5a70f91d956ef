"""Server <-> node round trips with a bound on the messages in flight on Flower's simulation engine.

Flower 1.42's simulation engine polls, every 0.1 s and for every registered SuperNode, all stored
instruction messages, so a round that pushes all N messages at once costs ``N x stored`` checks a
pass (benchmarks/records/performance-ray.md, "Flower's own polling"). :func:`send_and_receive`, the one round
trip of the package (:meth:`~flwr_sheaf.strategy.exchange.Exchange.round_trip`,
:meth:`~flwr_sheaf.strategy.discovery.Discovery.run`), keeps at most ``window`` messages in flight;
:func:`in_flight_limit` throttles only Flower's simulation grid (``InMemoryGrid``): the deployment
engine and :class:`flwr_sheaf.testing.LocalGrid` keep Flower's plain ``send_and_receive``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from flwr.app import Message
from flwr.serverapp import Grid

log = logging.getLogger(__name__)

#: messages in flight at once on Flower's simulation engine (benchmarks/records/performance-ray.md, "Bounded
#: messages in flight": chosen with ``benchmarks/ray_message_cost.py --supernodes 1000``).
SIMULATION_WINDOW = 48

#: a message unanswered for ``STALE_FACTOR`` times the longest reply time seen so far in the
#: exchange (at least ``MIN_STALE_S``; ``FIRST_REPLY_S`` before any reply, which covers the Ray
#: actors' start-up) stops holding a slot: its reply is still taken until the timeout, and a node
#: that never answers cannot keep the other nodes' messages from being sent.
STALE_FACTOR, MIN_STALE_S, FIRST_REPLY_S = 3.0, 1.0, 60.0

#: seconds between two pulls of the replies while messages are in flight (Flower's grid: 0.1 s);
#: a pull asks about at most ``window`` message ids, so it is cheap.
PULL_INTERVAL = 0.02

#: messages in flight before the first reply (then one more for each reply, up to the window): while
#: the Ray actors start (importing torch, loading the data: seconds, longer under load), Flower's
#: engine checks every stored message for every SuperNode every 0.1 s, so a full window waiting
#: there cost the ServerApp CPU in proportion to the wait (benchmarks/records/performance-ray.md, "Against
#: Flower's floor"); a run of 1,000 nodes reaches the full window within its first 40 replies.
SLOW_START = 8

#: while pulls bring no reply (the Ray actors starting, a slow node), the wait between pulls doubles
#: up to this (Flower's own 0.1 s), and falls back to ``PULL_INTERVAL`` at the next reply: polling at
#: 50 Hz through a long wait cost the ServerApp CPU in proportion to the wall time, so the more the
#: machine was loaded, the more (benchmarks/records/performance-ray.md, "Against Flower's floor").
MAX_PULL_INTERVAL = 0.1


def simulated(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's simulation engine's (its ``InMemoryGrid``): its nodes' node
    config holds only ``partition-id`` and ``num-partitions``, and their state lives in memory."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid  # Flower internal (1.42 pin)

    return isinstance(grid, InMemoryGrid)


def in_flight_limit(grid: Grid) -> int | None:
    """The bound on messages in flight for ``grid``: :data:`SIMULATION_WINDOW` on Flower's simulation
    engine (:func:`simulated`), ``None`` (all at once, Flower's ``send_and_receive``) otherwise."""
    return SIMULATION_WINDOW if simulated(grid) else None


def send_and_receive(
    grid: Grid,
    msgs: Sequence[Message],
    timeout: float,
    window: int | None = None,
    pull_interval: float = PULL_INTERVAL,
) -> list[Message]:
    """Send ``msgs`` (one per node) and collect their replies within ``timeout`` seconds (the whole
    exchange), at most ``window`` in flight (None: the grid's own ``send_and_receive``).

    Windowed: the first ``min(window, SLOW_START)`` messages are pushed (one more allowed in flight
    for each reply, up to ``window``), replies pulled every ``pull_interval`` seconds (doubling up
    to :data:`MAX_PULL_INTERVAL` while pulls bring nothing), each reply frees a slot for the next
    message; a message unanswered for ``STALE_FACTOR`` times the longest reply time seen (at least
    ``MIN_STALE_S``; ``FIRST_REPLY_S`` before any reply) stops holding its slot. A message the grid
    refused to store gets no reply, like Flower's; when ``timeout`` runs out, unanswered messages get
    none and unsent ones are not sent (logged): nothing is pushed at or after the deadline.

    Returns:
        The windowed exchange's replies in the order of ``msgs`` (not arrival order); the unbounded
        one's as the grid returns them.

    Raises:
        ValueError: ``window`` < 1.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 message in flight, got {window}")
    if window is None or len(msgs) <= window:
        return list(grid.send_and_receive(msgs, timeout=timeout))
    t0 = time.monotonic()
    deadline = t0 + timeout
    pending: dict[str, tuple[int, float]] = {}  # message id -> (index in msgs, push time)
    replies: dict[int, Message] = {}
    longest = -1.0  # the longest push-to-reply time seen so far (-1: no reply yet)
    sent = 0
    wait, cap = pull_interval, max(pull_interval, MAX_PULL_INTERVAL)
    limit = min(window, SLOW_START)  # grows by one per reply up to ``window``
    while True:
        now = time.monotonic()
        stale = FIRST_REPLY_S if longest < 0 else max(MIN_STALE_S, STALE_FACTOR * longest)
        busy = sum(1 for _, t in pending.values() if now - t < stale)
        if sent < len(msgs) and busy < limit and now < deadline:  # none past the deadline
            batch = msgs[sent : sent + limit - busy]
            stored = set(grid.push_messages(batch))
            for i, m in enumerate(batch, start=sent):
                if m.metadata.message_id in stored:
                    pending[m.metadata.message_id] = (i, now)
            sent += len(batch)
            busy += len(batch)
        got = 0
        if pending:
            for r in grid.pull_messages(list(pending)):
                slot = pending.pop(r.metadata.reply_to_message_id, None)
                if slot is not None:
                    replies[slot[0]] = r
                    got += 1
                    busy -= now - slot[1] < stale  # a stale message no longer held a slot
                    longest = max(longest, time.monotonic() - slot[1])
        if (not pending and sent == len(msgs)) or time.monotonic() >= deadline:
            break
        limit = min(window, limit + got)
        if busy >= limit or sent == len(msgs):
            # back off while nothing arrives (MAX_PULL_INTERVAL), never past the deadline
            wait = pull_interval if got else min(cap, max(2 * wait, pull_interval))
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
    if sent < len(msgs):
        log.warning(
            "%d of %d messages not sent: the %.1f s timeout ran out with %d in flight",
            len(msgs) - sent,
            len(msgs),
            timeout,
            len(pending),
        )
    return [replies[i] for i in sorted(replies)]
