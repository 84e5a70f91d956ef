"""The figure scripts' selection and reporting on hand-made rows (no training).

Checks: the weight is chosen per (point, seed, method) on the validation value of the reading
being reported (the strong post-hoc reading uses its own validation value, so it may pick another
weight than the paper's reading); the 95% interval is Student t with n - 1 degrees of freedom
(closed form for two seeds: t = 12.706); the markdown table prints what the CSV holds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulations"))

from figure_markdown import table  # noqa: E402
from paper_figures import PW, strong_readings, summarise  # noqa: E402


def _row(seed, method, w, comm, vcomm, pw=None, vpw=None, private=0.5):
    return {
        "x": 0.5,
        "seed": seed,
        "method": method,
        "weight": w,
        "private_accuracy_mean": private,
        "communication_accuracy_degree_weighted": comm,
        "val_private_accuracy_mean": private,
        "val_communication_accuracy_degree_weighted": vcomm,
        PW: pw,
        f"val_{PW}": vpw,
    }


ROWS = [
    # fedproto, two weights per seed: the paper's reading prefers w=1 (validation), the strong one w=0.1
    _row(0, "fedproto", 0.1, 0.30, 0.20, pw=0.50, vpw=0.60),
    _row(0, "fedproto", 1.0, 0.40, 0.30, pw=0.45, vpw=0.40),
    _row(1, "fedproto", 0.1, 0.32, 0.21, pw=0.54, vpw=0.61),
    _row(1, "fedproto", 1.0, 0.44, 0.31, pw=0.47, vpw=0.41),
    # sheaf-frl: lambda = 0 never counts as a Sheaf-FRL choice even when its validation value is best
    _row(0, "sheaf-frl", 0.0, 0.90, 0.90),
    _row(0, "sheaf-frl", 0.1, 0.60, 0.50),
    _row(1, "sheaf-frl", 0.0, 0.90, 0.90),
    _row(1, "sheaf-frl", 0.1, 0.64, 0.52),
]


def test_weights_are_chosen_on_the_validation_value_of_each_reading():
    paper = {r["method"]: r for r in summarise(ROWS, [0.5], [0, 1])}
    assert paper["fedproto"]["weights"] == "1.0 1.0" and paper["fedproto"][
        "comm_mean"
    ] == pytest.approx(0.42)
    assert paper["sheaf-frl"]["weights"] == "0.1 0.1" and paper["sheaf-frl"][
        "comm_mean"
    ] == pytest.approx(0.62)
    (strong,) = strong_readings(ROWS, [0.5], [0, 1])
    assert strong["method"] == "fedproto-pilots" and strong["weights"] == "0.1 0.1"
    assert strong["comm_mean"] == pytest.approx(0.52)
    # t interval, 2 seeds: 12.706 * stdev / sqrt(2), stdev of (0.50, 0.54) = 0.02 * sqrt(2)
    assert strong["comm_ci95"] == pytest.approx(12.7062 * 0.02, rel=1e-4)


def test_runs_without_the_strong_reading_give_no_pilots_row():
    rows = [{**r, PW: None, f"val_{PW}": None} for r in ROWS]
    assert strong_readings(rows, [0.5], [0, 1]) == []


def test_markdown_table_prints_each_cell_of_the_csv():
    rows = [
        {"x": "0.5", "method": "fedproto-pilots", "comm_mean": "0.52", "comm_ci95": "0.254"},
        {"x": "0.5", "method": "sheaf-frl", "comm_mean": "0.62", "comm_ci95": "nan"},
        {"x": "0.9", "method": "sheaf-frl", "comm_mean": "0.7", "comm_ci95": "0.1"},
    ]
    lines = table(rows, "comm").splitlines()
    assert lines[0] == "| method | 0.5 | 0.9 |"
    assert (
        lines[2] == "| sheaf-frl | 0.620 | 0.700 ± 0.100 |"
    )  # Sheaf-FRL first; one seed: no interval
    assert lines[3] == "| fedproto-pilots | 0.520 ± 0.254 | - |"


def test_paired_difference_uses_the_validation_chosen_lambda_against_lambda_zero():
    from figure_markdown import paired

    text, p = paired(ROWS)
    assert p["n"] == 2 and p["comm_wins"] == 0
    assert p["comm_diff"] == pytest.approx(-0.28)  # (0.60 - 0.90 + 0.64 - 0.90) / 2
    assert p["comm_ci95"] == pytest.approx(12.7062 * 0.02, rel=1e-4)
    assert p["private_diff"] == 0.0
    assert "| 0.5 | 1 | 0.1 | 0.640 | 0.900 | -0.260 |" in text


def test_sweep_progress_keeps_order_and_reports_done_total_and_eta():
    import io

    from progress import eta_seconds, map_with_progress

    assert eta_seconds(30.0, 3, 10) == pytest.approx(70.0)  # 10 s per run so far, 7 left
    assert eta_seconds(5.0, 0, 4) != eta_seconds(5.0, 0, 4)  # NaN before the first run
    log = io.StringIO()  # not a terminal: one line per finished run
    jobs = [-3, 1, -2, 4]
    assert map_with_progress(abs, jobs, workers=2, label=lambda j: f"job{j}", stream=log) == [
        3,
        1,
        2,
        4,
    ]
    lines = log.getvalue().splitlines()
    assert [ln.split("]")[0] for ln in lines] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert all("ETA" in ln for ln in lines) and lines[-1].endswith("ETA 0m00s")
    assert sorted(ln.split("] ")[1].split(" (")[0] for ln in lines) == sorted(
        f"job{j}" for j in jobs
    )
