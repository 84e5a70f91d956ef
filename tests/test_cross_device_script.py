"""simulations/cross_device.py as a user meets it (docs/cross-device.md):

- the documented command, extracted from the markdown (so the docs cannot drift), runs at tiny scale
  (size, engine and data overridden by later flags; argparse keeps the last) and its results say
  how many evaluated nodes ever trained;
- running it again moves the earlier ``results.json`` (and plot, log) into ``previous-<UTC time>/``;
- ``--agents`` bad values are argparse errors naming the flag and the fix, before any run;
- ``accuracy.png`` of a single evaluated round is readable (big marker, its value, one tick).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "simulations"))
import cross_device as cd  # noqa: E402

#: what makes the documented command tiny: later flags win in argparse
TINY = [
    "--agents",
    "12",
    "--engine",
    "inprocess",
    "--dataset",
    "mnist-bundled",
    "--rounds",
    "2",
    "--evaluate-every",
    "2",
    "--num-pilots",
    "32",
    "--batch-size",
    "16",
    "--max-steps-per-epoch",
    "1",
    "--fraction",
    "0.25",
]


def documented_command() -> list[str]:
    """The command under docs/cross-device.md's ``cross-device-command`` marker, as argv."""
    text = (ROOT / "docs" / "cross-device.md").read_text()
    block = re.search(r"<!-- cross-device-command:.*?-->\s*```bash\n(.*?)```", text, re.S)
    assert block, "docs/cross-device.md lost its cross-device command block"
    return shlex.split(block.group(1).replace("\\\n", " "))


def test_the_documented_cross_device_command_runs_and_reports_trained_evaluators(tmp_path):
    argv = documented_command()
    assert argv[:2] == ["python", "simulations/cross_device.py"]
    assert "--discovery" in argv and argv[argv.index("--discovery") + 1] == "sampled"
    out = tmp_path / "xd"
    cmd = [sys.executable, argv[1], *argv[2:], *TINY, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run() -> dict:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads((out / "N12" / "results.json").read_text())

    res = run()
    assert res["status"] == "completed" and res["config"]["discovery"] == "sampled"
    last = res["rounds"][-1]
    assert last["evaluated"] == last["sampled"] and len(last["evaluated"]) == 3  # 25% of 12
    assert last["evaluated_trained"] == 3 == res["evaluation"]["evaluated_trained"]
    assert res["evaluation"]["evaluate-nodes"] == "trained"
    first = (out / "N12" / "results.json").read_bytes()
    # run again: the earlier results are moved aside, not deleted
    run()
    (prev,) = sorted((out / "N12").glob("previous-*"))
    assert (prev / "results.json").read_bytes() == first
    assert {p.name for p in prev.iterdir()} >= {"results.json", "accuracy.png"}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "argument --agents: 0 agents: a cross-device run needs at least 2 agents"),
        ("-5", "argument --agents: -5 agents: a cross-device run needs at least 2 agents"),
        ("1.5", "argument --agents: '1.5' is not a whole number of agents"),
        ("100,abc", "argument --agents: 'abc' is not a whole number of agents"),
        ("20000", "argument --agents: 20000 agents: more than this machine is known to hold"),
    ],
)
def test_bad_agents_values_are_argparse_errors_naming_the_flag(value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cd.main(["--agents", value, "--dataset", "mnist-bundled"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "--agents" in err.split(message, 1)[1] or "e.g." in err  # the fix is named


def test_more_agents_than_this_machine_holds_are_not_refused_on_a_ray_cluster(capsys):
    # issue 34, F5: the 10,000 bound ran in argparse's type= and refused --ray-address, its own advice
    import socket

    with socket.socket() as s:  # a port nothing listens on: the cluster check refuses, not --agents
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    assert cd.main(["--agents", "20000", "--ray-address", f"127.0.0.1:{dead}"]) == 2
    err = capsys.readouterr().err
    assert "more than this machine is known to hold" not in err, err
    assert (
        "warning: --agents 20000 is more than the 10,000 SuperNodes measured on one machine" in err
    )
    assert f"127.0.0.1:{dead}" in err  # refused by the reachability check of the cluster named
    # in process (this machine) the bound still holds, with --ray-address or without
    with pytest.raises(SystemExit) as exc:
        cd.main(["--agents", "20000", "--engine", "inprocess", "--ray-address", "127.0.0.1:1"])
    assert exc.value.code == 2
    assert "20000 agents: more than this machine is known to hold" in capsys.readouterr().err


def test_evaluate_nodes_flag_reaches_the_run_config():
    from flwr_sheaf.config import EVALUATE_NODES

    parser = cd.build_parser()
    assert {a for a in parser._option_string_actions["--evaluate-nodes"].choices if a} == set(
        EVALUATE_NODES
    )
    args = parser.parse_args(["--evaluate-nodes", "panel", "--dataset", "mnist-bundled"])
    assert cd.run_config(100, args, Path("/tmp/x"))["evaluate-nodes"] == "panel"
    args = parser.parse_args(["--dataset", "mnist-bundled"])
    assert "evaluate-nodes" not in cd.run_config(100, args, Path("/tmp/x"))


def test_too_many_agents_for_the_bundled_digits_is_refused(capsys):
    with pytest.raises(SystemExit):
        cd.main(["--agents", "300", "--dataset", "mnist-bundled"])
    assert "use at most 100 agents" in capsys.readouterr().err


def test_accuracy_plot_of_a_single_evaluated_round_is_readable():
    from flwr_sheaf.results import accuracy_figure

    rounds = [{"round": r} for r in range(1, 5)] + [
        {
            "round": 5,
            "private_accuracy_mean": 0.41,
            "communication_accuracy_degree_weighted": 0.27,
            "communication_accuracy_mean": 0.25,
        }
    ]
    ax = accuracy_figure(rounds).axes[0]
    assert len(ax.lines) == 3 and all(line.get_markersize() >= 6 for line in ax.lines)
    assert sorted(t.get_text() for t in ax.texts) == ["0.250", "0.270", "0.410"]
    assert ax.get_xlim() == (0.5, 5.5) and list(ax.get_xticks()) == [1, 2, 3, 4, 5]
    ax1 = accuracy_figure(rounds[-1:]).axes[0]  # one round only
    assert ax1.get_xlim() == (4.5, 5.5) and list(ax1.get_xticks()) == [5]


@pytest.mark.parametrize("last", [0.96, 0.12, 0.5])  # points near the top, the bottom, the middle
def test_accuracy_plot_legend_covers_no_point_and_no_value(last):
    from flwr_sheaf.results import accuracy_figure

    rounds = [{"round": r} for r in range(1, 5)] + [
        {
            "round": 5,
            "private_accuracy_mean": last,
            "communication_accuracy_degree_weighted": last - 0.02,
            "communication_accuracy_mean": last - 0.04,
        }
    ]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = accuracy_figure(rounds)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # as savefig: the layout engine places the legend
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    legend = fig.legends[0] if fig.legends else ax.get_legend()
    box = legend.get_window_extent(renderer)
    assert [t.get_text() for t in legend.get_texts()] == [line.get_label() for line in ax.lines]
    fig_box = fig.bbox
    assert fig_box.x0 <= box.x0 and box.x1 <= fig_box.x1 and 0 <= box.y0  # inside the image
    assert not box.overlaps(ax.get_window_extent(renderer))  # not over the plotting area
    for text in ax.texts:  # the values written beside the points
        assert not box.overlaps(text.get_window_extent(renderer)), text.get_text()


def test_the_docs_quote_what_a_rerun_prints(tmp_path, monkeypatch, capsys):
    """Attack (minor): docs/guarantees.md row 8 quoted `results.json, accuracy.png,
    flwr.log` where an in-process rerun prints `results.json, checkpoint.pkl, accuracy.png`."""

    def fake_run(rc: dict) -> dict:  # what an in-process run leaves: results, checkpoint, plot
        out = Path(rc["results-dir"])
        out.mkdir(parents=True, exist_ok=True)
        for name in ("results.json", "checkpoint.pkl", "accuracy.png"):
            (out / name).write_text(json.dumps({"rounds": [], "status": "completed"}))
        return {"exit_code": 0, "wall_seconds": 0.0, "peak_rss_bytes": 0, "peak_rss_processes": 1}

    monkeypatch.setattr(cd, "run_inprocess_measured", fake_run)
    monkeypatch.setattr(cd, "round_stats", lambda res: {})
    argv = ["--agents", "12", "--engine", "inprocess", "--dataset", "mnist-bundled"]
    assert cd.main([*argv, "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert cd.main([*argv, "--out", str(tmp_path)]) == 0
    (printed,) = [ln.strip() for ln in capsys.readouterr().out.splitlines() if "moved" in ln]
    (row,) = [
        ln
        for ln in (ROOT / "docs" / "guarantees.md").read_text().splitlines()
        if ln.startswith("| `simulations/cross_device.py` run again")
    ]
    quoted = re.search(r"\| `(moved the earlier run's [^`]*)`", row)
    assert quoted is not None, row
    pattern = re.escape(quoted.group(1))
    pattern = pattern.replace(re.escape("<out>"), re.escape(str(tmp_path.resolve())))
    pattern = pattern.replace(re.escape("<N>"), "12").replace(re.escape("<UTC time>"), r"\S+")
    assert re.fullmatch(pattern, printed), (quoted.group(1), printed)


def test_a_rerun_moves_the_earlier_results_aside(tmp_path, monkeypatch):
    """Case 8: the script once deleted the earlier results.json before the run (only the package's
    checkpoint and plot were moved aside); the run itself is stubbed (it writes a results.json)."""
    calls = []

    def fake_run(rc: dict) -> dict:
        calls.append(rc)
        out = Path(rc["results-dir"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(
            json.dumps({"run": len(calls), "rounds": [], "status": "completed"})
        )
        return {"exit_code": 0, "wall_seconds": 0.0, "peak_rss_bytes": 0, "peak_rss_processes": 1}

    monkeypatch.setattr(cd, "run_inprocess_measured", fake_run)
    monkeypatch.setattr(cd, "round_stats", lambda res: {})
    argv = ["--agents", "12", "--engine", "inprocess", "--dataset", "mnist-bundled"]
    argv += ["--out", str(tmp_path)]
    assert cd.main(argv) == 0 and cd.main(argv) == 0
    (prev,) = sorted((tmp_path / "N12").glob("previous-*"))
    assert json.loads((prev / "results.json").read_text())["run"] == 1
    assert json.loads((tmp_path / "N12" / "results.json").read_text())["run"] == 2


@pytest.mark.parametrize("run_status", ["degraded", "failed"])
def test_a_run_that_did_not_complete_is_not_reported_completed(
    tmp_path, monkeypatch, capsys, run_status
):
    """The script printed ``completed=True`` (and ``yes`` in table.md, exit 0) for every run that
    wrote a results.json, a degraded or failed one too: the run's own ``status`` is reported."""

    def fake_run(rc: dict) -> dict:
        out = Path(rc["results-dir"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"rounds": [], "status": run_status}))
        return {"exit_code": 0, "wall_seconds": 0.0, "peak_rss_bytes": 0, "peak_rss_processes": 1}

    monkeypatch.setattr(cd, "run_inprocess_measured", fake_run)
    monkeypatch.setattr(cd, "round_stats", lambda res: {})
    argv = ["--agents", "12", "--engine", "inprocess", "--dataset", "mnist-bundled"]
    assert cd.main([*argv, "--out", str(tmp_path)]) == 1
    assert f"N=12: status={run_status} " in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["N12"]["completed"] is False and summary["N12"]["status"] == run_status
    assert (tmp_path / "table.md").read_text().splitlines()[-1].endswith(f"| {run_status} |")
