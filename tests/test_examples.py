"""The examples run: the comparison notebook (quick mode, executed by nbclient) and the drop-in app
(its own FedAvg and Sheaf-FRL through the in-process grid, no Ray)."""

from __future__ import annotations

import base64
import json
import re
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from flwr_sheaf.testing import LocalGrid

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NOTEBOOK = EXAMPLES / "compare_methods.ipynb"
#: config entries that differ between the runs of one method (the notebook's UNSEEDED)
PER_RUN = ("seed", "results-dir", "overwrite")
RUN_LINE = re.compile(
    r"^\s*(\S.*?) seed (\d+): private (\d\.\d{3})  paper reading\s+(n/a|\d\.\d{3})"
    r"  pilot reading (\d\.\d{3})",
    re.M,
)
PILOT = "communication_accuracy_pilot_whitening_degree_weighted"
TRAIN = "communication_accuracy_train_whitening_degree_weighted"


def _settings(nb: dict) -> dict:
    """The namespace of the notebook's cell tagged ``settings`` (plain literals, no imports)."""
    cells = [c for c in nb["cells"] if "settings" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"{len(cells)} cells tagged 'settings' in {NOTEBOOK.name} (want one)"
    (cell,) = cells
    ns: dict = {}
    exec("".join(cell["source"]), ns)  # noqa: S102 - the repository's own notebook
    return ns


def _effective(run_config: dict) -> dict:
    """What results.json records as ``config`` under the current code, less the per-run entries."""
    from flwr_sheaf.methods import parse_run_config

    cfg = parse_run_config(run_config)[0].to_dict()
    return {k: v for k, v in cfg.items() if k not in PER_RUN}


def _outputs(nb: dict) -> str:
    return "\n".join(
        "".join(o.get("text", ""))
        for c in nb["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
    )


def test_saved_comparison_was_made_by_the_settings_cell_under_the_current_defaults():
    """The settings cell, with the method defaults of the code as it is now, gives the effective
    config every saved run recorded: a default that changed since (a method's own optimizer, a
    package default) fails here until the notebook is re-run. >= 3 seeds, both readings."""
    nb = json.loads(NOTEBOOK.read_text())
    ns = _settings(nb)
    (line,) = re.findall(r"^EFFECTIVE CONFIGS (\{.*\})$", _outputs(nb), re.M)
    saved = json.loads(line)
    assert saved["quick"] is False and saved["seeds"] == ns["SEEDS"] and len(ns["SEEDS"]) >= 3
    assert set(saved["configs"]) == set(ns["METHODS"])
    for label, method in ns["METHODS"].items():
        rc = {**ns["SHARED"], **method, "seed": ns["SEEDS"][0], "results-dir": "/unused"}
        now, then = _effective(rc), saved["configs"][label]
        changed = {
            k: (then.get(k), now.get(k)) for k in set(now) | set(then) if now.get(k) != then.get(k)
        }
        assert not changed, (
            f"{label}: saved vs current effective config {changed}; re-run the notebook"
        )
        # every training setting the comparison depends on is written in the cell, not a default
        for key in (
            "lr",
            "momentum",
            "weight-decay",
            "train-defaults",
            "local-epochs",
            "num-pilots",
        ):
            assert key in {**ns["SHARED"], **method}, f"{label}: {key} not explicit"
    # every (method, seed) printed a row, with both readings (Sheaf-FRL too)
    printed = {(m[0], int(m[1])): m[2:] for m in RUN_LINE.findall(_outputs(nb))}
    assert set(printed) == {(lab, s) for lab in ns["METHODS"] for s in ns["SEEDS"]}
    assert all(paper != "n/a" for _, paper, _ in printed.values())


def test_notebook_configurations_run_at_reduced_size(tmp_path):
    """The notebook's configurations, at its quick size (tiny zoo, one round of 2 steps): every
    method completes, records the config the settings predict, and gives both readings per edge
    (Sheaf-FRL: its own is the pilot reading, the paper's its second)."""
    from simulations.inprocess import run_inprocess

    ns = _settings(json.loads(NOTEBOOK.read_text()))
    for label, method in ns["METHODS"].items():
        method = {**method, **{k: v for k, v in ns["QUICK_METHOD"].items() if k in method}}
        rc = {**ns["SHARED"], **ns["QUICK_SIZE"], **method, "seed": 0}
        rc["results-dir"] = str(tmp_path / label.replace(" ", "_"))
        res = run_inprocess(rc)
        assert res["status"] == "completed" and res["failures"] == []
        assert {k: v for k, v in res["config"].items() if k not in PER_RUN} == _effective(rc)
        (last,) = res["rounds"]
        sheaf = method["method"] == "sheaf-frl"  # whitening on pilots is its own reading
        second = TRAIN if sheaf else PILOT  # the other one (posthoc-readings = both)
        readings = [last["communication_accuracy_degree_weighted"], last.get(second)]
        assert res["evaluation"]["whitening-fit"] == ("pilots" if sheaf else "train")
        assert all(0.0 <= r <= 1.0 for r in readings)
        assert all(second.removesuffix("_degree_weighted") in e for e in res["edges"])
        assert (PILOT in last) != sheaf


@pytest.mark.slow
def test_compare_methods_notebook_runs_in_quick_mode(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("FLWR_SHEAF_QUICK", "1")
    monkeypatch.setenv("FLWR_SHEAF_RESULTS", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    ).execute()
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "quick mode" in text and "notebook wall time" in text
    ns = _settings(json.loads(NOTEBOOK.read_text()))
    assert {(m[0], int(m[1])) for m in RUN_LINE.findall(text)} == {
        (lab, 0) for lab in ns["METHODS"]
    }
    (line,) = re.findall(r"^EFFECTIVE CONFIGS (\{.*\})$", text, re.M)
    assert json.loads(line)["quick"] is True


PLOT_CALL = re.compile(
    r"\bplt\.(subplots|figure|plot|bar|scatter|imshow|hist)\(|\bfig\.|\bdisplay\(fig\)"
)
NOTE_ROW = re.compile(
    r"^\| (\S[^|]*?) \| [^|]+ \| (\d\.\d{3}) ± (\d\.\d{3}) \| (n/a|\d\.\d{3} ± \d\.\d{3}) \| "
    r"(\d\.\d{3}) ± (\d\.\d{3}) \|",
    re.M,
)


def test_committed_notebook_shows_its_figures_and_no_errors():
    """The notebook as committed (not re-run): every plot cell carries a PNG image, no cell an
    error, and the closing note's means are those of the per-seed lines the run printed."""
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    plot_cells = [c for c in code if PLOT_CALL.search("".join(c["source"]))]
    assert len(plot_cells) >= 1
    for cell in plot_cells:
        pngs = [o["data"]["image/png"] for o in cell["outputs"] if "image/png" in o.get("data", {})]
        assert pngs, f"plot cell without an image/png output: {''.join(cell['source'])[:80]!r}"
        for png in pngs:
            raw = base64.b64decode("".join(png) if isinstance(png, list) else png)
            assert raw.startswith(b"\x89PNG\r\n\x1a\n") and len(raw) > 5000
    for cell in code:
        assert cell["execution_count"] is not None, "the notebook is saved unexecuted"
        errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
        assert not errors, (
            f"error output saved: {errors[0].get('ename')}: {errors[0].get('evalue')}"
        )
    per_seed: dict[str, list[tuple[float, ...]]] = {}
    for m in RUN_LINE.findall(_outputs(nb)):
        paper = float("nan") if m[3] == "n/a" else float(m[3])
        per_seed.setdefault(m[0], []).append((float(m[2]), paper, float(m[4])))
    assert per_seed and all(len(v) >= 3 for v in per_seed.values()), "fewer than 3 seeds printed"
    note = "".join(nb["cells"][-1]["source"])
    rows = NOTE_ROW.findall(note)
    assert {r[0] for r in rows} == set(per_seed), "the closing note's table lacks a method"
    for label, private, _, paper, pilot, _ in rows:
        means = np.mean(per_seed[label], axis=0)  # of values printed to 3 decimals
        assert abs(means[0] - float(private)) < 1e-3 and abs(means[2] - float(pilot)) < 1e-3, label
        assert (paper == "n/a") == bool(np.isnan(means[1]))
        if paper != "n/a":
            assert abs(means[1] - float(paper.split(" ")[0])) < 1e-3, label


@pytest.fixture
def dropin(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "dropin_app"))
    for name in [m for m in sys.modules if m == "dropin_app" or m.startswith("dropin_app.")]:
        monkeypatch.delitem(sys.modules, name)
    from dropin_app.client_app import app as client_app
    from dropin_app.server_app import main

    rc = tomllib.loads((EXAMPLES / "dropin_app" / "pyproject.toml").read_text())["tool"]["flwr"][
        "app"
    ]["config"]
    return client_app, main, rc


def test_dropin_app_is_a_flower_app_with_its_own_handlers_and_sheaf_added(dropin, tmp_path):
    client_app, main, rc = dropin
    toml = tomllib.loads((EXAMPLES / "dropin_app" / "pyproject.toml").read_text())
    assert toml["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "dropin_app.server_app:app",
        "clientapp": "dropin_app.client_app:app",
    }
    assert {
        "train.default",
        "evaluate.default",
        "query.sheaf",
        "train.sheaf",
        "evaluate.sheaf",
        "evaluate.sheaf_comm",
    } <= set(client_app._registered_funcs)

    def server_context(cfg):
        return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg)

    # the app's own FedAvg pipeline still works next to the sheaf handlers
    cfg = {**rc, "strategy": "fedavg", "num-server-rounds": 1}
    result = main(LocalGrid(client_app, 4, run_config=cfg), server_context(cfg))
    assert (
        1 in result.evaluate_metrics_clientapp
        and "eval_acc" in result.evaluate_metrics_clientapp[1]
    )

    # Sheaf-FRL on the same SuperNodes: personalised models, pilots relayed, comm accuracy per edge
    out = tmp_path / "dropin"
    cfg = {**rc, "strategy": "sheaf-frl", "num-server-rounds": 2, "results-dir": str(out)}
    cfg["tracking"] = (
        "tensorboard"  # the example's optional per-round tracking (flwr_sheaf.tracking)
    )
    grid = LocalGrid(client_app, 4, run_config=cfg)
    s = main(grid, server_context(cfg))
    assert len(s.history) == 2 and s.ledger.failures == []
    assert len(s.ledger.edge_results) == 8 and {n["d"] for n in s.ledger.node_results.values()} == {
        16
    }
    last = s.history[-1]
    assert last["private_accuracy_mean"] > 0.2 and last["gluing_loss"] > 0
    sheaf_types = {m.metadata.message_type for m in grid.delivered}
    assert sheaf_types == {"query.sheaf", "train.sheaf", "evaluate.sheaf", "evaluate.sheaf_comm"}

    # its results, written by flwr_sheaf.write_results: they agree with the strategy's history
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and res["failures"] == []
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    for got, want in zip(res["rounds"], s.history, strict=True):
        for key in ("private_accuracy_mean", "communication_accuracy_degree_weighted", "ce"):
            assert got[key] == want[key]
    assert res["nodes"] == {str(p): row for p, row in s.ledger.node_results.items()}
    assert len(res["edges"]) == 8 and res["edges"] == json.loads(json.dumps(s.ledger.edge_results))
    # config: the example's run config, then the strategy's sections; the method found by its action
    assert res["config"]["method"] == "sheaf-frl" and res["config"]["graph"] == "ring"
    assert res["config"]["lambda"] == rc["lambda"] and res["config"]["num-nodes"] == 4
    png = (out / "accuracy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # the tracker's TensorBoard scalars are the history's (float32 in the event file)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tb_dir,) = (out / "tracking" / "tensorboard").iterdir()
    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("private_accuracy_mean")] == [
        (r["round"], float(np.float32(r["private_accuracy_mean"]))) for r in s.history
    ]

    # a second run into the same results-dir is refused before any message, unless overwrite
    grid2 = LocalGrid(client_app, 4, run_config=cfg)
    with pytest.raises(FileExistsError, match="overwrite"):
        main(grid2, server_context({**cfg, "tracking": ""}))
    assert grid2.delivered == []


def test_more_supernodes_than_agents_is_refused_before_training_naming_both(dropin, tmp_path):
    # the drop-in app splits its data by num-partitions: 8 SuperNodes for its num-nodes = 4 agents
    # would leave each agent 1/8 of the digits (the run used to end `completed` on that)
    client_app, main, rc = dropin
    cfg = {**rc, "num-server-rounds": 1, "results-dir": str(tmp_path / "out")}
    grid = LocalGrid(client_app, 8, run_config=cfg)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg)
    with pytest.raises(RuntimeError) as err:
        main(grid, ctx)
    text = str(err.value)
    assert "4 agents" in text and "num-partitions=8" in text
    assert 'num-supernodes=4"' in text  # the fix
    assert {m.metadata.message_type for m in grid.delivered} == {"query.sheaf"}  # nothing trained
    assert not (tmp_path / "out" / "results.json").exists()
