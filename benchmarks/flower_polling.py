"""Cost of Flower 1.42's simulation polling, measured on its own ``InMemoryLinkState``.

Flower's simulation engine (``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue``)
loops, every 0.1 s, over every registered SuperNode and calls
``InMemoryLinkState.get_message_ins(node_id, limit=1)``, which walks the stored instruction
messages (``_check_stored_messages`` on each: a lock, a timestamp, a federation check) until it
finds one for that node. A message stays stored from ``push_messages`` until its reply is pulled.
So one polling pass costs about ``N_nodes x |store| x c`` and a message pays ``N_nodes x c`` for
every pass it stays stored.

This script builds the same state Flower's simulation builds (``LinkStateFactory`` in memory,
``NoOpFederationManager``, nodes registered as ``vce_api._register_nodes`` does, one run), stores
``S`` messages (as ``InMemoryGrid.push_messages`` does), and times polling passes, with none of
the messages delivered yet (the first pass) and with all of them delivered (the passes while
replies are awaited). It prints the CPU-seconds of one pass and ``c``, the cost of one
(node, stored message) check, and what follows for a full query of ``N`` nodes::

    python benchmarks/flower_polling.py [--nodes 1000,3000] [--stored 0,100,1000]

Single-threaded CPU time (``time.process_time``) of this process only.
"""

from __future__ import annotations

import argparse
import sys
import time
from queue import Queue

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid


def make_state(n: int):
    """Flower's in-memory LinkState with ``n`` registered nodes and one running run."""
    factory = LinkStateFactory(
        FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
    )
    mapping = _register_nodes(n, factory)
    state = factory.state()
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None, "serverapp")
    info = state.get_run_info(run_ids=[run_id])[0]
    TaskIdentity.task_id, TaskIdentity.run_id = info.primary_task_id, run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    grid = InMemoryGrid(factory)
    grid.set_run(state.get_run_info(run_ids=[run_id])[0])
    return state, grid, list(mapping)


def one_pass(state, nodes: list[int], queue: Queue) -> float:
    """CPU-seconds of one ``add_messages_to_queue`` pass (its body, copied from Flower 1.42)."""
    c0 = time.process_time()
    for node_id in nodes:
        for msg in state.get_message_ins(node_id=node_id, limit=1):
            queue.put(msg)
    return time.process_time() - c0


def measure(n: int, stored: int) -> dict:
    """Pass costs with ``stored`` messages (to the first ``stored`` nodes) undelivered, then delivered."""
    state, grid, nodes = make_state(n)
    msgs = [
        Message(
            RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=nid, message_type="query"
        )
        for nid in nodes[:stored]
    ]
    c0 = time.process_time()
    ids = list(grid.push_messages(msgs))
    push = time.process_time() - c0
    queue: Queue = Queue()
    first = one_pass(state, nodes, queue)  # delivers every stored message
    assert queue.qsize() == stored, (queue.qsize(), stored)
    later = one_pass(state, nodes, queue)  # the passes while replies are awaited
    assert queue.qsize() == stored
    c0 = time.process_time()
    grid.pull_messages(ids)  # no reply yet: the grid's poll every 0.1 s
    pull = time.process_time() - c0
    return {"n": n, "stored": stored, "push": push, "first": first, "later": later, "pull": pull}


def main(argv: list[str] | None = None) -> int:
    """Print a table of pass costs per (nodes, stored messages) and the per-check cost ``c``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="1000,3000", help="comma-separated node counts")
    ap.add_argument("--stored", default="0,100,1000", help="comma-separated stored-message counts")
    args = ap.parse_args(argv)
    print(
        "| nodes | stored messages | polling pass, none delivered: CPU ms | pass, all delivered: CPU ms "
        "| c: us per (node, message) | grid pull (no reply yet): CPU ms |"
    )
    print("|---|---|---|---|---|---|")
    for n in [int(x) for x in args.nodes.split(",")]:
        for s in [int(x) for x in args.stored.split(",")]:
            if s > n:
                continue
            r = measure(n, s)
            c = f"{1e6 * r['later'] / (n * s):.2f}" if s else "-"
            print(
                f"| {n} | {s} | {1e3 * r['first']:.1f} | {1e3 * r['later']:.1f} | {c} "
                f"| {1e3 * r['pull']:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
