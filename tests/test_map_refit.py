"""``map-refit = step`` (paper Alg. 1 line 11): each step's penalty uses maps refitted on that step's pilots.

Independent check: for orthonormal-column maps the smallest residual over maps on the rows of one
step has the closed form ``||A_i||^2 + ||A_j||^2 - 2 ||A_i^T A_j||_*`` (nuclear norm; von Neumann's
trace inequality), so the per-edge residual logged by a step-refit step must equal it, and the
epoch maps (fitted on all K pilots) can only do worse on those rows.
"""

from __future__ import annotations

import pytest
import torch

from flwr_sheaf.apps.scenario import scenario_task
from flwr_sheaf.config import ConfigError, ScenarioConfig
from flwr_sheaf.methods.sheaf_frl.client import SheafGluing
from flwr_sheaf.methods.sheaf_frl.config import SheafConfig
from flwr_sheaf.protocol import EdgeConfig

torch.set_num_threads(1)


def _plugin(task, refit: str, nb: dict[int, torch.Tensor], edges: EdgeConfig) -> SheafGluing:
    return SheafGluing(task, 0.5, 16, edges, nb, None, "heterogeneous", "standard", map_refit=refit)


def test_step_refit_residual_is_the_procrustes_minimum_on_the_steps_rows():
    task = scenario_task(
        ScenarioConfig.from_mapping({"zoo": "tiny-4", "num-pilots": 64, "seed": 1}), 0
    )
    model, d_i, k = task.model, int(task.model.d), int(task.x_pilot.shape[0])
    g = torch.Generator().manual_seed(0)
    dims = (d_i - 3, d_i + 5)  # one edge where this node is the head, one where it is the tail
    nb = {1: torch.randn(k, dims[0], generator=g), 2: torch.randn(k, dims[1], generator=g)}
    edges = EdgeConfig((1, 2), dims, (True, False))
    x, y = task.x_train[:8], task.y_train[:8]
    out = {}
    for refit in ("epoch", "step"):
        p = _plugin(task, refit, nb, edges)
        p.begin_epoch(model, 0)
        svds0 = p.svds
        p.loss(model, x, y, torch.Generator().manual_seed(7))
        out[refit] = (dict(p.residual), p.svds - svds0)
    rows = torch.randperm(k, generator=torch.Generator().manual_seed(7))[:16]  # the step's draw
    model.eval()
    model.whitening.train()
    with torch.no_grad():
        a_i = model.whitening(model.latent(task.x_pilot[rows])).double()
    model.train()
    for j in (1, 2):
        a_j = nb[j][rows].double()
        best = (
            a_i.square().sum()
            + a_j.square().sum()
            - 2 * torch.linalg.matrix_norm(a_i.T @ a_j, "nuc")
        ) / 16
        assert out["step"][0][j] == pytest.approx(float(best), rel=1e-4, abs=1e-5)
        assert (
            out["epoch"][0][j] >= out["step"][0][j] - 1e-6
        )  # all-K maps are not optimal on these rows
    assert out["epoch"][1] == 0 and out["step"][1] == 2  # one SVD per edge per step


def test_map_refit_key_is_checked_and_reaches_the_plugin():
    assert SheafConfig.from_mapping({"map-refit": "step"}).map_refit == "step"
    with pytest.raises(ConfigError, match="map-refit='iteration'"):
        SheafConfig.from_mapping({"map-refit": "iteration"})
    task = scenario_task(ScenarioConfig.from_mapping({"zoo": "tiny-4", "num-pilots": 64}), 0)
    with pytest.raises(ValueError, match="map-refit='sometimes'"):
        SheafGluing(
            task,
            0.1,
            16,
            EdgeConfig((), (), ()),
            {},
            None,
            "heterogeneous",
            "standard",
            map_refit="sometimes",
        )
