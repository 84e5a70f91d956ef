"""Comparison methods (FedProto, FedSAF, non-cooperative) through the in-process grid (no Ray).

Oracles are independent of the code under test: prototype aggregation is recomputed in numpy
from the uploads the nodes actually sent; bad uploads are hand-made; the results schema is the
one Sheaf-FRL writes.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.methods import build_strategy, zoo_methods
from flwr_sheaf.apps.scenario import cnn_task_factory, scenario_task
from flwr_sheaf.config import (
    ConfigError,
    FederationConfig,
    LocalTrainConfig,
    RunConfig,
    ScenarioConfig,
)
from flwr_sheaf.methods._shared.protocol import GLOBAL_PROTOTYPES
from flwr_sheaf.methods._shared.prototypes import PoolingAdapter
from flwr_sheaf.methods.fedproto.client import FedProtoLoss
from flwr_sheaf.methods.fedproto.config import FedProtoConfig
from flwr_sheaf.methods.fedproto.strategy import FedProto
from flwr_sheaf.methods.fedsaf.client import FedSAFLoss
from flwr_sheaf.methods.fedsaf.config import FedSAFConfig
from flwr_sheaf.methods.fedsaf.strategy import FedSAF
from flwr_sheaf.methods.noncooperative.strategy import NonCooperative
from flwr_sheaf.protocol import NodeInfo, pack_arrays
from flwr_sheaf.testing import LocalGrid
from simulations.inprocess import run_inprocess

torch.set_num_threads(1)

RC = {"zoo": "tiny-4", "num-pilots": 64, "local-epochs": 1, "seed": 3, "graph": "ring"}
SC = ScenarioConfig.from_mapping(RC)
RING = FederationConfig(graph="ring", seed=3)
ONE_EPOCH = LocalTrainConfig(local_epochs=1)


def _fedproto(dim=12, **kw):
    return FedProto(4, federation=RING, train=ONE_EPOCH, fedproto=FedProtoConfig(dim=dim, **kw))


def _train_round(s, grid, rnd):
    if rnd == 1:
        s.discover(grid, timeout=5)
    s.ledger.begin_round(rnd)
    replies = list(
        grid.send_and_receive(list(s.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid)))
    )
    s.aggregate_train(rnd, replies)
    return replies


def _stub_app(upload_fn):
    """Real discovery (tiny-4 nodes); ``train.fedproto`` replies with ``upload_fn(round, pid)`` arrays."""
    app = ClientApp()

    @app.query("fedproto")
    def _query(msg, context):
        pid = int(context.node_config["partition-id"])
        task = cnn_task_factory(context)
        info = NodeInfo(
            pid,
            4,
            int(task.model.d),
            tuple(task.classes),
            int(task.x_pilot.shape[0]),
            len(task.y_train),
        )
        return Message(RecordDict({"info": info.to_record()}), reply_to=msg)

    @app.train("fedproto")
    def _train(msg, context):
        pid = int(context.node_config["partition-id"])
        arrays = upload_fn(int(msg.content["config"]["server-round"]), pid)
        return Message(
            RecordDict(
                {
                    "upload": pack_arrays(arrays),
                    "metrics": MetricRecord({"num-examples": 1, "ce": 0.5}),
                }
            ),
            reply_to=msg,
        )

    return app


def _upload(classes, protos, counts=None):
    out = {"classes": np.asarray(classes, np.int64), "prototypes": np.asarray(protos, np.float32)}
    if counts is not None:
        out["counts"] = np.asarray(counts, np.int64)
    return out


# ------------------------------------------------------------------------------------ aggregation
def test_server_aggregation_equals_hand_computed_weighted_mean_of_what_nodes_sent():
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s = _fedproto(12)
    sent = _train_round(s, grid, 1)
    assert len(sent) == 4
    num, den = {}, {}
    for r in sent:
        up = r.content["upload"]
        for c, p, n in zip(up["classes"].numpy(), up["prototypes"].numpy(), up["counts"].numpy()):
            assert p.shape == (12,)
            num[int(c)] = num.get(int(c), 0.0) + float(n) * p.astype(np.float64)
            den[int(c)] = den.get(int(c), 0) + int(n)
    # counts are the nodes' training-set class counts
    for r in sent:
        pid = grid.partition_of(r.metadata.src_node_id)
        y = scenario_task(SC, pid).y_train.numpy()
        up = r.content["upload"]
        assert dict(zip(up["classes"].numpy().tolist(), up["counts"].numpy().tolist())) == {
            int(c): int((y == c).sum()) for c in np.unique(y)
        }
    assert (
        s.ledger.current.train["num_global_prototypes"] == len(num)
        and s.ledger.current.train["prototypes_rejected"] == []
    )
    # round 2 messages carry exactly the count-weighted means
    _train_round(s, grid, 2)
    m2 = [
        m
        for m in grid.delivered
        if m.metadata.message_type == "train.fedproto" and m.metadata.group_id == "2"
    ]
    assert len(m2) == 4
    for m in m2:
        g = m.content[GLOBAL_PROTOTYPES]
        assert g["classes"].numpy().tolist() == sorted(num)
        for c, p in zip(g["classes"].numpy(), g["prototypes"].numpy()):
            np.testing.assert_allclose(p, num[int(c)] / den[int(c)], rtol=1e-6, atol=1e-7)


def test_unweighted_aggregation_and_missing_class_policies():
    p = {
        0: [[1, 0], [0, 2]],
        1: [[3, 0], [0, 4]],
    }  # classes (0, 1) of pid 0 / (0, 1) of pid 1 in round 1

    def upload(rnd, pid):
        if rnd == 1:
            return _upload([0, 1], p[pid % 2], [1, 3] if pid % 2 == 0 else [3, 1])
        return _upload([0], [[10.0, 10.0]], [5])  # round 2: class 1 missing everywhere

    for missing in ("carry", "drop"):
        grid = LocalGrid(_stub_app(upload), 4, run_config=RC)
        s = _fedproto(2, aggregation="unweighted", missing=missing)
        _train_round(s, grid, 1)
        np.testing.assert_allclose(
            s.prototypes.global_protos[0].numpy(), [2.0, 0.0]
        )  # plain mean of 1 and 3
        np.testing.assert_allclose(s.prototypes.global_protos[1].numpy(), [0.0, 3.0])
        _train_round(s, grid, 2)
        np.testing.assert_allclose(s.prototypes.global_protos[0].numpy(), [10.0, 10.0])
        if missing == "carry":
            np.testing.assert_allclose(s.prototypes.global_protos[1].numpy(), [0.0, 3.0])
        else:
            assert 1 not in s.prototypes.global_protos
    # weighted: (1*1 + 3*3) / 4 = 2.5 on class 0's first coordinate
    grid = LocalGrid(_stub_app(upload), 4, run_config=RC)
    s = _fedproto(2)
    _train_round(s, grid, 1)
    np.testing.assert_allclose(s.prototypes.global_protos[0].numpy(), [(1 * 1 + 3 * 3) / 4, 0.0])


def test_bad_uploads_are_rejected_with_the_partition_id_and_the_rest_aggregated():
    bad = {
        1: _upload([0, 1], [[np.nan, 0.0], [1.0, 1.0]], [2, 2]),
        2: _upload([0, 12], [[1.0, 1.0], [1.0, 1.0]], [2, 2]),
        3: _upload([0], [[1.0, 1.0, 1.0]], [2]),
    }

    def upload(rnd, pid):
        return bad.get(pid, _upload([0, 3], [[4.0, 4.0], [5.0, 6.0]], [1, 1]))

    grid = LocalGrid(_stub_app(upload), 4, run_config=RC)
    s = _fedproto(2)
    _train_round(s, grid, 1)
    reasons = {
        f["partition-id"]: f["reason"] for f in s.ledger.failures if f["phase"] == "prototypes"
    }
    assert set(reasons) == {1, 2, 3}
    assert "partition-id 1" in reasons[1] and "NaN" in reasons[1]
    assert "partition-id 2" in reasons[2] and "12" in reasons[2]
    assert "partition-id 3" in reasons[3] and "d=[3]" in reasons[3] and "d=2" in reasons[3]
    assert sorted(s.prototypes.global_protos) == [0, 3]
    np.testing.assert_allclose(s.prototypes.global_protos[0].numpy(), [4.0, 4.0])
    assert (
        s.history == []
        and s.ledger.current.train["prototypes_rejected"] == [1, 2, 3]
        and s.ledger.current.num_trained == 4
    )
    assert s.ledger.current.failed["prototypes"] == [1, 2, 3]


def test_dimension_mismatch_without_adapter_names_the_dims():
    dims = sorted({scenario_task(SC, p).model.d for p in range(4)})
    assert len(dims) > 1
    s = _fedproto("none")
    with pytest.raises(ValueError, match="fedproto-dim") as info:
        _train_round(s, LocalGrid(cnn_client_app, 4, run_config=RC), 1)
    for d in dims:
        assert f"d={d}" in str(info.value)


# ------------------------------------------------------------------------------------ objectives
def test_fedproto_objective_sends_gradient_into_the_encoder():
    task = scenario_task(SC, 0)
    model = task.model.train()
    idx = torch.randperm(len(task.y_train), generator=torch.Generator().manual_seed(1))[:32]
    x, y = task.x_train[idx], task.y_train[idx]
    gen = torch.Generator().manual_seed(0)
    protos = {int(c): torch.randn(model.d, generator=gen) for c in torch.unique(y)}
    grads = {}
    for lam in (0.0, 1.0):
        torch.manual_seed(0)  # same dropout masks
        model.zero_grad()
        plugin = FedProtoLoss(PoolingAdapter(model.d, model.d), protos, lam, "mse")
        loss, parts = plugin.loss(model, x, y, gen)
        loss.backward()
        grads[lam] = torch.cat(
            [p.grad.flatten() for p in model.encoder.parameters() if p.grad is not None]
        )
        assert parts["proto-covered"] == 1.0 and float(parts["proto-loss"]) > 0
    assert float((grads[1.0] - grads[0.0]).norm()) > 1e-6


def test_fedsaf_structure_terms_are_skipped_below_three_rows_and_applied_from_three():
    task = scenario_task(SC, 0)
    model = task.model.train()
    idx = torch.randperm(len(task.y_train), generator=torch.Generator().manual_seed(1))[:64]
    x, y = task.x_train[idx], task.y_train[idx]
    present = sorted(int(c) for c in torch.unique(y))
    assert len(present) >= 3
    for structure in ("gcsa", "rcsa"):
        pool = PoolingAdapter(model.d, model.d)
        for k in (2, 3):  # prototype level: k classes of the batch have a global prototype
            protos = {c: torch.rand(model.d) for c in present[:k]}
            loss, parts = FedSAFLoss(pool, protos, 10, 1.0, 1.0, structure).loss(model, x, y, None)
            assert parts["proto-applied"] == float(k >= 3) and parts["inst-applied"] == 1.0
            assert 0.0 <= float(parts["inst-loss"]) <= 1.0
            expect = parts["ce"] + parts["inst-loss"] + (parts["proto-loss"] if k >= 3 else 0.0)
            assert loss.item() == pytest.approx(float(expect), abs=1e-6)
        # instance level: only 2 covered samples -> both terms skipped, loss = CE
        two = torch.nonzero(y == present[0]).flatten()[:2]
        loss, parts = FedSAFLoss(pool, protos, 10, 1.0, 1.0, structure).loss(
            model, x[two], y[two], None
        )
        assert parts["proto-applied"] == 0.0 and parts["inst-applied"] == 0.0
        assert loss.item() == pytest.approx(float(parts["ce"]), abs=1e-6)


# ------------------------------------------------------------------------------------ protocol
def test_noncooperative_trains_without_traffic_and_evaluates_post_hoc():
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s = NonCooperative(4, federation=RING, train=ONE_EPOCH)
    replies = _train_round(s, grid, 1)
    for m in grid.delivered:
        if m.metadata.message_type == "train.noncooperative":
            assert list(m.content.keys()) == ["config"]
    assert all(list(r.content.keys()) == ["metrics"] for r in replies)
    ev = list(s.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid))
    assert all(m.content["config"]["whitening-fit"] == "train" for m in ev)
    s.evaluate_round(1, ArrayRecord(), ConfigRecord(), grid, timeout=60.0)
    assert len(s.ledger.edge_results) == 8 and s.ledger.current.num_trained == 4


def test_method_switch_builds_each_strategy_and_rejects_unknown():
    def build(**kw):
        return build_strategy(RunConfig.from_run_config({**RC, **kw}))

    expected = {
        "sheaf-frl": "SheafFRL",
        "fedproto": "FedProto",
        "fedsaf-gcsa": "FedSAF",
        "fedsaf-rcsa": "FedSAF",
        "non-cooperative": "NonCooperative",
        "fedmuscle": "FedMuscle",
        "comfed": "ComFed",
        "sheaf-fmtl": "SheafFMTL",
    }
    # the built-in zoo methods (a user method registered by another test file may be there too)
    assert set(expected) <= set(zoo_methods())
    assert {m: type(build(method=m)).__name__ for m in expected} == expected
    assert build(method="fedsaf-rcsa").fedsaf.structure == "rcsa"
    assert (
        build(method="fedsaf-gcsa", **{"fedsaf-structure": "cosine"}).fedsaf.structure == "cosine"
    )
    with pytest.raises(ConfigError, match="method='fedavg'"):
        build(method="fedavg")
    with pytest.raises(ConfigError, match="fedproto-aggregation='median'"):
        FedProtoConfig(aggregation="median")
    with pytest.raises(ConfigError, match="fedsaf-structure='l1'"):
        FedSAFConfig(structure="l1")
    with pytest.raises(ValueError, match="fedsaf-structure"):
        FedSAF(2, fedsaf=FedSAFConfig())


ROUND_KEYS = {
    "round",
    "private_accuracy_mean",
    "communication_accuracy_mean",
    "communication_accuracy_degree_weighted",
    "gluing_loss",
    "bytes_sent",
    "bytes_received",
    "wall_seconds",
    "ce",
    "num_trained",
}


@pytest.mark.parametrize("method", zoo_methods())
def test_each_method_runs_end_to_end_and_writes_the_common_schema(method, tmp_path):
    res = run_inprocess(
        {**RC, "method": method, "num-server-rounds": 1, "results-dir": str(tmp_path)}
    )
    assert json.loads((tmp_path / "results.json").read_text()) == res
    assert res["config"]["method"] == method and res["failures"] == []
    (last,) = res["rounds"]
    assert ROUND_KEYS <= set(last)
    assert (
        0.0 <= last["private_accuracy_mean"] <= 1.0
        and 0.0 <= last["communication_accuracy_degree_weighted"] <= 1.0
    )
    assert sorted(res["nodes"]) == ["0", "1", "2", "3"] and len(res["edges"]) == 8
    for n in res["nodes"].values():
        assert {"d", "private_accuracy", "val_private_accuracy"} <= set(n)
    for e in res["edges"]:
        assert {"src", "dst", "communication_accuracy"} <= set(e)
    if method in ("fedproto", "fedsaf-gcsa", "fedsaf-rcsa"):
        assert all(0.0 <= n["prototype_accuracy"] <= 1.0 for n in res["nodes"].values())
        assert not math.isnan(last["prototype_accuracy_mean"])
        # fedproto-dim = auto resolves to the smallest stalk dimension of the zoo, recorded
        smallest = min(scenario_task(SC, p).model.d for p in range(4))
        assert (
            res["config"]["fedproto-dim"] == "auto" and res["prototypes"]["feature_dim"] == smallest
        )
        assert res["prototypes"]["classes"]
    if method != "sheaf-frl":
        assert res["evaluation"]["whitening-fit"] == "train"
