"""FedProto mathematics: expected values are written by hand or derived in closed form."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from flwr_sheaf.methods._shared.prototype_aggregation import common_dimension
from flwr_sheaf.methods._shared.prototypes import (
    PoolingAdapter,
    aggregate_prototypes,
    class_prototypes,
    fedproto_loss,
    nearest_prototype_predict,
)

D64 = torch.float64


def t(*rows):
    return torch.tensor(rows, dtype=D64)


# ------------------------------------------------------------------ class_prototypes
def test_class_prototypes_hand_example_and_int_keys():
    z = t([1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [0.0, 0.0])
    y = torch.tensor([0, 0, 2, 2], dtype=torch.long)
    protos, counts = class_prototypes(z, y, num_classes=3)
    assert list(protos) == [0, 2] and all(type(k) is int for k in protos)
    assert all(type(k) is int for k in counts)
    assert torch.equal(protos[0], t(2.0, 3.0))
    assert torch.equal(protos[2], t(2.5, 3.0))
    assert counts == {0: 2, 2: 2}


def test_class_prototypes_gradient_is_one_over_count():
    z = torch.zeros(3, 2, dtype=D64, requires_grad=True)
    protos, _ = class_prototypes(z, torch.tensor([1, 1, 0]), num_classes=2)
    protos[1].sum().backward()
    assert torch.equal(z.grad, t([0.5, 0.5], [0.5, 0.5], [0.0, 0.0]))


def test_class_prototypes_rejects_bad_labels():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="10"):
        class_prototypes(z, torch.tensor([0, 10]), num_classes=10)
    with pytest.raises(ValueError, match="integer"):
        class_prototypes(z, torch.tensor([0.0, 1.0]), num_classes=10)
    with pytest.raises(ValueError, match="2 labels|latents have 2"):
        class_prototypes(z, torch.tensor([0, 1, 1]), num_classes=10)


# ------------------------------------------------------------------ aggregation
def _two_clients():
    a = ({0: t(1.0, 0.0)}, {0: 3})
    b = ({0: t(0.0, 1.0), 1: t(4.0, 8.0)}, {0: 1, 1: 5})
    return a, b


def test_weighted_aggregation_matches_hand_computed_mean():
    a, b = _two_clients()
    g = aggregate_prototypes([a, b], weighted=True, num_classes=10)
    assert list(g) == [0, 1]
    # counts 3 and 1 -> weights 0.75 / 0.25
    assert torch.allclose(g[0], t(0.75, 0.25), atol=1e-15)
    assert torch.allclose(g[1], t(4.0, 8.0), atol=1e-15)


def test_unweighted_aggregation_is_plain_client_mean():
    a, b = _two_clients()
    g = aggregate_prototypes([a, b], weighted=False)
    assert torch.allclose(g[0], t(0.5, 0.5), atol=1e-15)
    # counts may be omitted when unweighted
    g2 = aggregate_prototypes([(a[0], None), (b[0], None)], weighted=False)
    assert torch.allclose(g2[0], t(0.5, 0.5), atol=1e-15)


def test_three_client_weighted_mean():
    ups = [({2: t(3.0)}, {2: 2}), ({2: t(6.0)}, {2: 1}), ({2: t(0.0)}, {2: 3})]
    g = aggregate_prototypes(ups)
    assert math.isclose(g[2].item(), (2 * 3.0 + 1 * 6.0 + 3 * 0.0) / 6, abs_tol=1e-15)  # = 2.0


def test_carry_vs_drop_missing_classes():
    a, b = _two_clients()
    prev = {0: t(9.0, 9.0), 5: t(7.0, 7.0)}
    carry = aggregate_prototypes([a, b], previous=prev, missing="carry")
    drop = aggregate_prototypes([a, b], previous=prev, missing="drop")
    assert list(carry) == [0, 1, 5] and torch.equal(carry[5], t(7.0, 7.0))
    assert torch.allclose(carry[0], t(0.75, 0.25))  # uploaded this round: replaced, not blended
    assert list(drop) == [0, 1]
    carry[5].add_(1.0)
    assert torch.equal(prev[5], t(7.0, 7.0))  # carried prototype is a copy
    with pytest.raises(ValueError, match="missing"):
        aggregate_prototypes([a], missing="keep")


def test_nan_and_out_of_range_class_name_the_source():
    good = ({0: t(1.0, 0.0)}, {0: 1})
    nan = ({1: t(float("nan"), 0.0)}, {1: 2})
    with pytest.raises(ValueError, match="partition-id 3") as e:
        aggregate_prototypes([good, nan], sources=["partition-id 0", "partition-id 3"])
    assert "NaN" in str(e.value)
    inf = ({1: t(float("inf"), 0.0)}, {1: 2})
    with pytest.raises(ValueError, match="partition-id 3"):
        aggregate_prototypes([good, inf], sources=["partition-id 0", "partition-id 3"])
    bad_cls = ({10: t(1.0, 0.0)}, {10: 1})
    with pytest.raises(ValueError, match="partition-id 7") as e:
        aggregate_prototypes([good, bad_cls], num_classes=10, sources=["p0", "partition-id 7"])
    assert "10" in str(e.value)


def test_dimension_mismatch_names_both_dims():
    a = ({0: t(1.0, 0.0)}, {0: 1})
    b = ({0: t(1.0, 0.0, 0.0)}, {0: 1})
    with pytest.raises(ValueError, match="d=2") as e:
        aggregate_prototypes([a, b], sources=["client-a", "client-b"])
    msg = str(e.value)
    assert "d=3" in msg and "client-a" in msg and "client-b" in msg
    with pytest.raises(ValueError, match="d=3"):
        aggregate_prototypes([a], previous={0: t(1.0, 2.0, 3.0)})


def test_counts_validated_and_tensor_keys_converted():
    with pytest.raises(ValueError, match="count"):
        aggregate_prototypes([({0: t(1.0)}, {})])
    with pytest.raises(ValueError, match="count of class 0 is 0"):
        aggregate_prototypes([({0: t(1.0)}, {0: 0})])
    # keys as 0-dim tensors (e.g. from torch.unique) become Python ints
    g = aggregate_prototypes([({torch.tensor(3): t(2.0)}, {torch.tensor(3): 4})])
    assert list(g) == [3] and type(next(iter(g))) is int
    with pytest.raises(ValueError, match="not an integer|integer scalar"):
        aggregate_prototypes([({1.5: t(2.0)}, {1.5: 1})])
    with pytest.raises(ValueError, match="source labels"):
        aggregate_prototypes([({0: t(2.0)}, {0: 1})], sources=["a", "b"])


# ------------------------------------------------------------------ loss
def test_fedproto_loss_hand_values_both_reductions():
    z = t([1.0, 1.0], [0.0, 0.0], [3.0, 0.0])
    y = torch.tensor([0, 1, 2])
    protos = {0: t(0.0, 1.0), 2: t(0.0, 0.0)}  # class 1 has no prototype
    loss, n = fedproto_loss(z, y, protos)
    assert n == 2
    assert math.isclose(loss.item(), (1.0 + 9.0) / 2, abs_tol=1e-15)
    loss_mse, n2 = fedproto_loss(z, y, protos, reduction="mse")
    assert n2 == 2 and math.isclose(loss_mse.item(), 10.0 / (3 * 2), abs_tol=1e-15)


def test_fedproto_mse_matches_official_construction():
    # official FedProto / HtFLlib: target = features.detach(), rows replaced by the global proto
    torch.manual_seed(0)
    z = torch.randn(6, 4, dtype=D64)
    y = torch.tensor([0, 1, 2, 1, 0, 3])
    protos = {0: torch.randn(4, dtype=D64), 1: torch.randn(4, dtype=D64)}
    target = z.detach().clone()
    for j, lab in enumerate(y.tolist()):
        if lab in protos:
            target[j] = protos[lab]
    official = nn.MSELoss()(target, z)
    ours, n = fedproto_loss(z, y, protos, reduction="mse")
    assert n == 4
    assert math.isclose(ours.item(), official.item(), rel_tol=1e-12)


def test_int_key_bug_guard_labels_as_longtensor():
    z = t([1.0, 0.0], [0.0, 2.0])
    y = torch.tensor([0, 1], dtype=torch.long)
    protos = {0: t(0.0, 0.0), 1: t(0.0, 0.0)}  # plain Python int keys
    loss, n = fedproto_loss(z, y, protos)
    assert n == 2 and math.isclose(loss.item(), (1.0 + 4.0) / 2, abs_tol=1e-15)
    # prototypes keyed by the tensors that torch.unique returns are matched too
    tkeys = {c: t(0.0, 0.0) for c in torch.unique(y)}
    loss2, n2 = fedproto_loss(z, y, tkeys)
    assert n2 == 2 and math.isclose(loss2.item(), 2.5, abs_tol=1e-15)


def test_no_covered_sample_gives_graph_attached_zero():
    z = torch.randn(3, 2, requires_grad=True)
    loss, n = fedproto_loss(z, torch.tensor([0, 1, 1]), {5: torch.zeros(2)})
    assert n == 0 and loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(z.grad, torch.zeros(3, 2))
    loss_e, n_e = fedproto_loss(z, torch.tensor([0, 1, 1]), {})
    assert n_e == 0 and loss_e.requires_grad


def test_fedproto_loss_gradient_through_linear_encoder_closed_form():
    torch.manual_seed(1)
    enc = nn.Linear(3, 2, bias=False).double()
    x = torch.randn(5, 3, dtype=D64)
    y = torch.tensor([0, 1, 0, 2, 1])
    protos = {0: t(1.0, -1.0), 1: t(0.5, 2.0)}  # class 2 uncovered
    loss, n = fedproto_loss(enc(x), y, protos)
    loss.backward()
    assert n == 4
    # d/dW (1/n) sum_j ||W x_j - p_j||^2 = (2/n) sum_j (W x_j - p_j) x_j^T over covered j
    with torch.no_grad():
        expected = torch.zeros(2, 3, dtype=D64)
        for j in range(5):
            lab = int(y[j])
            if lab in protos:
                expected += 2.0 / n * torch.outer(enc.weight @ x[j] - protos[lab], x[j])
    assert enc.weight.grad.abs().sum() > 0
    assert torch.allclose(enc.weight.grad, expected, atol=1e-12)


def test_fedproto_loss_rejects_dim_mismatch_and_bad_reduction():
    with pytest.raises(ValueError, match="d=3.*d=2|d=2.*d=3"):
        fedproto_loss(torch.zeros(2, 3), torch.tensor([0, 1]), {0: torch.zeros(2)})
    with pytest.raises(ValueError, match="reduction"):
        fedproto_loss(torch.zeros(2, 2), torch.tensor([0, 1]), {}, reduction="sum")
    with pytest.raises(ValueError, match="NaN"):
        fedproto_loss(torch.zeros(2, 2), torch.tensor([0, 1]), {0: torch.tensor([math.nan, 0.0])})


# ------------------------------------------------------------------ inference
def test_nearest_prototype_predict_hand_example():
    protos = {1: t(0.0, 0.0), 4: t(10.0, 0.0), 7: t(0.0, 10.0)}
    z = t([1.0, 1.0], [9.0, 1.0], [2.0, 8.0], [6.0, 0.0], [5.0, 0.0])
    pred = nearest_prototype_predict(z, protos)
    assert pred.dtype == torch.int64
    assert pred.tolist() == [1, 4, 7, 4, 1]  # last row: tie 1 vs 4 -> smaller id
    with pytest.raises(ValueError, match="empty"):
        nearest_prototype_predict(z, {})
    with pytest.raises(ValueError, match="d=2.*d=3"):
        nearest_prototype_predict(z, {0: torch.zeros(3, dtype=D64)})


# ------------------------------------------------------------------ pooling adapter
def test_pooling_adapter_windows_by_hand():
    a = PoolingAdapter(5, 3)
    out = a(t([1.0, 2.0, 3.0, 4.0, 5.0]))
    # windows [0,2), [1,4), [3,5)
    assert torch.allclose(out, t([1.5, 3.0, 4.5]))
    assert list(a.parameters()) == []
    down = PoolingAdapter(8, 2)(torch.arange(8, dtype=D64).reshape(1, 8))
    assert torch.equal(down, t([1.5, 5.5]))  # groups of 4
    up = PoolingAdapter(2, 4)(t([3.0, -1.0]))
    assert torch.equal(up, t([3.0, 3.0, -1.0, -1.0]))  # each entry repeated twice
    batched = PoolingAdapter(8, 2)(torch.ones(2, 3, 8))
    assert batched.shape == (2, 3, 2)
    with pytest.raises(ValueError, match="d_in=5"):
        a(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="d_common"):
        PoolingAdapter(5, 0)


def test_common_dimension_names_the_dims():
    with pytest.raises(ValueError) as e:
        common_dimension("none", {0: 16, 1: 32, 2: 16}, "fedproto-dim")
    assert "d=16: partition-ids [0, 2]; d=32: partition-ids [1]" in str(e.value)
    assert "fedproto-dim='none'" in str(e.value)
    assert common_dimension("none", {0: 16, 1: 16}, "fedproto-dim") == 16
    assert common_dimension("auto", {0: 16, 1: 32}, "fedproto-dim") == 16
    assert common_dimension(24, {0: 16, 1: 32}, "fedproto-dim") == 24
