"""Pilot selection strategies and Parseval normalisation (paper App. B; notes/variants-pilots.md).

Unit tests of :mod:`flwr_sheaf.sheaf.pilots` (determinism from (seed, round), budgets, per-group
counts, dynamic persistence, adaptive on a planted toy, Parseval identities and the exact
invariance it gives the Procrustes fit), the selection message and its digest check, and in-process
runs of the real :class:`~flwr_sheaf.methods.sheaf_frl.strategy.SheafFRL` with the CNN ClientApp (tiny zoo):
what is relayed equals the held matrices reduced by the round's selection (also under partial
participation, with cached matrices from older rounds), and a node given indices in another order
than its neighbours' matrices fails with a recorded error instead of fitting a wrong map.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.config import ConfigError, FederationConfig, LocalTrainConfig
from flwr_sheaf.methods.sheaf_frl.client import received_selection
from flwr_sheaf.methods.sheaf_frl.config import SheafConfig
from flwr_sheaf.methods.sheaf_frl.protocol import (
    PILOT_INDEX_DIGEST,
    PILOT_SELECTION,
    index_digest,
    pack_pilot_selection,
    unpack_pilot_selection,
)
from flwr_sheaf.methods.sheaf_frl.strategy import SheafFRL
from flwr_sheaf.protocol import CONFIG, ProtocolError, pack_arrays
from flwr_sheaf.sheaf import procrustes
from flwr_sheaf.sheaf.pilots import (
    PilotSampler,
    adaptive_indices,
    apply_selection,
    cluster_pilots,
    dynamic_indices,
    group_means,
    parse_pilot_strategy,
    parseval,
    pilot_mismatch,
    stratified_indices,
    uniform_indices,
)
from flwr_sheaf.strategy.discovery import oriented_edges
from flwr_sheaf.testing import LocalGrid


# ------------------------------------------------------------------------------ parsing
def test_parse_pilot_strategy_forms_and_errors():
    assert parse_pilot_strategy("all").kind == "all"
    assert parse_pilot_strategy("uniform:100").k == 100
    s = parse_pilot_strategy("dynamic:20+30")
    assert (s.kind, s.k, s.persistent, s.refresh) == ("dynamic", 50, 20, 30)
    assert (
        parse_pilot_strategy("prototype-class").prototype
        and parse_pilot_strategy("prototype-class").groups == "class"
    )
    assert parse_pilot_strategy("stratified-cluster:50").groups == "cluster"
    for bad in (
        "uniform",
        "uniform:1",
        "dynamic:5",
        "dynamic:5+0",
        "random:3",
        "prototype-class:4",
    ):
        with pytest.raises(ValueError, match="pilot-strategy"):
            parse_pilot_strategy(bad)
    with pytest.raises(ConfigError, match="pilot-strategy"):
        SheafConfig.from_mapping({"pilot-strategy": "uniform:0"})
    with pytest.raises(ConfigError, match="pilot-normalisation"):
        SheafConfig.from_mapping({"pilot-normalisation": "qr"})


# ------------------------------------------------------------------------------ samplers
def test_uniform_is_a_function_of_seed_and_round_only():
    a = uniform_indices(500, 50, seed=3, server_round=4)
    assert np.array_equal(
        a, uniform_indices(500, 50, seed=3, server_round=4)
    )  # any node, any process
    assert (
        a.dtype == np.int64 and a.size == 50 and np.unique(a).size == 50 and np.all(np.diff(a) > 0)
    )
    assert not np.array_equal(a, uniform_indices(500, 50, seed=3, server_round=5))
    assert not np.array_equal(a, uniform_indices(500, 50, seed=4, server_round=4))
    assert np.array_equal(uniform_indices(500, 500, 0, 1), np.arange(500))  # uniform:M is all
    # unbiased Monte Carlo: every pilot's inclusion frequency over rounds is ~ K/M = 0.1
    freq = (
        np.bincount(
            np.concatenate([uniform_indices(100, 10, 0, t) for t in range(1, 2001)]), minlength=100
        )
        / 2000
    )
    assert np.abs(freq - 0.1).max() < 0.035


def test_stratified_class_takes_a_fixed_number_per_class():
    labels = np.repeat(np.arange(10), [60, 40, 55, 45, 50, 50, 70, 30, 52, 48])
    for k, seed, rnd in ((50, 0, 1), (100, 1, 7), (73, 2, 3)):
        idx = stratified_indices(labels, k, seed, rnd)
        counts = np.bincount(labels[idx], minlength=10)
        assert idx.size == k and np.unique(idx).size == k
        assert (
            set(counts.tolist()) <= {k // 10, k // 10 + 1}
            and (counts == k // 10 + 1).sum() == k % 10
        )
        assert np.array_equal(idx, stratified_indices(labels, k, seed, rnd))
    # a class smaller than its quota gives everything; the shortfall comes from the others
    small = np.array([0] * 3 + [1] * 50 + [2] * 50)
    idx = stratified_indices(small, 30, 0, 1)
    assert idx.size == 30 and np.bincount(small[idx], minlength=3)[0] == 3


def test_cluster_grouping_recovers_planted_blobs_and_stratified_cluster_samples_per_cluster():
    rng = np.random.default_rng(0)
    planted = np.repeat(np.arange(4), 25)
    centres = rng.standard_normal((4, 8)) * 20
    feats = centres[planted] + rng.standard_normal((100, 8))
    groups = cluster_pilots(feats, 4, seed=0)
    # the same partition up to relabelling: a bijection between planted and found ids
    pairs = set(zip(planted.tolist(), groups.tolist()))
    assert len(pairs) == 4 and len({a for a, _ in pairs}) == 4 and len({b for _, b in pairs}) == 4
    assert np.array_equal(groups, cluster_pilots(feats, 4, seed=0))
    sampler = PilotSampler(
        parse_pilot_strategy("stratified-cluster:16"), 100, seed=1, features=feats
    )
    assert sampler.num_groups == 4  # round(sqrt(16)) clusters
    sel = sampler.select(2)
    assert np.array_equal(np.bincount(planted[sel.indices], minlength=4), [4, 4, 4, 4])
    with pytest.raises(ValueError, match="features"):
        PilotSampler(parse_pilot_strategy("stratified-cluster:16"), 100, seed=1)


def test_prototype_rows_are_group_means():
    labels = np.array([2, 0, 2, 1, 0, 1, 1])
    s = PilotSampler(parse_pilot_strategy("prototype-class"), 7, seed=0, labels=labels)
    sel = s.select(5)
    assert sel.num_rows == 3 and np.array_equal(sel.indices, np.arange(7))
    a = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    got = apply_selection(a, sel)
    ref = np.stack([a.detach().numpy()[labels == c].mean(0) for c in range(3)])
    np.testing.assert_allclose(got.detach().numpy(), ref, atol=1e-12)
    got.sum().backward()  # differentiable (the node's own centroids sit inside the loss)
    np.testing.assert_allclose(a.grad.numpy()[:, 0], [1 / np.sum(labels == c) for c in labels])
    assert group_means(a.detach(), torch.tensor([0, 0, 1, 1, 1, 1, 1]), 2).shape == (2, 4)


def test_dynamic_keeps_the_persistent_subset_and_refreshes_the_rest():
    sets = [set(dynamic_indices(200, 20, 30, seed=7, server_round=t).tolist()) for t in range(1, 6)]
    assert all(len(s) == 50 for s in sets)
    persistent = set(
        dynamic_indices(200, 20, 0, seed=7, server_round=9).tolist()
    )  # R = 0: the persistent part
    assert len(persistent) == 20 and all(persistent <= s for s in sets)  # ... is in every round
    assert persistent == set(dynamic_indices(200, 20, 0, seed=7, server_round=1).tolist())
    assert persistent != set(dynamic_indices(200, 20, 0, seed=8, server_round=1).tolist())
    # the refreshed part changes with the round
    a, b = dynamic_indices(200, 20, 30, 7, 1), dynamic_indices(200, 20, 30, 7, 2)
    assert len(set(a) & set(b)) < 50
    assert len(set.union(*sets)) > 50 + 30  # coverage grows through the refreshed part


def test_adaptive_picks_the_pilots_with_the_largest_planted_mismatch():
    rng = np.random.default_rng(1)
    m, d = 60, 6
    base = rng.standard_normal((m, d))
    q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    bank = {0: base, 1: base @ q.T, 2: base @ np.linalg.qr(rng.standard_normal((d, d)))[0]}
    planted = np.array([3, 17, 29, 41, 58])
    bank[1] = bank[1].copy()
    bank[1][planted] += 3.0 * rng.standard_normal(
        (planted.size, d)
    )  # node 1 disagrees on these pilots
    score = pilot_mismatch(bank, [(1, 0), (2, 1), (2, 0)])
    assert np.array_equal(np.sort(np.argsort(-score)[:5]), planted)
    sampler = PilotSampler(parse_pilot_strategy("adaptive:5"), m, seed=0)
    assert np.array_equal(sampler.select(3, score).indices, planted)
    # nothing held yet (round 1): a uniform draw of K
    assert sampler.select(1, None).indices.size == 5
    assert np.isnan(pilot_mismatch({0: base}, [(1, 0)])).all()
    # ties are broken by the seeded permutation, the same for the same (seed, round)
    flat = np.zeros(10)
    assert np.array_equal(adaptive_indices(flat, 3, 0, 1), adaptive_indices(flat, 3, 0, 1))


# ------------------------------------------------------------------------------ Parseval
@pytest.mark.parametrize("k, d", [(5, 12), (40, 12), (12, 12)])
def test_parseval_identities(k, d):
    a = torch.randn(k, d, dtype=torch.float64)
    p = parseval(a)
    if k <= d:  # the paper's regime: A~^T A~ = I_K (rows orthonormal)
        torch.testing.assert_close(p @ p.T, torch.eye(k, dtype=torch.float64))
    if k >= d:  # K x K Gram singular: the rows are a Parseval frame of R^d
        torch.testing.assert_close(p.T @ p, torch.eye(d, dtype=torch.float64))
    # it is the polar factor: P = P~ H with H symmetric PSD (column convention A = A~ (A^T A)^{1/2})
    h = (p.T @ a) if k >= d else (a @ p.T)
    torch.testing.assert_close(h, h.T)
    assert torch.linalg.eigvalsh(h).min() > -1e-10
    # the paper's closed form for K < d: A (A^T A)^{-1/2} in columns = (P P^T)^{-1/2} P in rows
    if k < d:
        w, v = torch.linalg.eigh(a @ a.T)
        torch.testing.assert_close(p, v @ torch.diag(w**-0.5) @ v.T @ a)


@pytest.mark.parametrize("k, dh, dt", [(50, 10, 6), (8, 10, 6)])
def test_parseval_makes_procrustes_invariant_to_an_invertible_change_of_latent_basis(k, dh, dt):
    """For full-rank pilots, parseval(P M) = parseval(P) R with R orthogonal for any invertible M, so the
    Procrustes fit on normalised pilots absorbs R: the residual does not change (tail or head side) and
    the tail's transported pilots are identical. Without normalisation the residual changes."""
    g = torch.Generator().manual_seed(k)
    z = torch.randn(k, dt, generator=g, dtype=torch.float64)
    a_t = z
    a_h = z @ torch.linalg.qr(torch.randn(dh, dt, generator=g, dtype=torch.float64))[
        0
    ].T + 0.3 * torch.randn(k, dh, generator=g, dtype=torch.float64)
    m = torch.randn(dt, dt, generator=g, dtype=torch.float64) + 3 * torch.eye(
        dt, dtype=torch.float64
    )  # invertible
    mh = torch.randn(dh, dh, generator=g, dtype=torch.float64) + 3 * torch.eye(
        dh, dtype=torch.float64
    )
    assert abs(float(torch.linalg.det(m))) > 1e-3 and abs(float(torch.linalg.det(mh))) > 1e-3

    def fit(h, t):
        v = procrustes(h, t)
        return v, t @ v.T, float(((h - t @ v.T) ** 2).sum())

    ph, pt, ptm = parseval(a_h), parseval(a_t), parseval(a_t @ m)
    r = (
        pt.T @ ptm
    )  # K >= d_t: parseval(P M) = parseval(P) R, R = parseval(P)^T parseval(P M) orthogonal
    torch.testing.assert_close(r.T @ r, torch.eye(dt, dtype=torch.float64))
    torch.testing.assert_close(pt @ r, ptm)
    v0, moved0, res0 = fit(ph, pt)
    v1, moved1, res1 = fit(ph, ptm)
    assert res0 > 1e-3  # not the vacuous case (see the next test)
    assert abs(res0 - res1) < 1e-9
    torch.testing.assert_close(moved0, moved1)  # transported pilots identical
    torch.testing.assert_close(v1, v0 @ r)  # the map absorbs R
    # the head side (K >= d_h, or K < d_h where R_h exists by completing the orthonormal rows)
    assert abs(fit(parseval(a_h @ mh), pt)[2] - res0) < 1e-9

    # counterexample: without normalisation the (scale-free) residual changes under M
    def rel(h, t):
        return fit(h, t)[2] / float((h**2).sum())

    assert abs(rel(a_h, a_t) - rel(a_h, a_t @ m)) > 1e-2


def test_parseval_with_fewer_pilots_than_dimensions_makes_procrustes_vacuous():
    """K <= d_t: two normalised K-frames are always isometric, so the residual is 0 for *unrelated*
    pilots -- the invariance holds trivially and the map is identified only on the pilots' span (App. C)."""
    g = torch.Generator().manual_seed(1)
    a_h, a_t = (
        torch.randn(4, 10, generator=g, dtype=torch.float64),
        torch.randn(4, 6, generator=g, dtype=torch.float64),
    )
    ph, pt = parseval(a_h), parseval(a_t)
    v = procrustes(ph, pt)
    assert float(((ph - pt @ v.T) ** 2).sum()) < 1e-20
    assert (
        float(((a_h - a_t @ procrustes(a_h, a_t).T) ** 2).sum()) > 1.0
    )  # unnormalised: they do not align


def test_parseval_is_differentiable_and_rejects_bad_input():
    a = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    parseval(a).pow(2).mul(torch.arange(3.0, dtype=torch.float64)).sum().backward()
    assert a.grad is not None and torch.isfinite(a.grad).all()
    with pytest.raises(ValueError, match="NaN"):
        parseval(torch.full((3, 2), float("nan")))
    with pytest.raises(ValueError, match="pilot matrix"):
        parseval(torch.zeros(3))


# ------------------------------------------------------------------------------ selection message
def test_selection_digest_refuses_other_indices_or_order():
    idx = np.array([1, 4, 9])
    rec = pack_pilot_selection(idx)
    got, grp = unpack_pilot_selection(rec, index_digest(idx), 10)
    assert np.array_equal(got, idx) and grp is None
    with pytest.raises(ProtocolError, match=f"{PILOT_SELECTION}.*{PILOT_INDEX_DIGEST}"):
        unpack_pilot_selection(pack_pilot_selection(idx[::-1].copy()), index_digest(idx), 10)
    with pytest.raises(ProtocolError, match="digest"):
        unpack_pilot_selection(
            pack_pilot_selection(idx, np.array([0, 1, 1])),
            index_digest(idx, np.array([0, 1, 0])),
            10,
        )
    with pytest.raises(ProtocolError, match="outside"):
        unpack_pilot_selection(
            pack_pilot_selection(np.array([1, 10])), index_digest(np.array([1, 10])), 10
        )
    msg = SimpleNamespace(
        content=RecordDict({PILOT_SELECTION: rec, CONFIG: ConfigRecord({})})
    )  # what it reads
    with pytest.raises(ProtocolError, match=PILOT_INDEX_DIGEST):
        received_selection(msg, 10)


# ------------------------------------------------------------------------------ in-process runs (CNN ClientApp)
RC = {
    "zoo": "tiny-4",
    "num-pilots": 40,
    "local-epochs": 1,
    "lambda": 0.5,
    "seed": 3,
    "batch-size": 64,
    "max-steps-per-epoch": 3,
}


def _run(
    strategy_cls,
    pilot_strategy: str,
    participation: str = "1.0",
    rounds: int = 3,
    normalisation: str = "none",
):
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    # seed 0 with participation 1,.5,1,.5: node 3 trains in round 1, not in 2, its neighbours in 3 (a stale relay)
    fed = FederationConfig(graph="ring", participation=participation, seed=0, evaluate_every=0)
    s = strategy_cls(
        num_nodes=4,
        federation=fed,
        train=LocalTrainConfig(local_epochs=1, batch_size=64, max_steps_per_epoch=3),
        sheaf=SheafConfig(
            lam=0.5, pilot_strategy=pilot_strategy, pilot_normalisation=normalisation
        ),
    )
    s.start(grid=grid, num_rounds=rounds)
    return s, grid


def _log(grid: LocalGrid):
    produced: dict[int, dict[int, np.ndarray]] = {}
    for r in grid.replies:
        if r.metadata.message_type == "train.sheaf" and not r.has_error():
            produced.setdefault(int(r.metadata.group_id), {})[
                grid.partition_of(r.metadata.src_node_id)
            ] = r.content["pilots"]["pilots"].numpy()
    msgs: dict[int, dict[int, Message]] = {}
    for m in grid.delivered:
        if m.metadata.message_type == "train.sheaf":
            msgs.setdefault(int(m.metadata.group_id), {})[
                grid.partition_of(m.metadata.dst_node_id)
            ] = m
    return produced, msgs


@pytest.mark.parametrize(
    "pilot_strategy, participation, normalisation",
    [
        ("uniform:12", "1.0,0.5,1.0,0.5", "parseval"),
        ("prototype-class", "1.0", "none"),
        ("adaptive:12", "1.0", "none"),
    ],
)
def test_relayed_pilots_are_the_held_matrices_reduced_by_the_round_selection(
    pilot_strategy, participation, normalisation
):
    s, grid = _run(SheafFRL, pilot_strategy, participation, rounds=3, normalisation=normalisation)
    produced, msgs = _log(grid)
    assert not s.ledger.failures
    stale = 0
    for t, per_node in msgs.items():
        sels = {i: received_selection(m, 40) for i, m in per_node.items()}
        if (
            pilot_strategy.startswith("prototype") and t == 1
        ):  # round 1 asks for the pilots' labels, relays nothing
            assert all(
                x is None
                and not m.content["pilots"].keys()
                and m.content["config"]["pilot-describe"] == "class"
                for x, m in zip(sels.values(), per_node.values())
            )
            continue
        digests = {index_digest(x.indices, x.groups) for x in sels.values()}
        assert len(digests) == 1  # identical indices, order and groups on every node of the round
        sel = next(iter(sels.values()))
        for _i, m in per_node.items():
            for key in m.content["pilots"].keys():
                j = int(key)
                last = max(r for r in produced if r < t and j in produced[r])
                stale += t - last > 1
                expect = apply_selection(torch.tensor(produced[last][j]), sel).numpy()
                np.testing.assert_allclose(
                    m.content["pilots"][key].numpy(), expect, rtol=1e-6, atol=1e-6
                )
                assert m.content["pilots"][key].numpy().shape[0] == sel.num_rows
        if (
            pilot_strategy.startswith("adaptive") and t > 1
        ):  # top-12 of an independent numpy mismatch
            held = {
                j: produced[max(r for r in produced if r < t and j in produced[r])][j].astype(
                    np.float64
                )
                for j in range(4)
            }
            score = np.zeros(40)
            for h, tl in oriented_edges(s.graph, s.nodes):
                u, _, wt = np.linalg.svd(held[h].T @ held[tl], full_matrices=False)
                score += ((held[h] - held[tl] @ (u @ wt).T) ** 2).sum(1) / len(
                    oriented_edges(s.graph, s.nodes)
                )
            assert np.array_equal(sel.indices, np.sort(np.argsort(-score)[:12]))
    if pilot_strategy.startswith("prototype"):
        assert sel.num_rows == s.pilots.sampler.num_groups > 1
        assert s.history[-1]["pilot_rows"] == sel.num_rows
    else:
        assert sel.indices.size == 12 and s.history[-1]["pilot_rows"] == 12
        assert (stale > 0) == (
            participation != "1.0"
        )  # partial: a cached older matrix reduced with today's selection


class _ReversingStrategy(SheafFRL):
    """Sends partition-id 2 this round's indices in reverse order (neighbours' matrices untouched)."""

    def node_payload(self, server_round, pid):
        records, cfg = super().node_payload(server_round, pid)
        if pid == 2 and PILOT_SELECTION in records:
            idx = self.pilots.selection.indices[::-1].copy()
            records[PILOT_SELECTION] = pack_pilot_selection(idx)
        return records, cfg


def test_a_node_given_indices_in_another_order_fails_with_a_named_error():
    s, grid = _run(_ReversingStrategy, "uniform:10", rounds=2)
    fails = [f for f in s.ledger.failures if f["partition-id"] == 2]
    assert len(fails) == 2 and [f["round"] for f in fails] == [1, 2], s.ledger.failures
    assert all(
        "pilot index mismatch" in f["reason"] and PILOT_INDEX_DIGEST in f["reason"] for f in fails
    )
    assert {f["partition-id"] for f in s.ledger.failures} == {2}
    assert 2 not in s.bank  # its pilots were never stored


def test_strategy_groups_once_from_the_first_description_and_refuses_a_different_one():
    s = SheafFRL(num_nodes=3, sheaf=SheafConfig(pilot_strategy="prototype-class"))
    s.num_pilots = 6
    s.ledger.begin_round(1)
    labels = np.array([3, 1, 3, 1, 7, 7], dtype=np.int64)

    def reply(lab):
        return SimpleNamespace(content=RecordDict({"pilot-public": pack_arrays({"labels": lab})}))

    assert s._accept_description(1, 0, reply(labels))
    assert s.pilots.sampler.num_groups == 3
    np.testing.assert_array_equal(
        s.pilots.sampler.groups, [1, 0, 1, 0, 2, 2]
    )  # classes 1, 3, 7 -> 0, 1, 2
    assert s._accept_description(1, 1, reply(labels.copy()))  # the same description: accepted
    assert not s._accept_description(
        1, 2, reply(labels[::-1].copy())
    )  # another order: refused, recorded
    assert not s._accept_description(1, 2, SimpleNamespace(content=RecordDict({})))
    assert [f["partition-id"] for f in s.ledger.failures] == [2, 2]
    assert (
        "differs" in s.ledger.failures[0]["reason"]
        and "pilot-public/labels" in s.ledger.failures[1]["reason"]
    )
