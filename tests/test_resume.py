"""Node state across SuperNode restarts (``state-dir``) and exact server resume (docs/resume.md).

In-process with LocalGrid: a restarted SuperNode is a fresh ``Context`` with the same node config;
a stopped ServerApp is an exception raised from the grid in the middle of a round; a resumed run is
a new LocalGrid (new Flower run id, fresh contexts) with ``resume = true``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from flwr_sheaf.apps.client_app import app as cnn_app
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.client.state import (
    META_KEY,
    StateFileError,
    persist_state,
    read_state,
    serialize_state,
    state_files,
)
from flwr_sheaf.config import ConfigError
from flwr_sheaf.methods.rfedags.client import problem_factory, register_rfedags_handlers
from flwr_sheaf.methods.rfedags.pca import synthetic_pca_problem
from flwr_sheaf.methods.rfedags.strategy import RFedAGS
from flwr_sheaf.rundir import Checkpointer, load_checkpoint
from flwr_sheaf.testing import LocalGrid, set_task_identity

torch.set_num_threads(1)
logging.getLogger("flwr_sheaf").setLevel(logging.WARNING)

RC = {
    "zoo": "tiny-4",
    "num-pilots": 32,
    "local-epochs": 1,
    "max-steps-per-epoch": 2,
    "seed": 3,
    "graph": "ring",
}
VOLATILE = ("wall_seconds", "elapsed_seconds")


def _rounds(res: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in res["rounds"]]


class Stopped(Exception):
    """The ServerApp 'dies' here."""


class EventGrid(LocalGrid):
    """LocalGrid that runs ``hook(grid, messages, delivered)`` before and after delivering each batch."""

    def __init__(self, *args, hook, **kw):
        super().__init__(*args, **kw)
        self.hook = hook

    def push_messages(self, messages):
        messages = list(messages)
        self.hook(self, messages, False)
        ids = super().push_messages(messages)
        self.hook(self, messages, True)
        return ids


def _batch_is(messages, category: str, rnd: int) -> bool:
    return any(
        m.metadata.message_type.startswith(category + ".") and m.metadata.group_id == str(rnd)
        for m in messages
    )


# ---------------------------------------------------------------------------------- the mod, by hand
def _counting_app() -> ClientApp:
    """A ClientApp whose train handler appends the server round to ``state['w']['seen']``."""
    app = ClientApp(mods=[persist_state])

    def seen(context):
        return list(context.state["w"]["seen"]) if "w" in context.state else []

    @app.train("t")
    def _train(msg, context):
        context.state["w"] = ConfigRecord(
            {"seen": seen(context) + [int(msg.content["config"]["server-round"])]}
        )
        return Message(RecordDict({"m": MetricRecord({"n": len(seen(context))})}), reply_to=msg)

    @app.evaluate("t")
    def _evaluate(msg, context):
        return Message(
            RecordDict({"m": MetricRecord({"seen": [float(x) for x in seen(context)]})}),
            reply_to=msg,
        )

    return app


def _ctx(state_dir, run_id=1, pid=0, **rc) -> Context:
    return Context(
        run_id=run_id,
        node_id=7,
        node_config={"partition-id": pid, "num-partitions": 2, "state-dir": str(state_dir)},
        state=RecordDict(),
        run_config={"lr": 0.05, "num-server-rounds": 9, **rc},
    )


def _send(app, ctx, category, rnd) -> Message:
    msg = Message(
        RecordDict({"config": ConfigRecord({"server-round": rnd})}),
        dst_node_id=7,
        message_type=f"{category}.t",
    )
    msg.metadata.__dict__["_message_id"] = f"m{rnd}{category}"
    return app(msg, ctx)


def _seen(ctx) -> list[int]:
    return [int(x) for x in ctx.state["w"]["seen"]]


def test_state_files_lineage_restart_resume_and_pruning(tmp_path):
    set_task_identity()
    app, d = _counting_app(), tmp_path / "partition-0"
    ctx = _ctx(tmp_path)
    for rnd in (1, 2, 3):
        _send(app, ctx, "train", rnd)
    assert sorted(state_files(d)) == [2, 3]  # checkpoint-every = 1 -> the last two rounds are kept
    meta, state = read_state(state_files(d)[3])
    assert (meta["round"], meta["previous-round"], meta["run-id"], meta["partition-id"]) == (
        3,
        2,
        1,
        0,
    )
    assert (
        serialize_state(state) == serialize_state(ctx.state)
        and "num-server-rounds" not in meta["run-config"]
    )

    # SuperNode restart inside the same Flower run: evaluate of round 3 sees round 3's state
    ctx = _ctx(tmp_path)
    reply = _send(app, ctx, "evaluate", 3)
    assert [int(x) for x in reply.content["m"]["seen"]] == [1, 2, 3] and _seen(ctx) == [1, 2, 3]

    # a new Flower run resuming from the server's round-2 checkpoint: train of round 3 starts from round 2;
    # the stopped run's round-3 file is replaced by the resumed run's
    ctx = _ctx(tmp_path, run_id=2, resume=True)
    _send(app, ctx, "train", 3)
    assert _seen(ctx) == [1, 2, 3]
    meta, _ = read_state(state_files(d)[3])
    assert (meta["run-id"], meta["previous-round"]) == (2, 2)

    # keep max(2, checkpoint-every + 1) rounds
    ctx = _ctx(tmp_path, run_id=2, resume=True, **{"checkpoint-every": 3})
    for rnd in (4, 5, 6, 7):
        _send(app, ctx, "train", rnd)
    assert sorted(state_files(d)) == [4, 5, 6, 7]
    assert int(ctx.state[META_KEY]["round"]) == 7


def test_a_node_without_state_before_the_resumed_round_starts_afresh_and_a_pruned_round_is_refused(
    tmp_path,
):
    set_task_identity()
    app = _counting_app()
    _send(app, _ctx(tmp_path / "a"), "train", 5)  # first trained in round 5 of the stopped run
    ctx = _ctx(tmp_path / "a", run_id=2, resume=True)
    _send(app, ctx, "train", 3)  # the server resumes after round 2: this node had nothing yet
    assert _seen(ctx) == [3] and sorted(state_files(tmp_path / "a" / "partition-0")) == [3]

    ctx = _ctx(tmp_path / "b")
    for rnd in range(1, 6):
        _send(app, ctx, "train", rnd)  # keeps rounds 4 and 5 only
    with pytest.raises(StateFileError, match="pruned"):
        _send(app, _ctx(tmp_path / "b", run_id=2, resume=True), "train", 3)


def test_foreign_or_broken_state_files_are_refused_by_name(tmp_path):
    set_task_identity()
    app = _counting_app()
    _send(app, _ctx(tmp_path), "train", 1)
    # a fresh Flower run (no resume) must not pick up an earlier run's state
    with pytest.raises(StateFileError, match="resume=true"):
        _send(app, _ctx(tmp_path, run_id=2), "train", 1)
    # another run config (lr), named with both values, even when resuming
    with pytest.raises(StateFileError, match=r"lr: 0\.05 in the file, 0\.1 now"):
        _send(app, _ctx(tmp_path, run_id=2, resume=True, lr=0.1), "train", 2)
    # a changed num-server-rounds is fine (extending a run)
    ctx = _ctx(tmp_path, run_id=2, resume=True, **{"num-server-rounds": 20})
    _send(app, ctx, "train", 2)
    assert _seen(ctx) == [1, 2]
    # another partition's file
    (tmp_path / "partition-1").mkdir()
    shutil.copy(
        tmp_path / "partition-0" / "round-2.state", tmp_path / "partition-1" / "round-2.state"
    )
    with pytest.raises(StateFileError, match="partition-id 0 .* this node is partition-id 1"):
        _send(app, _ctx(tmp_path, pid=1), "train", 3)
    # a corrupted payload
    path = tmp_path / "partition-0" / "round-2.state"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(StateFileError, match="corrupted"):
        _send(app, _ctx(tmp_path, run_id=2, resume=True), "evaluate", 3)
    # a FIFO in its place: refused by name (opening it waited for a writer for ever)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(StateFileError, match=f"{path}: not a regular file"):
        _send(app, _ctx(tmp_path, run_id=2, resume=True), "evaluate", 3)
    # without state-dir nothing is read or written
    ctx = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 0, "num-partitions": 2},
        state=RecordDict(),
        run_config={},
    )
    _send(app, ctx, "train", 4)
    assert _seen(ctx) == [4] and META_KEY not in ctx.state


# ---------------------------------------------------------------------------------- a restarted node, CNN zoo
def test_a_restarted_node_continues_from_its_last_round(tmp_path):
    """Node 1 restarts (fresh Context) between rounds 1 and 2: with ``state-dir`` its round-2 training and
    the round-2 results equal the uninterrupted run's; without, they do not (the test can fail)."""
    rc = {**RC, "method": "sheaf-frl", "num-server-rounds": 2, "evaluate-every": 2}
    before = {}

    def restart(grid, messages, delivered):
        if _batch_is(messages, "train", 2) and not delivered and not before:
            nid = grid.node_ids[1]
            before["state"] = grid.contexts[nid].state
            grid.contexts[nid] = grid.fresh_context(1)

    def run(name, hook=None, state=True):
        cfg = {**rc, "results-dir": str(tmp_path / name)}
        nc = (lambda i: {"state-dir": str(tmp_path / f"state-{name}")}) if state else None
        grid = (
            EventGrid(cnn_app, 4, run_config=cfg, node_config=nc, hook=hook)
            if hook
            else LocalGrid(cnn_app, 4, run_config=cfg, node_config=nc)
        )
        return json.loads(run_server(grid, cfg).read_text()), grid

    straight, g0 = run("straight")
    restarted, g1 = run("restarted", restart)
    # the state the restarted node reloaded is the one it held before the restart
    meta, saved = read_state(state_files(tmp_path / "state-restarted" / "partition-1")[1])
    assert meta["round"] == 1 and serialize_state(saved) == serialize_state(before["state"])
    assert _rounds(restarted) == _rounds(straight) and restarted["nodes"] == straight["nodes"]
    model = "sheaf.model"
    for k, v in g0.contexts[g0.node_ids[1]].state[model].items():
        np.testing.assert_array_equal(
            g1.contexts[g1.node_ids[1]].state[model][k].numpy(), v.numpy()
        )
    before.clear()
    amnesiac, g2 = run("amnesiac", restart, state=False)
    assert _rounds(amnesiac)[1]["ce"] != _rounds(straight)[1]["ce"]
    w0, w2 = g0.contexts[g0.node_ids[1]].state[model], g2.contexts[g2.node_ids[1]].state[model]
    assert any(not np.array_equal(w0[k].numpy(), w2[k].numpy()) for k in w0.keys())


# ---------------------------------------------------------------------------------- exact server resume
@pytest.mark.parametrize(
    "method, rounds, evaluate_every", [("sheaf-frl", 4, 2), ("fedproto", 3, 0)]
)
def test_stop_and_resume_equals_the_straight_run(method, rounds, evaluate_every, tmp_path):
    """``rounds`` straight vs. a run stopped in round ``rounds - 1`` (the nodes have trained it, the server
    has not aggregated it) and resumed from the checkpoint of the round before, with new SuperNode
    contexts (a new Flower run): identical results. FedProto (train rounds only, to keep the test short)
    also compares the global prototypes of both final checkpoints."""
    rc = {**RC, "method": method, "num-server-rounds": rounds, "evaluate-every": evaluate_every}
    stop_round = rounds - 1

    def grid(name, cfg, run_id=1, hook=None):
        if (
            method == "fedproto"
        ):  # one root for every node in the run config (as under Flower's simulation engine)
            cfg, nc = {**cfg, "node-state-dir": str(tmp_path / f"state-{name}")}, None
        else:  # each SuperNode's own node config
            nc = lambda i: {"state-dir": str(tmp_path / f"state-{name}")}  # noqa: E731
        if hook is None:
            return LocalGrid(cnn_app, 4, run_config=cfg, node_config=nc, run_id=run_id)
        return EventGrid(cnn_app, 4, run_config=cfg, node_config=nc, run_id=run_id, hook=hook)

    def run(name, cfg, **kw):
        g = grid(name, cfg, **kw)
        return json.loads(run_server(g, g.run_config).read_text())

    straight = run("straight", {**rc, "results-dir": str(tmp_path / "straight")})

    def stop(g, messages, delivered):
        if _batch_is(messages, "train", stop_round) and delivered:
            raise Stopped

    cfg = {**rc, "results-dir": str(tmp_path / "resumed")}
    with pytest.raises(Stopped):
        g = grid("resumed", cfg, hook=stop)
        run_server(g, g.run_config)
    assert load_checkpoint(tmp_path / "resumed" / "checkpoint.pkl")["round"] == stop_round - 1
    stopped = tmp_path / "resumed" / "results.json"
    if stop_round > 1:  # the rounds before the stop are written, status failed (issue #28 case 3)
        part = json.loads(stopped.read_text())
        assert (
            part["status"] == "failed" and part["degradation"]["rounds_completed"] == stop_round - 1
        )
    else:
        assert not stopped.exists()
    assert stop_round in state_files(
        tmp_path / "state-resumed" / "partition-0"
    )  # the stopped run's last training

    cfg = {**cfg, "resume": True}
    resumed = run("resumed", cfg, run_id=2)
    assert [r["round"] for r in resumed["rounds"]] == list(range(1, rounds + 1))
    assert _rounds(resumed) == _rounds(straight)
    assert resumed["nodes"] == straight["nodes"] and resumed["edges"] == straight["edges"]
    assert resumed["failures"] == straight["failures"] == []
    assert resumed["resumed"]["after_round"] == stop_round - 1
    if method == "fedproto":
        a, b = (
            load_checkpoint(tmp_path / d / "checkpoint.pkl")["state"]["prototypes"].global_protos
            for d in ("straight", "resumed")
        )
        assert sorted(a) == sorted(b) == resumed["prototypes"]["classes"] != []
        for c in a:
            torch.testing.assert_close(a[c], b[c], rtol=0, atol=0)
    else:
        assert all(r["private_accuracy_mean"] is not None for r in resumed["rounds"][1::2])


def test_resume_refuses_a_changed_run_config_and_a_missing_checkpoint(tmp_path):
    cfg = {
        **RC,
        "method": "non-cooperative",
        "num-server-rounds": 1,
        "results-dir": str(tmp_path / "r"),
    }
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run_server(LocalGrid(cnn_app, 4, run_config=cfg), {**cfg, "resume": True})
    run_server(LocalGrid(cnn_app, 4, run_config=cfg), cfg)
    longer = {
        **cfg,
        "resume": True,
        "num-server-rounds": 2,
    }  # the nodes keep no state: refused at discovery
    with pytest.raises(RuntimeError, match="discovery failed .* keeps no state") as err:
        run_server(LocalGrid(cnn_app, 4, run_config=longer), longer)
    # every node failed the same way: the reason said once, with the count
    assert str(err.value).count("keeps no state") == 1
    assert "(the same on 3 more of the 4 nodes: node " in str(err.value)
    changed = {**cfg, "resume": True, "lr": 0.2, "num-server-rounds": 2}
    with pytest.raises(ConfigError, match=r"lr=0\.05 in the checkpoint, 0\.2 now"):
        run_server(LocalGrid(cnn_app, 4, run_config=changed), changed)
    other = {**cfg, "resume-from": str(tmp_path / "r" / "checkpoint.pkl"), "method": "fedproto"}
    with pytest.raises(ConfigError, match="method='non-cooperative' in the checkpoint"):
        run_server(LocalGrid(cnn_app, 4, run_config=other), other)


def test_rfedags_checkpoint_restores_point_estimates_and_history(tmp_path):
    """RFedAGS (strategy-level: the app's registry has no RFedAGS method): 6 rounds straight vs 3 +
    a fresh strategy resumed from the checkpoint for 3 more give the same points and weights."""
    prob = synthetic_pca_problem(num_clients=4, d=5, r=2, samples_per_client=30, seed=0)
    x0 = np.linalg.qr(np.random.default_rng(1).normal(size=(5, 2)))[0]
    p = [0.3, 0.9, 0.6, 0.5]

    def run(rounds, ckpt):
        app = register_rfedags_handlers(ClientApp(), problem_factory(prob))
        s = RFedAGS(4, p, mode="corrected", local_steps=2, step_size=0.05, seed=4)
        s.checkpointer = ckpt
        res = s.start(LocalGrid(app, 4), ArrayRecord({"x": Array(x0)}), num_rounds=rounds)
        return s, res.arrays["x"].numpy()

    d = tmp_path
    straight, x_straight = run(6, None)
    run(3, Checkpointer(d, {"method": "rfedags"}))
    resumed, x_resumed = run(6, Checkpointer(d, {"method": "rfedags"}, resume_from=d))
    np.testing.assert_array_equal(x_resumed, x_straight)
    assert [{k: v for k, v in r.items() if k not in VOLATILE} for r in resumed.history] == [
        {k: v for k, v in r.items() if k not in VOLATILE} for r in straight.history
    ]
    np.testing.assert_array_equal(resumed.server.x, straight.server.x)


def test_a_checkpoint_of_an_older_format_is_refused_as_older_naming_what_to_do(tmp_path):
    """Attack (minor): a format-1 checkpoint got the generic 'restore the file from a backup'."""
    from flwr_sheaf.rundir import CHECKPOINT_FORMAT as FORMAT

    cfg = {**RC, "method": "non-cooperative", "num-server-rounds": 1}
    cfg["results-dir"] = str(tmp_path / "r")
    run_server(LocalGrid(cnn_app, 4, run_config=cfg), cfg)
    path = tmp_path / "r" / "checkpoint.pkl"
    magic, meta, payload = path.read_bytes().split(b"\n", 2)
    head = json.loads(meta)
    head["format"] = FORMAT - 1
    path.write_bytes(magic + b"\n" + json.dumps(head).encode() + b"\n" + payload)
    expect = (
        rf"checkpoint {path} has format {FORMAT - 1}, written by an older flwr-sheaf: this version "
        rf"reads checkpoint format {FORMAT} only and cannot resume it. Finish that run with the "
        r"flwr-sheaf version that wrote it, or start afresh"
    )
    with pytest.raises(ConfigError, match=expect):
        load_checkpoint(path)
    resumed = {**cfg, "resume": True, "num-server-rounds": 2}
    with pytest.raises(ConfigError, match=expect):
        run_server(LocalGrid(cnn_app, 4, run_config=resumed), resumed)


@pytest.mark.parametrize("newer", ["format", "header"])
def test_a_checkpoint_of_a_newer_format_is_refused_naming_file_format_and_upgrade(tmp_path, newer):
    """(docs/guarantees.md): a checkpoint a newer flwr-sheaf wrote."""
    from flwr_sheaf.rundir import CHECKPOINT_FORMAT as FORMAT
    from flwr_sheaf.rundir import CHECKPOINT_MAGIC

    cfg = {**RC, "method": "non-cooperative", "num-server-rounds": 1}
    cfg["results-dir"] = str(tmp_path / "r")
    run_server(LocalGrid(cnn_app, 4, run_config=cfg), cfg)
    path = tmp_path / "r" / "checkpoint.pkl"
    magic, meta, payload = path.read_bytes().split(b"\n", 2)
    if newer == "format":
        head = json.loads(meta)
        head["format"] = FORMAT + 1
        path.write_bytes(magic + b"\n" + json.dumps(head).encode() + b"\n" + payload)
        what = f"format {FORMAT + 1}"
    else:
        assert magic + b"\n" == CHECKPOINT_MAGIC
        path.write_bytes(b"flwr-sheaf server checkpoint v2\n" + meta + b"\n" + payload)
        what = "header v2"
    expect = (
        rf"checkpoint {path} has {what}, written by a newer flwr-sheaf: this version reads "
        rf"checkpoint format {FORMAT} only, so it is not resumed. Upgrade flwr-sheaf"
    )
    with pytest.raises(
        ConfigError, match=expect
    ):  # was: "restore the file from a backup" / "bad header"
        load_checkpoint(path)
    resumed = {**cfg, "resume": True, "num-server-rounds": 2}
    with pytest.raises(ConfigError, match=expect):
        run_server(LocalGrid(cnn_app, 4, run_config=resumed), resumed)


class _SimulatedGrid(LocalGrid, InMemoryGrid):
    """LocalGrid standing in for Flower's simulation grid (its nodes' config: partition-ids only)."""


def test_resuming_a_simulation_without_node_state_is_refused_once_before_any_message(tmp_path):
    """In Flower's simulation engine a node keeps its state in memory only: resuming a run that
    set no node-state-dir cannot work. It is refused once, before any message (each node used to
    refuse the query with its own traceback), and the refusal and the preflight name what works."""
    cfg = {**RC, "method": "non-cooperative", "num-server-rounds": 1}
    cfg["results-dir"] = str(tmp_path / "r")
    run_server(_SimulatedGrid(cnn_app, 4, run_config=cfg), cfg)
    longer = {**cfg, "resume": True, "num-server-rounds": 2}
    grid = _SimulatedGrid(cnn_app, 4, run_config=longer)
    with pytest.raises(ConfigError) as err:
        run_server(grid, longer)
    assert grid.delivered == []  # said before any message
    text = str(err.value)
    assert (
        "node-state-dir" in text
        and "overwrite=true" in text
        and "keeps its state in memory" in text
    )
    # the advice works: overwrite=true runs afresh (the earlier files moved aside)
    again = {**cfg, "overwrite": True, "num-server-rounds": 2}
    run_server(_SimulatedGrid(cnn_app, 4, run_config=again), again)
    assert json.loads((tmp_path / "r" / "results.json").read_text())["status"] == "completed"
    # a fresh run into it: the preflight advises overwrite, not the resume that cannot work
    with pytest.raises(ConfigError) as err:
        run_server(_SimulatedGrid(cnn_app, 4, run_config=cfg), cfg)
    assert "overwrite=true" in str(err.value) and "resume=true to continue" not in str(err.value)
    # with node-state-dir the stopped run can be continued, and the preflight says so
    kept = {**cfg, "node-state-dir": str(tmp_path / "state"), "results-dir": str(tmp_path / "k")}
    run_server(_SimulatedGrid(cnn_app, 4, run_config=kept), kept)
    with pytest.raises(ConfigError, match="resume=true to continue that run"):
        run_server(_SimulatedGrid(cnn_app, 4, run_config=kept), kept)
    resumed = {**kept, "resume": True, "num-server-rounds": 2}
    run_server(_SimulatedGrid(cnn_app, 4, run_config=resumed), resumed)
    assert json.loads((tmp_path / "k" / "results.json").read_text())["status"] == "completed"
