"""Sheaf-FMTL: the parameter and map steps, the map budget, what travels in a Flower run, bad uploads.

Oracles: numpy written from the update equations (F1, F2 of notes/baselines-sheaf-fmtl.md s8) on a 3-node toy,
the paper's Tab. 2 parameter counts (written here by hand), and the arrays the nodes really sent
and stored in a LocalGrid run (P_ij theta_i recomputed in numpy from the node's state).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import networkx as nx
import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_sheaf import FederationConfig, LocalGrid, LocalTrainConfig, SheafFMTL
from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.methods import build_strategy
from flwr_sheaf.apps.scenario import cnn_task_factory, scenario_task
from flwr_sheaf.client.common import model_key
from flwr_sheaf.config import ConfigError, RunConfig, ScenarioConfig
from flwr_sheaf.methods._shared.protocol import UPLOAD
from flwr_sheaf.methods.sheaf_fmtl import (
    SHEAF_FMTL_DIMS,
    SHEAF_FMTL_NEIGHBOURS,
    SHEAF_FMTL_NUM_PARAMS,
    SHEAF_FMTL_PROJECTIONS,
    zoo_parameter_counts,
)
from flwr_sheaf.methods.sheaf_fmtl.client import SheafFMTLClient, trainable_vector
from flwr_sheaf.methods.sheaf_fmtl.config import SheafFMTLConfig
from flwr_sheaf.methods.sheaf_fmtl.maths import (
    edge_dim,
    init_map,
    map_bytes_per_node,
    map_step,
    parameter_step,
)
from flwr_sheaf.models.zoo import zoo_specs
from flwr_sheaf.protocol import CONFIG, SEED, NodeInfo, pack_arrays
from flwr_sheaf.topology import build_graph

torch.set_num_threads(1)


def test_parameter_and_map_steps_equal_numpy_on_a_three_node_toy():
    rng = np.random.default_rng(0)
    n = {0: 9, 1: 12, 2: 6}
    edges = [(0, 1), (1, 2), (0, 2)]
    gamma = 0.5
    d = {(a, b): max(1, math.floor(gamma * min(n[a], n[b]))) for a, b in edges}
    d.update({(b, a): v for (a, b), v in list(d.items())})
    assert [edge_dim(n[a], n[b], gamma) for a, b in edges] == [4, 3, 3]
    theta = {i: rng.normal(size=n[i]) for i in n}
    P = {(i, j): rng.normal(size=(d[(i, j)], n[i])) for (i, j) in d}
    lr, lam, eta = 0.05, 0.3, 0.02
    for i in n:
        nbrs = [j for j in n if (i, j) in P]
        y = {j: P[(j, i)] @ theta[j] for j in nbrs}
        # numpy oracle: theta_i - lr lam sum_j P_ij^T (P_ij theta_i - P_ji theta_j)
        expect = theta[i] - lr * lam * sum(
            P[(i, j)].T @ (P[(i, j)] @ theta[i] - y[j]) for j in nbrs
        )
        got = parameter_step(
            torch.from_numpy(theta[i]),
            {j: torch.from_numpy(P[(i, j)]) for j in nbrs},
            {j: torch.from_numpy(y[j]) for j in nbrs},
            lr,
            lam,
        )
        np.testing.assert_allclose(got.numpy(), expect, rtol=1e-12, atol=1e-12)
        for j in nbrs:  # P_ij - eta lam (P_ij theta_i - P_ji theta_j) theta_i^T, element by element
            diff = P[(i, j)] @ theta[i] - y[j]
            ref = np.array(
                [
                    [P[(i, j)][r, c] - eta * lam * diff[r] * theta[i][c] for c in range(n[i])]
                    for r in range(d[(i, j)])
                ]
            )
            got = map_step(
                torch.from_numpy(P[(i, j)]),
                torch.from_numpy(theta[i]),
                torch.from_numpy(y[j]),
                eta,
                lam,
                j,
            )
            np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12, atol=1e-12)
    # the steps descend the edge disagreement 1/2 ||P_01 theta_0 - P_10 theta_1||^2 for a small step
    y = P[(1, 0)] @ theta[1]
    before = np.sum((P[(0, 1)] @ theta[0] - y) ** 2)
    t = parameter_step(
        torch.from_numpy(theta[0]),
        {1: torch.from_numpy(P[(0, 1)])},
        {1: torch.from_numpy(y)},
        1e-3,
        1.0,
    )
    assert np.sum((P[(0, 1)] @ t.numpy() - y) ** 2) < before
    with pytest.raises(ValueError, match="neighbour partition-id 1 has shape"):
        map_step(torch.zeros(3, 4), torch.zeros(4), torch.zeros(2), 0.1, 0.1, 1)
    # per-node bytes: sum over its edges of d_ij * n_i * 2 (float16)
    assert map_bytes_per_node(n, edges, gamma) == {
        i: sum(2 * d[(i, j)] * n[i] for j in n if (i, j) in d) for i in n
    }


def test_map_initialisation_depends_only_on_seed_node_and_neighbour():
    a = init_map(5, 300, seed=3, partition_id=1, neighbour=2)
    assert a.shape == (5, 300) and a.dtype == torch.float32
    assert torch.equal(a, init_map(5, 300, seed=3, partition_id=1, neighbour=2))
    for other in (init_map(5, 300, 4, 1, 2), init_map(5, 300, 3, 2, 1), init_map(5, 300, 3, 1, 0)):
        assert not torch.equal(a, other)
    assert float(a.std()) == pytest.approx(0.01, rel=0.1) and abs(float(a.mean())) < 2e-3


# paper Tab. 2 (Sheaf-FRL App. G): trainable parameters of the 15 agents, written down independently
PAPER_COUNTS = [
    168842,
    380290,
    33386,
    290698,
    279706,
    63034,
    457674,
    189290,
    220986,
    32974,
    139030,
    720890,
    80230,
    113290,
    241370,
]


def test_budget_is_computed_before_any_node_and_refusal_names_the_size():
    counts = zoo_parameter_counts("paper-15")
    assert [counts[i] for i in range(15)] == PAPER_COUNTS and sum(PAPER_COUNTS) == 3411690
    assert ScenarioConfig().zoo == "paper-15"  # the default scenario's zoo
    g = build_graph("class-overlap", 15, class_sets=[s.classes for s in zoo_specs("paper-15")])
    per = np.zeros(15)
    for a, b in g.edges:
        dd = max(1, int(np.floor(1e-3 * min(PAPER_COUNTS[a], PAPER_COUNTS[b]))))
        per[a] += 2 * dd * PAPER_COUNTS[a]
        per[b] += 2 * dd * PAPER_COUNTS[b]
    worst = int(np.argmax(per))
    rc = RunConfig.from_run_config({"method": "sheaf-fmtl", "sheaf-fmtl-gamma": 1e-3})
    with pytest.raises(ConfigError) as exc:
        build_strategy(rc)
    msg = str(exc.value)
    assert f"partition-id {worst} need {per[worst] / 2**30:.3f} GiB" in msg
    assert f"all nodes: {per.sum() / 2**30:.3f} GiB" in msg and "sheaf-fmtl-max-gib=1" in msg
    # the default gamma fits the default budget; a raised budget admits the paper's gamma
    assert isinstance(
        build_strategy(RunConfig.from_run_config({"method": "sheaf-fmtl"})), SheafFMTL
    )
    ok = build_strategy(
        RunConfig.from_run_config(
            {"method": "sheaf-fmtl", "sheaf-fmtl-gamma": 1e-3, "sheaf-fmtl-max-gib": 2.0}
        )
    )
    assert ok.num_params == dict(enumerate(PAPER_COUNTS))


def test_client_hooks_apply_the_map_step_then_the_parameter_step():
    sc = ScenarioConfig(zoo="tiny-3", num_pilots=8, seed=2)
    task = scenario_task(sc, 0)
    theta0 = trainable_vector(task.model).double().numpy()
    n0 = theta0.size
    nbrs, dims = [1, 2], [3, 2]
    rng = np.random.default_rng(1)
    y = {1: rng.normal(size=3).astype(np.float32), 2: rng.normal(size=2).astype(np.float32)}
    lam, eta, lr = 0.2, 0.05, 0.1
    cfg = {
        **SheafFMTLConfig(lam=lam, eta=eta).to_dict(),
        **LocalTrainConfig(lr=lr).to_dict(),
        SEED: 2,
        SHEAF_FMTL_NEIGHBOURS: nbrs,
        SHEAF_FMTL_DIMS: dims,
        SHEAF_FMTL_NUM_PARAMS: n0,
    }
    msg = SimpleNamespace(
        content=RecordDict(
            {CONFIG: ConfigRecord(cfg), SHEAF_FMTL_PROJECTIONS: pack_arrays({"1": y[1], "2": y[2]})}
        )
    )
    ctx = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    client = SheafFMTLClient("sheaf_fmtl")
    plugin = client.plugin(msg, ctx, task)
    # oracle: float16 initial maps, F2 in float64, rounded to float16 at rest; then F1 with the stored maps
    p0 = {j: init_map(d, n0, 2, 0, j).half().double().numpy() for j, d in zip(nbrs, dims)}
    p1 = {
        j: (p0[j] - eta * lam * np.outer(p0[j] @ theta0 - y[j], theta0))
        .astype(np.float16)
        .astype(np.float64)
        for j in nbrs
    }
    for j in nbrs:
        np.testing.assert_allclose(plugin.maps[j].double().numpy(), p1[j], atol=2e-5, rtol=2e-3)
    records, metrics = client.after_train(msg, ctx, task, plugin)
    theta1 = theta0 - lr * lam * sum(p1[j].T @ (p1[j] @ theta0 - y[j]) for j in nbrs)
    np.testing.assert_allclose(trainable_vector(task.model).double().numpy(), theta1, atol=1e-5)
    up = records[UPLOAD]
    assert sorted(up) == ["1", "2"]
    for j, d in zip(nbrs, dims):
        assert up[str(j)].numpy().shape == (d,)
        np.testing.assert_allclose(up[str(j)].numpy(), p1[j] @ theta1, rtol=1e-4, atol=1e-5)
        assert ctx.state["sheaf_fmtl.maps"][str(j)].numpy().dtype == np.float16
    assert metrics["sheaf-fmtl-received"] == 2 and metrics["sheaf-fmtl-map-change"] > 0
    bad = SimpleNamespace(
        content=RecordDict({CONFIG: ConfigRecord({**cfg, SHEAF_FMTL_NUM_PARAMS: n0 + 1})})
    )
    with pytest.raises(
        ValueError, match=f"has {n0} trainable parameters, the server assumed {n0 + 1}"
    ):
        client.plugin(bad, ctx, task)


def test_only_projections_travel_and_they_are_the_senders_p_theta():
    n, rounds = 4, 2
    grid = LocalGrid(cnn_client_app, n, run_config={"zoo": "tiny-4", "num-pilots": 32, "seed": 4})
    counts = zoo_parameter_counts("tiny-4")
    s = SheafFMTL(
        n,
        num_params=counts,
        sheaf_fmtl=SheafFMTLConfig(gamma=2e-3, lam=0.1, eta=0.1),
        federation=FederationConfig(graph="ring", seed=4, evaluate_every=rounds),
        train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=1),
    )
    s.start(grid=grid, num_rounds=rounds)
    assert s.ledger.failures == []
    ring = nx.cycle_graph(n)
    dims = {
        (a, b): edge_dim(counts[a], counts[b], 2e-3) for a in range(n) for b in ring.neighbors(a)
    }
    assert max(dims.values()) >= 5 and min(counts.values()) > 1000
    uploads = {}
    for r in grid.replies:
        if r.metadata.message_type == "train.sheaf_fmtl":
            pid, rnd = grid.partition_of(r.metadata.src_node_id), int(r.metadata.group_id)
            up = r.content[UPLOAD]
            assert sorted(up) == sorted(str(j) for j in ring.neighbors(pid))
            uploads[(rnd, pid)] = {int(j): up[j].numpy() for j in up}
            assert all(v.shape == (dims[(pid, j)],) for j, v in uploads[(rnd, pid)].items())
    assert len(uploads) == n * rounds
    for m in grid.delivered:
        if m.metadata.message_type != "train.sheaf_fmtl":
            continue
        rnd, pid = int(m.metadata.group_id), grid.partition_of(m.metadata.dst_node_id)
        if rnd == 1:
            assert SHEAF_FMTL_PROJECTIONS not in m.content
            continue
        rec = m.content[SHEAF_FMTL_PROJECTIONS]
        assert sorted(int(k) for k in rec) == sorted(ring.neighbors(pid))
        for k in (
            rec
        ):  # exactly what neighbour j sent last round for this edge: P_ji theta_j, length d_ij
            np.testing.assert_array_equal(rec[k].numpy(), uploads[(rnd - 1, int(k))][pid])
    # train traffic carries only short projections; no message at all carries a parameter vector
    smallest = min(counts.values())
    for m in list(grid.delivered) + list(grid.replies):
        for name, rec in m.content.array_records.items():
            sizes = [rec[k].numpy().size for k in rec]
            assert not set(sizes) & set(counts.values()), (m.metadata.message_type, name)
            if m.metadata.message_type.startswith("train."):
                assert max(sizes) <= max(dims.values()) < smallest, (m.metadata.message_type, name)
    # each final upload is P_ij theta_i recomputed from the node's stored float16 maps and model
    for pid in range(n):
        ctx = grid.contexts[grid.node_ids[pid]]
        task = scenario_task(ScenarioConfig(zoo="tiny-4", num_pilots=32, seed=4), pid)
        task.model.load_state_dict(ctx.state[model_key("sheaf_fmtl")].to_torch_state_dict())
        theta = trainable_vector(task.model).double().numpy()
        maps = ctx.state["sheaf_fmtl.maps"]
        for j in ring.neighbors(pid):
            p = maps[str(j)].numpy()
            assert p.dtype == np.float16 and p.shape == (dims[(pid, j)], counts[pid])
            np.testing.assert_allclose(
                uploads[(rounds, pid)][j], p.astype(np.float64) @ theta, rtol=1e-4, atol=1e-5
            )
            # the map moved (map step in round 2) but started from the seeded draw
            init = init_map(dims[(pid, j)], counts[pid], 4, pid, j).half().numpy()
            assert np.abs(p.astype(np.float32) - init.astype(np.float32)).max() > 0
    tr = s.history
    assert tr[0]["sheaf_fmtl_map_change"] == 0.0 and tr[-1]["sheaf_fmtl_map_change"] > 0.0
    assert tr[-1]["projected_floats"] == sum(dims.values())
    assert math.isfinite(tr[-1]["communication_accuracy_degree_weighted"])


def test_bad_uploads_are_that_nodes_failure_and_never_relayed():
    counts = zoo_parameter_counts("tiny-4")
    dims = {
        (a, b): edge_dim(counts[a], counts[b], 2e-3)
        for a in range(4)
        for b in ((a + 1) % 4, (a - 1) % 4)
    }

    def upload(pid):
        good = {
            str(j): np.full(dims[(pid, j)], float(pid), np.float32)
            for j in ((pid + 1) % 4, (pid - 1) % 4)
        }
        if pid == 1:
            good[str(0)][0] = np.nan
        if pid == 2:
            good[str(1)] = np.zeros(dims[(2, 1)] + 1, np.float32)
        if pid == 3:
            good.pop(str(2))  # neighbour 2 missing
        return good

    app = ClientApp()

    @app.query("sheaf_fmtl")
    def _query(msg, context):
        task = cnn_task_factory(context)
        info = NodeInfo(
            int(context.node_config["partition-id"]),
            4,
            int(task.model.d),
            tuple(task.classes),
            int(task.x_pilot.shape[0]),
            len(task.y_train),
        )
        return Message(RecordDict({"info": info.to_record()}), reply_to=msg)

    @app.train("sheaf_fmtl")
    def _train(msg, context):
        return Message(
            RecordDict(
                {
                    UPLOAD: pack_arrays(upload(int(context.node_config["partition-id"]))),
                    "metrics": MetricRecord({"num-examples": 1, "ce": 0.5}),
                }
            ),
            reply_to=msg,
        )

    grid = LocalGrid(app, 4, run_config={"zoo": "tiny-4", "num-pilots": 32, "seed": 4})
    s = SheafFMTL(
        4,
        num_params=counts,
        sheaf_fmtl=SheafFMTLConfig(gamma=2e-3),
        federation=FederationConfig(graph="ring", seed=4),
        train=LocalTrainConfig(local_epochs=1),
    )
    s.discover(grid, timeout=5)
    for rnd in (1, 2):
        s.ledger.begin_round(rnd)
        msgs = list(s.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid))
        if (
            rnd == 2
        ):  # only node 0's projections were accepted: its neighbours 1 and 3 get them, nobody else anything
            got = {grid.partition_of(m.metadata.dst_node_id): m.content for m in msgs}
            assert SHEAF_FMTL_PROJECTIONS not in got[0] and SHEAF_FMTL_PROJECTIONS not in got[2]
            for pid in (1, 3):
                assert list(got[pid][SHEAF_FMTL_PROJECTIONS]) == ["0"]
                np.testing.assert_array_equal(
                    got[pid][SHEAF_FMTL_PROJECTIONS]["0"].numpy(), upload(0)[str(pid)]
                )
            break
        s.aggregate_train(rnd, list(grid.send_and_receive(msgs)))
    reasons = {f["partition-id"]: f["reason"] for f in s.ledger.failures}
    assert set(reasons) == {1, 2, 3}
    assert (
        "NaN" in reasons[1]
        and f"expected ({dims[(2, 1)]},)" in reasons[2]
        and "instead of the neighbours" in reasons[3]
    )
