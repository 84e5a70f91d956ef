"""One schema for results.json (flwr_sheaf/schema.py), one converter for what user hooks return.

Writing: numpy values are converted, any other value that JSON cannot write is named and the run is
written ``degraded`` with its rounds. Reading: a damaged or edited results.json gives exit 2 and
``file: field: problem`` from ``python -m flwr_sheaf.report``, never a traceback or a wrong
sentence. Aggregation: a loss part is the mean over the steps that returned it; a node metric sum
beyond the float range does not stop the round. The generated (Hypothesis) tests draw damaged
files and odd hook returns; HYPOTHESIS_PROFILE=deep searches longer (tests/conftest.py).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_expected import MEAN, _results  # a main-job results.json inside the band

from flwr_sheaf import FederationConfig, LocalGrid, LocalTrainConfig, NonCooperative, write_results
from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.client.loop import CrossEntropy, LossPlugin, train_local
from flwr_sheaf.report import main as report_main
from flwr_sheaf.schema import ResultsFileError, check_results, read_results, to_json_value
from flwr_sheaf.strategy.records import nanmean

torch.set_num_threads(1)

BIG = 1.6e308  # three of them overflow a float sum


def bounded(n: int):
    """``n`` examples in the normal suite; the loaded profile's count under HYPOTHESIS_PROFILE=deep."""
    deep = os.environ.get("HYPOTHESIS_PROFILE") == "deep"
    return settings(
        max_examples=settings().max_examples if deep else n,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# ---------------------------------------------------------------- one small completed run
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-node, 1-round NonCooperative run whose loss returns a part ("every_other", 1.0) on every
    other step only and whose nodes report an own metric of 1.6e308; its strategy and results.json."""
    mp = pytest.MonkeyPatch()
    steps = {"n": 0}

    def loss(self, model, x, y, gen):
        ce = F.cross_entropy(model.private_logits(x), y)
        steps["n"] += 1
        return ce, {"ce": ce.detach(), **({"every_other": 1.0} if steps["n"] % 2 else {})}

    mp.setattr(CrossEntropy, "loss", loss)
    mp.setattr(CrossEntropy, "metrics", lambda self, n: {"big": BIG})
    try:
        rc = {"zoo": "tiny-3", "num-pilots": 16, "max-steps-per-epoch": 2}
        strategy = NonCooperative(
            3,
            federation=FederationConfig(graph="ring", seed=1),
            train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=2),
        )
        strategy.start(grid=LocalGrid(cnn_client_app, 3, run_config=rc), num_rounds=1, timeout=60)
    finally:
        mp.undo()
    path = write_results(strategy, tmp_path_factory.mktemp("run"))
    return _Run(strategy=strategy, path=path, results=json.loads(path.read_text()))


class _Run(SimpleNamespace):
    def __repr__(self) -> str:  # Hypothesis prints the fixture of a failing example: not the file
        return f"run({self.path})"


def test_a_node_metric_whose_sum_overflows_is_aggregated_not_a_crash(run):
    # 1.6e308 on 3 nodes: math.fsum raised OverflowError and round 1 stopped, nothing written
    assert run.results["status"] == "completed"
    assert run.results["rounds"][0]["big"] == BIG  # the mean of three equal values, exactly
    assert nanmean([BIG, BIG, -BIG, 1.0]) == math.fsum([BIG / 4, BIG / 4, -BIG / 4, 0.25])
    assert math.isnan(nanmean([math.inf, -math.inf]))  # recorded as null, not raised


def test_a_loss_part_is_the_mean_over_the_steps_that_returned_it(run):
    # a part worth 1.0 on every other step was recorded as 0.5 (divided by every step)
    assert run.results["rounds"][0]["every_other"] == 1.0

    class Linear(torch.nn.Linear):
        def private_logits(self, x):
            return self(x)

    class Sometimes(LossPlugin):
        def __init__(self):
            self.seen: list[float] = []

        def loss(self, model, x, y, gen):
            ce = F.cross_entropy(model.private_logits(x), y)
            self.seen.append(float(ce.detach()))
            return ce, ({"ce": ce.detach()} if len(self.seen) == 1 else {"other": 2.0})

    g = torch.Generator().manual_seed(0)
    model = Linear(2, 2)
    task = SimpleNamespace(
        model=model, x_train=torch.randn(4, 2, generator=g), y_train=torch.tensor([0, 1, 0, 1])
    )
    cfg = LocalTrainConfig(local_epochs=1, batch_size=2)
    plugin = Sometimes()
    out = train_local(task, torch.optim.SGD(model.parameters(), lr=0.1), cfg, plugin, g, 1)
    # "ce" only on step 1 of 2: its value there, not half of it
    assert out["steps"] == 2 and out["ce"] == plugin.seen[0] and out["other"] == 2.0

    class LaterBad(Sometimes):
        def loss(self, model, x, y, gen):
            ce, parts = super().loss(model, x, y, gen)
            return ce, {**parts, **({"other": "oops"} if "ce" not in parts else {})}

    # a later step's part that is not a number: named like the first step's (was a bare ValueError)
    said = 'LaterBad.loss returned part "other" = oops (a str): each part must be a 0-d tensor'
    with pytest.raises(TypeError, match=re.escape(said)):
        train_local(task, torch.optim.SGD(model.parameters(), lr=0.1), cfg, LaterBad(), g, 1)


def test_a_plugins_numpy_metrics_are_numbers_and_a_set_is_named():
    # np.float32 / a 0-d array from LossPlugin.metrics: Flower's MetricRecord raised TypeError on
    # every node, and the run ended failed
    from flwr.app import MetricRecord

    class Linear(torch.nn.Linear):
        def private_logits(self, x):
            return self(x)

    returned = {
        "f32": np.float32(1.5),
        "zero_d": np.array(2.0),
        "t": torch.tensor(3.0),
        "arr": np.arange(2),
        "i": np.int64(4),
    }

    class Own(CrossEntropy):
        def metrics(self, steps):
            return dict(returned)

    g = torch.Generator().manual_seed(0)
    model = Linear(2, 2)
    task = SimpleNamespace(
        model=model, x_train=torch.randn(4, 2, generator=g), y_train=torch.tensor([0, 1, 0, 1])
    )
    cfg = LocalTrainConfig(local_epochs=1, batch_size=2)
    out = train_local(task, torch.optim.SGD(model.parameters(), lr=0.1), cfg, Own(), g, 1)
    got = {k: out[k] for k in returned}
    assert got == {"f32": 1.5, "zero_d": 2.0, "t": 3.0, "arr": [0, 1], "i": 4}
    assert all(type(v) in (int, float, list) for v in got.values())
    MetricRecord(out)  # what the train handler sends

    returned["bad"] = {1, 2}
    said = 'Own.metrics returned "bad" = {1, 2} (a set): each metric must be a number'
    with pytest.raises(TypeError, match=re.escape(said)):
        train_local(task, torch.optim.SGD(model.parameters(), lr=0.1), cfg, Own(), g, 1)


def test_a_problem_or_error_given_as_one_string_is_one_line_and_wall_seconds_is_named(
    run, tmp_path
):
    # problems="disk was full": recorded as ["d", "i", "s", "k", ...]
    for kw, status, field in (
        ({"problems": "disk was full"}, "degraded", "problems"),
        ({"errors": "disk was full"}, "failed", "reasons"),
    ):
        res = read_results(write_results(run.strategy, tmp_path / status, **kw))
        assert res["status"] == status and res["degradation"][field] == ["disk was full"]
    # wall_seconds="12s": a bare "could not convert string to float" (np.float32 is a number)
    with pytest.raises(
        TypeError, match=re.escape("wall_seconds='12s': expected a number of seconds")
    ):
        write_results(run.strategy, tmp_path / "w", wall_seconds="12s")
    assert not (tmp_path / "w" / "results.json").exists()
    res = read_results(write_results(run.strategy, tmp_path / "w", wall_seconds=np.float32(2.5)))
    assert res["total_wall_seconds"] == 2.5


# ---------------------------------------------------------------- hook returns
@pytest.mark.parametrize(
    "value, written",
    [(np.float32(1.5), 1.5), (np.int64(3), 3), (np.arange(3), [0, 1, 2]), ((1, np.nan), [1, None])],
    ids=["float32", "int64", "array", "tuple-nan"],
)
def test_numpy_values_from_results_extra_are_written_as_numbers(
    run, tmp_path, monkeypatch, value, written
):
    # np.float32(1.5): TypeError (not JSON serializable) and no results.json at all
    base = type(run.strategy).results_extra
    monkeypatch.setattr(type(run.strategy), "results_extra", lambda s: {**base(s), "x": value})
    res = read_results(write_results(run.strategy, tmp_path))
    assert res["x"] == written and res["status"] == "completed"
    assert res["rounds"] == run.results["rounds"]


def test_a_set_from_results_extra_is_named_and_the_run_written_degraded(run, tmp_path, monkeypatch):
    base = type(run.strategy).results_extra
    monkeypatch.setattr(type(run.strategy), "results_extra", lambda s: {**base(s), "x": {1, 2}})
    res = read_results(write_results(run.strategy, tmp_path))
    said = "NonCooperative.results_extra()['x']: set is not JSON-writable; return a list (written as null)"
    assert res["x"] is None and res["status"] == "degraded"
    assert res["degradation"]["problems"] == [said]
    assert res["rounds"] == run.results["rounds"]


def test_a_hook_key_outside_the_schema_is_named_and_the_rounds_kept(run, tmp_path, monkeypatch):
    base = type(run.strategy).results_extra
    monkeypatch.setattr(
        type(run.strategy), "results_extra", lambda s: {**base(s), "warnings": "one"}
    )
    path = write_results(run.strategy, tmp_path)
    res = json.loads(path.read_text())
    assert res["status"] == "degraded" and res["rounds"] == run.results["rounds"]
    assert res["degradation"]["problems"][0].startswith("the results.json written: warnings: ")
    with pytest.raises(
        ResultsFileError, match=re.escape(f"{path}: warnings: Input should be a valid list")
    ):
        read_results(path)


ODD = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(
        [1e308, -1e308, np.float32(1.5), np.int64(3), np.float64("nan"), np.bool_(True)]
    )
    | st.text(max_size=5)
    | st.builds(np.arange, st.integers(0, 4))
    | st.frozensets(st.integers(), max_size=2)
    | st.sets(st.integers(), max_size=2)
    | st.just(object()),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=3)
    ),
    max_leaves=12,
)


def _unwritable(x) -> int:
    if isinstance(x, (np.ndarray, np.generic, str, int, float)) or x is None:
        return 0
    if isinstance(x, dict):  # {1: a, "1": b}: the second is named, not written
        seen: set[str] = set()
        return sum(
            1 if str(k) in seen else (seen.add(str(k)) or _unwritable(v)) for k, v in x.items()
        )
    if isinstance(x, (list, tuple)):
        return sum(_unwritable(v) for v in x)
    return 1


@bounded(200)
@given(ODD)
def test_every_hook_return_is_written_as_json_or_named(value):
    out, problems = to_json_value({"x": value}, "hook")
    json.dumps(out, allow_nan=False)  # writable: finite numbers, lists, str keys
    assert len(problems) == _unwritable(value)
    assert all(p.startswith("hook['x']") and "is not JSON-writable" in p for p in problems)


def test_keys_written_alike_are_named_not_lost():
    # {1: "a", "1": "b"}: both written as "1", the second silently replaced the first
    out, problems = to_json_value({"m": {1: "a", "1": "b", np.int64(2): "c"}}, "hook")
    assert out == {"m": {"1": "a", "2": "c"}}
    assert problems == [
        "hook['m']['1']: key is not JSON-writable: it is written '1', as another key of the "
        "mapping (not written; use distinct string keys)"
    ]


@bounded(15)
@given(st.dictionaries(st.sampled_from(["a", "b", "note"]), ODD, max_size=2))
def test_write_results_with_any_hook_return_writes_a_readable_file_with_the_rounds(
    run, tmp_path, extra
):
    out = tmp_path / f"w{len(list(tmp_path.iterdir()))}"
    res = read_results(write_results(run.strategy, out, extra=extra))
    assert res["rounds"] == run.results["rounds"]
    assert (res["status"] == "degraded") == bool(_unwritable(extra))


# ---------------------------------------------------------------- reading: the report CLI
def _report(path: Path, capsys) -> tuple[int, str, str]:
    rc = report_main([str(path)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _edited(res: dict, **changes) -> dict:
    res = json.loads(json.dumps(res))
    last = [r for r in res["rounds"] if r.get("private_accuracy_mean") is not None][-1]
    for key, value in changes.items():
        if key.startswith("last."):
            last[key[5:]] = value
        else:
            res[key] = value
    return res


EDITS = {  # issue's cases: each was a traceback (exit 1) or a wrong sentence
    "evaluation-list": ({"evaluation": [1]}, "evaluation: Input should be a JSON object"),
    "degradation-list": ({"degradation": ["x"]}, "degradation: Input should be a JSON object"),
    "evaluated-trained-str": (
        {"last.evaluated_trained": "2"},
        ".evaluated_trained: Input should be a valid integer",
    ),
    "eigenvalues-str": (
        {"last.sheaf_laplacian_eigenvalues": ["0.1"]},
        ".sheaf_laplacian_eigenvalues[0]: Input should be a valid number",
    ),
    "4-of-2": (
        {"last.evaluated": [0, 1], "last.evaluated_trained": 4},
        "evaluated_trained = 4 is more than the 2 evaluated node(s)",
    ),
    "nan-accuracy": (
        {"last.private_accuracy_mean": math.nan},
        ".private_accuracy_mean: Input should be a finite number",
    ),
    "accuracy-above-1": (
        {"last.communication_accuracy_mean": 1.5},
        ".communication_accuracy_mean: Input should be less than or equal to 1",
    ),
    "status-unknown": (
        {"status": "done"},
        "status: Input should be 'completed', 'degraded' or 'failed'",
    ),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_an_edited_results_json_exits_2_naming_the_file_and_the_field(run, tmp_path, capsys, case):
    changes, said = EDITS[case]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_edited(run.results, **changes)))
    before = path.read_bytes()
    rc, out, err = _report(tmp_path, capsys)
    assert rc == 2 and err.startswith(f"flwr_sheaf.report: {path}: ") and said in err, err
    assert "Traceback" not in err and out == "" and path.read_bytes() == before


def test_a_damaged_file_deep_nesting_a_directory_and_links_are_named(tmp_path, capsys):
    deep = tmp_path / "deep" / "results.json"
    deep.parent.mkdir()
    deep.write_text("[" * 100_000 + "]" * 100_000)
    rc, _, err = _report(deep, capsys)
    assert rc == 2 and f"{deep}: nested too deeply" in err, err
    folder = tmp_path / "dir" / "results.json"
    folder.mkdir(parents=True)  # a results.json that is a directory "did not exist"
    for given_path in (folder, folder.parent):
        rc, _, err = _report(given_path, capsys)
        assert rc == 2 and f"{folder}: is a directory, not a results.json file" in err, err
    link = tmp_path / "link" / "results.json"
    link.parent.mkdir()
    link.symlink_to(tmp_path / "gone.json")
    rc, _, err = _report(link.parent, capsys)
    assert rc == 2 and f"{link}: does not exist (a link to {tmp_path / 'gone.json'}: missing" in err
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    rc, _, err = _report(loop, capsys)
    assert (
        rc == 2 and f"{loop}: does not exist (a link to {loop}: missing, or a loop of links)" in err
    )
    fifo = tmp_path / "fifo" / "results.json"  # said "does not exist"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    rc, _, err = _report(fifo.parent, capsys)
    assert rc == 2 and f"{fifo}: is not a regular file (a FIFO or a device)" in err, err


def test_whitespace_in_device_is_stripped_once_by_the_run_config():
    # device='cpu ' passed the run config and the report called the run a CUDA one
    from flwr_sheaf.config import RunConfig
    from flwr_sheaf.expected import not_judged

    assert RunConfig.from_run_config({"device": " cpu "}).to_dict()["device"] == "cpu"
    line = not_judged(
        {"status": "completed", "config": {"device": "cpu "}, "nodes": {}, "rounds": []}
    )
    assert line == [  # a file edited by hand is not called a CUDA run
        "device='cpu ': the band was measured on CPUs (device=cpu or auto); run with device=cpu to compare"
    ]


# ---------------------------------------------------------------- generated damaged files
def _paths(x, at=()):
    """Every path into a JSON value (dict keys and list indices), the root excluded."""
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        yield (*at, k)
        yield from _paths(v, (*at, k))


#: a run of the RFedAGS family: no client evaluation, its own report lines
RFEDAGS = {
    "rounds": [{"round": 3, "gap": 1e-3, "distance_to_optimum": 0.1, "num_responders": 7}],
    "config": {"method": "rfedags", "rfedags-problem": "pca"},
    "status": "completed",
}
BAD = (
    st.none()
    | st.booleans()
    | st.sampled_from([math.nan, math.inf, -1.0, 1e308, 2.5, 10**30, "0.5", "", [], {}, [[[[]]]]])
    | st.text(max_size=3)
    | st.integers()
    | st.lists(st.integers(), max_size=2)
)


@bounded(300)
@given(data=st.data())
def test_any_damaged_results_json_reports_or_exits_2_naming_the_field(run, tmp_path, capsys, data):
    bases = {"run": run.results, "main-job": _results(MEAN), "rfedags": RFEDAGS}
    res = json.loads(json.dumps(bases[data.draw(st.sampled_from(sorted(bases)), label="base")]))
    paths = list(_paths(res))
    at = data.draw(st.sampled_from(paths), label="path")
    *parent_at, key = at
    parent = res
    for k in parent_at:
        parent = parent[k]
    if data.draw(st.booleans(), label="remove") and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = data.draw(BAD, label="value")
    text = json.dumps(res).encode()
    damage = data.draw(st.sampled_from(["none", "truncate", "bytes"]), label="damage")
    if damage == "truncate":
        text = text[: data.draw(st.integers(0, len(text) - 1), label="cut")]
    elif damage == "bytes":  # a binary file, or one in another encoding
        text = data.draw(st.binary(max_size=40), label="bytes")
    path = tmp_path / "results.json"
    path.write_bytes(text)
    rc, out, err = _report(path, capsys)
    assert path.read_bytes() == text  # the file is never changed
    assert rc in (0, 2) and "Traceback" not in err
    if rc == 2:
        assert err.startswith(f"flwr_sheaf.report: {path}: ") and "\n" == err[-1], err
        assert str(at[0]) in err or "JSON" in err or "cannot be read" in err, err
    else:
        assert out and check_results(json.loads(text)) is not None


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "[1]", '{"rounds": 1}'])
def test_the_resume_preflight_reads_results_json_through_the_schema(tmp_path, text):
    # a results.json of a list, or deeply nested, in the results-dir: AttributeError / RecursionError
    # escaped the preflight's check of whose files they are (a traceback instead of its refusal)
    from flwr_sheaf.config import ConfigError
    from flwr_sheaf.rundir import recorded_run_config

    path = tmp_path / "results.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}"):
        recorded_run_config(path)


def test_a_final_accuracy_not_measured_is_not_judged_rather_than_outside():
    # a null (NaN when written) final accuracy was told "OUTSIDE: ... check the install"
    from flwr_sheaf.expected import band_lines

    res = _results({**MEAN, "communication_accuracy_mean": None})
    assert band_lines(res) == [
        f"expected band: not judged: round {res['rounds'][-1]['round']} did not measure the "
        "communication (receivers) accuracy (null in results.json)"
    ]
