"""The glue's promises, end to end through the in-process grid (no Ray).

- every method trains the same nodes in every round under the same participation spec, and those
  sets equal an independent numpy draw of the documented rule;
- a node that never answers an evaluation phase is recorded as failed within the timeout, the round
  completes and the other nodes' metrics stand;
- ``results.json`` records every key's effective value; every method runs on the default
  scenario's kind of zoo (different stalk dimensions) with its own defaults;
- the same seed gives the same numbers in two fresh processes.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from flwr_sheaf import FederationConfig, LocalGrid, LocalTrainConfig, RFedAGS, SheafConfig, SheafFRL
from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.methods import zoo_methods
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.config import KEYS, RunConfig
from flwr_sheaf.testing import set_task_identity

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "zoo": "tiny-4",
    "graph": "ring",
    "num-pilots": 32,
    "local-epochs": 1,
    "max-steps-per-epoch": 2,
    "batch-size": 16,
}


def _trained_per_round(grid: LocalGrid, rounds: int) -> list[list[int]]:
    out = {r: set() for r in range(1, rounds + 1)}
    for m in grid.delivered:
        if m.metadata.message_type.startswith("train."):
            out[int(m.metadata.group_id)].add(grid.partition_of(m.metadata.dst_node_id))
    return [sorted(out[r]) for r in range(1, rounds + 1)]


@pytest.mark.parametrize("spec", [{"participation": "0.5"}, {"fraction-train": 0.5}])
def test_every_method_trains_the_same_nodes_in_every_round(spec, tmp_path):
    rounds, seed, n = 4, 7, 4
    rc = {**TINY, **spec, "seed": seed, "num-server-rounds": rounds, "evaluate-every": 0}
    sets = {}
    for method in zoo_methods():
        grid = LocalGrid(cnn_client_app, n, run_config=rc)
        run_server(grid, {**rc, "method": method, "results-dir": str(tmp_path / method)})
        sets[method] = _trained_per_round(grid, rounds)
    # independent oracle: the documented rule, written with numpy directly
    u = [np.random.default_rng([seed, 0, r]).random(n) for r in range(1, rounds + 1)]
    if "participation" in spec:
        expected = [sorted(np.flatnonzero(x < 0.5).tolist()) for x in u]
    else:
        expected = [sorted(np.argsort(x)[:2].tolist()) for x in u]
    assert all(s == expected for s in sets.values()), sets
    assert len({tuple(map(tuple, s)) for s in sets.values()}) == 1
    assert any(len(e) not in (0, n) for e in expected)  # the draw is really partial
    if (
        "participation" in spec
    ):  # RFedAGS (a server-held manifold parameter) draws with the same sampler
        rfedags = RFedAGS(n, spec["participation"], seed=seed)
        assert [rfedags.sampler.sample(r) for r in range(1, rounds + 1)] == expected


def _silent(grid_ref: dict, phase: str, pid: int):
    def drop(msg: Message) -> bool:
        return (
            msg.metadata.message_type == phase
            and grid_ref["grid"].partition_of(msg.metadata.dst_node_id) == pid
        )

    return drop


@pytest.mark.parametrize("phase", ["evaluate.sheaf", "evaluate.sheaf_comm"])
def test_a_node_silent_in_an_evaluation_phase_is_recorded_and_the_round_completes(phase):
    ref = {}
    grid = LocalGrid(
        cnn_client_app, 4, run_config={**TINY, "seed": 3}, drop=_silent(ref, phase, 2), wait_cap=5.0
    )
    ref["grid"] = grid
    s = SheafFRL(
        4,
        federation=FederationConfig(graph="ring", seed=3),
        train=LocalTrainConfig(local_epochs=1),
        sheaf=SheafConfig(lam=0.5),
    )
    s.start(grid=grid, num_rounds=1, timeout=0.5)
    assert grid.waits == [0.5]  # one round trip waited, for exactly the configured timeout
    (rec,) = s.history
    failed_phase = "evaluate" if phase == "evaluate.sheaf" else "evaluate_comm"
    assert rec["failed"][failed_phase] == [2] and rec["failed"]["train"] == []
    assert [(f["phase"], f["partition-id"], f["reason"]) for f in s.ledger.failures] == [
        (failed_phase, 2, "no reply within the timeout")
    ]
    assert rec["wall_seconds"] >= 0.5
    edges = {(e["src"], e["dst"]) for e in s.ledger.edge_results}
    if failed_phase == "evaluate":  # node 2 has no latents: its edges are not measured at all
        assert sorted(s.ledger.node_results) == [0, 1, 3] and edges == {
            (0, 1),
            (1, 0),
            (0, 3),
            (3, 0),
        }
    else:  # node 2 evaluated privately, but measured no incoming edge
        assert sorted(s.ledger.node_results) == [0, 1, 2, 3] and edges == {
            (1, 0),
            (3, 0),
            (0, 1),
            (2, 1),
            (2, 3),
            (0, 3),
        }
    assert all(math.isfinite(n["private_accuracy"]) for n in s.ledger.node_results.values())
    assert all(math.isfinite(e["communication_accuracy"]) for e in s.ledger.edge_results)
    assert math.isfinite(rec["communication_accuracy_degree_weighted"])


def test_local_grid_refuses_to_wait_forever_like_flowers_grid_would():
    set_task_identity()
    grid = LocalGrid(cnn_client_app, 2, drop=lambda m: True)
    msg = Message(
        RecordDict({"config": ConfigRecord({})}),
        dst_node_id=grid.node_ids[0],
        message_type="query.sheaf",
    )
    with pytest.raises(RuntimeError, match="wait forever"):
        grid.send_and_receive([msg], timeout=None)


def test_results_record_every_effective_value_and_auto_dimension(tmp_path):
    rc = {
        **TINY,
        "method": "fedproto",
        "num-server-rounds": 1,
        "results-dir": str(tmp_path),
        "lambda": 0.25,
    }
    grid = LocalGrid(cnn_client_app, 4, run_config=rc)
    res = json.loads(run_server(grid, rc).read_text())
    assert res["config"] == RunConfig.from_run_config(rc).to_dict() and set(res["config"]) == set(
        KEYS
    )
    assert res["config"]["lambda"] == 0.25
    # FedProto's own optimizer settings (config.METHOD_TRAIN_DEFAULTS, notes/baselines.md s0)
    assert (res["config"]["lr"], res["config"]["momentum"], res["config"]["weight-decay"]) == (
        0.01,
        0.5,
        0.0,
    )
    dims = {n["d"] for n in res["nodes"].values()}
    assert len(dims) > 1 and res["prototypes"]["feature_dim"] == min(dims)
    assert res["participation"] == {"mode": "fraction", "seed": 0, "fraction": 1.0}


def test_start_refuses_a_second_channel_for_values_the_strategy_owns():
    s = SheafFRL(4)
    with pytest.raises(ValueError, match=r"\['lambda'\] are run-config keys"):
        s.start(
            grid=LocalGrid(cnn_client_app, 4),
            num_rounds=1,
            train_config=ConfigRecord({"lambda": 0.2}),
        )
    s = SheafFRL(4, federation=FederationConfig(graph="ring"))
    with pytest.raises(ValueError, match=r"\['whitening-fit'\] are set by the strategy"):
        s.start(
            grid=LocalGrid(cnn_client_app, 4, run_config=TINY),
            num_rounds=1,
            evaluate_config=ConfigRecord({"whitening-fit": "train"}),
        )


def test_extra_evaluate_config_reaches_both_evaluation_phases():
    grid = LocalGrid(cnn_client_app, 4, run_config=TINY)
    s = SheafFRL(
        4, federation=FederationConfig(graph="ring"), train=LocalTrainConfig(local_epochs=1)
    )
    s.start(grid=grid, num_rounds=1, evaluate_config=ConfigRecord({"my-tag": "x"}))
    ev = [m for m in grid.delivered if m.metadata.message_type.startswith("evaluate.")]
    assert {m.metadata.message_type for m in ev} == {"evaluate.sheaf", "evaluate.sheaf_comm"}
    assert all(m.content["config"]["my-tag"] == "x" for m in ev)


def test_spare_supernodes_stay_idle():
    grid = LocalGrid(cnn_client_app, 6, run_config=TINY)  # tiny-4 scenario, 6 SuperNodes
    s = SheafFRL(
        4, federation=FederationConfig(graph="ring"), train=LocalTrainConfig(local_epochs=1)
    )
    s.start(grid=grid, num_rounds=1)
    assert sorted(s.nodes) == [0, 1, 2, 3] and s.ledger.failures == []
    spare = {grid.node_ids[4], grid.node_ids[5]}
    assert {m.metadata.message_type for m in grid.delivered if m.metadata.dst_node_id in spare} == {
        "query.sheaf"
    }


def test_a_malformed_reply_is_that_nodes_failure_not_a_server_crash():
    grid = LocalGrid(cnn_client_app, 4, run_config=TINY)
    real = grid.app

    def app(msg, ctx):  # node 1 answers evaluation phase 1 without its metrics record
        reply = real(msg, ctx)
        if msg.metadata.message_type == "evaluate.sheaf" and ctx.node_config["partition-id"] == 1:
            del reply.content["metrics"]
        return reply

    grid.app = app
    s = SheafFRL(
        4, federation=FederationConfig(graph="ring"), train=LocalTrainConfig(local_epochs=1)
    )
    s.start(grid=grid, num_rounds=1)
    assert [(f["phase"], f["partition-id"]) for f in s.ledger.failures] == [("evaluate", 1)]
    assert "lacks record 'metrics'" in s.ledger.failures[0]["reason"] and sorted(
        s.ledger.node_results
    ) == [
        0,
        2,
        3,
    ]


_DETERMINISM = """
import json, sys
sys.path.insert(0, {root!r})
from simulations.inprocess import run_inprocess
res = run_inprocess({rc!r})
print(json.dumps([{{k: r.get(k) for k in ("ce", "gluing_loss", "private_accuracy_mean",
                                          "communication_accuracy_degree_weighted")}} for r in res["rounds"]]))
"""


def test_the_same_seed_gives_the_same_numbers_in_fresh_processes(tmp_path):
    outs = []
    for i in range(2):
        rc = {
            **TINY,
            "zoo": "tiny-3",
            "seed": 11,
            "num-server-rounds": 2,
            "results-dir": str(tmp_path / str(i)),
        }
        proc = subprocess.run(
            [sys.executable, "-c", _DETERMINISM.format(root=str(ROOT), rc=rc)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    assert outs[0][-1]["gluing_loss"] > 0  # round 2 glued, so the check covers the pilot path too


@pytest.mark.slow
@pytest.mark.parametrize("method", zoo_methods())
def test_every_method_trains_on_the_default_scenario_with_its_own_defaults(method, tmp_path):
    # the default zoo (paper-15) has stalk dimensions 64..256: FedProto/FedSAF must pick D themselves
    rc = {
        "method": method,
        "num-server-rounds": 1,
        "local-epochs": 1,
        "max-steps-per-epoch": 1,
        "evaluate-every": 0,
        "results-dir": str(tmp_path),
    }
    grid = LocalGrid(cnn_client_app, 15, run_config=rc)
    res = json.loads(run_server(grid, rc).read_text())
    assert res["failures"] == [] and res["rounds"][0]["num_trained"] == 15
    if "prototypes" in res:
        assert (
            res["prototypes"]["feature_dim"] == 64 and res["prototypes"]["fedproto-dim"] == "auto"
        )
