"""FedSAF mathematics: invariances (Props. 1-3), hand-computed values, closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from flwr_sheaf.methods.fedsaf.maths import (
    MIN_ROWS,
    centered_gram,
    coordinate_decomposition,
    cosine_alignment,
    fedsaf_objective,
    gcsa_loss,
    mse_alignment,
    rcsa_loss,
    rdm_vector,
    structure_alignment_inputs,
)

D64 = torch.float64
SEEDS = (0, 1, 2)


def t(*rows):
    return torch.tensor(rows, dtype=D64)


def raw_cosine_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - cos without the [0, 1] clamp of the losses, so rounding can't hide a wrong value."""
    return 1.0 - ((a * b).sum() / (a.norm() * b.norm())).item()


def rand_orth(d_in: int, d_out: int, gen: torch.Generator) -> torch.Tensor:
    """(d_in, d_out) with orthonormal rows (R R^T = I), d_out >= d_in."""
    q, _ = torch.linalg.qr(torch.randn(d_out, d_in, dtype=D64, generator=gen))
    return q.T


# ------------------------------------------------------------------ GCSA (Eq. 13, Prop. 2)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("d2", [4, 9])  # orthogonal and semi-orthogonal (d2 > d1)
def test_gcsa_zero_under_similarity_transform(seed, d2):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(7, 4, dtype=D64, generator=g)
    r = rand_orth(4, d2, g)
    assert torch.allclose(r @ r.T, torch.eye(4, dtype=D64), atol=1e-12)
    alpha = 0.1 + 5 * torch.rand(1, dtype=D64, generator=g).item()
    b = 10 * torch.randn(d2, dtype=D64, generator=g)
    q = alpha * p @ r + b
    assert gcsa_loss(p, q).abs().item() < 1e-10
    assert abs(raw_cosine_gap(centered_gram(p), centered_gram(q))) < 1e-10


@pytest.mark.parametrize("seed", SEEDS)
def test_gcsa_not_invariant_to_row_scaling(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(6, 3, dtype=D64, generator=g)
    dscale = torch.tensor([0.2, 1.0, 3.0, 0.5, 4.0, 1.5], dtype=D64)
    assert gcsa_loss(p, dscale[:, None] * p).item() > 1e-3


def test_gcsa_hand_value():
    # centred Grams: K_P = [[1,-1,0],[-1,1,0],[0,0,0]], K_Q = [[1,0,-1],[0,0,0],[-1,0,1]]
    # <K_P,K_Q> = 1, ||K_P|| = ||K_Q|| = 2  ->  1 - 1/4
    p = t([1.0, 0.0], [-1.0, 0.0], [0.0, 0.0])
    q = t([0.0, 1.0], [0.0, 0.0], [0.0, -1.0])
    assert math.isclose(gcsa_loss(p, q).item(), 0.75, abs_tol=1e-14)
    # operator returns K_P / ||P_c||_F^2 (here ||P_c||_F^2 = 2)
    assert torch.allclose(centered_gram(p), t([0.5, -0.5, 0.0], [-0.5, 0.5, 0.0], [0.0, 0.0, 0.0]))


# ------------------------------------------------------------------ RCSA (Eq. 14, Prop. 3)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("d2", [5, 8])
def test_rcsa_zero_under_row_scaling_and_orthogonal_map(seed, d2):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(6, 5, dtype=D64, generator=g)
    r = rand_orth(5, d2, g)
    dpos = 0.05 + 3 * torch.rand(6, dtype=D64, generator=g)
    q = dpos[:, None] * (p @ r)
    assert rcsa_loss(p, q).abs().item() < 1e-10
    assert abs(raw_cosine_gap(rdm_vector(p), rdm_vector(q))) < 1e-10


@pytest.mark.parametrize("seed", SEEDS)
def test_rcsa_penalises_translation_gcsa_does_not(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(6, 4, dtype=D64, generator=g)
    q = p + torch.randn(4, dtype=D64, generator=g)
    assert rcsa_loss(p, q).item() > 1e-3
    assert gcsa_loss(p, q).abs().item() < 1e-10


def test_rcsa_hand_value():
    # unit rows; RDM_P upper = [2, 4, 2], RDM_Q upper = [4, 2, 2]; cos = 20/24
    p = t([1.0, 0.0], [0.0, 1.0], [-1.0, 0.0])
    q = t([1.0, 0.0], [-1.0, 0.0], [0.0, 1.0])
    assert math.isclose(rcsa_loss(p, q).item(), 1.0 / 6.0, abs_tol=1e-14)
    assert torch.allclose(rdm_vector(p), t(2.0, 4.0, 2.0), atol=1e-15)  # pairs (0,1),(0,2),(1,2)
    scaled = torch.tensor([2.0, 3.0, 5.0], dtype=D64)[:, None] * p  # rows rescaled: same RDM
    assert math.isclose(rcsa_loss(scaled, q).item(), 1.0 / 6.0, abs_tol=1e-14)


# ------------------------------------------------------------------ shared properties
@pytest.mark.parametrize("loss", [gcsa_loss, rcsa_loss])
@pytest.mark.parametrize("seed", range(5))
def test_range_symmetry_permutation(loss, seed):
    g = torch.Generator().manual_seed(seed)
    n = 3 + seed
    p = torch.randn(n, 4, dtype=D64, generator=g)
    q = torch.randn(n, 7, dtype=D64, generator=g) + 0.3
    v = loss(p, q).item()
    assert 0.0 <= v <= 1.0
    assert abs(v - loss(q, p).item()) < 1e-12
    perm = torch.randperm(n, generator=g)
    assert abs(v - loss(p[perm], q[perm]).item()) < 1e-12


@pytest.mark.parametrize("loss", [gcsa_loss, rcsa_loss])
def test_min_rows_guard(loss):
    assert MIN_ROWS == 3
    with pytest.raises(ValueError, match="MIN_ROWS=3"):
        loss(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="n=4 and n=5"):
        loss(torch.randn(4, 3), torch.randn(5, 3))


def test_two_rows_are_degenerate_by_hand():
    # why the guard exists: for n = 2 both descriptors are determined up to scale.
    p = t([1.0, 2.0], [3.0, -1.0])
    q = t([-4.0, 0.5, 2.0], [7.0, 1.0, 0.0])
    for x in (p, q):
        xc = x - x.mean(0)
        k = xc @ xc.T
        assert torch.allclose(k / k[0, 0], t([1.0, -1.0], [-1.0, 1.0]))  # Gram ~ [[1,-1],[-1,1]]
    # a single RDM entry -> cosine 1 between positive scalars


@pytest.mark.parametrize("loss", [gcsa_loss, rcsa_loss])
def test_gradcheck_and_degenerate_gradients_finite(loss):
    g = torch.Generator().manual_seed(3)
    p = torch.randn(5, 3, dtype=D64, generator=g, requires_grad=True)
    q = torch.randn(5, 4, dtype=D64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(loss, (p, q))
    same = torch.ones(4, 3, requires_grad=True)  # all rows equal (and parallel): degenerate
    out = loss(same, torch.randn(4, 3))
    out.backward()
    assert math.isclose(out.item(), 1.0) and torch.isfinite(same.grad).all()


# ------------------------------------------------------------------ coordinate baselines
def test_mse_and_cosine_alignment_hand_values():
    p = t([1.0, 2.0], [3.0, 4.0])
    q = t([1.0, 0.0], [0.0, 4.0])  # squared errors 0 + 4 + 9 + 0 = 13
    assert math.isclose(mse_alignment(p, q).item(), 13.0 / 4, abs_tol=1e-15)
    assert math.isclose(mse_alignment(p, q, reduction="per_sample").item(), 13.0 / 2, abs_tol=1e-15)
    a = t([1.0, 0.0], [0.0, 1.0])
    b = t([1.0, 1.0], [0.0, -1.0])  # cosines 1/sqrt(2) and -1
    expected = ((1 - 1 / math.sqrt(2)) + 2.0) / 2
    assert math.isclose(cosine_alignment(a, b).item(), expected, abs_tol=1e-15)
    with pytest.raises(ValueError, match="d=2.*d=3"):
        mse_alignment(p, torch.zeros(2, 3, dtype=D64))
    with pytest.raises(ValueError, match="d=2.*d=3"):
        cosine_alignment(p, torch.zeros(2, 3, dtype=D64))


# ------------------------------------------------------------------ Prop. 1
@pytest.mark.parametrize("seed", SEEDS)
def test_prop1_decomposition(seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(10, 4, dtype=D64, generator=g)
    p = torch.randn(10, 4, dtype=D64, generator=g)
    zh = z / z.norm(dim=1, keepdim=True)
    ph = p / p.norm(dim=1, keepdim=True)
    dec = coordinate_decomposition(z, p)
    coord = ((zh - ph) ** 2).sum()
    assert abs(dec.l_coord.item() - coord.item()) < 1e-12
    assert abs((dec.l_shape + dec.l_rigid).item() - coord.item()) < 1e-10
    assert dec.l_rigid.item() >= -1e-12
    # closed form: min_R ||Zh - Ph R||^2 = ||Zh||^2 + ||Ph||^2 - 2 ||Ph^T Zh||_*
    nuc = torch.linalg.matrix_norm(ph.T @ zh, ord="nuc")
    assert abs(dec.l_shape.item() - (20.0 - 2 * nuc.item())) < 1e-10
    r = dec.rotation
    assert torch.allclose(r.T @ r, torch.eye(4, dtype=D64), atol=1e-12)
    for _ in range(5):  # optimality against random orthogonal matrices
        ro = rand_orth(4, 4, g)
        assert dec.l_shape.item() <= ((zh - ph @ ro) ** 2).sum().item() + 1e-12
    raw = coordinate_decomposition(z, p, normalize=False)
    assert abs((raw.l_shape + raw.l_rigid).item() - ((z - p) ** 2).sum().item()) < 1e-10


def test_prop1_rotated_copy_is_pure_rigid_cost():
    g = torch.Generator().manual_seed(7)
    p = torch.randn(8, 3, dtype=D64, generator=g)
    ro = rand_orth(3, 3, g)
    dec = coordinate_decomposition(p @ ro, p)
    assert dec.l_shape.abs().item() < 1e-10
    assert dec.l_rigid.item() > 1e-3  # coordinate loss > 0 although the structure is identical
    assert abs(dec.l_rigid.item() - dec.l_coord.item()) < 1e-10
    assert mse_alignment(p, p @ ro).item() > 1e-3
    assert gcsa_loss(p, p @ ro).abs().item() < 1e-10


# ------------------------------------------------------------------ two-level objective
def test_structure_alignment_inputs_by_hand():
    z = t([1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [5.0, 5.0], [0.0, 4.0])
    y = torch.tensor([0, 1, 0, 2, 3])
    gp = {0: t(1.0, 1.0, 1.0), 1: t(2.0, 2.0, 2.0), 3: t(3.0, 3.0, 3.0)}  # d_g = 3, no class 2
    s = structure_alignment_inputs(z, y, gp, num_classes=4)
    assert s.classes == [0, 1, 3]
    assert torch.equal(s.p_local, t([2.0, 0.0], [0.0, 2.0], [0.0, 4.0]))
    assert torch.equal(s.q_global, t([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [3.0, 3.0, 3.0]))
    assert torch.equal(s.z_inst, t([1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0]))
    assert torch.equal(s.z_global_inst, t([1.0] * 3, [2.0] * 3, [1.0] * 3, [3.0] * 3))
    empty = structure_alignment_inputs(z, y, {}, num_classes=4)
    assert empty.p_local.shape[0] == 0 and empty.classes == []


def test_fedsaf_objective_hand_composition():
    ce = torch.tensor(2.0, dtype=D64)
    p_hand = t([1.0, 0.0], [-1.0, 0.0], [0.0, 0.0])  # GCSA 0.75 against q_hand
    q_hand = t([0.0, 1.0], [0.0, 0.0], [0.0, -1.0])
    zi = t([1.0, 2.0], [0.0, 1.0], [3.0, 3.0], [2.0, -1.0])
    zg = 2.0 * zi + t(1.0, -5.0)  # similarity transform: GCSA 0
    out = fedsaf_objective(ce, p_hand, q_hand, zi, zg, lam=2.0, gamma=3.0, structure="gcsa")
    assert out.proto_applied and out.inst_applied
    assert math.isclose(out.total.item(), 2.0 + 2.0 * 0.75 + 3.0 * 0.0, abs_tol=1e-12)
    r_out = fedsaf_objective(
        ce,
        t([1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]),
        t([1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]),
        None,
        None,
        lam=6.0,
        gamma=1.0,
        structure="rcsa",
    )
    assert math.isclose(r_out.total.item(), 2.0 + 6.0 / 6.0, abs_tol=1e-12)  # RCSA 1/6
    assert not r_out.inst_applied
    m_out = fedsaf_objective(ce, p_hand, q_hand, None, None, lam=1.0, gamma=0.0, structure="mse")
    # squared errors: (1,0)->(0,1): 2, (-1,0)->(0,0): 1, (0,0)->(0,-1): 1 -> 4 / 6 elements
    assert math.isclose(m_out.total.item(), 2.0 + 4.0 / 6.0, abs_tol=1e-12)


def test_fedsaf_objective_skips_small_terms_and_validates():
    ce = torch.tensor(1.5, dtype=D64)
    two = t([1.0, 0.0], [0.0, 1.0])
    out = fedsaf_objective(ce, two, two + 1, None, None, lam=10.0, gamma=1.0)
    assert not out.proto_applied and out.total.item() == 1.5 and out.proto.item() == 0.0
    with pytest.raises(ValueError, match="lam"):
        fedsaf_objective(ce, None, None, None, None, lam=-1.0, gamma=0.0)
    with pytest.raises(ValueError, match="structure"):
        fedsaf_objective(ce, None, None, None, None, lam=1.0, gamma=0.0, structure="cka")
    with pytest.raises(ValueError, match="both"):
        fedsaf_objective(ce, two, None, None, None, lam=1.0, gamma=0.0)
    with pytest.raises(ValueError, match="d=2.*d=3"):
        fedsaf_objective(
            ce,
            torch.zeros(3, 2, dtype=D64),
            torch.zeros(3, 3, dtype=D64),
            None,
            None,
            lam=1.0,
            gamma=0.0,
            structure="mse",
        )


@pytest.mark.parametrize("structure", ["gcsa", "rcsa", "mse", "cosine"])
def test_fedsaf_gradients_reach_encoder(structure):
    torch.manual_seed(0)
    enc = nn.Linear(5, 4).double()
    x = torch.randn(12, 5, dtype=D64)
    y = torch.tensor([0, 1, 2, 3] * 3)
    gp = {c: torch.randn(4, dtype=D64) for c in range(4)}
    s = structure_alignment_inputs(enc(x), y, gp, num_classes=4)
    out = fedsaf_objective(
        torch.zeros((), dtype=D64),
        s.p_local,
        s.q_global,
        s.z_inst,
        s.z_global_inst,
        lam=1.0,
        gamma=1.0,
        structure=structure,
    )
    assert out.proto_applied and out.inst_applied
    out.total.backward()
    assert enc.weight.grad.abs().sum().item() > 0
    assert torch.isfinite(enc.weight.grad).all()
