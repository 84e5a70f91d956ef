"""ComFed: the learned-map message, the alignment loss, and what travels in a Flower run.

Oracles: numpy linear algebra (solve / lstsq) for the pseudo-inverse message, a hand-computed
loss, and the uploads the nodes really sent (averaged again in numpy).
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest
import torch

from flwr_sheaf import ComFed, FederationConfig, LocalGrid, LocalTrainConfig
from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.methods.comfed.config import ComFedConfig
from flwr_sheaf.methods.comfed.maths import comfed_alignment_loss, comfed_message

torch.set_num_threads(1)


def test_message_is_the_least_squares_decoding_through_the_shared_space():
    rng = np.random.default_rng(0)
    z_j, p_j = rng.normal(size=(5, 7)), rng.normal(size=(4, 7))
    p_sq = rng.normal(
        size=(4, 4)
    )  # r = d_i: P_i invertible, the message solves P_i zhat = P_j z_j exactly
    got = comfed_message(
        torch.from_numpy(z_j), torch.from_numpy(p_j), torch.from_numpy(p_sq)
    ).numpy()
    np.testing.assert_allclose(got, np.linalg.solve(p_sq, p_j @ z_j.T).T, rtol=1e-10, atol=1e-12)
    p_wide = rng.normal(size=(4, 9))  # r < d_i: minimum-norm solution
    got = comfed_message(
        torch.from_numpy(z_j), torch.from_numpy(p_j), torch.from_numpy(p_wide)
    ).numpy()
    ref = np.linalg.lstsq(p_wide, p_j @ z_j.T, rcond=None)[0].T
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(got @ p_wide.T, z_j @ p_j.T, atol=1e-10)
    with pytest.raises(ValueError, match="share r"):
        comfed_message(torch.zeros(2, 7), torch.zeros(4, 7), torch.zeros(3, 9))


def test_alignment_loss_is_the_mean_over_shared_classes_of_squared_distances():
    proj = {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([0.0, 0.0]), 5: torch.tensor([9.0, 9.0])}
    targets = {
        0: torch.tensor([1.0, 0.0]),
        1: torch.tensor([3.0, 4.0]),
        7: torch.tensor([0.0, 0.0]),
    }
    assert float(comfed_alignment_loss(proj, targets)) == pytest.approx(
        (4.0 + 25.0) / 2
    )  # classes 0 and 1 only
    assert float(comfed_alignment_loss(proj, {})) == 0.0


def test_what_travels_and_both_readings_of_communication_accuracy():
    grid = LocalGrid(cnn_client_app, 4, run_config={"zoo": "tiny-4", "num-pilots": 32, "seed": 4})
    s = ComFed(
        4,
        federation=FederationConfig(graph="ring", seed=4, evaluate_every=3),
        train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=3),
        comfed=ComFedConfig(lam=0.5),
    )
    s.start(grid=grid, num_rounds=3)
    assert s.ledger.failures == [] and s.r == min(n.d for n in s.nodes.values())
    ring = nx.cycle_graph(4)
    uploads = {}
    for r in grid.replies:
        if r.metadata.message_type == "train.comfed":
            up = r.content["upload"]
            assert up["prototypes"].numpy().shape[1] == s.r
            uploads[(int(r.metadata.group_id), grid.partition_of(r.metadata.src_node_id))] = dict(
                zip(up["classes"].numpy().tolist(), up["prototypes"].numpy())
            )
    for m in grid.delivered:
        if m.metadata.message_type != "train.comfed":
            continue
        rnd, pid = int(m.metadata.group_id), grid.partition_of(m.metadata.dst_node_id)
        if rnd == 1:
            assert "comfed-targets" not in m.content
            continue
        t = m.content["comfed-targets"]
        got = dict(zip(t["classes"].numpy().tolist(), t["prototypes"].numpy()))
        expect = {}
        for j in ring.neighbors(pid):
            for c, v in uploads[(rnd - 1, j)].items():
                expect.setdefault(c, []).append(v)
        assert sorted(got) == sorted(expect)
        for c in got:
            np.testing.assert_allclose(got[c], np.mean(expect[c], 0), rtol=1e-5, atol=1e-6)
    # the projection is a trained parameter: it moved away from its Xavier initialisation ...
    from flwr_sheaf.methods.comfed.maths import xavier_projection

    state = grid.contexts[grid.node_ids[0]].state["comfed.projection"]["p"].numpy()
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([4, 0, 7]).generate_state(1)[0]))
    init = xavier_projection(s.r, s.nodes[0].d, gen).numpy()
    assert state.shape == init.shape and np.abs(state - init).max() > 1e-4
    # ... and it is routed to the neighbours for the learned-map reading
    ev = [m for m in grid.delivered if m.metadata.message_type == "evaluate.comfed_comm"]
    assert ev and all(
        f"{j}/comfed-proj" in m.content["arrays"]
        for m in ev
        for j in m.content["config"]["neighbours"]
    )
    last = s.history[-1]
    edges = s.ledger.edge_results
    assert len(edges) == 8 and all(0.0 <= e["comfed_communication_accuracy"] <= 1.0 for e in edges)
    assert last["comfed_communication_accuracy_degree_weighted"] == pytest.approx(
        np.mean([e["comfed_communication_accuracy"] for e in edges])
    )
    assert math.isfinite(last["communication_accuracy_degree_weighted"])  # the post-hoc reading too
