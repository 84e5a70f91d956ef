"""Whitening / colouring (paper Sec. 3 + App. G). Expected values are derived here with numpy
from the documented definitions (unbiased covariance, Sigma_reg, Cholesky), never by calling the
layer's own helpers."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from flwr_sheaf.sheaf.whitening import (
    Colouring,
    Whitening,
    effective_rank,
    low_variance_fraction,
    regularised_covariance,
)


def _correlated(m: int = 1000, d: int = 6, mean: float = 3.0, seed: int = 0) -> np.ndarray:
    """Correlated, well-conditioned sample (eigenvalues of the population covariance in [0.25, 4])."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    scales = np.linspace(0.5, 2.0, d)
    return rng.standard_normal((m, d)) @ np.diag(scales) @ q.T + mean


def _sigma_reg_np(cov: np.ndarray, shrinkage: float, eps: float) -> np.ndarray:
    d = cov.shape[0]
    return (
        (1 - shrinkage) * cov
        + shrinkage * np.diag(np.diag(cov))
        + eps * np.trace(cov) / d * np.eye(d)
        + 1e-8 * np.eye(d)
    )


def _orthogonal(d: int, seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    return q


def test_eval_after_fit_zero_mean_identity_covariance():
    z = _correlated()
    w = Whitening(6, shrinkage=0.0, eps=1e-12).fit(torch.tensor(z, dtype=torch.float32)).eval()
    zhat = w(torch.tensor(z, dtype=torch.float32)).double().numpy()
    assert zhat.dtype == np.float64 and zhat.shape == (1000, 6)
    np.testing.assert_allclose(zhat.mean(axis=0), 0.0, atol=1e-5)
    # unbiased estimator, the documented convention (np.cov default ddof=1)
    np.testing.assert_allclose(np.cov(zhat, rowvar=False), np.eye(6), atol=1e-4)
    # the raw data really was correlated (the test is not vacuous)
    assert np.abs(np.cov(z, rowvar=False) - np.eye(6)).max() > 0.3


def test_train_mode_batch_is_whitened_with_batch_statistics():
    z = _correlated(m=200, seed=1)
    w = Whitening(6, eps=1e-12).train()
    zhat = w(torch.tensor(z)).numpy()
    np.testing.assert_allclose(zhat.mean(axis=0), 0.0, atol=1e-9)
    np.testing.assert_allclose(np.cov(zhat, rowvar=False), np.eye(6), atol=1e-6)


@pytest.mark.parametrize("shrinkage,eps", [(0.3, 1e-3), (0.7, 0.05), (1.0, 0.0)])
def test_shrinkage_covariance_equals_target_from_definition(shrinkage, eps):
    z = _correlated(seed=2)
    cov = np.cov(z, rowvar=False)
    chol = np.linalg.cholesky(_sigma_reg_np(cov, shrinkage, eps))
    linv = np.linalg.inv(chol)
    expected = linv @ cov @ linv.T
    w = Whitening(6, shrinkage=shrinkage, eps=eps).fit(torch.tensor(z, dtype=torch.float32)).eval()
    zhat = w(torch.tensor(z, dtype=torch.float32)).double().numpy()
    got = np.cov(zhat, rowvar=False)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    np.testing.assert_allclose(w.whitened_covariance_target().double().numpy(), expected, atol=1e-5)
    # with shrinkage the result is not the identity (the target is a real, documented deviation)
    assert np.abs(expected - np.eye(6)).max() > 1e-2


def test_full_shrinkage_gives_the_correlation_matrix():
    # shrinkage = 1, no floor: per-dimension standardisation => covariance = correlation matrix
    z = _correlated(seed=3)
    w = Whitening(6, shrinkage=1.0, eps=0.0).double().fit(torch.tensor(z)).eval()
    zhat = w(torch.tensor(z)).numpy()
    np.testing.assert_allclose(np.cov(zhat, rowvar=False), np.corrcoef(z, rowvar=False), atol=1e-6)
    np.testing.assert_allclose(zhat.std(axis=0, ddof=1), 1.0, atol=1e-6)


def test_regularised_covariance_formula():
    cov = np.cov(_correlated(seed=4), rowvar=False)
    got = regularised_covariance(torch.tensor(cov), shrinkage=0.4, eps=0.1).numpy()
    np.testing.assert_allclose(got, _sigma_reg_np(cov, 0.4, 0.1), atol=1e-12)


def test_colour_whiten_is_identity():
    z = torch.tensor(_correlated(seed=5), dtype=torch.float32)
    for shrinkage in (0.0, 0.5):
        w = Whitening(6, shrinkage=shrinkage, eps=1e-3).fit(z).eval()
        c = Colouring(w)
        torch.testing.assert_close(c(w(z)), z, atol=1e-5, rtol=0)
        # also for data that was not used in the fit
        other = torch.randn(50, 6) * 10
        torch.testing.assert_close(c(w(other)), other, atol=1e-4, rtol=0)
    assert c.whitening is w  # a reference, not a copy


def test_colouring_follows_refit_and_has_no_state():
    z = torch.tensor(_correlated(seed=6), dtype=torch.float32)
    w = Whitening(6).eval()
    c = Colouring(w)
    assert c.state_dict() == {} and list(c.parameters()) == []
    _ = c(torch.zeros(3, 6))  # caches the identity statistics
    w.fit(z)
    torch.testing.assert_close(c(w(z)), z, atol=1e-5, rtol=0)
    # colour(0) must now be the fitted mean
    torch.testing.assert_close(c(torch.zeros(1, 6))[0], z.mean(0), atol=1e-5, rtol=0)


def test_near_dead_direction_is_not_amplified_beyond_bound():
    eps = 1e-3
    rng = np.random.default_rng(7)
    base = rng.standard_normal((2000, 6))
    base[:, 5] = 1e-4 * rng.standard_normal(2000)  # variance ~1e-8
    q = _orthogonal(6, 8)
    z = base @ q.T + 1.0  # the dead direction is q[:, 5], not an axis
    cov = np.cov(z, rowvar=False)
    floor = eps * np.trace(cov) / 6 + 1e-8
    bound = 1.0 / np.sqrt(floor)  # documented operator-norm bound
    w = Whitening(6, eps=eps).fit(torch.tensor(z)).eval()
    assert w.max_gain() == pytest.approx(bound, rel=1e-6)
    # a fresh input moving along the dead direction (what went wrong with fixed whitening)
    dead = q[:, 5]
    mu = z.mean(axis=0)
    pts = torch.tensor(np.stack([mu, mu + dead, mu + 3.0 * dead]))
    out = w(pts).numpy()
    gains = np.linalg.norm(out[1:] - out[0], axis=1) / np.array([1.0, 3.0])
    assert np.all(gains <= bound * (1 + 1e-6))
    assert gains[0] > 0.5 * bound  # the bound is nearly attained along the dead direction
    # any direction: gain <= bound
    v = rng.standard_normal((100, 6))
    outv = w(torch.tensor(mu + v)).numpy() - out[0]
    assert np.all(np.linalg.norm(outv, axis=1) <= bound * np.linalg.norm(v, axis=1) * (1 + 1e-6))
    # the dead direction's whitened variance stays tiny instead of being blown up to 1
    zhat = w(torch.tensor(z)).numpy()
    var_dead = (base[:, 5]).var(ddof=1)
    assert np.cov(zhat, rowvar=False).trace() - 5.0 <= var_dead / floor + 1e-3
    assert var_dead / floor < 1e-3


@pytest.mark.parametrize("b,d", [(4, 8), (16, 6)])
def test_train_backward_finite_with_dead_channel_and_small_batch(b, d):
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, d)
    x = torch.randn(b, 5)
    z = torch.relu(lin(x))
    z = torch.cat([z[:, :-1], torch.zeros(b, 1)], dim=1)  # a dead channel
    w = Whitening(d, eps=1e-3).train()
    zhat = w(z)
    loss = (zhat**2).sum() + (zhat * torch.randn(b, d)).sum()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in lin.parameters())
    assert torch.isfinite(w.running_cov).all()


def test_backward_finite_for_constant_batch():
    z = torch.ones(4, 3, requires_grad=True)
    zhat = Whitening(3).train()(z)
    assert torch.equal(zhat, torch.zeros(4, 3))
    (zhat * torch.arange(12.0).reshape(4, 3)).sum().backward()
    assert torch.isfinite(z.grad).all()


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_rotation_changes_output_only_by_an_orthogonal_matrix(mode):
    z = _correlated(m=300, d=5, seed=9)
    q = _orthogonal(5, 10)
    # shrinkage 0: rotation-equivariant; float64 buffers so 1e-8 tolerances are meaningful
    w1, w2 = Whitening(5, eps=1e-3).double(), Whitening(5, eps=1e-3).double()
    if mode == "eval":
        w1.fit(torch.tensor(z)).eval()
        w2.fit(torch.tensor(z @ q)).eval()
    h1 = w1(torch.tensor(z)).numpy()
    h2 = w2(torch.tensor(z @ q)).numpy()
    # sample Gram matrices agree (invariant to a right orthogonal factor)
    np.testing.assert_allclose(h1 @ h1.T, h2 @ h2.T, atol=1e-8)
    # covariances agree up to conjugation by that orthogonal matrix: same spectrum
    np.testing.assert_allclose(
        np.linalg.eigvalsh(np.cov(h1, rowvar=False)),
        np.linalg.eigvalsh(np.cov(h2, rowvar=False)),
        atol=1e-10,
    )
    # the map h1 -> h2 is orthogonal
    r, *_ = np.linalg.lstsq(h1, h2, rcond=None)
    np.testing.assert_allclose(r.T @ r, np.eye(5), atol=1e-8)
    np.testing.assert_allclose(h1 @ r, h2, atol=1e-8)


def test_running_stats_ema_after_two_steps():
    m = 0.2
    rng = np.random.default_rng(11)
    b1, b2 = rng.standard_normal((8, 4)) + 1.0, 2.0 * rng.standard_normal((10, 4)) - 1.0
    w = Whitening(4, momentum=m).train()
    w(torch.tensor(b1, dtype=torch.float32))
    w(torch.tensor(b2, dtype=torch.float32))
    # documented: initial (0, I); running = (1 - m) running + m batch; unbiased covariances
    exp_mean = (1 - m) * ((1 - m) * 0.0 + m * b1.mean(0)) + m * b2.mean(0)
    exp_cov = (1 - m) * ((1 - m) * np.eye(4) + m * np.cov(b1, rowvar=False)) + m * np.cov(
        b2, rowvar=False
    )
    np.testing.assert_allclose(w.running_mean.numpy(), exp_mean, atol=1e-6)
    np.testing.assert_allclose(w.running_cov.numpy(), exp_cov, atol=1e-6)
    assert w.running_mean.dtype == torch.float32 and w.running_cov.dtype == torch.float32


def test_eval_cache_invalidated_when_buffers_change():
    z = torch.tensor(_correlated(seed=12), dtype=torch.float32)
    w = Whitening(6).eval()
    x = z[:5]
    torch.testing.assert_close(w(x), x, atol=1e-2, rtol=1e-2)  # initial stats (0, I): ~identity
    w.fit(z)
    after_fit = w(x)
    assert not torch.allclose(after_fit, x, atol=1e-2)
    w.running_mean.add_(1.0)  # in-place change of a buffer
    shifted = w(x)
    assert not torch.allclose(shifted, after_fit)
    # load_state_dict into another layer reproduces the fitted transform
    w.running_mean.sub_(1.0)
    buf = io.BytesIO()
    torch.save(w.state_dict(), buf)
    buf.seek(0)
    w2 = Whitening(6).eval()
    _ = w2(x)  # populate its cache with the identity statistics
    w2.load_state_dict(torch.load(buf))
    torch.testing.assert_close(w2(x), after_fit, atol=1e-6, rtol=0)
    assert set(w.state_dict()) == {"running_mean", "running_cov"}
    assert list(w.parameters()) == []


def test_bad_inputs_raise_value_error():
    w = Whitening(4)
    bad = torch.randn(5, 4)
    bad[2, 1] = float("nan")
    inf = torch.randn(5, 4)
    inf[0, 0] = float("inf")
    for mode in ("train", "eval"):
        w.train(mode == "train")
        with pytest.raises(ValueError, match="NaN"):
            w(bad)
        with pytest.raises(ValueError, match="inf"):
            w(inf)
        with pytest.raises(ValueError, match="d=4"):
            w(torch.randn(5, 3))
    with pytest.raises(ValueError, match="NaN"):
        w.fit(bad)
    with pytest.raises(ValueError, match="B=1"):
        w.train()(torch.randn(1, 4))
    with pytest.raises(ValueError, match="d=4"):
        Colouring(w)(torch.randn(2, 5))
    with pytest.raises(ValueError, match="NaN"):
        Colouring(w)(bad)
    with pytest.raises(ValueError, match="shrinkage"):
        Whitening(4, shrinkage=1.5)
    with pytest.raises(ValueError, match="eps"):
        Whitening(4, eps=-1.0)
    with pytest.raises(ValueError, match="momentum"):
        Whitening(4, momentum=0.0)
    with pytest.raises(ValueError, match="d=0"):
        Whitening(0)
    with pytest.raises(ValueError, match="NaN"):
        effective_rank(bad)
    with pytest.raises(ValueError, match="NaN"):
        low_variance_fraction(bad)


def test_low_variance_fraction():
    rng = np.random.default_rng(13)
    z = rng.standard_normal((500, 8))
    z[:, 2] *= 1e-3  # variance ~1e-6
    z[:, 6] = 5.0  # dead
    assert low_variance_fraction(torch.tensor(z)) == pytest.approx(2 / 8)
    assert low_variance_fraction(torch.tensor(z), threshold=10.0) == 1.0


def test_effective_rank_participation_ratio():
    # construct a sample whose unbiased covariance is exactly Q diag(lams) Q^T
    m, d = 400, 6
    rng = np.random.default_rng(14)
    h = rng.standard_normal((m, d))
    h -= h.mean(0)
    h, _ = np.linalg.qr(h)  # orthonormal, centred columns
    h *= np.sqrt(m - 1)
    q = _orthogonal(d, 15)
    for lams, expected in [
        ([1, 1, 1, 0, 0, 0], 3.0),
        ([2, 2, 2, 2, 2, 2], 6.0),
        ([4, 1, 0, 0, 0, 0], 25.0 / 17.0),
    ]:
        z = h @ np.diag(np.sqrt(lams)) @ q.T + 7.0
        assert effective_rank(torch.tensor(z)) == pytest.approx(expected, rel=1e-9)
    assert effective_rank(torch.ones(5, 3)) == 0.0


def test_train_mode_shrinks_rank_deficient_batches_towards_the_diagonal():
    """B - 1 < d: the batch covariance is shrunk by at least 1 - (B - 1) / d (independent numpy check)."""
    import numpy as np

    rng = np.random.default_rng(0)
    b, d, eps = 5, 8, 1e-3
    z = rng.normal(size=(b, d)) * np.linspace(0.5, 2.0, d)
    layer = Whitening(d, shrinkage=0.0, eps=eps).train()
    out = layer(torch.tensor(z)).numpy()
    alpha = 1 - (b - 1) / d
    cov = np.cov(z, rowvar=False)
    reg = (
        (1 - alpha) * cov
        + alpha * np.diag(np.diag(cov))
        + eps * np.trace(cov) / d * np.eye(d)
        + 1e-8 * np.eye(d)
    )
    chol = np.linalg.cholesky(reg)
    expected = np.linalg.solve(chol, (z - z.mean(0)).T).T
    np.testing.assert_allclose(out, expected, atol=1e-10)
    assert layer.batch_shrinkage(64) == 0.0 and layer.batch_shrinkage(2) == pytest.approx(1 - 1 / 8)
