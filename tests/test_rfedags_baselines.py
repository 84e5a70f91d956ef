"""RFedAGS's baselines (RFedAvg, RFedSVRG, RFedProj): maths against numpy/scipy references, Flower runs
against the maths loop (issue 12).

References are written out here from the papers' / authors' formulas with numpy and scipy
(``scipy.linalg.logm/expm/sqrtm/polar``), not taken from the code under test.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.clientapp import ClientApp
from oracles.rfedags_runner import run_federated
from scipy import linalg as sla

from flwr_sheaf.methods.rfedags.aggregation import aggregate_streams, participation_weights
from flwr_sheaf.methods.rfedags.baselines import (
    average_ambient,
    average_endpoints,
    projection_local_steps,
    svrg_local_steps,
)
from flwr_sheaf.methods.rfedags.baselines_strategy import RFedBaseline
from flwr_sheaf.methods.rfedags.client import problem_factory, register_rfedags_baseline_handlers
from flwr_sheaf.methods.rfedags.frechet import commuting_spd_problem, symmetric_poincare_problem
from flwr_sheaf.methods.rfedags.local import local_gradient_stream
from flwr_sheaf.methods.rfedags.manifolds import SPD, PoincareBall, Sphere, Stiefel
from flwr_sheaf.methods.rfedags.pca import (
    planted_pca_problem,
    synthetic_pca_problem,
)
from flwr_sheaf.participation import bernoulli_participation
from flwr_sheaf.testing import LocalGrid

logging.getLogger("flwr").setLevel(logging.WARNING)
logging.getLogger("flwr_sheaf").setLevel(logging.WARNING)


def unit(v):
    return v / np.linalg.norm(v)


# ------------------------------------------------------------------------------ server aggregations


def test_rfedavg_average_on_sphere_and_spd_equals_numpy_reference():
    rng = np.random.default_rng(0)
    sph = Sphere(4)
    x = unit(rng.standard_normal(4))
    ends = np.stack([unit(x + 0.3 * rng.standard_normal(4)) for _ in range(5)])
    mask = np.array([1, 0, 1, 1, 0], bool)
    for w in (
        participation_weights(mask, "uncorrected"),
        participation_weights(mask, "known-p", p=np.full(5, 0.6)),
    ):
        # normalisation retraction: R^{-1}_x(y) = y/<x, y> - x, R_x(u) = (x + u)/||x + u||
        ref = unit(x + sum(w[i] * (ends[i] / (x @ ends[i]) - x) for i in np.flatnonzero(mask)))
        np.testing.assert_allclose(average_endpoints(sph, x, ends, w)[0], ref, atol=1e-14)
    spd = SPD(3)
    x = spd.random_point(rng)
    ends = np.stack([spd.random_point(rng) for _ in range(4)])
    w = participation_weights(np.array([1, 1, 0, 1], bool), "uncorrected")
    s = sla.sqrtm(x).real
    si = np.linalg.inv(s)
    tangent = sum(w[i] * s @ sla.logm(si @ ends[i] @ si).real @ s for i in (0, 1, 3))  # Log_x
    ref = s @ sla.expm(si @ tangent @ si) @ s  # Exp_x
    np.testing.assert_allclose(average_endpoints(spd, x, ends, w)[0], ref, atol=1e-10)
    np.testing.assert_array_equal(
        average_endpoints(spd, x, np.full((4, 3, 3), np.nan), np.zeros(4))[0], x
    )


def test_rfedavg_with_one_local_step_equals_rfedags():
    """K = 1: the end point is R_x(-alpha g_i), so R^{-1} gives back the stream (any exact invretr)."""
    prob, p = planted_pca_problem(seed=1)
    x0 = prob.manifold.random_point(np.random.default_rng(2))
    kw = dict(num_rounds=6, local_steps=1, step_size=0.05, x0=x0, seed=3, mode="known-p")
    a = run_federated(prob, p, method="rfedags", **kw)
    b = run_federated(prob, p, method="rfedavg", **kw)
    np.testing.assert_allclose(b["x"], a["x"], atol=1e-12)


def test_rfedproj_ambient_average_equals_numpy_reference_and_refuses_noncompact():
    rng = np.random.default_rng(3)
    st = Stiefel(6, 2)
    x_mid = rng.standard_normal((6, 2))  # ambient, off the manifold
    z = rng.standard_normal((3, 6, 2))
    w = participation_weights(np.array([1, 0, 1], bool), "uncorrected")
    base = sla.polar(x_mid)[0]  # the polar factor U V^T
    ref_mid = base + 0.7 * (0.5 * (z[0] - base) + 0.5 * (z[2] - base))
    got_mid, got_x = average_ambient(st, x_mid, z, w, global_step=0.7)
    np.testing.assert_allclose(got_mid, ref_mid, atol=1e-13)
    np.testing.assert_allclose(got_x, sla.polar(ref_mid)[0], atol=1e-12)
    assert st.feasibility(got_x) < 1e-12
    for man, name in ((SPD(2), "SPD"), (PoincareBall(2), "PoincareBall")):
        with pytest.raises(ValueError, match=f"RFedProj needs a compact embedded.*{name}"):
            average_ambient(man, np.eye(2) if name == "SPD" else np.zeros(2), {}, np.zeros(1))
    prob, p = commuting_spd_problem(seed=0)
    with pytest.raises(ValueError, match="RFedProj.*SPD"):
        run_federated(prob, p, method="rfedproj", num_rounds=1, local_steps=1, step_size=0.1)


# ------------------------------------------------------------------------------ client phases


def test_svrg_local_steps_equal_numpy_loop_on_the_sphere():
    rng = np.random.default_rng(4)
    d, k_steps, alpha = 5, 4, 0.1
    a = [(lambda g: g @ g.T / d)(rng.standard_normal((d, d))) for _ in range(3)]
    x0 = unit(rng.standard_normal(d))
    proj = lambda x, v: v - (x @ v) * x  # noqa: E731
    rgrad = lambda i, x: proj(x, -2 * a[i] @ x)  # noqa: E731
    g = np.mean([rgrad(i, x0) for i in range(3)], axis=0)
    x = x0.copy()
    for _ in range(k_steps):  # eta = grad f_0(x) - P_x(grad f_0(x0) - g), normalisation retraction
        eta = rgrad(0, x) - proj(x, rgrad(0, x0) - g)
        x = unit(x - alpha * eta)
    got = svrg_local_steps(Sphere(d), x0, g, lambda y, k: -2 * a[0] @ y, k_steps, alpha)
    np.testing.assert_allclose(got, x, atol=1e-14)
    np.testing.assert_allclose(
        aggregate_streams(np.stack([rgrad(i, x0) for i in range(3)]), np.full(3, 1 / 3), (d,)),
        g,
        atol=1e-15,
    )


def test_svrg_full_participation_k1_is_centralised_rgd():
    """With g_t the exact mean gradient and K = 1 every client's step is R_x(-alpha grad F)."""
    prob, _ = planted_pca_problem(seed=5)
    x0 = prob.manifold.random_point(np.random.default_rng(6))
    h = run_federated(
        prob,
        np.ones(prob.num_clients),
        method="rfedsvrg",
        mode="uncorrected",
        num_rounds=1,
        local_steps=1,
        step_size=0.05,
        x0=x0,
    )
    a = prob.covariances.mean(axis=0)
    gf = -2 * a @ x0
    q, r = np.linalg.qr(x0 - 0.05 * (gf - x0 @ (0.5 * (x0.T @ gf + gf.T @ x0))))
    np.testing.assert_allclose(h["x"], q * np.sign(np.diag(r)), atol=1e-12)


def test_rfedproj_run_equals_numpy_loop_with_corrections():
    prob, p = planted_pca_problem(seed=7)
    k_steps, alpha, rounds = 3, 0.04, 5
    x0 = prob.manifold.random_point(np.random.default_rng(8))
    polar = lambda z: sla.polar(z)[0]  # noqa: E731
    proj = lambda x, v: v - x @ (0.5 * (x.T @ v + v.T @ x))  # noqa: E731
    x_mid, x_mid_prev, zeta, prev = x0.copy(), x0.copy(), {}, set()
    for t in range(1, rounds + 1):  # RFedProj_.m, eta_g = 1, written out
        resp = list(np.flatnonzero(bernoulli_participation(p, t, 0)))
        zs = []
        for i in resp:
            c = (polar(x_mid_prev) - x_mid) / (k_steps * alpha) - zeta[i] if i in prev else 0.0
            z_hat = z = polar(x_mid)
            acc = 0.0
            for _ in range(k_steps):
                eta = proj(z, -2 * prob.covariances[i] @ z)
                z_hat = z_hat - alpha * (eta + c)
                z = polar(z_hat)
                acc = acc + eta
            zeta[i] = acc / k_steps
            zs.append(z_hat)
        x_mid_prev = x_mid
        if resp:
            x_mid = np.mean(zs, axis=0)
        prev = set(resp)
    h = run_federated(
        prob,
        p,
        method="rfedproj",
        mode="uncorrected",
        num_rounds=rounds,
        local_steps=k_steps,
        step_size=alpha,
        x0=x0,
        seed=0,
    )
    np.testing.assert_allclose(h["x"], polar(x_mid), atol=1e-11)
    assert h["max_feasibility"] < 1e-12
    z_hat, zeta0 = projection_local_steps(
        prob.manifold, x0, 0.0, lambda y, k: prob.local_egrads(y, [0])[0], 1, alpha
    )
    np.testing.assert_allclose(zeta0, proj(x0, -2 * prob.covariances[0] @ x0), atol=1e-14)


@pytest.mark.parametrize("method", ["rfedavg", "rfedsvrg"])
def test_baselines_stay_feasible_on_spd_and_poincare(method):
    for make in (commuting_spd_problem, symmetric_poincare_problem):
        prob, p = make(seed=1)
        h = run_federated(
            prob,
            p,
            method=method,
            mode="uncorrected",
            num_rounds=15,
            local_steps=3,
            step_size=0.2,
            seed=1,
            record_every=15,
        )
        assert h["max_feasibility"] < 1e-12
        assert h["gap"][-1] < 0.5 * h["gap"][0]


# ------------------------------------------------------------------------------ Flower


def run_flower(prob, p, method, rounds, x0, manifold=None, drop=None, **kw):
    app = register_rfedags_baseline_handlers(ClientApp(), problem_factory(prob))
    grid = LocalGrid(app, prob.num_clients, drop=drop)
    strat = RFedBaseline(prob.num_clients, p, method=method, manifold=manifold, **kw)
    res = strat.start(
        grid,
        ArrayRecord({"x": Array(x0)}),
        num_rounds=rounds,
        evaluate_fn=lambda r, a: MetricRecord({"gap": prob.gap(a["x"].numpy())}),
    )
    return res, strat


@pytest.mark.parametrize("method", ["rfedavg", "rfedsvrg", "rfedproj"])
def test_flower_rounds_equal_the_maths_loop(method):
    prob = synthetic_pca_problem(num_clients=5, d=8, r=2, samples_per_client=10, seed=3)
    p = np.array([0.9, 0.5, 0.7, 1.0, 0.3])
    x0 = prob.manifold.random_point(np.random.default_rng(5))
    res, strat = run_flower(
        prob, p, method, 5, x0, local_steps=2, step_size=0.05, minibatch_size=4, seed=6
    )
    ref = run_federated(
        prob,
        p,
        method=method,
        mode="uncorrected",
        num_rounds=5,
        local_steps=2,
        step_size=0.05,
        x0=x0,
        seed=6,
        batch_size=4,
    )
    np.testing.assert_allclose(res.arrays["x"].numpy(), ref["x"], atol=1e-12)
    for rec in strat.history:  # the shared Bernoulli sampler, by partition-id
        assert rec["responders"] == list(
            np.flatnonzero(bernoulli_participation(p, rec["round"], 6))
        )
        assert rec["feasibility"] < 1e-10


def test_flower_spd_rfedsvrg_and_refused_rfedproj():
    prob, p = commuting_spd_problem(seed=2, num_frequent=2, num_rare=2)
    x0 = np.eye(3)
    res, _ = run_flower(
        prob, p, "rfedsvrg", 3, x0, manifold=prob.manifold, local_steps=2, step_size=0.2, seed=1
    )
    ref = run_federated(
        prob,
        p,
        method="rfedsvrg",
        mode="uncorrected",
        num_rounds=3,
        local_steps=2,
        step_size=0.2,
        x0=x0,
        seed=1,
    )
    np.testing.assert_allclose(res.arrays["x"].numpy(), ref["x"], atol=1e-12)
    with pytest.raises(ValueError, match="RFedProj needs a compact embedded.*SPD"):
        run_flower(prob, p, "rfedproj", 1, x0, manifold=prob.manifold)


def test_flower_a_dropped_node_is_a_recorded_non_responder():
    prob = synthetic_pca_problem(num_clients=4, d=6, r=2, samples_per_client=8, seed=4)
    p = np.ones(4)
    x0 = prob.manifold.random_point(np.random.default_rng(7))
    app = register_rfedags_baseline_handlers(ClientApp(), problem_factory(prob))
    grid = LocalGrid(app, 4)
    # LocalGrid's drop= predicate: train messages to partition 2 are lost (no reply) in every round
    grid.drop = lambda m: (
        m.metadata.message_type.startswith("train")
        and grid.partition_of(m.metadata.dst_node_id) == 2
    )
    strat = RFedBaseline(4, p, method="rfedavg", local_steps=2, step_size=0.05)
    res = strat.start(grid, ArrayRecord({"x": Array(x0)}), num_rounds=2, timeout=5)
    for rec in strat.history:
        assert rec["responders"] == [0, 1, 3] and rec["failed"]["train"] == [2]
    # the survivors' plain mean: x_{t+1} = R_x(mean_{0,1,3} R^{-1}_x(x_i))
    x = x0
    for _ in range(2):
        ends = [
            local_gradient_stream(
                prob.manifold, x, lambda y, k, i=i: prob.local_egrads(y, [i])[0], 2, 0.05
            ).endpoint
            for i in (0, 1, 3)
        ]
        x = prob.manifold.retr(x, np.mean([prob.manifold.invretr(x, e) for e in ends], axis=0))
    np.testing.assert_allclose(res.arrays["x"].numpy(), x, atol=1e-12)


@pytest.mark.parametrize("make", [commuting_spd_problem, symmetric_poincare_problem])
def test_rfedags_strategy_runs_unchanged_on_spd_and_poincare(make):
    """The RFedAGS strategy and ClientApp handlers, given the manifold, equal the maths loop."""
    from flwr_sheaf.methods.rfedags.client import register_rfedags_handlers
    from flwr_sheaf.methods.rfedags.strategy import RFedAGS

    prob, p = (
        make(seed=3, num_pairs=2)
        if make is symmetric_poincare_problem
        else make(seed=3, num_frequent=2, num_rare=2)
    )
    man = prob.manifold
    x0 = np.eye(3) if isinstance(man, SPD) else np.array([0.1, -0.2])
    app = register_rfedags_handlers(ClientApp(), problem_factory(prob))
    strat = RFedAGS(
        prob.num_clients, p, mode="corrected", manifold=man, local_steps=2, step_size=0.2, seed=2
    )
    res = strat.start(LocalGrid(app, prob.num_clients), ArrayRecord({"x": Array(x0)}), num_rounds=4)
    ref = run_federated(
        prob,
        p,
        method="rfedags",
        mode="corrected",
        num_rounds=4,
        local_steps=2,
        step_size=0.2,
        x0=x0,
        seed=2,
    )
    np.testing.assert_allclose(res.arrays["x"].numpy(), ref["x"], atol=1e-12)
    assert all(
        rec["feasibility"] == 0.0 and rec["tangent_error_max"] < 1e-12 for rec in strat.history
    )
