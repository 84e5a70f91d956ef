"""Issue 28, case 13: a baseline's own optimizer settings and the latent-collapse warning.

FedProto's latents collapsed under the shared optimizer (momentum 0.9); it now trains with its
authors' settings unless the user sets the keys, and a run whose latents collapse says so in
``results.json`` (notes/baselines.md s0, docs/results-schema.md).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flwr_sheaf.config import DEFAULTS, RunConfig, config_differences, method_train_changes
from flwr_sheaf.protocol import LOW_VARIANCE_FRACTION
from flwr_sheaf.results import COLLAPSE_WARN_FRACTION, collapse_warnings
from flwr_sheaf.sheaf.whitening import low_variance_fraction

torch.set_num_threads(1)


def _train(rc: dict) -> tuple[float, float, float]:
    t = RunConfig.from_run_config(rc).train
    return t.lr, t.momentum, t.weight_decay


def test_fedproto_trains_with_its_authors_sgd_unless_the_user_sets_a_key():
    # Tan et al. 2022's code: SGD lr 0.01, momentum 0.5, no weight decay
    assert _train({"method": "fedproto"}) == (0.01, 0.5, 0.0)
    # flwr run fills every default in: a key equal to the package default still counts as unset
    assert _train(
        {"method": "fedproto", "lr": DEFAULTS["lr"], "momentum": DEFAULTS["momentum"]}
    ) == (
        0.01,
        0.5,
        0.0,
    )
    # a key the user set keeps the user's value; the others stay the method's
    assert _train({"method": "fedproto", "momentum": 0.0}) == (0.01, 0.0, 0.0)
    # train-defaults=shared: the package's defaults, as every method had them before
    shared = (DEFAULTS["lr"], DEFAULTS["momentum"], DEFAULTS["weight-decay"])
    assert _train({"method": "fedproto", "train-defaults": "shared"}) == shared
    # other methods: unchanged
    for m in ("sheaf-frl", "non-cooperative", "fedsaf-gcsa", "fedmuscle", "comfed"):
        assert _train({"method": m}) == shared, m
    # preset=paper is one protocol for every method: the preset's values, not FedProto's
    assert _train({"method": "fedproto", "preset": "paper"}) == (0.01, 0.9, 5e-4)
    # what the ServerApp logs at start: every key the method's settings changed, never silently
    assert method_train_changes({"method": "fedproto", "lr": 0.02}) == {
        "momentum": (0.9, 0.5),
        "weight-decay": (5e-4, 0.0),
    }
    assert method_train_changes({"method": "fedproto", "train-defaults": "shared"}) == {}
    assert method_train_changes({"method": "sheaf-frl"}) == {}


def test_results_config_records_the_effective_settings_and_resume_sees_them():
    cfg = RunConfig.from_run_config({"method": "fedproto"}).to_dict()
    assert (cfg["lr"], cfg["momentum"], cfg["weight-decay"], cfg["train-defaults"]) == (
        0.01,
        0.5,
        0.0,
        "method",
    )
    # resuming: the recorded effective values equal the run config's; a run under the shared
    # optimizer is another run
    assert config_differences(cfg, {"method": "fedproto"}) == {}
    shared = {"method": "fedproto", "train-defaults": "shared"}
    assert set(config_differences(shared, {"method": "fedproto"})) == {"train-defaults"}


def test_a_bad_train_defaults_value_is_refused_naming_it():
    from flwr_sheaf.config import ConfigError

    with pytest.raises(ConfigError, match="train-defaults='sharde'.*did you mean 'shared'"):
        RunConfig.from_run_config({"train-defaults": "sharde"})


@pytest.mark.parametrize("d,k", [(8, 0), (8, 3), (32, 18), (5, 5)])
def test_low_variance_fraction_counts_the_constant_dimensions(d, k):
    # k constant columns (variance 0) among d; the others have variance about 1 >> 1e-3
    rng = np.random.default_rng(d + k)
    z = rng.normal(size=(200, d))
    z[:, rng.choice(d, size=k, replace=False)] = rng.normal(size=k)  # constant per column
    assert low_variance_fraction(torch.tensor(z)) == pytest.approx(k / d, abs=0)


def test_collapse_warning_names_the_collapsed_nodes_and_their_fractions():
    rng = np.random.default_rng(0)

    def node(constant: int, d: int = 8) -> dict:
        z = rng.normal(size=(64, d))
        z[:, :constant] = 0.5
        return {"low_variance_fraction": low_variance_fraction(torch.tensor(z)), "d": d}

    nodes = {
        "0": node(0),
        "1": node(5),
        "2": node(2),
        "10": node(8),
        "3": {"low_variance_fraction": None},
    }
    (w,) = collapse_warnings(nodes)
    # 5/8 and 8/8 are above 0.25; 2/8 = 0.25 is not (strictly above); None = not measured
    assert w["kind"] == "latent-collapse" and w["nodes"] == {"1": 5 / 8, "10": 1.0}
    assert w["threshold"] == COLLAPSE_WARN_FRACTION == 0.25
    assert (
        "2 of 5 node(s)" in w["message"] and "1: 62%" in w["message"] and "10: 100%" in w["message"]
    )
    assert collapse_warnings({"0": node(0), "1": node(1)}) == []


def test_results_json_of_a_collapsed_run_carries_the_warning(tmp_path):
    """A crafted evaluation reply: partition-id 1 reports 60% of its dimensions collapsed."""
    from flwr_sheaf.apps.client_app import app as client_app
    from flwr_sheaf.apps.server_app import run_server
    from flwr_sheaf.report import summary_lines
    from flwr_sheaf.testing import LocalGrid

    class CollapsingGrid(LocalGrid):
        def pull_messages(self, message_ids=None, *, reply_to_message_ids=None):
            out = super().pull_messages(message_ids, reply_to_message_ids=reply_to_message_ids)
            for reply in out:
                if reply.has_error() or not reply.metadata.message_type.startswith("evaluate."):
                    continue
                if self.partition_of(reply.metadata.src_node_id) != 1:
                    continue
                for rec in reply.content.metric_records.values():
                    if LOW_VARIANCE_FRACTION in rec:
                        rec[LOW_VARIANCE_FRACTION] = 0.6
            return out

    rc = {
        "method": "fedproto",
        "zoo": "tiny-3",
        "graph": "ring",
        "num-pilots": 64,
        "max-steps-per-epoch": 2,
        "local-epochs": 1,
        "num-server-rounds": 1,
        "checkpoint-every": 0,
        "results-dir": str(tmp_path / "run"),
    }
    path = run_server(CollapsingGrid(client_app, 3, run_config=rc), rc)
    res = json.loads(open(path).read())
    assert res["nodes"]["1"]["low_variance_fraction"] == 0.6
    expected = {
        p: n["low_variance_fraction"]
        for p, n in res["nodes"].items()
        if n["low_variance_fraction"] is not None and n["low_variance_fraction"] > 0.25
    }
    w = res["latent_collapse"]
    assert w["kind"] == "latent-collapse" and w["nodes"] == expected and "1" in w["nodes"]
    assert res["status"] == "completed"  # a warning, not a degraded run
    assert any(line.startswith("WARNING: latent collapse on") for line in summary_lines(res))


@pytest.mark.parametrize(
    "over, said",
    [
        (
            {},
            "lr 0.01 (package default 0.05), momentum 0.5 (package default 0.9), weight-decay 0.0",
        ),
        ({"lr": 0.02}, "momentum 0.5 (package default 0.9), weight-decay 0.0"),
        ({"lr": 0.02, "momentum": 0.8, "weight-decay": 1e-4}, None),
    ],
    ids=["unset", "lr-set", "all-set"],
)
def test_the_run_log_names_the_method_defaults_it_applies_and_only_those(tmp_path, over, said):
    # issue 34 (docs/own-method.md): when FedProto's own optimizer settings apply, the run log says so
    import logging

    from flwr_sheaf.apps.client_app import app
    from flwr_sheaf.apps.server_app import run_server
    from flwr_sheaf.testing import LocalGrid

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("flwr_sheaf")
    log.addHandler(handler)
    level, log.level = log.level, logging.INFO
    rc = {
        "method": "fedproto",
        "zoo": "tiny-3",
        "graph": "ring",
        "num-pilots": 32,
        "max-steps-per-epoch": 1,
        "local-epochs": 1,
        "num-server-rounds": 1,
        "evaluate-every": 0,
        "results-dir": str(tmp_path / "r"),
        **over,
    }
    try:
        run_server(LocalGrid(app, 3, run_config=rc), rc)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    own = [x for x in lines if "trains with its own settings" in x]
    if said is None:
        assert own == []
    else:
        (line,) = own
        assert line.startswith("fedproto trains with its own settings (train-defaults='method'): ")
        assert said in line and ("lr " in line) == ("lr" not in over)
