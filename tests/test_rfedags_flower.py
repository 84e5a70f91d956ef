"""RFedAGS through Flower's Message API (in-process LocalGrid, no Ray).

The strategy + ClientApp must reproduce the Phase-1 maths on the same inputs: the expected
trajectory is rebuilt here from the primitives (participation masks, per-client local streams,
weights from the paper's formulas, QR retraction in numpy), not from the strategy's own output.
"""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.clientapp import ClientApp
from oracles.rfedags_runner import run_federated

from flwr_sheaf.methods.rfedags.baselines_strategy import RFedBaseline
from flwr_sheaf.methods.rfedags.client import (
    STATE_KEY,
    ProblemClient,
    problem_factory,
    register_rfedags_handlers,
)
from flwr_sheaf.methods.rfedags.local import local_gradient_stream
from flwr_sheaf.methods.rfedags.pca import (
    batch_indices,
    planted_pca_problem,
    synthetic_pca_problem,
)
from flwr_sheaf.methods.rfedags.strategy import RFedAGS, RiemannianArgs, setup_riemannian
from flwr_sheaf.participation import bernoulli_participation, parse_participation
from flwr_sheaf.testing import LocalGrid

logging.getLogger("flwr").setLevel(logging.WARNING)
logging.getLogger("flwr_sheaf").setLevel(logging.WARNING)


def qr_retr_oracle(x, u):
    q, r = np.linalg.qr(x + u)
    s = np.sign(np.diag(r))
    s[s == 0] = 1.0
    return q * s


def run_flower(prob, p, mode, rounds, x0, drop=None, **kw):
    app = register_rfedags_handlers(ClientApp(), problem_factory(prob))
    grid = LocalGrid(app, prob.num_clients, drop=drop)
    strat = RFedAGS(prob.num_clients, p, mode=mode, **kw)
    traj = {}

    def capture(rnd, arrays):
        traj[rnd] = arrays["x"].numpy().copy()
        return MetricRecord({"gap": prob.gap(traj[rnd])})

    res = strat.start(grid, ArrayRecord({"x": Array(x0)}), num_rounds=rounds, evaluate_fn=capture)
    return res, traj, strat, grid


def manual_rounds(prob, p, mode, rounds, x0, alpha, k_steps, seed, skip=lambda t, i: False):
    """Paper Alg. 1 written out from the primitives; q from past rounds: one pseudo-response (c + 1)/((t - 1) + 1),
    floor 0.01 (t - 1 rounds observed before round t; notes/participation.md, s4.1)."""
    n = prob.num_clients
    x, counts, out = x0.copy(), np.zeros(n), {0: x0.copy()}
    for t in range(1, rounds + 1):
        drawn = bernoulli_participation(p, t, seed)
        resp = [i for i in np.flatnonzero(drawn) if not skip(t, i)]
        q = np.maximum((counts + 1) / t, 0.01)
        direction = np.zeros_like(x)
        for i in resp:
            zeta = local_gradient_stream(
                prob.manifold, x, lambda xk, k, i=i: -2 * prob.covariances[i] @ xk, k_steps, alpha
            ).zeta
            w = {
                "corrected": 1 / (q[i] * n),
                "known-p": 1 / (p[i] * n),
                "uncorrected": 1 / len(resp),
            }[mode]
            direction = direction + w * zeta
        if resp:
            x = qr_retr_oracle(x, direction)
        counts[resp] += 1
        out[t] = x.copy()
    return out


@pytest.mark.parametrize("mode", ["corrected", "known-p", "uncorrected"])
def test_strategy_rounds_equal_phase1_math(mode):
    prob, p = planted_pca_problem(seed=2)
    x0 = prob.manifold.random_point(np.random.default_rng(9))
    res, traj, strat, grid = run_flower(prob, p, mode, 8, x0, local_steps=3, step_size=0.05, seed=4)
    expected = manual_rounds(prob, p, mode, 8, x0, 0.05, 3, seed=4)
    for t in range(9):
        np.testing.assert_allclose(traj[t], expected[t], atol=1e-12, err_msg=f"round {t}")
    np.testing.assert_allclose(res.arrays["x"].numpy(), expected[8], atol=1e-12)
    # the drawn sets are the Bernoulli(p_i) draws of the Phase-1 sampler, by partition-id
    for rec in strat.history:
        t = rec["round"]
        assert rec["drawn"] == list(np.flatnonzero(bernoulli_participation(p, t, 4)))
        assert rec["responders"] == rec["drawn"]
        assert rec["tangent_error_max"] < 1e-12 and rec["feasibility"] < 1e-10
    # per-node state lives in context.state: one training count per drawn round
    drawn_counts = np.zeros(prob.num_clients, int)
    for rec in strat.history:
        drawn_counts[rec["drawn"]] += 1
    for nid, ctx in grid.contexts.items():
        pid = grid.partition_of(nid)
        got = int(ctx.state[STATE_KEY]["rounds-trained"]) if STATE_KEY in ctx.state else 0
        assert got == drawn_counts[pid]


def test_minibatch_run_equals_reference_run():
    prob = synthetic_pca_problem(num_clients=6, d=12, r=3, samples_per_client=20, seed=1)
    p = np.array([0.9, 0.3, 0.6, 0.1, 1.0, 0.5])
    x0 = prob.manifold.random_point(np.random.default_rng(2))
    kw = dict(local_steps=4, step_size=0.03, decay_rounds=10.0, seed=5)
    for mode in ("corrected", "uncorrected"):
        res, _, _, _ = run_flower(prob, p, mode, 25, x0, minibatch_size=8, **kw)
        ref = run_federated(
            prob,
            p,
            mode=mode,
            num_rounds=25,
            local_steps=4,
            step_size=lambda t: 0.03 / (1 + t / 10.0),
            x0=x0,
            seed=5,
            batch_size=8,
        )
        np.testing.assert_allclose(res.arrays["x"].numpy(), ref["x"], atol=1e-12)
    # the batches really are mini-batches without replacement
    b = batch_indices(5, 3, 2, 4, 20, 8)
    assert b.shape == (4, 8) and all(len(set(row)) == 8 for row in b)


class FailingPCAClient(ProblemClient):
    """PCA client whose local phase raises in chosen (round, partition-id) pairs."""

    fail: frozenset = frozenset()

    def gradient_oracle(self, server_round, num_steps, config):
        if (server_round, self.client) in self.fail:
            raise RuntimeError(f"injected failure round {server_round} partition {self.client}")
        return super().gradient_oracle(server_round, num_steps, config)


def test_silent_and_failing_nodes_are_non_responders():
    prob, p = planted_pca_problem(seed=3)
    x0 = prob.manifold.random_point(np.random.default_rng(1))
    silent = {(2, 0), (3, 1), (3, 5)}
    failing = frozenset({(1, 1), (3, 2), (4, 0)})

    def factory(context):
        c = FailingPCAClient(prob, int(context.node_config["partition-id"]))
        c.fail = failing
        return c

    app = register_rfedags_handlers(ClientApp(), factory)
    grid = LocalGrid(app, prob.num_clients)

    def drop(msg: Message) -> bool:
        if not msg.metadata.message_type.startswith("train"):
            return False
        t = int(msg.content["config"]["server-round"])
        return (t, grid.partition_of(msg.metadata.dst_node_id)) in silent

    grid.drop = drop
    strat = RFedAGS(prob.num_clients, p, mode="corrected", local_steps=2, step_size=0.05, seed=1)
    res = strat.start(grid, ArrayRecord({"x": Array(x0)}), num_rounds=4)
    lost = silent | failing
    expected = manual_rounds(
        prob, p, "corrected", 4, x0, 0.05, 2, seed=1, skip=lambda t, i: (t, i) in lost
    )
    np.testing.assert_allclose(res.arrays["x"].numpy(), expected[4], atol=1e-12)
    drawn = {(r["round"], i) for r in strat.history for i in r["drawn"]}
    assert lost & drawn and silent & drawn and failing & drawn  # the scenario exercises both kinds
    recorded = {(f["round"], f["partition-id"]): f["reason"] for f in strat.ledger.failures}
    assert set(recorded) == lost & drawn
    for key in failing & drawn:
        assert "injected failure" in recorded[key]
    for key in silent & drawn:
        assert recorded[key] == "no reply within the timeout"
    # the estimator counted only streams that arrived
    arrived = np.zeros(prob.num_clients)
    for r in strat.history:
        arrived[r["responders"]] += 1
    np.testing.assert_array_equal(strat.server.estimator.counts, arrived)


@pytest.mark.parametrize(
    "mode,bad",
    [
        ("uncorrected", 0),
        ("uncorrected", -2.0),
        ("corrected", float("nan")),
        ("known-p", float("inf")),
        ("corrected", "nan-stream"),
        ("uncorrected", "misshaped-stream"),
    ],
)
def test_an_unusable_reply_is_that_nodes_failure_and_the_others_are_aggregated(mode, bad):
    prob, p = planted_pca_problem(seed=3)
    x0 = prob.manifold.random_point(np.random.default_rng(1))
    app = register_rfedags_handlers(ClientApp(), problem_factory(prob))
    grid = LocalGrid(app, prob.num_clients)
    real, corrupted = grid.app, set()

    def corrupting(msg, ctx):
        reply = real(msg, ctx)
        if not msg.metadata.message_type.startswith("train."):
            return reply
        t, pid = int(msg.content["config"]["server-round"]), int(ctx.node_config["partition-id"])
        if pid in (0, 3):  # two nodes send an unusable reply in every round they are drawn
            if bad == "nan-stream":
                z = reply.content["stream"]["zeta"].numpy().copy()
                z[0, 0] = np.nan
                reply.content["stream"] = ArrayRecord({"zeta": Array(z)})
            elif bad == "misshaped-stream":
                reply.content["stream"] = ArrayRecord({"zeta": Array(np.zeros((prob.d + 1, 2)))})
            else:
                m = dict(reply.content["metrics"])
                m["num-examples"] = bad
                reply.content["metrics"] = MetricRecord(m)
            corrupted.add((t, pid))
        return reply

    grid.app = corrupting
    strat = RFedAGS(prob.num_clients, p, mode=mode, local_steps=2, step_size=0.05, seed=1)
    res = strat.start(grid, ArrayRecord({"x": Array(x0)}), num_rounds=4)
    expected = manual_rounds(
        prob, p, mode, 4, x0, 0.05, 2, seed=1, skip=lambda t, i: (t, i) in corrupted
    )
    np.testing.assert_allclose(res.arrays["x"].numpy(), expected[4], atol=1e-12)
    assert (
        corrupted and {(f["round"], f["partition-id"]) for f in strat.ledger.failures} == corrupted
    )
    reason = {
        "nan-stream": "NaN/inf stream",
        "misshaped-stream": f"stream of shape ({prob.d + 1}, 2), expected",
    }.get(bad, f"num-examples = {bad!r} must be a finite number > 0")
    assert all(reason in f["reason"] for f in strat.ledger.failures)
    assert all(not set(r["responders"]) & {0, 3} for r in strat.history)


def test_empty_rounds_keep_the_parameter():
    prob, p = planted_pca_problem(seed=0)
    p = np.zeros(prob.num_clients)
    p[0] = 0.3
    x0 = prob.manifold.random_point(np.random.default_rng(0))
    res, traj, strat, _ = run_flower(
        prob, p, "known-p", 6, x0, local_steps=2, step_size=0.05, seed=0
    )
    for rec in strat.history:
        t = rec["round"]
        if rec["num_responders"] == 0:
            np.testing.assert_array_equal(traj[t], traj[t - 1])
        else:
            assert rec["responders"] == [0]
    assert any(r["num_responders"] == 0 for r in strat.history)


def test_bad_inputs():
    prob, p = planted_pca_problem(seed=0)
    with pytest.raises(ValueError, match=r"participation\[1\] = 1.5"):
        RFedAGS(3, [0.5, 1.5, 0.2])
    with pytest.raises(ValueError, match="mode"):
        RFedAGS(3, [0.5, 0.5, 0.2], mode="fedavg")
    with pytest.raises(ValueError, match="expected num_nodes=3"):
        RFedAGS(3, [0.5, 0.5])
    with pytest.raises(TypeError, match="'local_step'"):  # a misspelled setting, named
        RFedAGS(3, [0.5, 0.5, 0.2], local_step=2)
    with pytest.raises(TypeError, match="'step_sise'"):
        RFedBaseline(3, [0.5, 0.5, 0.2], method="rfedavg", step_sise=0.1)
    # an off-manifold point: the strategy refuses to start
    app = register_rfedags_handlers(ClientApp(), problem_factory(prob))
    grid = LocalGrid(app, prob.num_clients)
    strat = RFedAGS(prob.num_clients, p)
    with pytest.raises(ValueError, match="off Stiefel"):
        strat.start(grid, ArrayRecord({"x": Array(np.ones((prob.d, 2)))}), num_rounds=1)


def test_the_settings_typeddict_names_every_setting_setup_riemannian_takes():
    # RFedAGS's and RFedBaseline's **settings are typed by RiemannianArgs; the defaults are in
    # setup_riemannian's signature: both must name the same settings
    params = inspect.signature(setup_riemannian).parameters.values()
    with_default = {p.name for p in params if p.default is not inspect.Parameter.empty}
    assert set(RiemannianArgs.__annotations__) == with_default


def test_participation_spec_forms():
    np.testing.assert_array_equal(parse_participation("0.9,0.2,1", 3), [0.9, 0.2, 1.0])
    np.testing.assert_array_equal(parse_participation(0.5, 2), [0.5, 0.5])
    u = parse_participation("uniform:3", 40)
    assert u.shape == (40,) and (u >= 0).all() and (u < 1).all()
    np.testing.assert_array_equal(u, parse_participation("uniform:3", 40))
    with pytest.raises(ValueError, match="has 2 values, expected 3"):
        parse_participation("0.1,0.2", 3)
    with pytest.raises(ValueError, match=r"participation\[0\] = 2.0"):
        parse_participation("2", 3)
    with pytest.raises(ValueError, match="neither a number"):
        parse_participation("often", 3)
