"""Bounded messages in flight (``flwr_sheaf.strategy.messaging``).

- against a fake grid that counts the messages pushed and not yet pulled, answers each after a
  seeded number of pulls, and can refuse to store a message or never answer it: never more than
  ``window`` in flight, every reply returned once and in the order of the messages, unanswered and
  unsent messages get no reply when the timeout runs out;
- the grid choice: only Flower's simulation grid (``InMemoryGrid``) is throttled;
- end to end on the in-process grid: a Sheaf-FRL run with injected faults gives the same results
  and the same recorded failures with a window of 2 as with every message at once.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Error, Message, RecordDict

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.strategy import messaging
from flwr_sheaf.testing import LocalGrid, set_task_identity

torch.set_num_threads(1)


class FakeGrid:
    """Replies to message i after ``delay[i]`` pulls (``None``: never); refuses the ids in ``refuse``."""

    def __init__(self, delay: list[int | None], refuse: frozenset[int] = frozenset()):
        self.delay, self.refuse = delay, refuse
        self.in_flight: dict[str, int] = {}  # message id -> index, pushed and not pulled
        self.max_in_flight = 0
        self.pulls: dict[str, int] = {}
        self.pushed: list[int] = []
        self.returned: list[str] = []
        self.plain_calls = 0

    def push_messages(self, messages):
        ids = []
        for m in messages:
            i = int(m.content["config"]["i"])
            m.metadata.__dict__["_message_id"] = f"m{i}"
            self.pushed.append(i)
            if i in self.refuse:
                continue
            self.in_flight[f"m{i}"] = i
            ids.append(f"m{i}")
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        return ids

    def pull_messages(self, message_ids):
        out = []
        for mid in message_ids:
            if mid not in self.in_flight:
                continue
            i = self.in_flight[mid]
            self.pulls[mid] = self.pulls.get(mid, 0) + 1
            if self.delay[i] is not None and self.pulls[mid] > self.delay[i]:
                del self.in_flight[mid]
                reply = (
                    Message(Error(code=2, reason=f"node {i} failed"), reply_to=_msg_of(i, mid))
                    if i % 7 == 3
                    else Message(
                        RecordDict({"config": ConfigRecord({"i": i})}), reply_to=_msg_of(i, mid)
                    )
                )
                out.append(reply)
                self.returned.append(mid)
        return out[::-1]  # arrival order differs from the messages' order

    def send_and_receive(self, messages, *, timeout=None):
        self.plain_calls += 1
        ids = self.push_messages(list(messages))
        return self.pull_messages(ids)


class FakeClock:
    """``time`` for the windowed exchange: advances only when it sleeps (LocalGrid answers at once)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 1e-3)


def _msg(i: int) -> Message:
    return Message(
        RecordDict({"config": ConfigRecord({"i": i})}), dst_node_id=100 + i, message_type="query.x"
    )


def _msg_of(i: int, mid: str) -> Message:
    m = _msg(i)
    m.metadata.__dict__["_message_id"] = mid
    return m


def _index(reply: Message) -> int:
    return int(reply.metadata.reply_to_message_id[1:])


@pytest.fixture(autouse=True)
def _identity():
    set_task_identity()


@pytest.mark.parametrize("window", [1, 3, 8])
def test_never_more_than_window_in_flight_and_every_reply_once_in_message_order(window):
    n = 40
    delay = [int(d) for d in np.random.default_rng(window).integers(0, 5, n)]
    grid = FakeGrid(delay)
    replies = messaging.send_and_receive(grid, [_msg(i) for i in range(n)], 30.0, window, 0.0)
    assert grid.max_in_flight == window
    assert [_index(r) for r in replies] == list(range(n))  # each once, in the messages' order
    assert sorted(grid.returned) == sorted(f"m{i}" for i in range(n))
    assert [r.has_error() for r in replies] == [
        i % 7 == 3 for i in range(n)
    ]  # errors returned as is
    assert grid.pushed == list(range(n)) and grid.plain_calls == 0


def test_a_refused_message_gets_no_reply_and_does_not_hold_a_slot():
    grid = FakeGrid([0] * 10, refuse=frozenset({2, 5}))
    replies = messaging.send_and_receive(grid, [_msg(i) for i in range(10)], 30.0, 2, 0.0)
    assert [_index(r) for r in replies] == [0, 1, 3, 4, 6, 7, 8, 9]
    assert grid.pushed == list(range(10))


def test_on_timeout_unanswered_messages_get_no_reply_and_the_rest_are_not_sent(caplog):
    # node 1 never answers: it holds one of the two slots until the timeout; the other slot keeps working
    grid = FakeGrid([0, None] + [1] * 1000)
    t0 = time.monotonic()
    replies = messaging.send_and_receive(grid, [_msg(i) for i in range(1002)], 0.3, 2, 0.01)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    got = [_index(r) for r in replies]
    assert 1 not in got and got == sorted(got) and got[0] == 0
    unsent = 1002 - len(grid.pushed)
    assert unsent > 0 and grid.pushed == list(range(len(grid.pushed)))
    assert f"{unsent} of 1002 messages not sent" in caplog.text


@pytest.mark.parametrize("window", [None, 5, 6])
def test_without_a_bound_or_with_a_wide_one_it_is_the_grids_own_send_and_receive(window):
    grid = FakeGrid([0] * 5)
    replies = messaging.send_and_receive(grid, [_msg(i) for i in range(5)], 1.0, window)
    assert grid.plain_calls == 1 and len(replies) == 5


def test_silent_nodes_give_up_their_slots_once_stale(monkeypatch):
    # the first two messages never get a reply: without stale slots nothing else would be sent
    monkeypatch.setattr(messaging, "FIRST_REPLY_S", 0.05)
    monkeypatch.setattr(messaging, "MIN_STALE_S", 0.05)
    grid = FakeGrid([None, None] + [1] * 8)
    replies = messaging.send_and_receive(grid, [_msg(i) for i in range(10)], 5.0, 2, 0.01)
    assert [_index(r) for r in replies] == list(range(2, 10))
    assert set(grid.in_flight) == {"m0", "m1"} and grid.pushed == list(range(10))


def test_window_below_one_is_refused():
    with pytest.raises(ValueError, match="window must be >= 1 message in flight, got 0"):
        messaging.send_and_receive(FakeGrid([0] * 3), [_msg(i) for i in range(3)], 1.0, 0)


def test_only_flowers_simulation_grid_is_throttled():
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation import NoOpFederationManager
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    factory = LinkStateFactory(
        FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
    )
    assert messaging.in_flight_limit(InMemoryGrid(factory)) == messaging.SIMULATION_WINDOW
    assert messaging.in_flight_limit(LocalGrid(cnn_client_app, 2)) is None


def _faulty_run(tmp_path, window, monkeypatch) -> dict:
    """A 6-node Sheaf-FRL run, 3 rounds, a seeded set of nodes raising or silent per round."""
    monkeypatch.setattr(messaging, "in_flight_limit", lambda grid: window)
    monkeypatch.setattr(
        messaging, "time", FakeClock()
    )  # deadlines in pulls, not in load-bound seconds
    monkeypatch.setattr(messaging, "FIRST_REPLY_S", 0.05)  # silent nodes: slots freed in 0.05 s
    monkeypatch.setattr(messaging, "MIN_STALE_S", 0.05)
    n = 6
    rc = {
        "zoo": f"tiny-{n}",
        "graph": "ring",
        "num-pilots": 32,
        "local-epochs": 1,
        "max-steps-per-epoch": 1,
        "batch-size": 16,
        "method": "sheaf-frl",
        "num-server-rounds": 3,
        "seed": 3,
        "results-dir": str(tmp_path / str(window)),
        "round-timeout": 2.0,
    }
    grid = LocalGrid(cnn_client_app, n, run_config=rc)
    real = grid.app

    def fate(msg) -> str:
        if not msg.metadata.message_type.startswith(("train.", "evaluate.")):
            return "ok"
        rnd, pid = int(msg.metadata.group_id), grid.partition_of(msg.metadata.dst_node_id)
        u = np.random.default_rng([7, rnd, pid, len(msg.metadata.message_type)]).random()
        return "raise" if u < 0.15 else ("silent" if u < 0.3 else "ok")

    def app(msg, ctx):
        if fate(msg) == "raise":
            raise RuntimeError("injected")
        return real(msg, ctx)

    grid.app, grid.drop = app, lambda msg: fate(msg) == "silent"
    res = json.loads(run_server(grid, rc).read_text())
    drop = ("time", "wall", "seconds", "_s")
    return {
        "failures": res["failures"],
        "rounds": [
            {k: v for k, v in r.items() if not any(d in k for d in drop)} for r in res["rounds"]
        ],
    }


def test_a_windowed_run_records_the_same_results_and_failures_as_an_unbounded_one(
    tmp_path, monkeypatch
):
    plain = _faulty_run(tmp_path, None, monkeypatch)
    windowed = _faulty_run(tmp_path, 2, monkeypatch)
    reasons = {f["reason"] for f in plain["failures"]}
    assert any("injected" in r for r in reasons) and "no reply within the timeout" in reasons
    assert windowed == plain


def test_flowers_polling_pass_checks_every_stored_message_for_every_node(monkeypatch):
    """The model behind the window (benchmarks/records/performance-ray.md): with messages delivered and awaiting
    their replies, one pass of Flower's simulation polling checks each stored message once per
    registered node (N x stored checks), on Flower's own in-memory LinkState."""
    import importlib.util
    from pathlib import Path
    from queue import Queue

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "flower_polling.py"
    spec = importlib.util.spec_from_file_location("flower_polling", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    n, stored = 30, 5
    state, grid, nodes = bench.make_state(n)
    msgs = [_msg(i) for i in range(stored)]
    for m, nid in zip(msgs, nodes):
        m.metadata.__dict__["_dst_node_id"] = nid
    grid.push_messages(msgs)
    queue: Queue = Queue()
    bench.one_pass(state, nodes, queue)  # delivers the stored messages
    assert queue.qsize() == stored
    checks = []
    real = state._check_stored_messages
    monkeypatch.setattr(
        state, "_check_stored_messages", lambda ids, *a: (checks.append(len(ids)), real(ids, *a))
    )
    bench.one_pass(state, nodes, queue)
    assert sum(checks) == n * stored and queue.qsize() == stored


def test_before_the_first_reply_few_messages_wait_and_pulls_back_off(monkeypatch):
    """While the Ray actors start (no reply for seconds), the ServerApp polled at 50 Hz with a full
    window stored, which Flower's engine checks for every SuperNode every 0.1 s: its CPU grew with the
    wall time, so with the machine's load (benchmarks/records/performance-ray.md, "Against Flower's floor"). Now
    ``SLOW_START`` messages wait for the first reply (one more per reply, up to the window) and pulls
    that bring nothing back off to Flower's 0.1 s; replies bring back 0.02 s."""
    clock = FakeClock()
    monkeypatch.setattr(messaging, "time", clock)

    class SlowStart(FakeGrid):
        pull_times: list[float] = []
        stored_while_starting = 0

        def pull_messages(self, message_ids):
            self.pull_times.append(clock.now)
            if clock.now < 10.0:
                self.stored_while_starting = max(self.stored_while_starting, len(self.in_flight))
                return []
            return super().pull_messages(message_ids)

    n, window = 300, 48
    grid = SlowStart([0] * n)
    replies = messaging.send_and_receive(grid, [_msg(i) for i in range(n)], 600.0, window)
    assert [_index(r) for r in replies] == list(range(n))
    assert grid.stored_while_starting == messaging.SLOW_START == 8
    assert grid.max_in_flight == window  # the window is reached once replies flow
    waiting = [t for t in grid.pull_times if t < 10.0]
    # 10 s without a reply: about 100 pulls at Flower's 0.1 s (500 at a fixed 0.02 s)
    assert 95 <= len(waiting) <= 110, len(waiting)
    # once replies flow: 8, 16, 32, 48, 48, ... answered a pull, 0.02 s apart
    after = [t for t in grid.pull_times if t >= 10.0]
    assert len(after) <= 4 + n // window + 1
    gaps = [b - a for a, b in zip(after, after[1:])]
    assert max(gaps) <= messaging.PULL_INTERVAL + 1e-9


def test_nothing_is_pushed_once_the_timeout_has_run_out(monkeypatch, caplog):
    """Review of the pull back-off: its last sleep ends on the deadline itself; slots that turned
    stale during it were refilled there, i.e. messages were pushed that nobody would wait for (a
    node then trained for a round already closed). Nothing is pushed at or after the deadline."""
    clock = FakeClock()
    monkeypatch.setattr(messaging, "time", clock)

    class Timed(FakeGrid):
        push_times: list[float] = []

        def push_messages(self, messages):
            self.push_times.extend(clock.now for _ in messages)
            return super().push_messages(messages)

    # message 0 answers at once (stale after MIN_STALE_S = 1 s), the others never; timeout 1 s
    n, timeout = 20, messaging.MIN_STALE_S
    grid = Timed([0] + [None] * (n - 1))
    replies = messaging.send_and_receive(grid, [_msg(i) for i in range(n)], timeout, 2)
    assert [_index(r) for r in replies] == [0]
    assert grid.pushed == [0, 1, 2] and max(grid.push_times) < timeout
    assert clock.now == pytest.approx(timeout)  # it returns on the deadline, not a pull later
    assert f"{n - 3} of {n} messages not sent" in caplog.text
