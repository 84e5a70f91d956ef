"""Issue 28, case 12: the main job's expected band (flwr_sheaf/expected_results.json) and the report's
verdict on a run against it (README.md, "Expected results")."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from flwr_sheaf.config import RunConfig
from flwr_sheaf.expected import METRICS, band_lines, load_reference, reference_mismatch
from flwr_sheaf.report import main as report_main

REF = load_reference()
FINAL = REF["final_round"]


def test_the_stored_band_is_what_the_recorded_seeds_give():
    seeds = REF["per_seed"]
    assert len(seeds) >= 3 and "0" in seeds
    for key in METRICS:
        finals = [seeds[s][key][FINAL - 1] for s in seeds]
        assert all(len(seeds[s][key]) == FINAL for s in seeds)
        band = REF["band"][key]
        assert band["min"] == min(finals) and band["max"] == max(finals)
        assert band["mean"] == pytest.approx(statistics.fmean(finals), abs=1e-6)
    # the tolerance is the largest final-round difference measured between seed 0 and a CPU variant
    diffs = [
        abs(v["final_round"][k] - seeds["0"][k][FINAL - 1])
        for v in REF["cpu_variants"].values()
        for k in METRICS
    ]
    assert REF["cpu_variants"] and REF["tolerance"] == pytest.approx(max(diffs), abs=1e-6)


def test_the_reference_is_the_main_jobs_config_at_todays_defaults():
    # what scripts/main.sh runs: every key at its default. A changed default makes this fail: re-measure
    # the band (scripts/expected_band.py) and update README.md's "Expected results".
    assert reference_mismatch(RunConfig.from_run_config({}).to_dict()) == []


def _results(values: dict[str, float], **overrides) -> dict:
    """A results.json of the schema (docs/results-schema.md) with the given final-round numbers."""
    cfg = RunConfig.from_run_config({"results-dir": "/tmp/x", **overrides}).to_dict()
    rounds = [{"round": r, **{k: 0.1 for k in METRICS}} for r in range(1, FINAL)]
    rounds.append({"round": FINAL, **values, "low_variance_fraction_mean": 0.01})
    return {"config": cfg, "rounds": rounds, "status": "completed", "latent_collapse": None}


def test_a_run_inside_the_band_is_said_to_be_inside():
    mean = {k: REF["band"][k]["mean"] for k in METRICS}
    lines = band_lines(_results(mean, seed=3, **{"torch-threads": 2, "checkpoint-every": 0}))
    assert lines[0].startswith(f"expected band (main job, round {FINAL}): INSIDE")
    assert all(" inside [" in x for x in lines[1:]) and len(lines) == 1 + len(METRICS)


def test_a_run_outside_the_band_is_said_to_be_outside_naming_the_number():
    tol = REF["tolerance"]
    vals = {k: REF["band"][k]["mean"] for k in METRICS}
    vals["communication_accuracy_degree_weighted"] = (
        REF["band"]["communication_accuracy_degree_weighted"]["max"] + tol + 0.005
    )
    lines = band_lines(_results(vals))
    assert "OUTSIDE: not explained by seed or CPU differences" in lines[0]
    (bad,) = [x for x in lines[1:] if "OUTSIDE" in x]
    assert bad.startswith("  communication (degree-weighted)")
    # just inside the edge is inside
    vals["communication_accuracy_degree_weighted"] -= 0.0051
    assert "INSIDE" in band_lines(_results(vals))[0]


def test_another_config_has_no_reference_and_says_which_keys_differ():
    mean = {k: REF["band"][k]["mean"] for k in METRICS}
    (line,) = band_lines(_results(mean, **{"lambda": 0.3}))
    assert line == (
        "expected band: no reference for this config (lambda = 0.3 (reference: 0.1)); it exists for the "
        "main job only"
    )
    # FedProto with its own optimizer settings: method, lr, momentum, weight-decay differ
    (line,) = band_lines(_results(mean, method="fedproto"))
    assert "method = 'fedproto' (reference: 'sheaf-frl')" in line and "lr = 0.01" in line
    # an own app's results.json records only its strategy's sections: no verdict
    own = _results(mean)
    own["config"] = {"method": "sheaf-frl", "lambda": 0.1}
    (line,) = band_lines(own)
    assert re.search(r"no reference for this config \(\d+ key\(s\) not recorded: ", line), line


def test_report_cli_takes_the_results_dir_and_prints_the_verdict(tmp_path, capsys):
    mean = {k: REF["band"][k]["mean"] for k in METRICS}
    res = _results(mean)
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert report_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "expected band (main job, round 10): INSIDE" in out
    assert report_main([str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
