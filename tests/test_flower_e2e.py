"""Ray-free end-to-end tests of the Sheaf-FRL strategy + ClientApp through an in-process Grid."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest
import torch
from flwr.clientapp import ClientApp
from torch import nn

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.scenario import scenario_task
from flwr_sheaf.config import ConfigError, FederationConfig, LocalTrainConfig, ScenarioConfig
from flwr_sheaf.methods.sheaf_frl.client import register_sheaf_handlers
from flwr_sheaf.methods.sheaf_frl.config import SheafConfig
from flwr_sheaf.methods.sheaf_frl.strategy import SheafFRL
from flwr_sheaf.protocol import pack_arrays
from flwr_sheaf.sheaf.network import orient_edge
from flwr_sheaf.sheaf.whitening import Colouring, Whitening
from flwr_sheaf.testing import LocalGrid

torch.set_num_threads(1)

RC = {"zoo": "tiny-4", "num-pilots": 64, "local-epochs": 1, "lambda": 0.5, "seed": 3}


def _strategy(graph="ring", **kw):
    nx_graph = graph if isinstance(graph, nx.Graph) else None
    fed = FederationConfig(graph=graph if nx_graph is None else "ring", seed=RC["seed"])
    return SheafFRL(
        num_nodes=4,
        federation=fed,
        train=LocalTrainConfig(local_epochs=RC["local-epochs"]),
        sheaf=SheafConfig(lam=RC["lambda"]),
        graph=nx_graph,
        **kw,
    )


def _run(strategy, grid, rounds=2):
    strategy.start(grid=grid, num_rounds=rounds)
    return strategy


def _step(strategy, grid, rnd):
    """Discover (round 1) and open round ``rnd`` by hand, for tests that send messages themselves."""
    if rnd == 1:
        strategy.discover(grid, timeout=5)
    strategy.ledger.begin_round(rnd)


def test_each_node_receives_exactly_its_neighbours_latest_pilots():
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s = _run(_strategy(), grid, rounds=2)
    ring = nx.cycle_graph(4)
    sent_pilots = {}  # (round, pid) -> pilots in the train reply
    for r in grid.replies:
        if r.metadata.message_type == "train.sheaf":
            rnd = int(r.metadata.group_id)
            sent_pilots[(rnd, grid.partition_of(r.metadata.src_node_id))] = r.content["pilots"][
                "pilots"
            ].numpy()
    train_msgs = [m for m in grid.delivered if m.metadata.message_type == "train.sheaf"]
    assert len(train_msgs) == 8
    for m in train_msgs:
        rnd, pid = int(m.metadata.group_id), grid.partition_of(m.metadata.dst_node_id)
        got = {int(k): m.content["pilots"][k].numpy() for k in m.content["pilots"].keys()}
        if rnd == 1:
            assert got == {}  # nobody has reported pilots yet
            continue
        assert set(got) == set(ring.neighbors(pid))
        for j, a in got.items():
            np.testing.assert_array_equal(a, sent_pilots[(rnd - 1, j)])
            assert a.shape == (64, s.nodes[j].d)
        cfg = m.content["config"]
        d = {p: s.nodes[p].d for p in range(4)}
        assert list(cfg["neighbours"]) == sorted(ring.neighbors(pid))
        assert [bool(x) for x in cfg["i-is-head"]] == [
            orient_edge(pid, d[pid], j, d[j])[0] == pid for j in cfg["neighbours"]
        ]


def test_communication_accuracy_is_per_directed_edge_and_averages_are_consistent():
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s = _run(_strategy(graph="0-1,1-2,2-3,1-3"), grid, rounds=1)
    edges = {(e["src"], e["dst"]) for e in s.ledger.edge_results}
    expected = {(a, b) for a, b in [(0, 1), (1, 2), (2, 3), (1, 3)]} | {
        (b, a) for a, b in [(0, 1), (1, 2), (2, 3), (1, 3)]
    }
    assert edges == expected and len(s.ledger.edge_results) == 8
    last = s.history[-1]
    accs = [e["communication_accuracy"] for e in s.ledger.edge_results]
    assert last["communication_accuracy_degree_weighted"] == pytest.approx(np.mean(accs))
    per_recv = {}
    for e in s.ledger.edge_results:
        per_recv.setdefault(e["dst"], []).append(e["communication_accuracy"])
    assert last["communication_accuracy_mean"] == pytest.approx(
        np.mean([np.mean(v) for v in per_recv.values()])
    )
    # degree-weighted mean of receiver means == mean over directed edges (paper Fig. 2)
    deg = {k: len(v) for k, v in per_recv.items()}
    dw = sum(deg[k] * np.mean(v) for k, v in per_recv.items()) / sum(deg.values())
    assert dw == pytest.approx(last["communication_accuracy_degree_weighted"])
    for key in ("private_accuracy_mean", "gluing_loss", "bytes_sent", "wall_seconds"):
        assert key in last and last[key] is not None and not math.isnan(last[key])


class RotatedAgent(nn.Module):
    """Agent B = agent A seen through an orthogonal Q: latent_B = Q latent_A, head_B = head_A o Q^T."""

    def __init__(self, base: nn.Module, q: torch.Tensor):
        super().__init__()
        self.base, self.q, self.d = base, q, base.d
        self.whitening = Whitening(base.d)
        self.colouring = Colouring(self.whitening)

    def latent(self, x):
        return self.base.latent(x) @ self.q.T

    def private_logits(self, x):
        return self.base.head.mlp(self.latent(x) @ self.q)

    def classify_whitened(self, zhat):
        return self.base.head.mlp(self.colouring(zhat) @ self.q)


def test_rotated_twin_communication_accuracy_equals_private_accuracy():
    """Notes s8 item 11: B = A rotated by Q; Procrustes on pilots must make comm acc == private acc."""
    sc = ScenarioConfig(zoo="tiny-2", num_pilots=0, seed=1)
    gen = torch.Generator().manual_seed(0)
    base = scenario_task(sc, 0).model.eval()
    q, _ = torch.linalg.qr(torch.randn(base.d, base.d, generator=gen))

    def factory(context):
        pid = int(context.node_config["partition-id"])
        task = scenario_task(
            sc, 0
        )  # both nodes hold agent 0's data; node 1's model is the rotated twin
        task.model = base if pid == 0 else RotatedAgent(base, q)
        return task

    app = ClientApp()
    register_sheaf_handlers(app, factory)
    grid = LocalGrid(app, 2)
    s = SheafFRL(num_nodes=2, federation=FederationConfig(graph="0-1"))
    _step(s, grid, 1)
    s.evaluate_round(1, None, {}, grid, timeout=60.0)
    priv = s.ledger.node_results[0]["private_accuracy"]
    assert s.ledger.node_results[1]["private_accuracy"] == pytest.approx(priv)
    for e in s.ledger.edge_results:
        assert e["communication_accuracy"] == pytest.approx(priv, abs=1e-9), e


def test_failed_node_keeps_state_cached_pilots_are_relayed_and_run_continues():
    calls = {"n": 0}
    sc = ScenarioConfig.from_mapping(RC)

    def factory(context):
        return scenario_task(sc, int(context.node_config["partition-id"]))

    app = ClientApp()
    register_sheaf_handlers(app, factory)

    @app.train("boom")  # unused action: proves other handlers coexist
    def _boom(msg, ctx):  # pragma: no cover - never routed
        raise AssertionError

    grid = LocalGrid(app, 4, run_config=RC)
    orig = grid.app

    def flaky(msg, ctx):
        if (
            msg.metadata.message_type == "train.sheaf"
            and msg.metadata.group_id == "2"
            and ctx.node_config["partition-id"] == 1
        ):
            calls["n"] += 1
            raise RuntimeError("injected failure")
        return orig(msg, ctx)

    grid.app = flaky
    s = _run(_strategy(), grid, rounds=3)
    assert calls["n"] == 1
    assert any(
        f["round"] == 2 and f["partition-id"] == 1 and "injected" in f["reason"]
        for f in s.ledger.failures
    )
    assert len(s.history) == 3 and s.history[-1]["num_trained"] == 4
    assert s.history[1]["pilot_age_max"] == 1
    # round 3: neighbours of 1 received node 1's round-1 pilots (its last successful ones)
    r1 = (
        [
            r
            for r in grid.replies
            if r.metadata.message_type == "train.sheaf"
            and r.metadata.group_id == "1"
            and grid.partition_of(r.metadata.src_node_id) == 1
        ][0]
        .content["pilots"]["pilots"]
        .numpy()
    )
    m3 = [
        m
        for m in grid.delivered
        if m.metadata.message_type == "train.sheaf"
        and m.metadata.group_id == "3"
        and grid.partition_of(m.metadata.dst_node_id) == 0
    ][0]
    np.testing.assert_array_equal(m3.content["pilots"]["1"].numpy(), r1)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="not connected"):
        _run(_strategy(graph="0-1,2-3"), LocalGrid(cnn_client_app, 4, run_config=RC), rounds=1)
    with pytest.raises(ValueError, match="node 7"):
        _run(
            _strategy(graph="0-1,1-2,2-3,3-7"),
            LocalGrid(cnn_client_app, 4, run_config=RC),
            rounds=1,
        )
    s = _strategy()
    s.discovery_timeout = 0.5
    with pytest.raises(RuntimeError, match="num-supernodes=4"):
        _run(s, LocalGrid(cnn_client_app, 3, run_config={**RC, "zoo": "tiny-4"}), rounds=1)
    with pytest.raises(ConfigError, match="shift=1.5"):
        ScenarioConfig(shift=1.5)
    with pytest.raises(ConfigError, match="absent-policy='sometimes'"):
        SheafConfig(absent_policy="sometimes")


def test_neighbour_pilots_with_wrong_stalk_dimension_or_nan_are_rejected_by_the_node():
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s = _strategy()
    _step(s, grid, 1)
    msgs = list(s.configure_train(1, None, {}, grid))
    m = msgs[0]
    pid = grid.partition_of(m.metadata.dst_node_id)
    j = sorted(nx.cycle_graph(4).neighbors(pid))[0]
    for bad, pattern in [
        (np.zeros((64, s.nodes[j].d + 1), np.float32), "stalk dimension mismatch"),
        (np.full((64, s.nodes[j].d), np.nan, np.float32), "NaN"),
    ]:
        m.content["pilots"] = pack_arrays({str(j): bad})
        before = dict(grid.contexts[m.metadata.dst_node_id].state)
        (reply,) = grid.send_and_receive([m])
        assert (
            reply.has_error()
            and pattern in reply.error.reason
            and f"partition-id {j}" in reply.error.reason
        )
        assert (
            dict(grid.contexts[m.metadata.dst_node_id].state).keys() == before.keys()
        )  # nothing committed


def test_server_rejects_nan_or_misshaped_pilots_and_keeps_cache():
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s = _strategy()
    _step(s, grid, 1)
    replies = list(grid.send_and_receive(list(s.configure_train(1, None, {}, grid))))
    s.aggregate_train(1, replies)
    good = {p: a.copy() for p, a in s.bank.items()}
    _step(s, grid, 2)
    replies = list(grid.send_and_receive(list(s.configure_train(2, None, {}, grid))))
    for r in replies:
        pid = grid.partition_of(r.metadata.src_node_id)
        if pid == 2:
            r.content["pilots"]["pilots"] = __import__("flwr").app.Array(
                np.full((64, s.nodes[2].d), np.nan, np.float32)
            )
        if pid == 3:
            r.content["pilots"]["pilots"] = __import__("flwr").app.Array(
                np.zeros((64, s.nodes[3].d + 2), np.float32)
            )
    s.aggregate_train(2, replies)
    np.testing.assert_array_equal(s.bank[2], good[2])
    np.testing.assert_array_equal(s.bank[3], good[3])
    reasons = {f["partition-id"]: f["reason"] for f in s.ledger.failures if f["round"] == 2}
    assert "NaN" in reasons[2] and "shape" in reasons[3]


def test_discovery_of_registered_nodes_that_answer_too_slowly_names_the_timeout_to_set():
    """Every SuperNode registered, none failed, some never answered within discovery-timeout (the
    Ray engine with thousands of SuperNodes on two cores): the error says how many answered and the
    discovery-timeout to set, not to start more SuperNodes."""
    s = _strategy()
    s.discovery_timeout = 0.5
    grid = LocalGrid(
        cnn_client_app,
        4,
        run_config=RC,
        drop=lambda m: (
            m.metadata.message_type.startswith("query")
            and m.metadata.dst_node_id == grid.node_ids[3]
        ),
    )
    with pytest.raises(RuntimeError) as err:
        _run(s, grid, rounds=1)
    text = str(err.value)
    assert "answered 3 of 4 nodes" in text and "from partition-id 3" in text
    assert "set discovery-timeout to at least" in text and "num-supernodes" not in text
