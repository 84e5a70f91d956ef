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
    nodes = {str(i): {"d": 24, "device": "cpu", "trained": True} for i in range(3)}
    return {
        "config": cfg,
        "rounds": rounds,
        "status": "completed",
        "latent_collapse": None,
        "nodes": nodes,
    }


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


# ---------------------------------------------------------------- issue 34, case 5: what is judged
MEAN = {k: REF["band"][k]["mean"] for k in METRICS}


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda r: r.update(status="degraded"), "the run ended 'degraded', not completed"),
        (lambda r: r.update(status="failed"), "the run ended 'failed', not completed"),
        (lambda r: r.pop("status"), "results.json records no status"),
        (
            lambda r: r["config"].update(device="cuda"),
            "device='cuda': the band was measured on CPUs",
        ),
        (lambda r: r["config"].update(device="cuda:1"), "device='cuda:1'"),
    ],
    ids=["degraded", "failed", "no-status", "cuda", "cuda-1"],
)
def test_only_a_completed_cpu_run_is_judged_and_the_line_says_why_not(change, reason):
    res = _results(MEAN)  # numbers at the band's mean: INSIDE if it were judged
    assert band_lines(res)[0].endswith("INSIDE: this install reproduces the reference")
    change(res)
    (line,) = band_lines(res)
    assert line.startswith("expected band: not judged: ") and reason in line, line
    assert "INSIDE" not in line and line.endswith(
        "the band is for a completed run of the main job on the CPU"
    )


def test_the_report_of_a_degraded_run_says_degraded_and_not_inside(tmp_path, capsys):
    res = _results(MEAN)
    res.update(status="degraded", degradation={"reasons": ["train: 3 of 15 nodes failed"]})
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert report_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("RUN DEGRADED: reasons: ['train: 3 of 15 nodes failed']")
    assert "INSIDE" not in out and "expected band: not judged: the run ended 'degraded'" in out


def test_another_config_is_still_named_key_by_key_when_the_run_completed():
    res = _results(MEAN, **{"lambda": 0.3, "shift": 0.5})
    (line,) = band_lines(res)
    assert "lambda = 0.3 (reference: 0.1)" in line and "shift = 0.5 (reference: 0.7)" in line


def _malformed(kind: str, res: dict) -> str:
    """The text of a results.json broken in one way."""
    if kind == "truncated":
        text = json.dumps(res, indent=1)
        return text[: len(text) // 2]
    if kind == "no-rounds":
        res.pop("rounds")
    elif kind == "string-number":
        res["rounds"][-1]["private_accuracy_mean"] = "0.83"
    elif kind == "rounds-not-a-list":
        res["rounds"] = {"10": res["rounds"][-1]}
    return json.dumps(res)


MALFORMED = {
    "truncated": "is not valid JSON (",
    "no-rounds": "rounds: missing",
    "string-number": f"rounds[{FINAL - 1}].private_accuracy_mean: Input should be a valid number "
    "(got '0.83')",
    "rounds-not-a-list": "rounds: Input should be a valid list",
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_results_json_is_named_with_what_is_wrong_and_exit_2(kind, tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(_malformed(kind, _results(MEAN)))
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flwr_sheaf.report: {path}: ") and MALFORMED[kind] in err, err
    assert "Traceback" not in err
    if kind != "truncated":  # the verdict on a parsed dict says it too, rather than raising
        (line,) = band_lines(json.loads(path.read_text()))
        assert line.startswith("expected band: not judged: results.json is malformed (")
        assert MALFORMED[kind] in line


def _band_script(*args: str):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "expected_band.py"), *args],
        capture_output=True,
        text=True,
        cwd=root,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )


def test_expected_band_script_names_the_bad_run_and_exits_non_zero(tmp_path):
    good, bad, degraded = tmp_path / "seed0", tmp_path / "seed1", tmp_path / "seed2"
    for d in (good, bad, degraded):
        d.mkdir()
    (good / "results.json").write_text(json.dumps(_results(MEAN, seed=0)))
    (bad / "results.json").write_text(_malformed("string-number", _results(MEAN, seed=1)))
    res = _results(MEAN, seed=2)
    res["status"] = "degraded"
    (degraded / "results.json").write_text(json.dumps(res))
    out = tmp_path / "ref.json"
    p = _band_script("--seeds", str(good), str(bad), "--out", str(out))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{bad / 'results.json'}: rounds[" in p.stderr
    assert MALFORMED["string-number"] in p.stderr
    p = _band_script("--seeds", str(good), str(degraded), "--out", str(out))
    assert p.returncode == 1 and f"{degraded}: the run ended 'degraded'" in p.stderr, p.stderr
    assert not out.exists()
    p = _band_script("--seeds", str(good), "--out", str(out))  # a clean run still gives a band
    assert p.returncode == 0 and json.loads(out.read_text())["band"], p.stderr


# ------------------------------------------- issue 34, F6: device=auto is judged only when it ran on CPUs
def test_a_device_auto_run_with_a_node_on_cuda_is_not_judged():
    res = _results(MEAN)  # the default device=auto, every node on the CPU: judged
    assert res["config"]["device"] == "auto"
    assert band_lines(res)[0].endswith("INSIDE: this install reproduces the reference")
    res["nodes"]["1"]["device"] = "cuda:0"
    (line,) = band_lines(res)
    assert line.startswith(
        "expected band: not judged: device='auto' resolved to a non-CPU device on 1 "
    )
    assert "(partition-id 1 on cuda:0)" in line and "INSIDE" not in line


def test_an_older_device_auto_results_json_without_node_devices_says_it_cannot_tell():
    res = _results(MEAN)
    for row in res["nodes"].values():
        del row["device"]
    (line,) = band_lines(res)
    assert "records no node's resolved device" in line and "cannot tell" in line, line
    res["config"]["device"] = "cpu"  # asked for the CPU: judged without the nodes' word
    assert band_lines(res)[0].endswith("INSIDE: this install reproduces the reference")


def test_an_inprocess_run_records_each_nodes_resolved_device_cpu(tmp_path):
    from simulations.inprocess import run_inprocess

    res = run_inprocess(
        {
            "zoo": "tiny-4",
            "graph": "ring",
            "num-server-rounds": 1,
            "max-steps-per-epoch": 1,
            "num-pilots": 64,
            "device": "cpu",
            "results-dir": str(tmp_path),
        }
    )
    assert sorted(res["nodes"]) == ["0", "1", "2", "3"]
    assert {row["device"] for row in res["nodes"].values()} == {"cpu"}
    # the file the report reads records it too
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {row["device"] for row in saved["nodes"].values()} == {"cpu"}
