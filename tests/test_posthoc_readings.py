"""Both post-hoc readings of communication accuracy (run-config ``posthoc-readings``, notes/baselines.md).

A post-hoc method trains exactly like Sheaf-FRL at lambda = 0 (same cross-entropy, same random
streams), so its *strong* reading (whitening fitted on the pilots) must equal Sheaf-FRL's
lambda = 0 communication accuracy to the last digit, edge by edge: an independent check that the
second reading is the strong post-hoc baseline and not a third protocol. Symmetrically, Sheaf-FRL's
second reading (whitening fitted on the private training latents) at lambda = 0 must equal the
post-hoc method's paper reading edge by edge.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flwr_sheaf.config import ConfigError, FederationConfig, LocalTrainConfig
from flwr_sheaf.methods.noncooperative.strategy import NonCooperative
from flwr_sheaf.methods.sheaf_frl.config import SheafConfig
from flwr_sheaf.methods.sheaf_frl.strategy import SheafFRL
from flwr_sheaf.report import summary_lines
from simulations.inprocess import run_inprocess

torch.set_num_threads(1)

RC = {
    "zoo": "tiny-4",
    "num-pilots": 64,
    "local-epochs": 1,
    "seed": 3,
    "graph": "ring",
    "num-server-rounds": 1,
    "non-edge-pairs": 0,
}
PW = "communication_accuracy_pilot_whitening"
TW = "communication_accuracy_train_whitening"


def _edges(res: dict, key: str) -> dict[tuple[int, int], float]:
    return {(e["src"], e["dst"]): e[key] for e in res["edges"]}


@pytest.fixture(scope="module")
def lambda_zero(tmp_path_factory) -> tuple[dict, dict]:
    """Non-cooperative training and Sheaf-FRL at lambda = 0, same seed: the same models."""
    tmp = tmp_path_factory.mktemp("lambda0")
    nc = run_inprocess({**RC, "method": "non-cooperative", "results-dir": str(tmp / "nc")})
    sf = run_inprocess({**RC, "method": "sheaf-frl", "lambda": 0.0, "results-dir": str(tmp / "sf")})
    return nc, sf


def test_strong_reading_of_a_post_hoc_method_equals_sheaf_frl_at_lambda_zero(lambda_zero):
    nc, sf = lambda_zero
    (a,), (b,) = nc["rounds"], sf["rounds"]
    assert a["private_accuracy_mean"] == b["private_accuracy_mean"]  # the same training
    assert _edges(nc, PW) == _edges(sf, "communication_accuracy")
    assert _edges(nc, "val_" + PW) == _edges(sf, "val_communication_accuracy")
    assert a[f"{PW}_degree_weighted"] == b["communication_accuracy_degree_weighted"]
    assert a[f"val_{PW}_degree_weighted"] == b["val_communication_accuracy_degree_weighted"]
    assert (
        nc["evaluation"]["pilot-whitening-reading"] is True
        and sf["evaluation"]["pilot-whitening-reading"] is False
    )
    # the paper's reading (whitening on private training latents) is another number on some edge
    assert _edges(nc, "communication_accuracy") != _edges(nc, PW)


def test_paper_reading_of_sheaf_frl_at_lambda_zero_equals_the_post_hoc_paper_reading(lambda_zero):
    nc, sf = lambda_zero
    (a,), (b,) = nc["rounds"], sf["rounds"]
    assert _edges(sf, TW) == _edges(nc, "communication_accuracy")
    assert _edges(sf, "val_" + TW) == _edges(nc, "val_communication_accuracy")
    assert b[f"{TW}_degree_weighted"] == a["communication_accuracy_degree_weighted"]
    assert b[f"val_{TW}_degree_weighted"] == a["val_communication_accuracy_degree_weighted"]
    assert sf["evaluation"]["train-whitening-reading"] is True
    assert nc["evaluation"]["train-whitening-reading"] is False
    assert _edges(sf, TW) != _edges(sf, "communication_accuracy")  # another reading


def test_paper_reading_of_sheaf_frl_changes_none_of_its_numbers_and_paper_only_drops_it(tmp_path):
    sf = {**RC, "method": "sheaf-frl", "lambda": 0.1, "non-edge-pairs": 2}
    both = run_inprocess({**sf, "results-dir": str(tmp_path / "b")})
    own = run_inprocess({**sf, "posthoc-readings": "paper", "results-dir": str(tmp_path / "p")})
    (rb,), (rp,) = both["rounds"], own["rounds"]
    assert TW + "_degree_weighted" not in rp and all(TW not in e for e in own["edges"])
    assert 0.0 <= rb[f"{TW}_degree_weighted"] <= 1.0
    added = {k for k in rb if TW in k}
    assert added and set(rb) - added - set(rp) == set()
    keep = [k for k in rp if k.endswith(("accuracy_mean", "degree_weighted", "_loss"))]
    assert keep and all(
        rb[k] == rp[k] for k in keep if rp[k] == rp[k]
    )  # NaN-free ones bit-identical
    assert [{k: e[k] for k in e if TW not in k} for e in both["edges"]] == own["edges"]
    line = f"whitening fitted on private training latents (the paper's reading): {rb[TW + '_degree_weighted']:.3f}"
    assert any(line in x for x in summary_lines(both))
    assert not any("private training latents" in x for x in summary_lines(own))


def test_paper_only_reading_sends_no_pilot_whitened_arrays(tmp_path):
    both = run_inprocess({**RC, "method": "fedproto", "results-dir": str(tmp_path / "b")})
    paper = run_inprocess(
        {
            **RC,
            "method": "fedproto",
            "posthoc-readings": "paper",
            "results-dir": str(tmp_path / "p"),
        }
    )
    (rb,), (rp,) = both["rounds"], paper["rounds"]
    assert f"{PW}_degree_weighted" not in rp and all(PW not in e for e in paper["edges"])
    assert (
        rp["communication_accuracy_degree_weighted"] == rb["communication_accuracy_degree_weighted"]
    )
    assert rp["private_accuracy_mean"] == rb["private_accuracy_mean"]
    assert 0.0 <= rb[f"{PW}_degree_weighted"] <= 1.0
    assert rb["bytes_received"] > rp["bytes_received"]  # three more arrays per evaluated node
    with pytest.raises(ConfigError, match="posthoc-readings='strong'"):
        run_inprocess(
            {
                **RC,
                "method": "fedproto",
                "posthoc-readings": "strong",
                "results-dir": str(tmp_path / "x"),
            }
        )


def test_evaluation_config_carries_the_flag_and_a_reply_without_the_strong_reading_is_a_failure_reason():
    s = NonCooperative(
        4, federation=FederationConfig(graph="ring", seed=3), train=LocalTrainConfig(local_epochs=1)
    )
    ev = s.evaluation
    assert ev.pilot_reading and ev.array_names[-3:] == (
        "pw-pilots",
        "pw-test-latents",
        "pw-val-latents",
    )
    assert ev.config(1, s.train)["pilot-reading"] == 1
    paper = NonCooperative(4, federation=FederationConfig(graph="ring", posthoc_readings="paper"))
    assert (
        paper.evaluation.config(1, paper.train)["pilot-reading"] == 0
        and "pw-pilots" not in paper.evaluation.array_names
    )
    assert not SheafFRL(
        4, federation=FederationConfig(graph="ring")
    ).evaluation.pilot_reading  # its reading is already pilots
    edge = {
        "src": [1, 3],
        "communication-accuracy": [0.5, 0.5],
        "val-communication-accuracy": [0.5, 0.5],
    }
    strong = {
        "communication-accuracy-pilot-whitening": [0.4, 0.6],
        "val-communication-accuracy-pilot-whitening": [0.4, 0.6],
    }
    reply = lambda m: SimpleNamespace(content={"metrics": m})  # noqa: E731
    assert ev.comm_problem(reply({**edge, **strong}), (1, 3)) is None
    assert "lacks ['communication-accuracy-pilot-whitening'" in ev.comm_problem(reply(edge), (1, 3))
    assert "not in [0, 1]" in ev.comm_problem(
        reply({**edge, **strong, "communication-accuracy-pilot-whitening": [1.5, 0]}), (1, 3)
    )
    assert "different lengths" in ev.comm_problem(
        reply({**edge, **strong, "val-communication-accuracy-pilot-whitening": [0.4]}), (1, 3)
    )


def test_sheaf_frl_asks_for_its_paper_reading_unless_paper_only_or_stringent():
    fed = FederationConfig(graph="ring", seed=3)
    ev = SheafFRL(4, federation=fed).evaluation
    assert ev.array_names[-3:] == ("tw-pilots", "tw-test-latents", "tw-val-latents")
    assert ev.config(1, LocalTrainConfig())["pilot-reading"] == 1
    edge = {"src": [1, 3], "communication-accuracy": [0.5, 0.5]}
    edge["val-communication-accuracy"] = [0.5, 0.5]
    reply = lambda m: SimpleNamespace(content={"metrics": m})  # noqa: E731
    assert "lacks ['communication-accuracy-train-whitening'" in ev.comm_problem(reply(edge), (1, 3))
    paper = FederationConfig(graph="ring", seed=3, posthoc_readings="paper")
    for off in (
        SheafFRL(4, federation=paper).evaluation,
        SheafFRL(4, federation=fed, sheaf=SheafConfig(privacy="stringent")).evaluation,
    ):
        assert off.config(1, LocalTrainConfig())["pilot-reading"] == 0
        assert not any(n.startswith("tw-") for n in off.array_names)
        assert off.comm_problem(reply(edge), (1, 3)) is None
