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
METHODS = [
    "non-cooperative",
    "fedproto",
    "fedsaf-gcsa",
    "fedsaf-rcsa",
    "fedmuscle",
    "comfed",
    "sheaf-fmtl",
    "sheaf-frl",
]


@pytest.mark.slow
def test_compare_methods_notebook_runs_in_quick_mode(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("FLWR_SHEAF_QUICK", "1")
    monkeypatch.setenv("FLWR_SHEAF_RESULTS", str(tmp_path))
    nb = nbformat.read(EXAMPLES / "compare_methods.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    ).execute()
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "quick mode" in text and "notebook wall time" in text
    assert (
        "ValueError: fedproto-dim='none' needs equal stalk dimensions" in text
    )  # the no-adapter demonstration
    for setting in ("two-agent:16", "tiny-4"):
        for method in METHODS:
            res = json.loads((tmp_path / setting / method / "results.json").read_text())
            assert res["config"]["method"] == method and res["failures"] == []
            assert res["rounds"][-1]["private_accuracy_mean"] is not None


PLOT_CALL = re.compile(
    r"\bplt\.(subplots|figure|plot|bar|scatter|imshow|hist)\(|\bfig\.|\bdisplay\(fig\)"
)
RUN_LINE = re.compile(r"^\s*(\S+)\s+(\S+): private (\d\.\d{3})  communication (\d\.\d{3})", re.M)


def test_committed_notebook_shows_its_figures_and_no_errors():
    """The notebook as committed (not re-run): every plot cell carries a PNG image, no cell an
    error, and the closing note's table repeats the accuracies the run printed."""
    nb = json.loads((EXAMPLES / "compare_methods.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    plot_cells = [c for c in code if PLOT_CALL.search("".join(c["source"]))]
    assert len(plot_cells) >= 2
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
    printed = {
        (m[0], m[1]): (m[2], m[3])
        for c in code
        for o in c["outputs"]
        if o["output_type"] == "stream"
        for m in RUN_LINE.findall("".join(o["text"]))
    }
    assert len(printed) >= 24  # 8 methods x (two-agent:32, two-agent:64, paper-15)
    note = "".join(nb["cells"][-1]["source"])
    rows = {
        (r[0], r[1]): (r[2], r[3])
        for r in re.findall(r"^\| (\S+) \| (\S+) \| (\d\.\d{3}) \| (\d\.\d{3}) \|", note, re.M)
    }
    assert rows == printed, "the closing note's table differs from what the run printed"


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
