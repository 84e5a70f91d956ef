"""Partial participation in Sheaf-FRL: absent-neighbour policies, edge weights, the toy sheaf check.

Two kinds of tests:

- the **toy check** (notes/participation.md, s5): a quadratic sheaf problem (6
  agents on a ring plus a chord, stalks R^3, fixed orthogonal restriction maps, local loss
  ``||x_i - b_i||^2 / 2`` plus the gluing penalty, a few local gradient steps, uneven Bernoulli
  participation p = [.9, .9, .9, .2, .2, .2]). Its full-participation optimum solves
  ``(I + mu L) x = b`` with the sheaf Laplacian ``L`` of :class:`flwr_sheaf.sheaf.NetworkSheaf`.
  A small ClientApp runs it through the real :class:`~flwr_sheaf.methods.sheaf_frl.strategy.SheafFRL` on a
  :class:`~flwr_sheaf.testing.LocalGrid` (its gradient is the package's
  :func:`~flwr_sheaf.sheaf.local_gluing_penalty`, edge weights included), and an independent numpy
  reference of the same dynamics must agree with it to rounding error. ``cached`` reaches the optimum
  (< 1e-3 relative error), ``drop`` is biased (> 0.3); ``drop-reweighted`` (1/q) with one local step
  and a decaying step size gets within 0.05 (numpy reference, 2e4 rounds);
- **strategy-level** tests with the CNN ClientApp (tiny zoo, 32 pilots): what each policy relays
  (pilots, ages, weights) against an independent reconstruction from the delivered messages and the
  replies; p_i = 0 nodes and rounds where nobody is sampled.
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest
import torch
from flwr.app import Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.config import ConfigError, FederationConfig, LocalTrainConfig
from flwr_sheaf.methods.sheaf_frl.config import SheafConfig
from flwr_sheaf.methods.sheaf_frl.strategy import SheafFRL
from flwr_sheaf.participation import (
    ParticipationSampler,
    bernoulli_participation,
    parse_participation,
)
from flwr_sheaf.protocol import EdgeConfig, NodeInfo, ProtocolError, pack_arrays
from flwr_sheaf.sheaf import EdgeTerm, NetworkSheaf, local_gluing_penalty, procrustes
from flwr_sheaf.testing import LocalGrid

torch.set_num_threads(1)

# ---------------------------------------------------------------------------------------- toy sheaf
N_TOY, D, KP = 6, 3, 2  # agents, stalk dimension, pilot rows
MU = 1.0  # penalty weight per edge: lambda / (d K) in Eq. 16
LAM = MU * D * KP
P_TOY = [0.9, 0.9, 0.9, 0.2, 0.2, 0.2]
Q_MIN = 0.05


def _toy_problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    graph = nx.cycle_graph(N_TOY)
    graph.add_edge(0, 3)
    maps = {}
    for a, b in sorted(graph.edges):
        h, t = max(a, b), min(a, b)  # equal stalks: the larger partition-id is the head
        q, r = np.linalg.qr(rng.normal(size=(D, D)))
        maps[(h, t)] = q * np.sign(np.diag(r))
    targets = rng.normal(size=(N_TOY, KP, D))
    return graph, maps, targets


GRAPH, MAPS, B = _toy_problem()


def _optimum() -> np.ndarray:
    sheaf = NetworkSheaf(
        GRAPH, {i: D for i in range(N_TOY)}, {e: torch.from_numpy(v) for e, v in MAPS.items()}
    )
    lap = sheaf.laplacian().numpy()
    rhs = B.transpose(0, 2, 1).reshape(N_TOY * D, KP)  # node blocks stacked, one column per pilot
    x = np.linalg.solve(np.eye(N_TOY * D) + MU * lap, rhs)
    return x.reshape(N_TOY, D, KP).transpose(0, 2, 1)


X_STAR = _optimum()


def _rel_err(x: np.ndarray) -> float:
    return float(np.linalg.norm(x - X_STAR) / np.linalg.norm(X_STAR))


def toy_client_app(local_steps: int, step_size: float) -> ClientApp:
    """Agent i holds x_i (its 'pilots', (KP, D)); K gradient steps on ||x_i - b_i||^2/2 + Eq. 16."""
    app = ClientApp()

    @app.query("sheaf")
    def _query(msg: Message, context) -> Message:
        info = NodeInfo(
            int(context.node_config["partition-id"]),
            int(context.node_config["num-partitions"]),
            D,
            (0,),
            KP,
            1,
        )
        return Message(RecordDict({"info": info.to_record()}), reply_to=msg)

    @app.train("sheaf")
    def _train(msg: Message, context) -> Message:
        i = int(context.node_config["partition-id"])
        cfg = msg.content["config"]
        edges = EdgeConfig.from_config(cfg)
        weights = dict(zip(edges.neighbours, edges.weights or ()))
        rec = msg.content["pilots"]
        nb = {int(k): torch.from_numpy(rec[k].numpy().copy()) for k in rec.keys()}
        x = (
            torch.from_numpy(context.state["x"]["x"].numpy().copy())
            if "x" in context.state
            else torch.zeros(KP, D, dtype=torch.float64)
        )
        b = torch.from_numpy(B[i])
        terms = [
            EdgeTerm(
                j, nb[j], torch.from_numpy(MAPS[(i, j) if hd else (j, i)]), hd, weights.get(j, 1.0)
            )
            for j, hd in zip(edges.neighbours, edges.heads)
            if j in nb
        ]
        for _ in range(local_steps):
            x = x.detach().requires_grad_(True)
            pen, _ = local_gluing_penalty(x, terms, float(cfg["lambda"]))
            loss = 0.5 * ((x - b) ** 2).sum() + pen
            (g,) = torch.autograd.grad(loss, x)
            x = x.detach() - step_size * g
        context.state["x"] = pack_arrays({"x": x.numpy()})
        return Message(
            RecordDict(
                {
                    "pilots": pack_arrays({"pilots": x.numpy()}),
                    "metrics": MetricRecord(
                        {
                            "num-examples": 1,
                            "ce": 0.0,
                            "gluing": float(pen.detach()),
                            "low-variance-fraction": 0.0,
                        }
                    ),
                }
            ),
            reply_to=msg,
        )

    return app


def toy_reference(
    policy: str, rounds: int, local_steps: int, alpha, seed: int = 1
) -> tuple[np.ndarray, list[dict]]:
    """Independent numpy model of the same dynamics (the strategy's policy semantics, written out).

    Returns the final iterates and, per round, ``{(i, j): weight}`` of the edge terms used.
    """
    x = np.zeros((N_TOY, KP, D))
    bank, produced = {}, {}
    counts = np.zeros((rounds + 1, N_TOY))  # counts[r] = arrivals in rounds 1..r
    used = []
    for t in range(1, rounds + 1):
        drawn = bernoulli_participation(P_TOY, t, seed)
        # q_j for round t: arrival frequency over rounds 1..t-2 (independent of arrival in t-1), floored
        q = np.maximum(counts[t - 2] / (t - 2), Q_MIN) if t > 2 else np.ones(N_TOY)
        a_t = alpha(t) if callable(alpha) else alpha
        new, used_t = {}, {}
        for i in np.flatnonzero(drawn):
            terms = []
            for j in sorted(GRAPH.neighbors(i)):
                if j not in bank or (policy != "cached" and produced[j] != t - 1):
                    continue
                terms.append((j, 1.0 / q[j] if policy == "drop-reweighted" else 1.0))
                used_t[(int(i), j)] = terms[-1][1]
            xi = x[i].copy()
            for _ in range(local_steps):
                g = xi - B[i]
                for j, w in terms:
                    if i > j:  # i is the head: residual x_i - x_j V^T
                        g = g + MU * w * (xi - bank[j] @ MAPS[(i, j)].T)
                    else:  # i is the tail: residual x_j - x_i V^T
                        g = g - MU * w * (bank[j] - xi @ MAPS[(j, i)].T) @ MAPS[(j, i)]
                xi = xi - a_t * g
            new[int(i)] = xi
        for i, xi in new.items():
            x[i] = xi
            bank[i] = xi.copy()
            produced[i] = t
        counts[t] = counts[t - 1] + drawn
        used.append(used_t)
    return x, used


def _toy_strategy(policy: str) -> SheafFRL:
    fed = FederationConfig(participation=",".join(map(str, P_TOY)), seed=1, evaluate_every=0)
    return SheafFRL(
        num_nodes=N_TOY,
        graph=GRAPH,
        federation=fed,
        sheaf=SheafConfig(
            lam=LAM, absent_policy=policy, reweight_q_min=Q_MIN, sheaf_variant="heterogeneous"
        ),
    )  # the toy client runs Alg. 1


def _run_toy(policy: str, rounds: int, local_steps: int = 5, step_size: float = 0.05):
    grid = LocalGrid(toy_client_app(local_steps, step_size), N_TOY)
    strategy = _toy_strategy(policy)
    strategy.start(grid=grid, num_rounds=rounds)
    x = np.zeros((N_TOY, KP, D))
    for nid, ctx in grid.contexts.items():
        if "x" in ctx.state:
            x[grid.partition_of(nid)] = ctx.state["x"]["x"].numpy()
    return x, strategy, grid


def test_toy_laplacian_optimum_is_the_stationary_point_of_the_local_objectives():
    """Sanity of the oracle: at x*, every agent's full local gradient (all edges, weight 1) vanishes."""
    for i in range(N_TOY):
        x = torch.from_numpy(X_STAR[i]).requires_grad_(True)
        terms = [
            EdgeTerm(
                j,
                torch.from_numpy(X_STAR[j]),
                torch.from_numpy(MAPS[(max(i, j), min(i, j))]),
                i > j,
            )
            for j in GRAPH.neighbors(i)
        ]
        pen, _ = local_gluing_penalty(x, terms, LAM)
        (g,) = torch.autograd.grad(0.5 * ((x - torch.from_numpy(B[i])) ** 2).sum() + pen, x)
        assert float(g.abs().max()) < 1e-12


@pytest.mark.parametrize("policy", ["cached", "drop", "drop-reweighted"])
def test_toy_flower_run_matches_the_numpy_reference(policy):
    """The strategy relays exactly what the policy says (pilots and 1/q weights), checked by dynamics."""
    rounds = 30
    x_flower, strategy, grid = _run_toy(policy, rounds)
    x_ref, used = toy_reference(policy, rounds, 5, 0.05)
    np.testing.assert_allclose(x_flower, x_ref, rtol=0, atol=1e-10)
    # the last round's relayed edges and weights equal the reference's
    assert {e: w for e, (_, w) in strategy.relayed.items()} == pytest.approx(used[-1], rel=1e-12)
    last = [
        m
        for m in grid.delivered
        if m.metadata.message_type == "train.sheaf" and m.metadata.group_id == str(rounds)
    ]
    for m in last:
        i = grid.partition_of(m.metadata.dst_node_id)
        cfg = m.content["config"]
        sent = {int(k) for k in m.content["pilots"].keys()}
        assert sent == {j for (r, j) in used[-1] if r == i}
        if policy == "drop-reweighted":
            expect = [used[-1].get((i, j), 0.0) for j in cfg["neighbours"]]
            assert list(cfg["edge-weights"]) == pytest.approx(expect, rel=1e-12)
        else:
            assert "edge-weights" not in cfg


def test_toy_check_cached_reaches_the_full_participation_optimum_and_drop_is_biased():
    """Spec (notes/participation.md, s5): cached < 1e-3 relative error; drop > 0.3 (through Flower)."""
    x_cached, s_cached, _ = _run_toy("cached", 150)
    x_drop, s_drop, _ = _run_toy("drop", 150)
    assert _rel_err(x_cached) < 1e-3
    assert _rel_err(x_drop) > 0.3
    # uneven participation really happened, and cached pilots were stale (exact) ones
    trained = np.array([r["num_trained"] for r in s_cached.history])
    assert 0 < trained.mean() < N_TOY
    assert max(r["relayed_pilot_age_max"] for r in s_cached.history) > 3
    assert max(r["relayed_pilot_age_max"] for r in s_drop.history) == 1
    assert all(math.isfinite(r["gluing_loss"]) or r["num_trained"] == 0 for r in s_cached.history)


def test_toy_check_reweighting_removes_the_drop_bias_with_one_local_step():
    """Notes B: drop + 1/q with K = 1 and a decaying step gets < 0.05 while drop stays > 0.3 (numpy reference)."""
    alpha = lambda t: 0.05 / (1 + t / 2000)  # noqa: E731
    x_rw, _ = toy_reference("drop-reweighted", 20_000, 1, alpha)
    x_drop, _ = toy_reference("drop", 20_000, 1, alpha)
    assert _rel_err(x_rw) < 0.05
    assert _rel_err(x_drop) > 0.3


# ------------------------------------------------------------------------------ CNN ClientApp tests
RC = {
    "zoo": "tiny-6",
    "num-pilots": 32,
    "local-epochs": 1,
    "lambda": 0.5,
    "seed": 3,
    "batch-size": 64,
}


def _cnn_run(
    policy: str,
    participation,
    rounds: int,
    seed: int = 5,
    evaluate: bool = False,
    evaluate_nodes: str = "auto",
):
    grid = LocalGrid(cnn_client_app, 6, run_config=RC)
    fed = FederationConfig(
        graph="ring",
        participation=",".join(map(str, participation)),
        seed=seed,
        evaluate_every=10**9 if evaluate else 0,
        evaluate_nodes=evaluate_nodes,
    )
    s = SheafFRL(
        num_nodes=6,
        federation=fed,
        train=LocalTrainConfig(local_epochs=1, batch_size=64),
        sheaf=SheafConfig(lam=0.5, absent_policy=policy, reweight_q_min=0.1),
    )
    s.start(grid=grid, num_rounds=rounds)
    return s, grid


def _replay(grid: LocalGrid):
    """Independent log: {round: {pid: pilots}} of successful train replies, and the train messages."""
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


def _last_produced(produced, j: int, before: int):
    rounds = [t for t in produced if t < before and j in produced[t]]
    return (max(rounds), produced[max(rounds)][j]) if rounds else (None, None)


P_CNN = [1.0, 0.6, 0.5, 0.3, 0.4, 0.0]  # node 5 never trains
ROUNDS_CNN = 5


def test_cached_policy_relays_every_known_neighbour_with_its_last_pilots_and_age():
    s, grid = _cnn_run("cached", P_CNN, ROUNDS_CNN)
    produced, msgs = _replay(grid)
    ring = nx.cycle_graph(6)
    stale = 0
    for t, per_node in msgs.items():
        for i, m in per_node.items():
            got = {int(k): m.content["pilots"][k].numpy() for k in m.content["pilots"].keys()}
            expect = {}
            for j in ring.neighbors(i):
                rj, a = _last_produced(produced, j, t)
                if rj is not None:
                    expect[j] = (rj, a)
            assert set(got) == set(expect)
            for j, (rj, a) in expect.items():
                np.testing.assert_array_equal(got[j], a)
                stale += (t - rj) > 1
            assert "edge-weights" not in m.content["config"]
        if t == ROUNDS_CNN:
            assert {e: a for e, (a, _) in s.relayed.items()} == {
                (i, j): t - _last_produced(produced, j, t)[0]
                for i in per_node
                for j in ring.neighbors(i)
                if _last_produced(produced, j, t)[0] is not None
            }
    assert stale > 0  # the scenario did exercise stale (exact) pilots
    assert 5 not in {i for per_node in msgs.values() for i in per_node}  # p = 0: never trained
    assert s.history[-1]["never_trained"] == 1


def test_drop_policy_relays_only_pilots_from_the_previous_round():
    s, grid = _cnn_run("drop", P_CNN, ROUNDS_CNN)
    produced, msgs = _replay(grid)
    ring = nx.cycle_graph(6)
    for t, per_node in msgs.items():
        for i, m in per_node.items():
            got = {int(k): m.content["pilots"][k].numpy() for k in m.content["pilots"].keys()}
            fresh = {j for j in ring.neighbors(i) if j in produced.get(t - 1, {})}
            assert set(got) == fresh
            for j in fresh:
                np.testing.assert_array_equal(got[j], produced[t - 1][j])
    assert all(r["relayed_pilot_age_max"] <= 1 for r in s.history)
    assert sum(r["edges_dropped"] for r in s.history) > 0


def test_drop_reweighted_sends_inverse_frequency_weights():
    s, grid = _cnn_run("drop-reweighted", P_CNN, ROUNDS_CNN)
    produced, msgs = _replay(grid)
    n_checked = 0
    for t, per_node in msgs.items():
        arrived = np.array(
            [[j in produced.get(r, {}) for j in range(6)] for r in range(1, t - 1)], dtype=bool
        ).reshape(-1, 6)
        q = np.maximum(arrived.mean(0), 0.1) if len(arrived) else np.ones(6)
        for _i, m in per_node.items():
            cfg = m.content["config"]
            fresh = {j for j in cfg["neighbours"] if j in produced.get(t - 1, {})}
            assert {int(k) for k in m.content["pilots"].keys()} == fresh
            expect = [1.0 / q[j] if j in fresh else 0.0 for j in cfg["neighbours"]]
            assert list(cfg["edge-weights"]) == pytest.approx(expect, rel=1e-12)
            n_checked += len(fresh)
    assert n_checked > 0
    assert any(r["edge_weight_max"] > 1.0 for r in s.history if r["edges_relayed"])


def test_zero_probability_nodes_and_empty_rounds_are_handled_without_nan():
    # find a seed whose round 2 samples nobody while rounds 1 and 3 sample someone
    p = [0.5, 0.3, 0.0, 0.3, 0.2, 0.0]
    seed = next(
        sd
        for sd in range(1000)
        if not bernoulli_participation(p, 2, sd).any()
        and bernoulli_participation(p, 1, sd).any()
        and bernoulli_participation(p, 3, sd).any()
    )
    # every node evaluated (untrained ones too): the independent draw, not auto's trainers
    s, grid = _cnn_run("drop-reweighted", p, 3, seed=seed, evaluate=True, evaluate_nodes="drawn")
    assert s.history[1]["num_sampled"] == 0 and s.history[1]["num_trained"] == 0
    assert not [
        m
        for m in grid.delivered
        if m.metadata.message_type == "train.sheaf" and m.metadata.group_id == "2"
    ]
    trained = {
        grid.partition_of(m.metadata.dst_node_id)
        for m in grid.delivered
        if m.metadata.message_type == "train.sheaf"
    }
    assert not trained & {2, 5}
    assert not s.ledger.failures
    last = s.history[-1]
    for key in (
        "private_accuracy_mean",
        "communication_accuracy_degree_weighted",
        "communication_accuracy_mean",
    ):
        assert math.isfinite(last[key]), key
    assert len(s.ledger.node_results) == 6 and all(
        math.isfinite(n["private_accuracy"]) for n in s.ledger.node_results.values()
    )
    assert np.isfinite(s._q_for_next).all() and (s._q_for_next > 0).all()
    # nobody at all: every round empty, evaluation still runs on the untrained models
    s0, _ = _cnn_run("cached", [0.0] * 6, 2, evaluate=True, evaluate_nodes="drawn")
    assert [r["num_trained"] for r in s0.history] == [0, 0] and not s0.bank
    assert math.isfinite(s0.history[-1]["private_accuracy_mean"])


# ------------------------------------------------------------------------------------ small pieces
def test_parse_participation_forms():
    assert parse_participation("", 3) is None
    np.testing.assert_array_equal(parse_participation("0.3", 3), [0.3, 0.3, 0.3])
    np.testing.assert_array_equal(parse_participation("0.9,0,0.2", 3), [0.9, 0.0, 0.2])
    p = parse_participation("uniform:0.1-0.5", 200, seed=4)
    assert len(p) == 200 and min(p) >= 0.1 and max(p) <= 0.5
    np.testing.assert_array_equal(p, parse_participation("uniform:0.1-0.5", 200, seed=4))
    assert not np.array_equal(p, parse_participation("uniform:0.1-0.5", 200, seed=5))
    assert len(parse_participation("uniform", 7)) == 7
    for bad, match in [
        ("1.5", r"\[0, 1\]"),
        ("0.1,0.2", "expected 3"),
        ("uniform:0.6-0.2", "a <= b"),
        ("often", "neither"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_participation(bad, 3)
    with pytest.raises(ConfigError, match="absent-policy='reweighted'"):
        SheafConfig(absent_policy="reweighted")
    with pytest.raises(ValueError, match="partition-id"):
        parse_participation({0: 0.5, 1: 0.5}, 3)
    with pytest.raises(ConfigError, match="participation='often'"):
        FederationConfig(participation="often")


def test_fraction_train_samples_a_fixed_number_per_round():
    sampler = ParticipationSampler(10, fraction=0.3, seed=2)
    draws = [sampler.sample(t) for t in range(1, 6)]
    assert all(len(d) == 3 for d in draws) and len({tuple(d) for d in draws}) > 1
    # the draw of round t is a function of (seed, t) only: a fresh sampler, other order, same sets
    assert [
        ParticipationSampler(10, fraction=0.3, seed=2).sample(t) for t in (5, 4, 3, 2, 1)
    ] == draws[::-1]
    # the 3 partition-ids with the smallest per-round uniforms (independent oracle: numpy directly)
    u = np.random.default_rng([2, 0, 4]).random(10)
    assert draws[3] == sorted(np.argsort(u)[:3].tolist())


def test_edge_weight_scales_the_term_and_leaves_procrustes_unchanged():
    torch.manual_seed(0)
    a_i, a_j, v = (
        torch.randn(8, 3, dtype=torch.float64),
        torch.randn(8, 2, dtype=torch.float64),
        torch.linalg.qr(torch.randn(3, 2, dtype=torch.float64))[0],
    )
    one, _ = local_gluing_penalty(a_i, [EdgeTerm(1, a_j, v, True)], 0.7)
    w, per = local_gluing_penalty(a_i, [EdgeTerm(1, a_j, v, True, 3.5)], 0.7)
    assert float(w) == pytest.approx(3.5 * float(one), rel=1e-14)
    assert per[1] == pytest.approx(
        float(((a_i - a_j @ v.T) ** 2).sum()) / 8
    )  # logged residual is un-weighted
    zero, _ = local_gluing_penalty(a_i, [EdgeTerm(1, a_j, v, True, 0.0)], 0.7)
    assert float(zero) == 0.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight"):
            local_gluing_penalty(a_i, [EdgeTerm(1, a_j, v, True, bad)], 0.7)
    torch.testing.assert_close(procrustes(a_i, a_j), procrustes(3.5 * a_i, a_j), rtol=0, atol=1e-12)


def test_edge_weights_config_is_validated():
    base = {"neighbours": [1, 2], "neighbour-dims": [4, 4], "i-is-head": [1, 0]}
    assert EdgeConfig.from_config(base).weights is None
    assert EdgeConfig.from_config({**base, "edge-weights": [2.0, 0.0]}).weights == (2.0, 0.0)
    with pytest.raises(ProtocolError, match="2 neighbours.*1 weights"):
        EdgeConfig.from_config({**base, "edge-weights": [1.0]})
    with pytest.raises(ProtocolError, match="partition-id 2"):
        EdgeConfig.from_config({**base, "edge-weights": [1.0, -1.0]})


def test_sampler_probabilities_are_a_vector_not_a_spec():
    # a spec string would be drawn without the sampler's seed: specs go through from_spec
    import pytest

    from flwr_sheaf.participation import ParticipationSampler

    with pytest.raises(ValueError):
        ParticipationSampler(3, probabilities="uniform:0.2-0.8", seed=5)
    spec = ParticipationSampler.from_spec(3, 1.0, "uniform:0.2-0.8", seed=5)
    assert spec.probabilities is not None and spec.probabilities.shape == (3,)


# ---------------------------------------------------------------- issue 34: config and scale (case 10)


@pytest.mark.parametrize(
    ("spec", "low", "high"),
    [
        ("uniform:1e-3-0.5", 1e-3, 0.5),
        ("uniform:0.1-1e-1", 0.1, 0.1),
        ("uniform:1E-3-2.5e-1", 1e-3, 0.25),
        ("uniform:.5-1", 0.5, 1.0),
        ("uniform: 0.2 - 0.4 ", 0.2, 0.4),
    ],
)
def test_range_spec_accepts_scientific_notation_as_a_lone_number_does(spec, low, high):
    """``uniform:1e-3-0.5`` was refused while ``1e-3`` alone was accepted."""
    from flwr_sheaf.config import RunConfig
    from flwr_sheaf.participation import parse_participation

    p = parse_participation(spec, 2000, seed=3)
    assert p.min() >= low and p.max() <= high and p.max() - p.min() <= high - low
    # the one string parser strips surrounding whitespace (as for every key)
    assert (
        RunConfig.from_run_config({"participation": spec}).federation.participation == spec.strip()
    )


@pytest.mark.parametrize("spec", ["uniform:0.1-x", "uniform:-0.1-0.5", "uniform:0.1-0.2-0.3"])
def test_a_bad_range_spec_quotes_the_grammar(spec):
    from flwr_sheaf.participation import check_participation_spec

    with pytest.raises(
        ValueError, match=r"uniform:<a>-<b>.*scientific notation, e\.g\. 'uniform:1e-3-0\.5'"
    ):
        check_participation_spec(spec)


@pytest.mark.parametrize(
    ("spec", "hint"),
    [("Uniform:0.1-0.5", "uniform:0.1-0.5"), ("UNIFORM", "uniform"), ("Uniform:3", "uniform:3")],
)
def test_a_capitalised_uniform_gets_a_did_you_mean(spec, hint):
    """Issue 34 case 10: ``Uniform:`` had no did-you-mean."""
    from flwr_sheaf.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=rf"participation='{spec}'.*\(did you mean '{hint}'\?\)"):
        RunConfig.from_run_config({"participation": spec})


# ------------------------------------------------------------------ issue 34, case 6: nobody drawn
def _app_run(tmp_path, name: str, **rc):
    """``run_server`` of ``rc`` in-process: ``(results.json, the RunFailedError or None, log text)``."""
    import json
    import logging

    from flwr_sheaf.apps.methods import num_nodes
    from flwr_sheaf.apps.server_app import run_server
    from flwr_sheaf.methods import parse_run_config
    from flwr_sheaf.strategy.ledger import RunFailedError

    rc = {"results-dir": str(tmp_path / name), **rc}
    cfg, method = parse_run_config(rc)
    grid = LocalGrid(cnn_client_app, num_nodes(cfg, method), run_config=rc)
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flwr_sheaf").addHandler(handler)
    err = None
    try:
        run_server(grid, rc)
    except RunFailedError as exc:
        err = exc
    finally:
        logging.getLogger("flwr_sheaf").removeHandler(handler)
    res = json.loads((tmp_path / name / "results.json").read_text())
    return res, err, "\n".join(records)


TINY_APP = {
    "zoo": "tiny-3",
    "graph": "ring",
    "num-pilots": 64,
    "max-steps-per-epoch": 1,
    "local-epochs": 1,
    "evaluate-every": 0,
}


@pytest.mark.parametrize(
    "rc",
    [
        {**TINY_APP, "participation": "1e-9", "num-server-rounds": 2},
        {**TINY_APP, "participation": "0.001", "num-server-rounds": 3},
        {"method": "rfedags", "participation": "1e-9", "num-server-rounds": 3, "seed": 1},
    ],
    ids=["sheaf-frl-1e-9", "sheaf-frl-0.001", "rfedags-1e-9"],
)
def test_a_run_in_which_no_round_draws_a_node_ends_failed(tmp_path, rc):
    res, err, logged = _app_run(tmp_path, "nobody", **rc)
    rounds = rc["num-server-rounds"]
    assert [r["num_sampled"] for r in res["rounds"]] == [0] * rounds  # the premise: nobody drawn
    assert res["status"] == res["degradation"]["status"] == "failed"
    why = f"no node was drawn to train in any of the {rounds} round(s), so nothing was trained"
    assert any(why in r for r in res["degradation"]["reasons"])
    assert res["degradation"]["rounds_drawing_nobody"] == list(range(1, rounds + 1))
    assert err is not None and why in str(err) and "participation" in str(err)
    assert "max-failed-fraction" not in str(err)  # no node failed: that advice would not help
    assert "the run FAILED" in logged and why in logged


@pytest.mark.parametrize("drawn", [(False, True, False), (True, False, True)])
def test_a_run_in_which_a_round_draws_nobody_is_degraded_and_says_so(tmp_path, drawn):
    # before: one such round of three left the run completed, with nothing said
    p, rounds = 0.2, 3
    seed = next(  # the rounds of `drawn` draw somebody, the others nobody
        sd
        for sd in range(1000)
        if tuple(bool(bernoulli_participation([p] * 3, t, sd).any()) for t in (1, 2, 3)) == drawn
    )
    rc = {**TINY_APP, "participation": str(p), "num-server-rounds": rounds, "seed": seed}
    res, err, logged = _app_run(tmp_path, "most", **rc)
    empty = [t for t in (1, 2, 3) if not drawn[t - 1]]
    assert err is None and [r["num_sampled"] == 0 for r in res["rounds"]] == [not d for d in drawn]
    assert res["status"] == "degraded" and res["degradation"]["rounds_drawing_nobody"] == empty
    line = f"{len(empty)} of 3 rounds drew no node to train (rounds {empty})"
    assert any(line in x for x in res["degradation"]["problems"])
    assert "DEGRADED" in logged and line in logged
    from flwr_sheaf.report import summary_lines

    assert line in summary_lines(res)[0] and summary_lines(res)[0].startswith("RUN DEGRADED")
