"""RFedAGS maths (no Flower): checks R1, R2, R3, R5 (+ R4 slow) of notes/baselines-rfedags.md, s5.6.

Every expected value is derived independently of the code under test: numpy QR/projection oracles
for the geometry, exact subset enumeration and scipy quadrature for p~, ``numpy.linalg.eigh`` for
optima, Monte-Carlo means with standard errors for unbiasedness.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
from oracles.rfedags_runner import run_federated
from scipy import integrate

from flwr_sheaf.methods.rfedags.aggregation import (
    RFedAGSServer,
    aggregate_streams,
    effective_weights_uncorrected,
    participation_weights,
    server_update,
)
from flwr_sheaf.methods.rfedags.local import local_gradient_stream, step_size_schedule
from flwr_sheaf.methods.rfedags.manifolds import Sphere, Stiefel
from flwr_sheaf.methods.rfedags.pca import (
    PCAProblem,
    planted_pca_problem,
    subspace_distance,
    synthetic_pca_problem,
)
from flwr_sheaf.participation import (
    FrequencyEstimator,
    bernoulli_participation,
    check_probabilities,
    paper_participation,
    simulate_participation,
)

# ------------------------------------------------------------------------------ numpy oracles


def sym(a):
    return 0.5 * (a + np.swapaxes(a, -1, -2))


def proj_oracle(x, u):
    return u - x @ sym(x.T @ u)


def qr_retr_oracle(x, u):
    q, r = np.linalg.qr(x + u)
    s = np.sign(np.diag(r))
    s[s == 0] = 1.0
    return q * s


def rand_stiefel(rng, d, r):
    return qr_retr_oracle(np.zeros((d, r)), rng.standard_normal((d, r)))


def p_tilde_quad(p):
    """p~_i = p_i * int_0^1 prod_{j != i} (1 - p_j + p_j t) dt by adaptive quadrature (notes/participation.md, s2)."""
    p = np.asarray(p, dtype=float)
    out = []
    for i in range(p.size):
        others = np.delete(p, i)
        val, _ = integrate.quad(
            lambda t, o=others: np.prod(1 - o + o * t), 0.0, 1.0, epsabs=1e-14, epsrel=1e-13
        )
        out.append(p[i] * val)
    return np.array(out)


# ------------------------------------------------------------------------------ manifolds


def test_stiefel_matches_numpy_oracle():
    rng = np.random.default_rng(0)
    man = Stiefel(7, 3)
    x = rand_stiefel(rng, 7, 3)
    u = rng.standard_normal((7, 3))
    np.testing.assert_allclose(man.proj(x, u), proj_oracle(x, u), atol=1e-14)
    np.testing.assert_allclose(man.egrad2rgrad(x, u), proj_oracle(x, u), atol=1e-14)
    xi = proj_oracle(x, u) * 0.3
    np.testing.assert_allclose(man.retr(x, xi), qr_retr_oracle(x, xi), atol=1e-13)
    y = qr_retr_oracle(x, xi)
    np.testing.assert_allclose(man.transp(x, y, xi), proj_oracle(y, xi), atol=1e-14)
    # R_X(0) = X thanks to the sign fix (a plain QR may flip columns).
    np.testing.assert_allclose(man.retr(x, np.zeros_like(x)), x, atol=1e-14)
    assert man.feasibility(man.retr(x, xi)) < 1e-14
    assert man.tangent_error(x, man.proj(x, u)) < 1e-14
    assert np.isclose(man.inner(x, u, xi), np.trace(u.T @ xi))


def test_stiefel_batched_broadcast():
    rng = np.random.default_rng(1)
    man = Stiefel(6, 2)
    x = rand_stiefel(rng, 6, 2)
    u = rng.standard_normal((4, 6, 2)) * 0.1
    out = man.retr(x, man.proj(x, u))
    for b in range(4):
        np.testing.assert_allclose(out[b], qr_retr_oracle(x, proj_oracle(x, u[b])), atol=1e-13)


def test_sphere_operators():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(5)
    x /= np.linalg.norm(x)
    u = rng.standard_normal(5)
    xi = u - (x @ u) * x
    s = Sphere(5)
    np.testing.assert_allclose(s.proj(x, u), xi, atol=1e-15)
    np.testing.assert_allclose(s.retr(x, xi), (x + xi) / np.linalg.norm(x + xi), atol=1e-15)
    th = np.linalg.norm(xi)
    exp = np.cos(th) * x + np.sin(th) * xi / th
    se = Sphere(5, retraction="exp", transport="parallel")
    y = se.retr(x, xi)
    np.testing.assert_allclose(y, exp, atol=1e-14)
    # parallel transport along the geodesic is an isometry onto T_y S and maps xi to the velocity.
    w = rng.standard_normal(5)
    w -= (x @ w) * x
    tw, txi = se.transp(x, y, w), se.transp(x, y, xi)
    assert abs(y @ tw) < 1e-14
    assert np.isclose(tw @ txi, w @ xi, atol=1e-14)
    vel = -np.sin(th) * th * x + np.cos(th) * xi  # d/ds exp_x(s xi) at s=1
    np.testing.assert_allclose(txi, vel, atol=1e-13)
    np.testing.assert_allclose(s.transp(x, y, w), w - (y @ w) * y, atol=1e-15)


def test_manifold_bad_input():
    with pytest.raises(ValueError, match="d=2, r=3"):
        Stiefel(2, 3)
    man = Stiefel(5, 2)
    with pytest.raises(ValueError, match=r"\(5, 3\)"):
        man.proj(np.zeros((5, 2)), np.zeros((5, 3)))
    with pytest.raises(ValueError, match="off Stiefel"):
        man.check_point(np.ones((5, 2)))
    with pytest.raises(ValueError, match="'cayley'"):
        Sphere(3, retraction="cayley")


# ------------------------------------------------------------------------------ R1 exactness


def small_problem(seed=0, n=4, d=8, r=3):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 30, d)) * (1 + np.arange(n))[:, None, None] / n
    return PCAProblem(np.swapaxes(z, 1, 2) @ z / 30, r, samples=z)


def test_r1_full_participation_k1_equals_centralised_rgd():
    prob = small_problem()
    rng = np.random.default_rng(3)
    x0 = rand_stiefel(rng, prob.d, prob.r)
    a = prob.covariances.mean(axis=0)
    alpha, t_rounds = 0.05, 6
    x = x0.copy()
    expected = []
    for _ in range(t_rounds):  # centralised Riemannian GD qf(X - alpha grad F(X)), numpy only
        x = qr_retr_oracle(x, -alpha * proj_oracle(x, -2 * a @ x))
        expected.append(x)
    for mode in ("corrected", "known-p", "uncorrected"):
        for t_stop in (1, t_rounds):
            h = run_federated(
                prob,
                np.ones(prob.num_clients),
                mode=mode,
                num_rounds=t_stop,
                local_steps=1,
                step_size=alpha,
                x0=x0,
            )
            np.testing.assert_allclose(h["x"], expected[t_stop - 1], atol=1e-12, err_msg=mode)
            assert h["max_feasibility"] < 1e-10


def test_r1_stream_tangent_and_first_term_exact():
    prob = small_problem(seed=1)
    man = prob.manifold
    rng = np.random.default_rng(4)
    x = rand_stiefel(rng, prob.d, prob.r)
    alpha, k_steps = 0.04, 5
    st = local_gradient_stream(man, x, lambda xk, k: prob.local_egrads(xk), k_steps, alpha)
    assert st.steps.shape == (k_steps, prob.num_clients, prob.d, prob.r)
    # every transported term (hence zeta) is in T_{x_t} St: ||sym(X^T zeta)|| < 1e-12
    for k in range(k_steps):
        for i in range(prob.num_clients):
            assert np.linalg.norm(sym(x.T @ st.steps[k, i])) < 1e-12
    for i in range(prob.num_clients):
        assert np.linalg.norm(sym(x.T @ st.zeta[i])) < 1e-12
        # k = 0 term is -alpha grad f_i(X_t), no transport applied
        g0 = -alpha * proj_oracle(x, -2 * prob.covariances[i] @ x)
        np.testing.assert_allclose(st.steps[0, i], g0, rtol=0, atol=1e-15)
        # whole local loop against a numpy re-implementation of paper Alg. 1 (client part)
        xk, terms = x.copy(), []
        for k in range(k_steps):
            v = -alpha * proj_oracle(xk, -2 * prob.covariances[i] @ xk)
            terms.append(v if k == 0 else proj_oracle(x, v))
            xk = qr_retr_oracle(xk, v)
        np.testing.assert_allclose(st.zeta[i], np.sum(terms, axis=0), atol=1e-13)
        np.testing.assert_allclose(st.endpoint[i], xk, atol=1e-13)


def test_client_bad_input():
    man = Stiefel(4, 2)
    x = np.eye(4)[:, :2]
    with pytest.raises(ValueError, match="num_steps"):
        local_gradient_stream(man, x, lambda xk, k: xk, 0, 0.1)
    with pytest.raises(ValueError, match="step_size"):
        local_gradient_stream(man, x, lambda xk, k: xk, 1, -0.1)
    with pytest.raises(ValueError, match="NaN"):
        local_gradient_stream(man, x, lambda xk, k: xk * np.nan, 1, 0.1)
    with pytest.raises(ValueError, match="shape"):
        local_gradient_stream(man, x, lambda xk, k: np.zeros((3, 2)), 1, 0.1)
    with pytest.raises(ValueError, match="t must be >= 0"):
        step_size_schedule(0.1, 10)(-1)
    assert step_size_schedule(0.05, 200)(200) == pytest.approx(0.025)


# ------------------------------------------------------------------------------ R2 unbiasedness


def test_p_tilde_exact_enumeration_and_quadrature():
    p = np.array([0.9, 0.05, 0.5, 0.3, 0.7, 0.2, 1.0, 0.0])
    exact = np.zeros(p.size)  # E[1{i in S}/|S|] over all 2^N subsets
    for bits in itertools.product([0, 1], repeat=p.size):
        b = np.array(bits, dtype=bool)
        if b.any():
            exact[b] += np.prod(np.where(b, p, 1 - p)) / b.sum()
    pt = effective_weights_uncorrected(p)
    np.testing.assert_allclose(pt, exact, atol=1e-14)
    np.testing.assert_allclose(pt, p_tilde_quad(p), atol=1e-12)
    assert pt[-1] == 0.0


def test_r2_corrected_unbiased_uncorrected_matches_p_tilde():
    rng = np.random.default_rng(5)
    n, d, r, draws = 8, 6, 2, 20_000
    man = Stiefel(d, r)
    x = rand_stiefel(rng, d, r)
    zetas = np.stack([proj_oracle(x, rng.standard_normal((d, r))) for _ in range(n)])
    p = rng.uniform(0.1, 0.9, n)
    masks = simulate_participation(p, draws, seed=11)
    corr = np.empty((draws, d, r))
    unc = np.empty((draws, d, r))
    for t in range(draws):
        corr[t] = aggregate_streams(zetas, participation_weights(masks[t], "known-p", p=p), (d, r))
        unc[t] = aggregate_streams(zetas, participation_weights(masks[t], "uncorrected"), (d, r))
    target_corr = zetas.mean(axis=0)
    target_unc = np.tensordot(p_tilde_quad(p), zetas, axes=1)
    dirs = [rng.standard_normal((d, r)) for _ in range(3)] + [target_corr, target_unc]
    for v in dirs:  # scalar projections: |mean - truth| < 3 SE
        for samples, truth in ((corr, target_corr), (unc, target_unc)):
            s = np.tensordot(samples, v, axes=2)
            se = s.std(ddof=1) / np.sqrt(draws)
            assert abs(s.mean() - np.sum(v * truth)) < 3 * se
    # the bias of the uncorrected mean is far outside the Monte-Carlo error
    s = np.tensordot(unc, target_corr - target_unc, axes=2)
    assert abs(
        s.mean() - np.sum((target_corr - target_unc) * target_corr)
    ) > 10 * s.std() / np.sqrt(draws)
    # all aggregates are tangent at x
    assert man.tangent_error(x, corr[:50]).max() < 1e-12


def test_weights_closed_forms_and_errors():
    mask = np.array([True, False, True, True])
    p = np.array([0.5, 0.0, 0.25, 1.0])
    np.testing.assert_allclose(participation_weights(mask, "known-p", p=p), [0.5, 0, 1.0, 0.25])
    np.testing.assert_allclose(participation_weights(mask, "uncorrected"), [1 / 3, 0, 1 / 3, 1 / 3])
    np.testing.assert_allclose(
        participation_weights(mask, "uncorrected", num_examples=[10, 5, 30, 60]), [0.1, 0, 0.3, 0.6]
    )
    assert not participation_weights(np.zeros(4, bool), "corrected", q=np.full(4, 0.5)).any()
    with pytest.raises(ValueError, match=r"client 1 responded but p\[1\] = 0.0"):
        participation_weights(np.array([1, 1, 0, 0], bool), "known-p", p=p)
    with pytest.raises(ValueError, match="mode"):
        participation_weights(mask, "fedavg")
    with pytest.raises(ValueError, match=r"p\[1\] = 1.2"):
        check_probabilities([0.5, 1.2])
    with pytest.raises(ValueError, match="stream is missing"):
        aggregate_streams({0: np.zeros((2, 1))}, np.array([0.5, 0.5]), (2, 1))


# ------------------------------------------------------------------------------ R3 bias


@pytest.fixture(scope="module")
def planted_runs():
    prob, p = planted_pca_problem(seed=0)
    sched = step_size_schedule(0.05, 200)
    runs = {
        mode: run_federated(
            prob,
            p,
            mode=mode,
            num_rounds=1500,
            local_steps=5,
            step_size=sched,
            seed=0,
            record_every=1500,
        )
        for mode in ("corrected", "known-p", "uncorrected")
    }
    return prob, p, runs


def test_r3_planted_problem_setup(planted_runs):
    prob, p, _ = planted_runs
    lam, vec = np.linalg.eigh(prob.covariances.mean(axis=0))
    assert lam.min() > 0 and lam[-2] - lam[-3] > 0.4  # PSD, clear eigengap
    e23 = np.eye(prob.d)[:, [2, 3]]
    e01 = np.eye(prob.d)[:, [0, 1]]
    assert subspace_distance(vec[:, -2:], e23) < 0.02  # F is minimised near span(e2, e3)
    lam_t, vec_t = np.linalg.eigh(np.tensordot(p_tilde_quad(p), prob.covariances, axes=1))
    assert subspace_distance(vec_t[:, -2:], e01) < 0.02  # F~ (uncorrected) near span(e0, e1)
    # the problem object's closed forms agree with eigh
    u, f_star = prob.optimum()
    assert f_star == pytest.approx(-lam[-2:].sum(), abs=1e-13)
    assert subspace_distance(u, vec[:, -2:]) < 1e-12
    assert (
        subspace_distance(prob.reweighted_optimum(effective_weights_uncorrected(p)), vec_t[:, -2:])
        < 1e-12
    )


def test_r3_corrected_reaches_truth_uncorrected_biased(planted_runs):
    prob, p, runs = planted_runs
    lam, vec = np.linalg.eigh(prob.covariances.mean(axis=0))
    u, f_star = vec[:, -2:], -lam[-2:].sum()
    _, vec_t = np.linalg.eigh(np.tensordot(p_tilde_quad(p), prob.covariances, axes=1))
    u_tilde = vec_t[:, -2:]
    for mode in ("corrected", "known-p"):
        x = runs[mode]["x"]
        assert subspace_distance(x, u) < 0.05, mode
        assert -np.trace(x.T @ prob.covariances.mean(axis=0) @ x) - f_star < 1e-3, mode
    x = runs["uncorrected"]["x"]
    assert subspace_distance(x, u) > 1.3
    assert subspace_distance(x, u_tilde) < 0.05
    for h in runs.values():
        assert h["max_feasibility"] < 1e-10  # ||X^T X - I|| after every round


# ------------------------------------------------------------------------------ R5 and edge cases


def test_r5_frequency_estimates_converge():
    p = np.linspace(0.05, 0.95, 19)
    t_rounds = 2000
    est = FrequencyEstimator(p.size, q_min=0.01, estimator="empirical")
    plus_one = FrequencyEstimator(p.size, q_min=0.01)
    counts = np.zeros(p.size)
    for t in range(1, t_rounds + 1):
        m = bernoulli_participation(p, t, seed=7)
        est.observe(m)
        plus_one.observe(m)
        counts += m
    q = est.estimate()
    np.testing.assert_allclose(q, np.maximum(counts / t_rounds, 0.01), atol=0)
    assert np.all(np.abs(q - p) <= 4 * np.sqrt(p * (1 - p) / t_rounds))
    q1 = plus_one.estimate()
    np.testing.assert_allclose(q1, np.maximum((counts + 1) / (t_rounds + 1), 0.01), atol=0)
    assert np.all(np.abs(q1 - p) <= 4 * np.sqrt(p * (1 - p) / t_rounds) + 1 / t_rounds)


def test_estimator_never_seen_prior_and_include_current():
    est = FrequencyEstimator(3, q_min=0.05, estimator="empirical")
    np.testing.assert_array_equal(est.estimate(), [1.0, 1.0, 1.0])  # prior before any round
    est.observe(np.array([True, False, False]))
    est.observe(np.array([True, True, False]))
    np.testing.assert_allclose(est.estimate(), [1.0, 0.5, 0.05])  # never seen -> floor, finite
    np.testing.assert_allclose(est.estimate(include=np.array([0, 0, 1])), [2 / 3, 1 / 3, 1 / 3])
    with pytest.raises(ValueError, match="q_min"):
        FrequencyEstimator(3, q_min=0.0)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        est.observe(np.array([True, False]))
    with pytest.raises(ValueError, match="estimator must be one of .* got 'bayes'"):
        FrequencyEstimator(3, estimator="bayes")


def test_plus_one_estimator_closed_form():
    est = FrequencyEstimator(3, q_min=0.3)  # default: one pseudo-response, (c + 1)/(t + 1), floored
    np.testing.assert_allclose(est.estimate(), [1.0, 1.0, 1.0])
    est.observe(np.array([True, False, False]))
    est.observe(np.array([True, True, False]))
    est.observe(np.array([True, True, False]))
    np.testing.assert_allclose(est.estimate(), [4 / 4, 3 / 4, 0.3])  # 1/4 < floor 0.3
    np.testing.assert_allclose(est.estimate(include=np.array([0, 0, 1])), [4 / 5, 3 / 5, 2 / 5])


def _expected_corrected_weight(
    p: float, n: int, t: int, estimator: str, q_min: float = 0.01
) -> float:
    """E[1{i in S_{t+1}} / (q_i N)] after t observed rounds, by exact enumeration of C ~ Binomial(t, p)."""
    from math import comb

    total = 0.0
    for c in range(t + 1):
        pmf = comb(t, c) * p**c * (1 - p) ** (t - c)
        if estimator == "plus-one":
            q = max((c + 1) / (t + 1), q_min)
        else:
            q = 1.0 if t == 0 else max(c / t, q_min)
        total += pmf / q
    return p * total / n


def test_round2_weights_within_factor_two_monte_carlo():
    # issue 11: N = 2, p = (0.3, 0.9); the paper's empirical q inflates round-2 weights to ~10.5 and ~4.9
    p, n, seeds = np.array([0.3, 0.9]), 2, 4_000
    man = Sphere(3)
    w2 = {"plus-one": np.empty((seeds, n)), "empirical": np.empty((seeds, n))}
    masks = [
        (bernoulli_participation(p, 1, seed=s), bernoulli_participation(p, 2, seed=s))
        for s in range(seeds)
    ]
    for kind, out in w2.items():
        srv = RFedAGSServer(man, np.eye(3)[0], n, mode="corrected", estimator_kind=kind)
        for s, (m1, m2) in enumerate(
            masks
        ):  # the server's weights in round 2 after observing round 1
            srv.estimator.counts, srv.estimator.rounds = m1.astype(np.int64), 1
            out[s] = srv.weights(m2)[0]
    for kind, out in w2.items():
        mean, se = out.mean(axis=0), out.std(axis=0, ddof=1) / np.sqrt(seeds)
        exact = [_expected_corrected_weight(pi, n, 1, kind) for pi in p]
        assert np.all(np.abs(mean - exact) < 4 * se), (kind, mean, exact)
    exact = np.array([_expected_corrected_weight(pi, n, 1, "plus-one") for pi in p])
    np.testing.assert_allclose(
        exact, (1 - (1 - p) ** 2) / n, rtol=1e-12
    )  # docs closed form: 0.255, 0.495
    assert np.all((exact > 0.5 / 2) & (exact < 0.5 * 2)), (
        exact
    )  # within a factor 2 of 1/N (the MC mean agrees)
    assert w2["plus-one"].max() <= 2 / n  # a single round-2 weight is at most (t + 1)/N
    emp = w2["empirical"].mean(axis=0)
    assert (
        emp[0] > 9 and emp[1] > 4 and w2["empirical"].max() == 50
    )  # the inflation (exact 10.545, 4.905)
    # every round: the expected weight is (1 - (1 - p)^(t+1))/N <= 1/N and tends to 1/N
    for pi in (0.05, 0.3, 0.9, 1.0):
        ws = [
            _expected_corrected_weight(pi, n, t, "plus-one") for t in range(0, 99)
        ]  # floor inactive: 1/(t+1) >= 0.01
        np.testing.assert_allclose(
            ws, [(1 - (1 - pi) ** (t + 1)) / n for t in range(0, 99)], rtol=1e-10
        )
        assert max(ws) <= 1 / n + 1e-12 and abs(ws[-1] - 1 / n) < 0.01


def test_server_estimate_order_paper_vs_code():
    man = Stiefel(4, 1)
    x0 = np.eye(4)[:, :1]
    z = np.stack([proj_oracle(x0, np.eye(4)[:, [i]]) for i in (1, 2)])  # e1, e2: tangent at e0
    masks = [np.array([True, False]), np.array([True, True])]
    paper = RFedAGSServer(man, x0, 2, mode="corrected", q_min=0.05, estimator_kind="empirical")
    code = RFedAGSServer(
        man,
        x0,
        2,
        mode="corrected",
        q_min=0.05,
        estimate_includes_current=True,
        estimator_kind="empirical",
    )
    w_paper = [paper.step(m, z).weights for m in masks]
    w_code = [code.step(m, z).weights for m in masks]
    # paper: q from previous rounds (prior 1 in round 1, then [1, floor 0.05])
    np.testing.assert_allclose(w_paper[0], [0.5, 0.0])
    np.testing.assert_allclose(w_paper[1], [1 / (1.0 * 2), 1 / (0.05 * 2)])
    # code: round t counted first -> q = [1/1, .] then [2/2, 1/2]
    np.testing.assert_allclose(w_code[0], [0.5, 0.0])
    np.testing.assert_allclose(w_code[1], [0.5, 1.0])


def test_sphere_rfedags_round_k1_is_centralised_step():
    rng = np.random.default_rng(12)
    n, d, alpha = 3, 6, 0.1
    g = rng.standard_normal((n, d, d))
    a = np.einsum("nij,nkj->nik", g, g) / d
    x0 = rng.standard_normal(d)
    x0 /= np.linalg.norm(x0)
    sph = Sphere(d)
    st = local_gradient_stream(sph, x0, lambda x, k: -2 * np.einsum("nij,j->ni", a, x), 1, alpha)
    srv = RFedAGSServer(sph, x0, n, mode="known-p", p=np.ones(n))
    x1 = srv.step(np.ones(n, bool), st.zeta).x
    eg = -2 * a.mean(0) @ x0
    y = x0 - alpha * (eg - (x0 @ eg) * x0)
    np.testing.assert_allclose(x1, y / np.linalg.norm(y), atol=1e-14)


def test_participation_is_reproducible_and_respects_zero_and_one():
    p = np.array([0.0, 1.0, 0.5])
    a = simulate_participation(p, 200, seed=3)
    assert not a[:, 0].any() and a[:, 1].all()
    np.testing.assert_array_equal(a[41], bernoulli_participation(p, 42, seed=3))
    forced = bernoulli_participation([0.0, 1e-12, 0.0], 1, seed=0, force_one_if_empty=True)
    np.testing.assert_array_equal(forced, [False, True, False])


def test_participation_draw_of_a_client_depends_only_on_seed_round_and_index():
    """notes/participation.md, s1.2: the mask of the first k clients is a prefix of the mask of all."""
    p = np.random.default_rng(9).random(40)
    for t in (1, 2, 17, 500):
        full = bernoulli_participation(p, t, seed=5)
        for k in (1, 7, 39):
            np.testing.assert_array_equal(bernoulli_participation(p[:k], t, seed=5), full[:k])
        u = np.random.default_rng([5, 0, t]).random(p.size)  # the documented uniforms
        np.testing.assert_array_equal(full, u < p)


def test_nobody_responds_keeps_iterate_exactly():
    rng = np.random.default_rng(8)
    man = Stiefel(5, 2)
    x0 = rand_stiefel(rng, 5, 2)
    for mode in ("corrected", "known-p", "uncorrected"):
        srv = RFedAGSServer(man, x0, 3, mode=mode, p=np.array([0.3, 0.0, 0.5]))
        res = srv.step(np.zeros(3, bool), np.full((3, 5, 2), np.nan))
        np.testing.assert_array_equal(res.x, x0)
        assert res.num_responders == 0 and not res.weights.any()
        assert srv.estimator.rounds == 1
    np.testing.assert_array_equal(server_update(man, x0, np.zeros((5, 2))), x0)


def test_zero_probability_clients_no_nan():
    prob, p = planted_pca_problem(seed=1)
    p = p.copy()
    p[[0, 7]] = 0.0
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error", RuntimeWarning)
        for mode in ("corrected", "known-p", "uncorrected"):
            h = run_federated(prob, p, mode=mode, num_rounds=30, local_steps=2, step_size=0.02)
            assert np.all(np.isfinite(h["gap"])) and h["max_feasibility"] < 1e-10
            assert (
                h["q"][0] == 1 / 31 and np.isfinite(h["q"]).all()
            )  # never seen in 30 rounds: (0 + 1)/(30 + 1)
        h = run_federated(
            prob,
            np.zeros(prob.num_clients),
            mode="corrected",
            num_rounds=5,
            local_steps=2,
            step_size=0.02,
            seed=4,
        )
    assert h["empty_rounds"] == 5 and h["gap"][0] == h["gap"][-1]


# ------------------------------------------------------------------------------ R4 (slow)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 7])  # two seeds (30 s each) keep the suite near its budget
def test_r4_paper_setup_corrected_beats_uncorrected(seed):
    prob = synthetic_pca_problem(seed=seed)
    p = paper_participation(prob.num_clients, seed=seed + 1)
    lam = np.linalg.eigvalsh(prob.covariances.mean(axis=0))
    f_star = -lam[-prob.r :].sum()
    kw = dict(
        num_rounds=2000, local_steps=5, step_size=2e-2, seed=seed, batch_size=50, record_every=2000
    )
    hc = run_federated(prob, p, mode="corrected", **kw)
    hu = run_federated(prob, p, mode="uncorrected", **kw)
    cost = lambda x: -np.trace(x.T @ prob.covariances.mean(axis=0) @ x)  # noqa: E731
    gap0, gc, gu = hc["gap"][0], cost(hc["x"]) - f_star, cost(hu["x"]) - f_star
    assert gc <= 0.1 * gap0 and gc <= 0.5 * gu, (gap0, gc, gu)
