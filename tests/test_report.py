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
