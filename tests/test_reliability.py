"""Reliability (issue 11): one node's unusable reply is that node's recorded failure, never a server crash
or a silent wrong number; the other nodes are aggregated normally (docs/guarantees.md).

Replies are corrupted by wrapping the in-process grid's ClientApp (the real handlers run, then one
node's reply is altered), so every check goes through the real strategies and round loop.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.config import ConfigError
from flwr_sheaf.methods._shared.protocol import UPLOAD
from flwr_sheaf.protocol import ARRAYS, METRICS, NUM_EXAMPLES
from flwr_sheaf.testing import LocalGrid

torch.set_num_threads(1)
TINY = {
    "zoo": "tiny-4",
    "graph": "ring",
    "num-pilots": 32,
    "local-epochs": 1,
    "max-steps-per-epoch": 1,
    "batch-size": 16,
}


def _corrupting_grid(n: int, rc: dict, corrupt) -> tuple[LocalGrid, list]:
    """LocalGrid whose replies pass through ``corrupt(msg, pid, reply) -> reply``; also returns the replies seen."""
    grid = LocalGrid(cnn_client_app, n, run_config=rc)
    real, seen = grid.app, []

    def app(msg, ctx):
        reply = real(msg, ctx)
        pid = int(ctx.node_config["partition-id"])
        reply = corrupt(msg, pid, reply)
        seen.append((msg.metadata.message_type, int(msg.metadata.group_id or 0), pid, reply))
        return reply

    grid.app = app
    return grid, seen


def _set_metric(reply, key, value):
    m = dict(reply.content[METRICS])
    m[key] = value
    reply.content[METRICS] = MetricRecord(m)
    return reply


@pytest.mark.parametrize(
    "method,value",
    [
        ("sheaf-frl", 0),
        ("non-cooperative", -5),
        ("fedproto", float("nan")),
        ("fedmuscle", float("inf")),
        ("comfed", 0.0),
    ],
)
def test_a_train_reply_with_an_unusable_weight_is_that_nodes_failure(method, value, tmp_path):
    def corrupt(msg, pid, reply):
        if msg.metadata.message_type.startswith("train.") and pid == 1:
            return _set_metric(reply, NUM_EXAMPLES, value)
        return reply

    rc = {
        **TINY,
        "method": method,
        "num-server-rounds": 2,
        "evaluate-every": 0,
        "results-dir": str(tmp_path),
    }
    grid, _ = _corrupting_grid(4, rc, corrupt)
    res = json.loads(run_server(grid, rc).read_text())
    assert [(f["round"], f["phase"], f["partition-id"]) for f in res["failures"]] == [
        (1, "train", 1),
        (2, "train", 1),
    ]
    assert all(
        f"num-examples = {value!r} must be a finite number > 0" in f["reason"]
        for f in res["failures"]
    )
    assert [r["num_trained"] for r in res["rounds"]] == [3, 3]
    assert all(r["failed"]["train"] == [1] for r in res["rounds"])


def test_a_train_reply_with_an_infinite_metric_is_that_nodes_failure_and_the_mean_stays_finite(
    tmp_path,
):
    def corrupt(msg, pid, reply):
        if msg.metadata.message_type == "train.sheaf" and pid == 2:
            return _set_metric(reply, "ce", float("inf"))
        return reply

    rc = {
        **TINY,
        "method": "sheaf-frl",
        "num-server-rounds": 1,
        "evaluate-every": 0,
        "results-dir": str(tmp_path),
    }
    grid, seen = _corrupting_grid(4, rc, corrupt)
    res = json.loads(run_server(grid, rc).read_text())
    assert [(f["phase"], f["partition-id"], f["reason"]) for f in res["failures"]] == [
        ("train", 2, "metric ce = inf is infinite")
    ]
    others = [
        float(r.content[METRICS]["ce"])
        for mt, _, pid, r in seen
        if mt == "train.sheaf" and pid != 2
    ]
    assert res["rounds"][0]["num_trained"] == 3 and math.isclose(
        res["rounds"][0]["ce"], np.mean(others), rel_tol=1e-12
    )


def _global_prototypes(seen, rnd, skip):
    """Count-weighted mean per class of the uploads of round ``rnd`` except ``skip`` (numpy reference)."""
    num, den = {}, {}
    for mt, r, pid, reply in seen:
        if mt != "train.fedproto" or r != rnd or pid == skip:
            continue
        up = reply.content[UPLOAD]
        for c, p, n in zip(up["classes"].numpy(), up["prototypes"].numpy(), up["counts"].numpy()):
            num[int(c)] = num.get(int(c), 0) + float(n) * p.astype(np.float64)
            den[int(c)] = den.get(int(c), 0) + float(n)
    return {c: num[c] / den[c] for c in num}


@pytest.mark.parametrize("bad_counts", ["zero", "float"])
def test_fedproto_counts_zero_or_non_integer_are_that_nodes_failure(bad_counts, tmp_path):
    def corrupt(msg, pid, reply):
        if msg.metadata.message_type == "train.fedproto" and pid == 2:
            up = reply.content[UPLOAD]
            counts = up["counts"].numpy()
            new = np.zeros_like(counts) if bad_counts == "zero" else counts.astype(np.float64) + 0.5
            reply.content[UPLOAD] = ArrayRecord(
                {"classes": up["classes"], "prototypes": up["prototypes"], "counts": Array(new)}
            )
        return reply

    from flwr_sheaf import FederationConfig, FedProto, LocalTrainConfig

    grid, seen = _corrupting_grid(4, TINY, corrupt)
    s = FedProto(
        4,
        federation=FederationConfig(graph="ring", evaluate_every=0),
        train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=1, batch_size=16),
    )
    s.start(grid=grid, num_rounds=1)
    assert [(f["phase"], f["partition-id"]) for f in s.ledger.failures] == [("prototypes", 2)]
    assert "counts must be" in s.ledger.failures[0]["reason"]
    expected = _global_prototypes(seen, 1, skip=2)
    assert sorted(s.prototypes.global_protos) == sorted(expected)
    for c, p in expected.items():
        np.testing.assert_allclose(s.prototypes.global_protos[c].numpy(), p, rtol=1e-5, atol=1e-6)


def test_comfed_non_integer_counts_are_that_nodes_failure_not_a_crash(tmp_path):
    def corrupt(msg, pid, reply):
        if msg.metadata.message_type == "train.comfed" and pid == 0:
            up = reply.content[UPLOAD]
            reply.content[UPLOAD] = ArrayRecord(
                {
                    "classes": up["classes"],
                    "prototypes": up["prototypes"],
                    "counts": Array(np.full(up["counts"].numpy().shape, np.nan)),
                }
            )
        return reply

    rc = {
        **TINY,
        "method": "comfed",
        "num-server-rounds": 1,
        "evaluate-every": 0,
        "results-dir": str(tmp_path),
    }
    grid, _ = _corrupting_grid(4, rc, corrupt)
    res = json.loads(run_server(grid, rc).read_text())
    assert [(f["phase"], f["partition-id"]) for f in res["failures"]] == [("train", 0)]
    assert (
        "counts must be integers" in res["failures"][0]["reason"]
        and res["rounds"][0]["num_trained"] == 3
    )


def test_unusable_evaluation_replies_are_those_nodes_failures_and_their_edges_are_not_measured(
    tmp_path,
):
    """Phase 1: node 0 reports another d, node 1 NaN test latents, node 2 an accuracy of 1.5;
    phase 2: node 3 names a source it was not routed, node 4 sends per-edge lists of different lengths."""

    def corrupt(msg, pid, reply):
        mt = msg.metadata.message_type
        if mt == "evaluate.sheaf" and pid == 0:
            return _set_metric(reply, "d", int(reply.content[METRICS]["d"]) + 1)
        if mt == "evaluate.sheaf" and pid == 1:
            arrs = {k: reply.content[ARRAYS][k].numpy() for k in reply.content[ARRAYS].keys()}
            arrs["test-latents"] = np.full_like(arrs["test-latents"], np.nan)
            reply.content[ARRAYS] = ArrayRecord({k: Array(v) for k, v in arrs.items()})
        if mt == "evaluate.sheaf" and pid == 2:
            return _set_metric(reply, "private-accuracy", 1.5)
        if mt == "evaluate.sheaf_comm" and pid == 3:
            return _set_metric(reply, "src", [0 for _ in reply.content[METRICS]["src"]])
        if mt == "evaluate.sheaf_comm" and pid == 4:
            return _set_metric(
                reply,
                "communication-accuracy",
                list(reply.content[METRICS]["communication-accuracy"])[:-1],
            )
        return reply

    rc = {
        **TINY,
        "zoo": "tiny-6",
        "graph": "complete",
        "method": "sheaf-frl",
        "num-server-rounds": 1,
        "results-dir": str(tmp_path),
    }
    grid, _ = _corrupting_grid(6, rc, corrupt)
    res = json.loads(run_server(grid, rc).read_text())
    got = {(f["phase"], f["partition-id"]): f["reason"] for f in res["failures"]}
    assert sorted(got) == [
        ("evaluate", 0),
        ("evaluate", 1),
        ("evaluate", 2),
        ("evaluate_comm", 3),
        ("evaluate_comm", 4),
    ]
    assert "but the node reported d=" in got[("evaluate", 0)]
    assert "NaN/inf test latents" in got[("evaluate", 1)]
    assert "private-accuracy = 1.5 is not in [0, 1]" in got[("evaluate", 2)]
    assert "but neighbours [4, 5] were routed to it" in got[("evaluate_comm", 3)]
    assert "per-edge lists of different lengths" in got[("evaluate_comm", 4)]
    assert sorted(res["nodes"], key=int) == ["3", "4", "5"]
    assert sorted((e["src"], e["dst"]) for e in res["edges"]) == [(3, 5), (4, 5)]
    assert all(0 <= e["communication_accuracy"] <= 1 for e in res["edges"])
    acc = np.mean([e["communication_accuracy"] for e in res["edges"]])
    assert math.isclose(
        res["rounds"][0]["communication_accuracy_degree_weighted"], acc, rel_tol=1e-12
    )


def test_a_comfed_reply_without_its_routed_arrays_is_that_nodes_failure(tmp_path):
    def corrupt(msg, pid, reply):
        if msg.metadata.message_type == "evaluate.comfed" and pid == 3:
            arrs = {
                k: reply.content[ARRAYS][k]
                for k in reply.content[ARRAYS].keys()
                if k != "comfed-proj"
            }
            reply.content[ARRAYS] = ArrayRecord(arrs)
        return reply

    rc = {**TINY, "method": "comfed", "num-server-rounds": 1, "results-dir": str(tmp_path)}
    grid, _ = _corrupting_grid(4, rc, corrupt)
    res = json.loads(run_server(grid, rc).read_text())
    assert [(f["phase"], f["partition-id"]) for f in res["failures"]] == [("evaluate", 3)]
    assert "lacks ['comfed-proj']" in res["failures"][0]["reason"]
    assert sorted(res["nodes"], key=int) == ["0", "1", "2"]


# ------------------------------------------------------------------------------ fraction-evaluate


def _numpy_fraction_draw(seed: int, stream: int, rnd: int, n: int, fraction: float) -> list[int]:
    """The documented rule written with numpy: the max(1, floor(f N)) smallest uniforms of default_rng([seed, stream, r])."""
    u = np.random.default_rng([seed, stream, rnd]).random(n)
    return sorted(np.argsort(u, kind="stable")[: max(1, int(np.floor(fraction * n)))].tolist())


def test_evaluator_sampler_equals_an_independent_numpy_draw_on_its_own_stream():
    from flwr_sheaf.participation import EVALUATE_STREAM, ParticipationSampler

    n, seed = 1000, 9
    ev = ParticipationSampler(n, 0.02, seed=seed, stream=EVALUATE_STREAM, key="fraction-evaluate")
    tr = ParticipationSampler(n, 0.02, seed=seed)
    for rnd in (1, 2, 50):
        assert (
            ev.sample(rnd) == _numpy_fraction_draw(seed, 1, rnd, n, 0.02)
            and len(ev.sample(rnd)) == 20
        )
        assert ev.sample(rnd) != tr.sample(rnd)  # distinct streams: evaluators are not the trainers
    with pytest.raises(ValueError, match=r"fraction-evaluate=0.0: must be in \(0, 1\]"):
        ParticipationSampler(n, 0.0, stream=EVALUATE_STREAM, key="fraction-evaluate")
    with pytest.raises(ValueError, match="stream 0 only"):
        ParticipationSampler(3, probabilities=[0.5, 0.5, 0.5], stream=EVALUATE_STREAM)


def test_fraction_evaluate_visits_only_the_sampled_nodes_and_measures_only_their_edges(tmp_path):
    n, seed, rounds = 6, 5, 2
    rc = {
        **TINY,
        "zoo": f"tiny-{n}",
        "graph": "complete",
        "method": "sheaf-frl",
        "num-server-rounds": rounds,
        "fraction-evaluate": 0.5,
        "seed": seed,
        "results-dir": str(tmp_path),
    }
    grid, _ = _corrupting_grid(n, rc, lambda msg, pid, reply: reply)
    res = json.loads(run_server(grid, rc).read_text())
    expected = [_numpy_fraction_draw(seed, 1, r, n, 0.5) for r in range(1, rounds + 1)]
    assert [r["evaluated"] for r in res["rounds"]] == expected and expected[0] != expected[1]
    for r, ev in zip(range(1, rounds + 1), expected):  # no evaluation message reached another node
        got = {
            grid.partition_of(m.metadata.dst_node_id)
            for m in grid.delivered
            if m.metadata.message_type.startswith("evaluate.") and int(m.metadata.group_id) == r
        }
        assert got == set(ev)
    assert res["failures"] == [] and [r["num_trained"] for r in res["rounds"]] == [n, n]
    assert sorted(map(int, res["nodes"])) == expected[-1]
    # complete graph: every ordered pair of evaluated nodes, and no edge with an unsampled end
    assert sorted((e["src"], e["dst"]) for e in res["edges"]) == [
        (a, b) for a in expected[-1] for b in expected[-1] if a != b
    ]
    acc = np.mean([e["communication_accuracy"] for e in res["edges"]])
    assert math.isclose(
        res["rounds"][-1]["communication_accuracy_degree_weighted"], acc, rel_tol=1e-12
    )
    assert res["evaluation"]["fraction-evaluate"] == 0.5


# ------------------------------------------------------------------------------ load with faults


def _model_hash(ctx, key: str = "sheaf.model") -> str:
    import hashlib

    h = hashlib.sha256()
    if key in ctx.state:
        rec = ctx.state[key]
        for name in sorted(rec.keys()):
            h.update(name.encode())
            h.update(np.ascontiguousarray(rec[name].numpy()).tobytes())
    return h.hexdigest()


@pytest.mark.slow
def test_fifty_rounds_with_twenty_percent_injected_faults_complete_with_exact_failure_counts(
    tmp_path,
):
    """Each node fails each train / evaluate / evaluate_comm message independently with probability 0.2
    (half raise inside the handler after it ran, half never reply), decided by a seeded RNG."""
    n, rounds, p_fail = 3, 50, 0.2
    phase_of = {
        "train.sheaf": "train",
        "evaluate.sheaf": "evaluate",
        "evaluate.sheaf_comm": "evaluate_comm",
    }
    code = {"train": 0, "evaluate": 1, "evaluate_comm": 2}

    def fate(rnd: int, pid: int, phase: str) -> str:
        u = np.random.default_rng([2024, rnd, pid, code[phase]]).random(2)
        return "ok" if u[0] >= p_fail else ("raise" if u[1] < 0.5 else "silent")

    rc = {
        **TINY,
        "zoo": f"tiny-{n}",
        "method": "sheaf-frl",
        "num-server-rounds": rounds,
        "seed": 1,
        "results-dir": str(tmp_path),
        "round-timeout": 5.0,
    }
    grid = LocalGrid(cnn_client_app, n, run_config=rc)
    real, injected, before = grid.app, [], {}

    def observe(msg) -> tuple[int, int, str] | None:
        mt = msg.metadata.message_type
        if mt not in phase_of:
            return None
        rnd, pid = int(msg.metadata.group_id), grid.partition_of(msg.metadata.dst_node_id)
        if rnd not in before:  # committed model state of every node at the start of the round
            before[rnd] = {
                grid.partition_of(nid): _model_hash(c) for nid, c in grid.contexts.items()
            }
        return rnd, pid, phase_of[mt]

    def drop(msg):
        key = observe(msg)
        if key is not None and fate(*key) == "silent":
            injected.append((key[0], key[2], key[1], "silent"))
            return True
        return False

    def app(msg, ctx):
        reply = real(msg, ctx)  # the handler runs (and mutates this copy of the state) ...
        key = observe(msg)
        if key is not None and fate(*key) == "raise":
            injected.append((key[0], key[2], key[1], "raise"))
            raise RuntimeError(f"injected fault {key}")  # ... then fails: nothing may be committed
        return reply

    grid.app, grid.drop = app, drop
    res = json.loads(run_server(grid, rc).read_text())
    after = {
        **{r: before[r + 1] for r in range(1, rounds)},
        rounds: {grid.partition_of(nid): _model_hash(c) for nid, c in grid.contexts.items()},
    }

    assert len(res["rounds"]) == rounds
    got = sorted((f["round"], f["phase"], f["partition-id"]) for f in res["failures"])
    assert got == sorted(
        (r, ph, pid) for r, ph, pid, _ in injected
    )  # exactly the injected faults, nothing else
    kinds = {k for *_, k in injected}
    assert kinds == {"raise", "silent"} and 0.1 < len(injected) / (rounds * n * 3) < 0.3
    for f in res["failures"]:
        kind = next(
            k
            for r, ph, pid, k in injected
            if (r, ph, pid) == (f["round"], f["phase"], f["partition-id"])
        )
        assert ("injected fault" in f["reason"]) == (kind == "raise")
        assert (f["reason"] == "no reply within the timeout") == (kind == "silent")
    for rec in res["rounds"]:
        r = rec["round"]
        failed_train = {pid for rr, ph, pid, _ in injected if rr == r and ph == "train"}
        assert rec["failed"]["train"] == sorted(failed_train) and rec["num_trained"] == n - len(
            failed_train
        )
        if rec["num_trained"]:
            assert math.isfinite(rec["ce"])
        evaluated = n - len(rec["failed"].get("evaluate", []))
        assert math.isfinite(rec["private_accuracy_mean"]) == (evaluated > 0)
        for pid in range(
            n
        ):  # a failed train leaves the model exactly as it was; a successful one changes it
            assert (after[r][pid] == before[r][pid]) == (pid in failed_train), (r, pid)


# ------------------------------------------------------------------------------ bad data


def _write_idx_dataset(root, labels: np.ndarray) -> str:
    """A tiny idx dataset (train part only) with the given labels and random images; returns its spec."""
    import struct

    root.mkdir(parents=True, exist_ok=True)
    images = np.random.default_rng(0).integers(0, 256, size=(labels.size, 28, 28), dtype=np.uint8)
    for name, arr in (
        ("train-images-idx3-ubyte", images),
        ("train-labels-idx1-ubyte", labels.astype(np.uint8)),
    ):
        header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(">" + "i" * arr.ndim, *arr.shape)
        (root / name).write_bytes(header + arr.tobytes())
    return f"idx:{root}"


def test_an_agent_whose_only_class_is_absent_from_the_data_is_a_clear_error(tmp_path):
    from flwr_sheaf.data.partition import load_agent_data

    labels = np.repeat(np.arange(9), 40)  # classes 0..8 only: no 9
    spec = _write_idx_dataset(tmp_path / "no-nine", labels)
    with pytest.raises(
        ValueError,
        match=r"partition-id 1: target class\(es\) \[9\] of its class set \[9\] have no "
        r"sample in its data \(samples of those classes in dataset .*: \{9: 0\}\)",
    ):
        load_agent_data(spec, [(0, 1), (9,)], 0.7, 0, 1)
    assert (
        load_agent_data(spec, [(0, 1), (9,)], 0.7, 0, 0).y_train.numel() > 0
    )  # the other agent is fine


def test_a_node_without_training_data_is_refused_at_discovery_naming_its_partition_id(tmp_path):
    from flwr_sheaf.data.partition import load_agent_data
    from flwr_sheaf.models.zoo import zoo_specs

    sets = [
        s.classes for s in zoo_specs("tiny-1000")
    ]  # the case: 1000 agents on the 5000 bundled digits
    with pytest.raises(
        ValueError,
        match=r"partition-id 999 \(classes \[.*\]\) gets \d+ training, 0 validation and "
        r"0 test samples of dataset 'mnist-bundled' \(5000 samples for N=1000 agents\)",
    ):
        load_agent_data("mnist-bundled", sets, 0.7, 0, 999)
    # through the ServerApp: a dataset too small for 3 agents is refused before any message (the
    # ServerApp checks every agent's split where the data is on its machine), naming the partition-ids
    spec = _write_idx_dataset(tmp_path / "small", np.repeat(np.arange(10), 4))
    rc = {
        **TINY,
        "zoo": "tiny-3",
        "dataset": spec,
        "num-pilots": 4,
        "num-server-rounds": 1,
        "results-dir": str(tmp_path / "out"),
    }
    grid = LocalGrid(cnn_client_app, 3, run_config=rc)
    with pytest.raises(
        ConfigError,
        match=r"of N=3 agents get an empty training, validation or test split.*"
        r"partition-id \d: \d+ training, \d+ validation, \d+ test",
    ):
        run_server(grid, rc)
    assert grid.delivered == []
    # where the ServerApp's machine lacks the data, the nodes refuse at discovery with the same reason
    from flwr_sheaf.data.partition import agent_data, prepare_split

    with pytest.raises(
        ValueError,
        match=r"partition-id \d \(classes .*\) gets \d+ training, \d+ validation and \d+ test",
    ):
        prep = prepare_split(
            spec, [s.classes for s in zoo_specs("tiny-3")], TINY.get("shift", 0.7), 0, 4
        )
        for pid in range(3):
            agent_data(prep, pid)


BAD_RUN_CONFIG = [  # (override, text the error must contain)
    (
        {"participation": "0"},
        "participation='0': every node has probability 0, so no node would ever train",
    ),
    ({"participation": "uniform:0-0"}, "participation='uniform:0-0': every node has probability 0"),
    ({"reweight-q-min": 0.0}, "reweight-q-min=0.0"),
    ({"fraction-evaluate": 0.0}, "fraction-evaluate=0.0"),
    ({"fraction-evaluate": 1.5}, "fraction-evaluate=1.5"),
    ({"zoo": "tiny-2", "graph": "0-0,0-1"}, "self-loop"),
    ({"zoo": "tiny-3", "graph": "0-1,1-7"}, "node 7"),
    ({"zoo": "tiny-3", "graph": "0-1"}, "graph='0-1'"),
    ({"shift": float("nan")}, "shift=nan"),
    (
        {"zoo": "tiny-3", "graph": "ring", "participation": "0.5,0.5"},
        "participation='0.5,0.5' on zoo='tiny-3': participation spec "
        "'0.5,0.5' has 2 values, expected 3",
    ),
]


@pytest.mark.parametrize(
    "override, text",
    BAD_RUN_CONFIG,
    ids=[f"{next(iter(o))}-{i}" for i, (o, _) in enumerate(BAD_RUN_CONFIG)],
)
def test_more_bad_run_config_is_refused_before_any_message_is_sent(override, text, tmp_path):
    grid = LocalGrid(cnn_client_app, 3)
    with pytest.raises(ValueError) as info:
        run_server(grid, {**override, "results-dir": str(tmp_path)})
    assert text in str(info.value), str(info.value)
    assert grid.delivered == [] and not (tmp_path / "results.json").exists()


def test_a_missing_dataset_path_fails_discovery_with_the_path(tmp_path):
    rc = {
        **TINY,
        "zoo": "tiny-2",
        "dataset": f"idx:{tmp_path / 'nowhere'}",
        "num-server-rounds": 1,
        "results-dir": str(tmp_path / "out"),
    }
    with pytest.raises(
        RuntimeError,
        match=r"discovery failed on node \d+: .*idx dataset directory not found: .*nowhere"
        r".* \(the same on 1 more of the 2 nodes: node \d+\)",  # every failed node, its reason once
    ):
        run_server(LocalGrid(cnn_client_app, 2, run_config=rc), rc)


def test_an_unknown_partition_id_fails_discovery_naming_it(tmp_path):
    rc = {**TINY, "zoo": "tiny-3", "num-server-rounds": 1, "results-dir": str(tmp_path)}
    grid = LocalGrid(cnn_client_app, 3, run_config=rc)
    grid.contexts[grid.node_ids[2]].node_config["partition-id"] = (
        5  # a SuperNode started with a wrong partition-id
    )
    with pytest.raises(
        RuntimeError,
        match=r"discovery failed on node \d+: .*partition-id=5 is outside 0\.\.2 \(num-partitions=3\); "
        r"start the SuperNode with --node-config",
    ):
        run_server(grid, rc)


def test_pilots_in_a_different_order_on_one_node_are_refused_at_discovery(tmp_path):
    import dataclasses

    from flwr.clientapp import ClientApp

    from flwr_sheaf.apps.methods import register_all_handlers
    from flwr_sheaf.apps.scenario import cnn_task_factory

    def factory(context):
        task = cnn_task_factory(context)
        if int(context.node_config["partition-id"]) == 1:  # same pilot samples, reversed order
            return dataclasses.replace(task, x_pilot=task.x_pilot.flip(0))
        return task

    rc = {**TINY, "zoo": "tiny-3", "num-server-rounds": 1, "results-dir": str(tmp_path)}
    grid = LocalGrid(register_all_handlers(ClientApp(), factory), 3, run_config=rc)
    with pytest.raises(
        ValueError,
        match=r"nodes hold different pilots \(partition-ids \[0, 2\] agree; \[\[1\]\] "
        r"differ\): the pilots must be the same samples in the same order",
    ):
        run_server(grid, rc)
    assert not [m for m in grid.delivered if not m.metadata.message_type.startswith("query.")]


def test_an_error_reply_written_by_the_superlink_is_recorded_with_its_reason(tmp_path):
    """Flower's SuperLink answers for a node it considers gone with an error reply whose sender is the
    SuperLink itself; the failure must name that node and the SuperLink's reason, not a timeout."""
    from flwr.app import Error, Message

    superlink_id = 1  # not a node id of the grid

    def corrupt(msg, pid, reply):
        if (
            msg.metadata.message_type.startswith("train.")
            and pid == 2
            and int(msg.metadata.group_id) == 2
        ):
            reply = Message(
                Error(code=3, reason="node unavailable (emulated SuperLink reply)"), reply_to=msg
            )
            reply.metadata.__dict__["_src_node_id"] = superlink_id
        return reply

    rc = {**TINY, "num-server-rounds": 2, "evaluate-every": 0, "results-dir": str(tmp_path)}
    grid, _ = _corrupting_grid(4, rc, corrupt)
    res = json.loads(run_server(grid, rc).read_text())
    assert [(f["round"], f["phase"], f["partition-id"]) for f in res["failures"]] == [
        (2, "train", 2)
    ]
    assert "node unavailable (emulated SuperLink reply)" in res["failures"][0]["reason"]
