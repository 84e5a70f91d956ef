"""Who is evaluated in a cross-device run (run-config ``evaluate-nodes``), in-process.

- under sampled training, ``auto`` evaluates this round's trainers: every evaluated node trained, and
  ``results.json`` says so per round (``evaluated``, ``evaluated_trained``), in ``evaluation`` and in
  the report; the former independent draw (``drawn``) evaluates nodes that never trained, which the
  results count (recomputed here from the recorded trainers) and the report warns about;
- ``panel`` evaluates the same seeded nodes every round (numpy's draw on stream 2, round 0);
- the latent-collapse warning leaves out nodes that never trained.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import torch

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.report import summary_lines
from flwr_sheaf.results import collapse_warnings
from flwr_sheaf.testing import LocalGrid

torch.set_num_threads(1)


def _rc(tmp_path, name: str, n: int = 20, **kw) -> dict:
    return {
        "zoo": f"tiny-{n}",
        "graph": "class-overlap-knn:2",
        "num-pilots": 32,
        "local-epochs": 1,
        "max-steps-per-epoch": 1,
        "batch-size": 16,
        "method": "sheaf-frl",
        "num-server-rounds": 2,
        "evaluate-every": 1,
        "fraction-train": 0.2,
        "fraction-evaluate": 0.2,
        "non-edge-pairs": 0,
        "discovery": "sampled",
        "seed": 3,
        "results-dir": str(tmp_path / name),
        "round-timeout": 5.0,
        **kw,
    }


def _run(rc: dict) -> dict:
    n = int(rc["zoo"].split("-")[1])
    grid = LocalGrid(cnn_client_app, n, run_config=rc)
    return json.loads(run_server(grid, rc).read_text())


def _ever_trained(res: dict, upto: int) -> set[int]:
    return {
        p
        for r in res["rounds"]
        if r["round"] <= upto
        for p in r["sampled"]
        if p not in r["failed"].get("train", [])
    }


def test_sampled_run_evaluates_its_trainers_and_reports_how_many_evaluated_nodes_trained(tmp_path):
    res = _run(_rc(tmp_path, "auto"))
    assert res["status"] == "completed"
    assert res["evaluation"]["evaluate-nodes"] == "trained"
    for r in res["rounds"]:
        assert r["evaluated"] == r["sampled"] and len(r["sampled"]) == 4  # 20% of 20
        assert r["evaluated_trained"] == len(r["evaluated"]) == 4
    assert res["evaluation"]["evaluated"] == res["evaluation"]["evaluated_trained"] == 4
    assert all(row["trained"] for row in res["nodes"].values())
    assert "evaluated nodes that ever trained: 4 of 4 (evaluate-nodes=trained)" in summary_lines(
        res
    )


def test_independent_draw_counts_the_evaluated_nodes_that_never_trained(tmp_path):
    res = _run(_rc(tmp_path, "drawn", **{"evaluate-nodes": "drawn", "num-server-rounds": 1}))
    assert res["evaluation"]["evaluate-nodes"] == "drawn"
    counts = []
    for r in res["rounds"]:
        ever = _ever_trained(res, r["round"])  # recomputed from the recorded trainers
        counts.append(len(set(r["evaluated"]) & ever))
        assert r["evaluated_trained"] == counts[-1]
    assert counts[-1] < len(res["rounds"][-1]["evaluated"])  # the test means something
    last = res["rounds"][-1]
    assert res["evaluation"]["evaluated_trained"] == counts[-1]
    assert {int(p) for p, row in res["nodes"].items() if row["trained"]} == set(
        last["evaluated"]
    ) & _ever_trained(res, last["round"])
    assert any(
        line.startswith(
            f"WARNING: evaluated nodes that ever trained: {counts[-1]} of {len(last['evaluated'])} "
            "(evaluate-nodes=drawn)"
        )
        for line in summary_lines(res)
    )


def test_panel_evaluates_the_same_seeded_nodes_every_round(tmp_path):
    n, f, seed = 20, 0.2, 3
    res = _run(_rc(tmp_path, "panel", discovery="all", **{"evaluate-nodes": "panel"}))
    u = np.random.default_rng([seed, 2, 0]).random(n)
    panel = sorted(np.argsort(u, kind="stable")[: int(f * n)].tolist())
    assert [r["evaluated"] for r in res["rounds"]] == [panel, panel]
    assert res["evaluation"]["evaluate-nodes"] == "panel"


def test_full_participation_keeps_the_independent_draw():
    from flwr_sheaf.config import FederationConfig
    from flwr_sheaf.participation import ParticipationSampler
    from flwr_sheaf.strategy.graph import evaluate_nodes_mode

    fed = FederationConfig()
    assert fed.evaluate_nodes == "auto"
    assert evaluate_nodes_mode(fed, ParticipationSampler(15, 1.0)) == "drawn"
    assert evaluate_nodes_mode(fed, ParticipationSampler(15, 0.5)) == "trained"
    # Bernoulli participation that is not all ones samples the trainers too: evaluate them
    assert evaluate_nodes_mode(fed, ParticipationSampler(3, probabilities=[1, 1, 0.5])) == "trained"
    assert evaluate_nodes_mode(fed, ParticipationSampler(3, probabilities=[1, 1, 1])) == "drawn"


def test_bernoulli_participation_evaluates_only_the_nodes_that_trained(tmp_path, caplog):
    # F15: participation=0.3 leaves fraction-train at 1; auto must still evaluate the trainers only
    rc = _rc(tmp_path, "bern", n=10, participation="0.3", discovery="all", seed=1)
    rc.update({"fraction-train": 1.0, "fraction-evaluate": 1.0})
    res = _run(rc)
    assert res["evaluation"]["evaluate-nodes"] == "trained"
    for r in res["rounds"]:
        trained = set(r["sampled"]) - set(r["failed"].get("train", []))
        assert set(r.get("evaluated", [])) == trained  # recomputed from the recorded trainers
        assert r.get("evaluated_trained", 0) == len(trained)
    # explicitly drawn: the evaluated nodes that never trained are a WARNING in the server's log
    log = logging.getLogger("flwr_sheaf")  # does not propagate: listen on it directly
    log.addHandler(caplog.handler)
    try:
        drawn = _run({**rc, "results-dir": str(tmp_path / "drawn"), "evaluate-nodes": "drawn"})
    finally:
        log.removeHandler(caplog.handler)
    never = len(drawn["rounds"][-1]["evaluated"]) - drawn["rounds"][-1]["evaluated_trained"]
    assert never > 0
    assert any(
        rec.levelname == "WARNING" and "evaluated node(s) never trained" in rec.getMessage()
        for rec in caplog.records
    )


def test_collapse_warning_leaves_out_nodes_that_never_trained():
    nodes = {
        "0": {"low_variance_fraction": 0.9, "trained": False},
        "1": {"low_variance_fraction": 0.0, "trained": True},
    }
    assert collapse_warnings(nodes) == []
    nodes["2"] = {"low_variance_fraction": 0.5, "trained": True}
    (w,) = collapse_warnings(nodes)
    assert w["nodes"] == {"2": 0.5} and w["untrained_skipped"] == 1
    assert w["message"].startswith(
        "latent collapse on 1 of 2 node(s) (1 evaluated node(s) that never trained are not counted)"
    )
    # results without the "trained" key (written before it existed) are read as before
    assert collapse_warnings({"0": {"low_variance_fraction": 0.9}})[0]["nodes"] == {"0": 0.9}


def test_a_sampler_pickled_before_fixed_round_existed_still_draws():
    import pickle

    from flwr_sheaf.participation import ParticipationSampler

    s = ParticipationSampler(10, 0.3, seed=4)
    del s.__dict__["fixed_round"]  # as unpickled from an older checkpoint
    restored = pickle.loads(pickle.dumps(s))
    assert restored.sample(2) == ParticipationSampler(10, 0.3, seed=4).sample(2)


def test_node_rows_count_the_rounds_each_node_trained_and_the_collapse_warning_names_them(tmp_path):
    """Cross-device sampling: each evaluated node's ``trained_rounds`` is the number of rounds whose
    sample held it without a train failure (read back from the rounds' records), and the collapse
    warning names, per flagged node, how many rounds it trained (a node that trained little reads
    as collapsed from its initialisation: the advice names more training, not only the optimizer)."""
    res = _run(_rc(tmp_path, "rounds", **{"num-server-rounds": 3}))
    for pid, row in res["nodes"].items():
        want = sum(
            int(pid) in r["sampled"] and int(pid) not in r["failed"].get("train", [])
            for r in res["rounds"]
        )
        assert row["trained_rounds"] == want >= 1
    assert {row["trained_rounds"] for row in res["nodes"].values()} != {3}  # sampling varies it
    w = res["latent_collapse"]
    assert w is not None  # 1 step a round: the latents keep their initial scale
    for pid in w["nodes"]:
        k = res["nodes"][pid]["trained_rounds"]
        assert f"{pid}: {w['nodes'][pid]:.0%} after {k} training round(s)" in w["message"]
    assert "give it more rounds, local-epochs or fraction-train" in w["message"]
