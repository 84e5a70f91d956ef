"""FedMuscle: the contrastive pilot loss, the network averages, the cycle, and what travels in Flower.

Oracles: the loss written with explicit Python loops from its definition (notes/baselines-alignment.md s6),
hand-checked averages, and the uploads the nodes really sent (recomputed in numpy).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from flwr_sheaf import FederationConfig, FedMuscle, LocalGrid, LocalTrainConfig
from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.methods._shared.prototypes import PoolingAdapter
from flwr_sheaf.methods.fedmuscle.client import FedMuscleLoss
from flwr_sheaf.methods.fedmuscle.config import FedMuscleConfig
from flwr_sheaf.methods.fedmuscle.maths import (
    is_contrastive_epoch,
    leave_one_out_means,
    muscle_loss,
)

torch.set_num_threads(1)


def _loop_oracle(z, others, every, tau):
    """The definition, one pilot at a time: -log(e^{pos/tau} / (e^{pos/tau} + e^{neg/tau}))."""
    cos = lambda a, b: float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))  # noqa: E731
    out = []
    for i in range(len(z)):
        pos = cos(z[i], others[i])
        neg = np.mean([cos(z[i], every[j]) for j in range(len(z)) if j != i])
        out.append(-math.log(math.exp(pos / tau) / (math.exp(pos / tau) + math.exp(neg / tau))))
    return float(np.mean(out))


def test_muscle_loss_equals_its_definition_and_has_the_right_gradient():
    g = torch.Generator().manual_seed(0)
    z, o, a = (torch.randn(7, 5, generator=g, dtype=torch.float64) for _ in range(3))
    for tau in (0.1, 1.0):
        assert float(muscle_loss(z, o, a, tau)) == pytest.approx(
            _loop_oracle(z.numpy(), o.numpy(), a.numpy(), tau), rel=1e-12
        )
    zz = z.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: muscle_loss(t, o, a, 0.1), (zz,))


def test_the_positive_of_pilot_k_is_pilot_k():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(16, 8, generator=g, dtype=torch.float64)
    every = torch.randn(16, 8, generator=g, dtype=torch.float64)
    aligned = muscle_loss(z, 2.0 * z, every, 0.1)  # the same pilots elsewhere, scaled: cos = 1
    shifted = muscle_loss(
        z, torch.roll(2.0 * z, 1, dims=0), every, 0.1
    )  # pilot k paired with pilot k-1
    assert float(aligned) < float(shifted)
    sim = torch.nn.functional.normalize(z, dim=1) @ torch.nn.functional.normalize(every, dim=1).T
    neg = (sim.sum(1) - sim.diagonal()) / 15
    assert float(aligned) == pytest.approx(
        float(torch.nn.functional.softplus((neg - 1.0) / 0.1).mean()), rel=1e-12
    )


class _Identity(nn.Module):
    """latent(x) = x flattened (so pooled pilot representations are known exactly)."""

    d = 6

    def latent(self, x):
        return x.reshape(len(x), -1)

    def private_logits(self, x):
        return torch.zeros(len(x), 10, dtype=x.dtype, requires_grad=True)


def test_the_plugin_pairs_the_same_pilot_rows_of_inputs_and_targets():
    g = torch.Generator().manual_seed(2)
    x_pilot = torch.randn(40, 1, 6, generator=g)
    reps = x_pilot.reshape(40, 6)
    every = torch.randn(40, 6, generator=g)
    plugin = FedMuscleLoss(
        PoolingAdapter(6, 6),
        x_pilot,
        (3.0 * reps, every),
        {0},
        lam=1.0,
        temperature=0.1,
        pilot_batch_size=8,
    )
    plugin.begin_epoch(_Identity(), 0)
    gen = torch.Generator().manual_seed(5)
    _, parts = plugin.loss(_Identity(), torch.zeros(4, 1, 6), torch.zeros(4, dtype=torch.long), gen)
    pidx = torch.randperm(40, generator=torch.Generator().manual_seed(5))[
        :8
    ]  # the rows the plugin drew
    sim = (
        torch.nn.functional.normalize(reps[pidx], dim=1)
        @ torch.nn.functional.normalize(every[pidx], dim=1).T
    )
    neg = (sim.sum(1) - sim.diagonal()) / 7
    assert parts["muscle-loss"] == pytest.approx(
        float(torch.nn.functional.softplus((neg - 1.0) / 0.1).mean()), rel=1e-5
    )
    plugin.begin_epoch(_Identity(), 1)  # not a contrastive epoch: CE only
    assert (
        plugin.loss(_Identity(), torch.zeros(4, 1, 6), torch.zeros(4, dtype=torch.long), gen)[1][
            "muscle-loss"
        ]
        == 0.0
    )


def test_leave_one_out_means_and_the_cycle():
    reps = {
        0: torch.tensor([[1.0, 0.0]]),
        1: torch.tensor([[3.0, 0.0]]),
        2: torch.tensor([[5.0, 6.0]]),
    }
    others, every = leave_one_out_means(reps)
    np.testing.assert_allclose(others[0].numpy(), [[4.0, 3.0]])
    np.testing.assert_allclose(others[2].numpy(), [[2.0, 0.0]])
    np.testing.assert_allclose(every.numpy(), [[3.0, 2.0]])
    assert [e for e in range(15) if is_contrastive_epoch(e, 4)] == [
        4,
        9,
        14,
    ]  # 4 task epochs, then 1
    with pytest.raises(ValueError, match="at least two agents"):
        leave_one_out_means({0: torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="partition-id 1"):
        leave_one_out_means({0: torch.zeros(3, 2), 1: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="at least 2 pilots"):
        muscle_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), 0.1)


def test_what_travels_in_a_flower_run():
    rc = {"zoo": "tiny-4", "num-pilots": 32, "seed": 2}
    grid = LocalGrid(cnn_client_app, 4, run_config=rc)
    s = FedMuscle(
        4,
        federation=FederationConfig(graph="ring", seed=2, evaluate_every=0),
        train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=2),
        fedmuscle=FedMuscleConfig(task_epochs=1, pilot_batch_size=16),
    )
    s.start(grid=grid, num_rounds=4)
    assert s.ledger.failures == [] and s.common_dim == min(n.d for n in s.nodes.values())
    uploads = {}  # round -> {pid: (K, D)} from the replies the nodes sent
    for r in grid.replies:
        if r.metadata.message_type == "train.fedmuscle":
            a = r.content["upload"]["pilot-reps"].numpy()
            assert a.shape == (32, s.common_dim)
            uploads.setdefault(int(r.metadata.group_id), {})[
                grid.partition_of(r.metadata.src_node_id)
            ] = a
    for m in grid.delivered:
        if m.metadata.message_type != "train.fedmuscle":
            continue
        rnd, pid = int(m.metadata.group_id), grid.partition_of(m.metadata.dst_node_id)
        # epochs 1, 3 (0-based, one per round) are contrastive: rounds 2 and 4 carry targets
        if rnd in (2, 4):
            prev = uploads[rnd - 1]
            t = m.content["muscle-targets"]
            np.testing.assert_allclose(
                t["others"].numpy(), np.mean([prev[j] for j in prev if j != pid], 0), rtol=1e-5
            )
            np.testing.assert_allclose(t["all"].numpy(), np.mean(list(prev.values()), 0), rtol=1e-5)
        else:
            assert "muscle-targets" not in m.content
    assert [r["contrastive_round"] for r in s.history] == [0, 1, 0, 1]
