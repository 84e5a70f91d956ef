"""RFedAGS beyond Stiefel: SPD (affine-invariant) and Poincaré-ball Fréchet means (issue 12).

Expected values come from outside the code under test: geoopt's own operators (torch), finite
differences, the closed-form mean of commuting SPD matrices, the symmetry of the planted hyperbolic
configuration, and geoopt's exponential/logarithm maps in a centralised Karcher flow as the reference solver.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from oracles.rfedags_runner import run_federated

from flwr_sheaf.methods.rfedags.aggregation import (
    aggregate_streams,
    effective_weights_uncorrected,
    participation_weights,
)
from flwr_sheaf.methods.rfedags.frechet import (
    FrechetMeanProblem,
    centralised_frechet_mean,
    commuting_spd_problem,
    symmetric_poincare_problem,
)
from flwr_sheaf.methods.rfedags.local import step_size_schedule
from flwr_sheaf.methods.rfedags.manifolds import SPD, PoincareBall, Sphere, Stiefel
from flwr_sheaf.participation import simulate_participation

T = torch.from_numpy


def _geo(man, name, *arrays):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return getattr(man._geo, name)(*map(T, arrays)).numpy()


@pytest.mark.parametrize("man", [SPD(3), PoincareBall(3)], ids=repr)
def test_operators_match_geoopt(man):
    rng = np.random.default_rng(0)
    x, y = man.random_point(rng), man.random_point(rng)
    u = man.proj(x, rng.standard_normal(man.point_shape))
    np.testing.assert_allclose(man.retr(x, u), _geo(man, "expmap", x, u), atol=1e-12)
    np.testing.assert_allclose(man.log(x, y), _geo(man, "logmap", x, y), atol=1e-12)
    np.testing.assert_allclose(man.transp(x, y, u), _geo(man, "transp", x, y, u), atol=1e-12)
    np.testing.assert_allclose(man.dist(x, y), np.squeeze(_geo(man, "dist", x, y)), atol=1e-12)
    np.testing.assert_allclose(
        man.inner(x, u, u), np.squeeze(_geo(man, "inner", x, u, u)), atol=1e-10
    )
    g = rng.standard_normal(man.point_shape)
    np.testing.assert_allclose(man.egrad2rgrad(x, g), _geo(man, "egrad2rgrad", x, g), atol=1e-12)
    # inverses and isometries
    np.testing.assert_allclose(
        man.rgrad2egrad(x, man.egrad2rgrad(x, g)), man.proj(x, g), atol=1e-12
    )
    np.testing.assert_allclose(man.retr(x, man.invretr(x, y)), y, atol=1e-12)
    w = man.transp(x, y, u)
    assert man.inner(y, w, w) == pytest.approx(man.inner(x, u, u), rel=1e-12)
    assert man.dist(x, y) == pytest.approx(
        np.sqrt(man.inner(x, man.log(x, y), man.log(x, y))), rel=1e-12
    )
    # batched: a stack of points against one base point
    ys = np.stack([y, man.random_point(rng)])
    for k in range(2):
        np.testing.assert_allclose(man.log(x, ys)[k], man.log(x, ys[k]), atol=1e-14)
    assert float(np.max(man.feasibility(man.retr(x, 3 * u)))) == 0.0 or isinstance(man, SPD)


def test_feasibility_and_refusals():
    spd, ball = SPD(2), PoincareBall(2)
    assert spd.feasibility(np.eye(2)) == 0.0
    assert spd.feasibility(-np.eye(2)) == np.inf
    with pytest.raises(ValueError, match="off SPD"):
        spd.check_point(np.diag([1.0, -1.0]))
    assert ball.feasibility(np.array([0.6, 0.0])) == 0.0
    assert ball.feasibility(np.array([1.2, 0.0])) > 0.19
    with pytest.raises(ValueError, match="PoincareBall"):
        ball.check_point(np.array([1.0, 0.0]))
    # a huge step stays inside the ball (geoopt's clipping)
    assert ball.feasibility(ball.retr(np.zeros(2), np.array([50.0, 0.0]))) == 0.0
    with pytest.raises(ValueError, match="log and dist"):
        FrechetMeanProblem(Stiefel(3, 2), np.zeros((1, 1, 3, 2)))


def test_invretr_inverts_the_retraction_on_every_manifold():
    rng = np.random.default_rng(1)
    st = Stiefel(7, 3)
    x = st.random_point(rng)
    u = st.proj(x, 0.4 * rng.standard_normal((7, 3)))
    y = st.retr(x, u)
    np.testing.assert_allclose(
        st.invretr(x, y), u, atol=1e-12
    )  # QR inverse retraction (Manopt invretr_qr)
    assert st.tangent_error(x, st.invretr(x, y)) < 1e-12
    for sph in (Sphere(5), Sphere(5, retraction="exp")):
        x = sph.random_point(rng)
        u = sph.proj(x, 0.5 * rng.standard_normal(5))
        np.testing.assert_allclose(sph.invretr(x, sph.retr(x, u)), u, atol=1e-12)
    with pytest.raises(ValueError, match="not reachable"):
        Sphere(3).invretr(np.array([1.0, 0, 0]), np.array([-1.0, 0, 0]))


@pytest.mark.parametrize("make", [commuting_spd_problem, symmetric_poincare_problem])
def test_frechet_gradient_matches_finite_differences(make):
    prob, _ = make(seed=2)
    man = prob.manifold
    rng = np.random.default_rng(3)
    x = man.random_point(rng) if isinstance(man, SPD) else 0.3 * man.random_point(rng)
    e = man.proj(x, rng.standard_normal(man.point_shape))
    h = 1e-5
    for i in (0, prob.num_clients - 1):
        fd = (prob.local_costs(x + h * e)[i] - prob.local_costs(x - h * e)[i]) / (2 * h)
        assert np.sum(prob.local_egrads(x, [i])[0] * e) == pytest.approx(fd, rel=1e-6, abs=1e-9)


def test_planted_optima_are_independent_closed_forms():
    spd, p = commuting_spd_problem(seed=0)
    q, lspec = spd.log_spectra
    x_star = spd.optimum()[0]
    # x* = exp(mean log A) with logm computed from scratch (eigh of each point)
    logs = []
    for a in spd.samples.reshape(-1, 3, 3):
        lam, v = np.linalg.eigh(a)
        logs.append(v @ np.diag(np.log(lam)) @ v.T)
    lam, v = np.linalg.eigh(np.mean(logs, axis=0))
    np.testing.assert_allclose(x_star, v @ np.diag(np.exp(lam)) @ v.T, atol=1e-12)
    assert np.linalg.norm(spd.rgrad(x_star)) < 1e-12  # stationary
    ball, _ = symmetric_poincare_problem(seed=0)
    assert np.linalg.norm(ball.rgrad(np.zeros(2))) < 1e-14  # origin stationary by symmetry
    np.testing.assert_allclose(
        centralised_frechet_mean(ball.manifold, ball.samples, steps=60), 0.0, atol=1e-10
    )


@pytest.fixture(scope="module")
def planted_runs():
    """RFedAGS (frequency-corrected and uncorrected) on both planted problems: 150 rounds, K = 3."""
    out = {}
    for make in (commuting_spd_problem, symmetric_poincare_problem):
        prob, p = make(seed=0)
        for mode in ("corrected", "uncorrected"):
            out[make.__name__, mode] = (
                prob,
                p,
                run_federated(
                    prob,
                    p,
                    method="rfedags",
                    mode=mode,
                    num_rounds=150,
                    local_steps=3,
                    step_size=step_size_schedule(0.3, 3),
                    seed=0,
                    record_every=150,
                ),
            )
    return out


def test_spd_corrected_reaches_exp_mean_log_uncorrected_its_reweighted_mean(planted_runs):
    prob, p, hc = planted_runs["commuting_spd_problem", "corrected"]
    _, _, hu = planted_runs["commuting_spd_problem", "uncorrected"]
    man = prob.manifold
    x_star = prob.optimum()[0]
    x_tilde = prob.weighted_optimum(
        effective_weights_uncorrected(p)
    )  # closed form for commuting matrices
    sep = float(man.dist(x_star, x_tilde))
    assert sep > 0.4
    assert man.dist(hc["x"], x_star) < 0.2 * sep
    assert man.dist(hu["x"], x_tilde) < 0.2 * sep and man.dist(hu["x"], x_star) > 0.8 * sep
    for h in (hc, hu):  # every iterate symmetric positive definite
        assert h["max_feasibility"] < 1e-12


def test_poincare_corrected_reaches_origin_uncorrected_its_reweighted_mean(planted_runs):
    prob, p, hc = planted_runs["symmetric_poincare_problem", "corrected"]
    _, _, hu = planted_runs["symmetric_poincare_problem", "uncorrected"]
    man = prob.manifold
    x_tilde = centralised_frechet_mean(
        man, prob.samples, weights=effective_weights_uncorrected(p), steps=100
    )
    sep = float(man.dist(np.zeros(2), x_tilde))
    assert sep > 0.3
    assert man.dist(hc["x"], np.zeros(2)) < 0.2 * sep
    assert man.dist(hu["x"], x_tilde) < 0.2 * sep
    for h in (hc, hu):  # every iterate inside the ball
        assert h["max_feasibility"] == 0.0


def test_poincare_full_participation_matches_centralised_solver():
    rng = np.random.default_rng(4)
    ball = PoincareBall(3)
    pts = ball.retr(np.zeros(3), 0.6 * rng.standard_normal((4, 3, 3)))  # non-symmetric, 4 clients
    prob = FrechetMeanProblem(ball, pts)
    prob.set_optimum(centralised_frechet_mean(ball, pts, steps=100))
    h = run_federated(
        prob,
        np.ones(4),
        method="rfedags",
        mode="known-p",
        num_rounds=60,
        local_steps=1,
        step_size=0.5,
        seed=0,
        record_every=60,
    )
    assert prob.distance_to_optimum(h["x"]) < 1e-7
    assert h["gap"][-1] < 1e-12 and h["max_feasibility"] == 0.0


def test_r2_corrected_aggregate_unbiased_on_spd():
    """R2 of tests/test_rfedags.py on SPD: E[sum_S zeta_i/(p_i N)] = mean zeta_i; uncorrected -> p~."""
    rng = np.random.default_rng(5)
    n, draws = 8, 8_000
    man = SPD(3)
    x = man.random_point(rng)
    zetas = np.stack([man.proj(x, rng.standard_normal((3, 3))) for _ in range(n)])
    p = rng.uniform(0.1, 0.9, n)
    masks = simulate_participation(p, draws, seed=11)
    w_c = masks / (p * n)  # (draws, n): the known-p weights, vectorised ...
    w_u = masks / np.maximum(masks.sum(axis=1, keepdims=True), 1)
    for t in range(0, draws, 200):  # ... and equal to the server's weights
        np.testing.assert_allclose(
            participation_weights(masks[t], "known-p", p=p), w_c[t], atol=1e-15
        )
        np.testing.assert_allclose(
            participation_weights(masks[t], "uncorrected"), w_u[t], atol=1e-15
        )
    corr = np.einsum("tn,nij->tij", w_c, zetas)
    unc = np.einsum("tn,nij->tij", w_u, zetas)
    np.testing.assert_allclose(corr[7], aggregate_streams(zetas, w_c[7], (3, 3)), atol=1e-14)
    truth_c, truth_u = (
        zetas.mean(axis=0),
        np.tensordot(effective_weights_uncorrected(p), zetas, axes=1),
    )
    for v in [rng.standard_normal((3, 3)) for _ in range(3)] + [truth_c, truth_u]:
        for samples, truth in ((corr, truth_c), (unc, truth_u)):
            s = np.tensordot(samples, v, axes=2)
            assert abs(s.mean() - np.sum(v * truth)) < 3 * s.std(ddof=1) / np.sqrt(draws)
    s = np.tensordot(
        unc, truth_c - truth_u, axes=2
    )  # the uncorrected bias is far outside the MC error
    assert abs(s.mean() - np.sum((truth_c - truth_u) * truth_c)) > 10 * s.std() / np.sqrt(draws)
    assert man.tangent_error(x, corr[:100]).max() < 1e-15  # aggregates stay symmetric (tangent)
    assert np.all(man.feasibility(man.retr(x, corr[:100])) < 1e-12)
