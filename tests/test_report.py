"""`python -m flwr_sheaf.report` on every method's results (scripts/main.sh prints it)."""

from __future__ import annotations


def test_the_report_of_a_global_model_run_prints_its_gap_instead_of_refusing():
    from flwr_sheaf.report import summary_lines

    lines = summary_lines(
        {
            "rounds": [{"round": 3, "gap": 1e-3, "distance_to_optimum": 0.1, "num_responders": 7}],
            "config": {"method": "rfedags", "rfedags-problem": "pca"},
        }
    )
    assert lines[0] == "method rfedags | problem pca" and "optimality gap 1.000e-03" in lines[1]
    assert summary_lines({"rounds": [{"round": 1}]}) == ["no evaluated round in results"]


def test_the_report_prints_only_the_settings_the_results_record():
    # issue #28: one's own app's results printed "shift ? | zoo ? | dataset ?"
    from flwr_sheaf.report import summary_lines

    row = {
        "round": 2,
        "private_accuracy_mean": 0.5,
        "communication_accuracy_degree_weighted": 0.25,
        "communication_accuracy_mean": 0.25,
    }
    lines = summary_lines({"rounds": [row], "config": {"method": "my-method", "zoo": "tiny-4"}})
    assert lines[0] == "method my-method | zoo tiny-4" and "?" not in "".join(lines)
    full = {"method": "sheaf-frl", "lambda": 0.1, "shift": 0.7, "zoo": "paper-15", "dataset": "d"}
    lines = summary_lines({"rounds": [row], "config": full})
    assert lines[0] == "method sheaf-frl | lambda 0.1 | shift 0.7 | zoo paper-15 | dataset d"
    assert summary_lines({"rounds": [row]})[0].startswith("final round 2: private accuracy 0.500")


# ------------------------------------------------ issue 34, F7: malformed shapes are named, not raised
def _evaluated_results() -> dict:
    row = {
        "round": 2,
        "private_accuracy_mean": 0.5,
        "communication_accuracy_degree_weighted": 0.25,
        "communication_accuracy_mean": 0.25,
    }
    return {"rounds": [row], "config": {"method": "sheaf-frl"}, "status": "completed"}


def test_the_report_names_a_null_config_and_a_round_without_its_accuracy_and_exits_2(
    tmp_path, capsys
):
    import json

    from flwr_sheaf.report import main

    cases = {
        "null-config": (lambda r: r.update(config=None), "config: Input should be a JSON object"),
        "no-degree-weighted": (
            lambda r: r["rounds"][-1].pop("communication_accuracy_degree_weighted"),
            "rounds[0]: round 2 is evaluated (private_accuracy_mean) but has no "
            "'communication_accuracy_degree_weighted'",
        ),
    }
    for name, (change, expected) in cases.items():
        res = _evaluated_results()
        assert main_ok(tmp_path / f"ok-{name}", res, main, capsys)
        change(res)
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps(res))
        assert main([str(d)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"flwr_sheaf.report: {d / 'results.json'}: ")
        assert "does not have the results.json schema" in err
        assert expected in err and "Traceback" not in err, err


def main_ok(d, res, main, capsys) -> bool:
    """The unbroken results.json reports with exit 0."""
    import json

    d.mkdir()
    (d / "results.json").write_text(json.dumps(res))
    ok = main([str(d)]) == 0
    capsys.readouterr()
    return ok
