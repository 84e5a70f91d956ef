"""Server <-> node round trips with a bound on the messages in flight on Flower's simulation engine.

Flower 1.42's simulation engine polls all stored messages for every SuperNode every 0.1 s, so
pushing all N messages at once costs ``N x stored`` checks a pass (benchmarks/records/performance-ray.md).
:func:`send_and_receive` keeps at most ``window`` in flight; only ``InMemoryGrid`` is throttled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from flwr.app import Message
from flwr.serverapp import Grid

log = logging.getLogger(__name__)

# Tuned against Flower's polling cost in benchmarks/records/performance-ray.md.
SIMULATION_WINDOW = 48  #: messages in flight at once on Flower's simulation engine
#: a message unanswered for ``STALE_FACTOR`` x the longest reply time seen (at least ``MIN_STALE_S``;
#: ``FIRST_REPLY_S`` before any reply: Ray actors' start-up) stops holding a slot (its reply is
#: still taken), so a silent node cannot block the others' messages
STALE_FACTOR, MIN_STALE_S, FIRST_REPLY_S = 3.0, 1.0, 60.0
PULL_INTERVAL = 0.02  #: seconds between two pulls while messages are in flight (Flower's: 0.1 s)
SLOW_START = 8  #: messages in flight before the first reply (then one more per reply)
MAX_PULL_INTERVAL = 0.1  #: while pulls bring nothing, their interval doubles up to this


def simulated(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's simulation engine's ``InMemoryGrid``."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid  # Flower internal (1.42 pin)

    return isinstance(grid, InMemoryGrid)


def in_flight_limit(grid: Grid) -> int | None:
    """:data:`SIMULATION_WINDOW` on Flower's simulation engine, else None (all at once)."""
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

    Windowed: slow start, pulls every ``pull_interval`` s backing off, stale messages free their
    slot (module constants); at the deadline unsent messages are not sent (logged). Returns the
    replies (windowed: in the order of ``msgs``).

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
