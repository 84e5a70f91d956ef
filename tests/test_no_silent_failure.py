"""No silent failure (issue 20, items 2, 3, 5, 7, 9, 10 and the preflight): each input of the issue is
refused with an error naming the key / partition-id / file and the fix, before any training message
(LocalGrid records every delivered message). docs/guarantees.md lists these rows.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import pickle
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.config import ConfigError, RunConfig
from flwr_sheaf.rundir import LOCK_NAME, DirLock, load_checkpoint
from flwr_sheaf.testing import LocalGrid

torch.set_num_threads(1)
logging.getLogger("flwr_sheaf").setLevel(logging.WARNING)

TINY = {
    "zoo": "tiny-3",
    "graph": "ring",
    "num-pilots": 64,
    "max-steps-per-epoch": 2,
    "local-epochs": 1,
    "num-server-rounds": 1,
    "evaluate-every": 0,
}
ROOT = Path(__file__).resolve().parents[1]


def _refused(rc: dict, match: str, exc=ConfigError, grid=None) -> LocalGrid:
    """Run ``rc`` in-process; assert the refusal and that no message at all (or only discovery) was sent."""
    grid = grid or LocalGrid(cnn_client_app, 3, run_config=rc)
    with pytest.raises(exc, match=match):
        run_server(grid, rc)
    assert not [
        m for m in grid.delivered if not m.metadata.message_type.startswith("query.")
    ]  # nothing trained
    return grid


def _run(rc: dict) -> dict:
    grid = LocalGrid(cnn_client_app, 3, run_config=rc)
    return json.loads(run_server(grid, rc).read_text())


# ------------------------------------------------------------------------- item 2 + preflight
@pytest.mark.parametrize("every", [1, 0])
def test_an_unwritable_results_dir_is_refused_before_any_message(tmp_path, every):
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc = {**TINY, "results-dir": str(afile / "out"), "checkpoint-every": every}
    grid = _refused(
        rc,
        rf"results-dir='{afile}/out': {afile} is a file, not a directory.*set results-dir to a "
        rf"directory you can write",
    )
    assert grid.delivered == []
    rc = {**TINY, "results-dir": str(afile)}
    _refused(rc, rf"results-dir='{afile}': {afile} exists and is not a directory")


def test_an_unwritable_node_state_dir_is_refused_before_any_message(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc = {**TINY, "results-dir": str(tmp_path / "r"), "node-state-dir": str(afile / "state")}
    grid = _refused(rc, rf"node-state-dir='{afile}/state': {afile} is a file, not a directory")
    assert grid.delivered == [] and not (tmp_path / "r" / LOCK_NAME).exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes everywhere")
def test_a_read_only_results_dir_is_refused(tmp_path):  # pragma: no cover - not as root
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        _refused({**TINY, "results-dir": str(ro)}, "is not writable")
    finally:
        ro.chmod(0o700)


# ------------------------------------------------------------------------- item 5
def test_a_results_dir_of_another_run_is_refused_unless_resume_or_overwrite(tmp_path):
    out = tmp_path / "r"
    rc = {**TINY, "results-dir": str(out)}
    first = _run(rc)
    before = (out / "results.json").read_bytes()
    _refused(
        rc,
        r"already holds another run's results \(results.json, checkpoint.pkl\).*resume=true.*overwrite=true",
    )
    assert (out / "results.json").read_bytes() == before and not (out / LOCK_NAME).exists()
    (out / "results.json").unlink()  # a stopped run: its checkpoint alone counts too
    _refused({**rc, "lr": 0.1}, r"already holds another run's results \(checkpoint.pkl\)")
    second = _run({**rc, "overwrite": True})  # explicit: replaced
    assert second["config"]["overwrite"] is True and first["config"]["overwrite"] is False
    assert load_checkpoint(out / "checkpoint.pkl")["round"] == 1 and not (out / LOCK_NAME).exists()


def test_a_live_lock_refuses_a_second_run_and_a_stale_one_is_taken_over(tmp_path, caplog):
    out = tmp_path / "r"
    out.mkdir()
    other = DirLock(out).acquire()  # another run (here: in this process) holds the lock
    rc = {**TINY, "results-dir": str(out)}
    grid = _refused(
        rc, rf"in use by another run: process {os.getpid()} on this host holds .*{LOCK_NAME}"
    )
    assert grid.delivered == [] and (out / LOCK_NAME).exists()  # not ours: left alone
    other.release()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK_NAME).write_text(
        json.dumps({"pid": dead.pid, "host": socket.gethostname(), "time": 0, "token": "x"})
    )
    log = logging.getLogger("flwr_sheaf")
    log.addHandler(caplog.handler)
    try:
        lock = DirLock(out).acquire()
    finally:
        log.removeHandler(caplog.handler)
    assert f"taking over the stale lock {out / LOCK_NAME} of process {dead.pid}" in caplog.text
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(ConfigError, match=f"process {os.getpid()}"):
        DirLock(out).acquire()  # a second run while the first holds it
    lock.release()
    assert not (out / LOCK_NAME).exists()
    _run(rc)  # runs, and leaves no lock behind
    assert not (out / LOCK_NAME).exists()


# ------------------------------------------------------------------------- item 3
def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "overwritten":
        path.write_text('{"not": "a checkpoint"}')
    elif (
        how == "modified"
    ):  # one byte of the payload (the pickled pilot bank, history, ...) changed
        b = bytearray(data)
        b[-40] ^= 0x01
        path.write_bytes(bytes(b))
    elif how == "old-format":  # the bare pickle of the format before the header
        path.write_bytes(pickle.dumps(load_checkpoint(path), protocol=pickle.HIGHEST_PROTOCOL))


@pytest.mark.parametrize(
    "how,match",
    [
        ("truncated", r"payload is truncated or corrupted"),
        ("empty", r"is empty \(0 bytes"),
        ("overwritten", r"is not a flwr-sheaf server checkpoint \(bad header"),
        ("modified", r"payload is truncated or corrupted .*SHA-256"),
        ("old-format", r"has the old format \(a bare pickle"),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file_before_any_message(tmp_path, how, match):
    out = tmp_path / "r"
    rc = {**TINY, "results-dir": str(out)}
    _run(rc)
    ckpt = out / "checkpoint.pkl"
    assert ckpt.read_bytes().startswith(b"flwr-sheaf server checkpoint v1\n")
    _damage(ckpt, how)
    grid = _refused({**rc, "resume": True, "num-server-rounds": 2}, rf"checkpoint {ckpt}.*{match}")
    assert grid.delivered == []
    with pytest.raises(ConfigError, match="results-dir|resume-from|afresh"):
        load_checkpoint(ckpt)


# ------------------------------------------------------------------------- item 7
def test_different_pilot_counts_name_each_partition_id_and_its_count(tmp_path):
    import dataclasses

    from flwr.clientapp import ClientApp

    from flwr_sheaf.apps.methods import register_all_handlers
    from flwr_sheaf.apps.scenario import cnn_task_factory

    def factory(context):
        task = cnn_task_factory(context)
        if int(context.node_config["partition-id"]) == 1:
            return dataclasses.replace(task, x_pilot=task.x_pilot[:50])
        return task

    rc = {**TINY, "results-dir": str(tmp_path)}
    grid = LocalGrid(register_all_handlers(ClientApp(), factory), 3, run_config=rc)
    _refused(
        rc,
        r"different pilot counts \[50, 64\] \(partition-id 0: 64, partition-id 1: 50, partition-id 2: 64\)",
        exc=ValueError,
        grid=grid,
    )


def test_missing_client_handlers_name_the_register_function(tmp_path):
    from flwr.clientapp import ClientApp

    from flwr_sheaf import register_sheaf_handlers
    from flwr_sheaf.apps.scenario import cnn_task_factory

    rc = {**TINY, "method": "fedproto", "results-dir": str(tmp_path)}
    grid = LocalGrid(register_sheaf_handlers(ClientApp(), cnn_task_factory), 3, run_config=rc)
    _refused(
        rc,
        r"No query function registered with name 'fedproto'.*call flwr_sheaf\.register_fedproto_handlers"
        r"\(app, factory\)",
        exc=RuntimeError,
        grid=grid,
    )


def test_deploy_local_refuses_zero_supernodes():
    from flwr_sheaf.tools.deploy_local import check_run_config, main

    with pytest.raises(ValueError, match=r"--num-supernodes 0: must be an integer >= 1") as err:
        check_run_config("zoo='tiny-3' graph='ring'", 0)
    assert "tiny-0" not in str(err.value)
    assert main(["--num-supernodes", "0"]) == 2
    with pytest.raises(ValueError, match=r"zoo='tiny-2' graph='ring'"):
        check_run_config("", 2)


@pytest.mark.parametrize("zoo", ["two-agent:16", "tiny-2", "tiny-3", "tiny-4"])
def test_the_default_graph_on_few_agents_suggests_ring_or_complete(zoo):
    with pytest.raises(
        ConfigError, match=r"graph='class-overlap' on zoo=.*use graph='ring' or graph='complete'"
    ):
        RunConfig.from_run_config({"zoo": zoo})
    RunConfig.from_run_config({"zoo": zoo, "graph": "ring"})


# ------------------------------------------------------------------------- item 9
def _idx(array: np.ndarray) -> bytes:
    import struct

    return (
        bytes([0, 0, 0x08, array.ndim])
        + struct.pack(">" + "i" * array.ndim, *array.shape)
        + array.astype(np.uint8).tobytes()
    )


def _idx_dir(
    d: Path, images: bytes | None = None, labels: bytes | None = None, gz: bool = False
) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    x = np.random.default_rng(0).integers(0, 256, size=(20, 28, 28))
    for name, data in (
        ("train-images-idx3-ubyte", images if images is not None else _idx(x)),
        ("train-labels-idx1-ubyte", labels if labels is not None else _idx(np.arange(20) % 10)),
    ):
        if gz:
            (d / (name + ".gz")).write_bytes(gzip.compress(data))
        else:
            (d / name).write_bytes(data)
    return d


@pytest.mark.parametrize(
    "labels,match",
    [
        (b"", r"train-labels-idx1-ubyte is empty \(0 bytes\)"),
        (
            b"\x00\x00\x08",
            r"train-labels-idx1-ubyte is truncated: 3 bytes, shorter than the 8-byte idx header",
        ),
        (
            _idx(np.arange(20) % 10)[:-5],
            r"train-labels-idx1-ubyte is truncated: its header says 20 = 20 bytes of data, "
            r"the file has 15",
        ),
        (_idx(np.zeros((20, 28, 28))), r"magic number 0x00000803, expected 0x00000801"),
    ],
)
def test_broken_idx_files_are_named(tmp_path, labels, match):
    from flwr_sheaf.data.sources import load_source

    d = _idx_dir(tmp_path / "data", labels=labels)
    with pytest.raises(ValueError, match=match):
        load_source(f"idx:{d}")


def test_a_truncated_gz_is_named_and_an_empty_named_file_says_how_to_reinstall(tmp_path):
    from flwr_sheaf.data.sources import load_source

    d = _idx_dir(tmp_path / "gz", gz=True)
    gzfile = d / "train-images-idx3-ubyte.gz"
    gzfile.write_bytes(gzfile.read_bytes()[:200])
    with pytest.raises(ValueError, match=rf"{gzfile}: the gzip archive is truncated"):
        load_source(f"idx:{d}")
    d = tmp_path / "fm"
    d.mkdir()
    (d / "t10k-labels-idx1-ubyte.gz").write_bytes(b"")
    (d / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(np.zeros((1, 28, 28)))))
    with pytest.raises(
        ValueError,
        match=r"t10k-labels-idx1-ubyte.gz is empty.*bash scripts/get_data.sh fashion-mnist",
    ):
        load_source(f"idx:{d}")


def test_the_idx_reader_gives_the_same_arrays_as_before(tmp_path):
    """The validating reader returns what torchvision's readers returned (images uint8, labels as ints)."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    from flwr_sheaf.data.sources import read_idx_file

    d = _idx_dir(tmp_path / "same")
    np.testing.assert_array_equal(
        read_idx_file(d / "train-images-idx3-ubyte", "images"),
        read_image_file(str(d / "train-images-idx3-ubyte")).numpy(),
    )
    np.testing.assert_array_equal(
        read_idx_file(d / "train-labels-idx1-ubyte", "labels"),
        read_label_file(str(d / "train-labels-idx1-ubyte")).numpy(),
    )


def test_a_named_dataset_modified_after_install_is_refused_at_load(tmp_path, monkeypatch):
    from flwr_sheaf.data import catalog
    from flwr_sheaf.data.sources import clear_source_cache, load_source

    d = tmp_path / "fashion-mnist"
    d.mkdir()
    for name in catalog.NAMED_DATASETS["fashion-mnist"]:
        (d / name).write_bytes(b"not the file")
    monkeypatch.setattr(catalog, "data_dirs", lambda name: [d])
    clear_source_cache()
    with pytest.raises(
        ValueError,
        match=r"fashion-mnist.*has the wrong SHA-256 \(modified, truncated or another version"
        r".*re-run `bash scripts/get_data.sh fashion-mnist`",
    ):
        load_source("fashion-mnist")
    clear_source_cache()


def test_checksums_are_hashed_once_per_file_version(tmp_path, monkeypatch):
    from flwr_sheaf.data import catalog

    f = tmp_path / "a"
    f.write_bytes(b"one")
    calls = []
    real = catalog.hashlib.sha256
    monkeypatch.setattr(catalog.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    h1 = catalog._sha256_cached(f)
    assert catalog._sha256_cached(f) == h1 and len(calls) == 1
    f.write_bytes(b"two!")  # another size: hashed again
    assert catalog._sha256_cached(f) != h1 and len(calls) == 2


# ------------------------------------------------------------------------- item 10
@pytest.mark.parametrize(
    "rc,match",
    [
        (
            {"participation": "0.9,,0.2,0.5"},
            r"participation='0.9,,0.2,0.5': participation spec .*entry 1 .*is empty",
        ),
        ({"participation": "0.9,0.2,0.5,"}, r"entry 3 .*is empty"),
        ({"participation": "uniformly"}, r"participation='uniformly'"),
        ({"participation": "uniform:"}, r"'uniform:<seed>' needs a non-negative integer seed"),
        (
            {"graph": "0-1,,1-2"},
            r"graph='0-1,,1-2': graph spec '0-1,,1-2': edge 1 \(0-based\) of the edge list is empty",
        ),
        ({"graph": "0-1,1-2,"}, r"edge 2 \(0-based\) of the edge list is empty"),
        ({"graph": "random-regular:2_0"}, r"degree/seed \['2_0'\] are not integers"),
        ({"graph": "class-overlap:nan"}, r"density 'nan' is not a number"),
        ({"graph": "class-overlap:1_0"}, r"density '1_0' is not a number"),
        ({"graph": "class-overlap:1.5"}, r"density '1.5' must be in \(0, 1\]"),
    ],
)
def test_lenient_specs_are_refused_before_any_message(tmp_path, rc, match):
    rc = {**TINY, **rc, "results-dir": str(tmp_path)}
    grid = _refused(rc, match)
    assert grid.delivered == []


def test_a_participation_mapping_outside_the_nodes_is_refused_naming_it():
    from flwr_sheaf.methods.rfedags.strategy import RFedAGS
    from flwr_sheaf.participation import parse_participation

    with pytest.raises(ValueError, match=r"partition-id\(s\) \[7\] outside \[0, 3\) \(N=3 nodes\)"):
        parse_participation({0: 0.5, 1: 0.5, 2: 0.5, 7: 0.9}, 3)
    with pytest.raises(ValueError, match=r"\[7\] outside \[0, 3\)"):
        RFedAGS(3, {0: 0.5, 1: 0.5, 2: 0.5, 7: 0.9})  # at construction: before any message
    assert parse_participation({2: 0.1, 0: 0.5, 1: 0.3}, 3).tolist() == [0.5, 0.3, 0.1]


# ---------------------------------------------------------------- item 6: discovery checks the model
def test_model_reporting_the_wrong_latent_size_fails_discovery_naming_d_and_the_width(tmp_path):
    """A model whose ``d`` says 3 more than ``latent()`` gives: discovery fails on that node, naming its
    partition-id, ``model.d`` and the width, and nothing is trained."""
    from flwr.clientapp import ClientApp

    from flwr_sheaf import register_sheaf_handlers
    from flwr_sheaf.apps.scenario import cnn_task_factory

    widths = {}

    def factory(context):
        task = cnn_task_factory(context)
        if int(context.node_config["partition-id"]) == 1:
            widths["real"] = int(task.model.d)
            task.model.d = widths["real"] + 3
        return task

    app = ClientApp()
    register_sheaf_handlers(app, factory)
    grid = LocalGrid(app, 3, run_config=dict(TINY))
    with pytest.raises(RuntimeError, match="discovery failed") as err:
        run_server(grid, {**TINY, "results-dir": str(tmp_path / "out")})
    real = widths["real"]
    assert f"partition-id 1: model.latent() returned shape (2, {real})" in str(err.value)
    assert f"model.d = {real + 3}" in str(err.value)
    assert {m.metadata.message_type.split(".")[0] for m in grid.delivered} == {"query"}


# ------------------------------------------- issue 22: infeasible splits refused before any message
# (tiny-900: the most agents mnist-bundled's size allows under label-shift, 4,500 samples past the
# pilots / 5; more are refused from the config alone, issue 34 case 4)
@pytest.mark.parametrize(
    "zoo, dataset", [("tiny-900", "mnist-bundled"), ("tiny-10000", "fashion-mnist")]
)
def test_scenario_whose_splits_cannot_be_non_empty_is_refused_in_seconds_before_any_message(
    zoo, dataset, tmp_path
):
    import time

    from flwr_sheaf.data.catalog import find_installed

    if dataset == "fashion-mnist":
        try:
            find_installed("fashion-mnist")
        except FileNotFoundError:
            pytest.skip("fashion-mnist not installed (bash scripts/get_data.sh fashion-mnist)")
    n = int(zoo.split("-")[1])
    rc = {
        "zoo": zoo,
        "dataset": dataset,
        "graph": "ring",
        "num-pilots": 100,
        "results-dir": str(tmp_path / "r"),
    }
    grid = LocalGrid(cnn_client_app, n, run_config=rc)
    t0 = time.process_time()  # CPU-seconds of this process: the machine's load does not count
    with pytest.raises(
        ConfigError,
        match=rf"of N={n} agents get an empty training, validation or test split.*"
        r"partition-id 0: \d+ training, \d+ validation, \d+ test.*use fewer agents",
    ):
        run_server(grid, rc)
    # seconds, not the minutes that building N agents' data and models would take (+ loading the
    # dataset the first time in this process); a wall-clock bound failed under a load average of 19
    assert time.process_time() - t0 < 5.0 + 3.0
    assert grid.delivered == []  # not even discovery


# ------------------------------------------------------------------------- item 4: degraded runs, node-side rollback
def _failing_app(fails):
    """The CNN ClientApp whose train handler raises when ``fails(round, partition-id)``."""

    def app(msg, ctx):
        rnd, pid = int(msg.metadata.group_id or 0), int(ctx.node_config["partition-id"])
        if msg.metadata.message_type.startswith("train.") and fails(rnd, pid):
            raise OSError(f"injected: cannot write the state of partition-id {pid}")
        return cnn_client_app(msg, ctx)

    return app


def _logged(caplog, fn):
    log = logging.getLogger("flwr_sheaf")
    log.addHandler(caplog.handler)
    try:
        return fn()
    finally:
        log.removeHandler(caplog.handler)


def test_a_run_in_which_nobody_trains_ends_failed_after_writing_results_naming_nodes_and_reasons(
    tmp_path, caplog
):
    from flwr_sheaf.strategy.ledger import RunFailedError

    rc = {**TINY, "num-server-rounds": 2, "results-dir": str(tmp_path / "r")}
    grid = LocalGrid(_failing_app(lambda rnd, pid: True), 3, run_config=rc)
    with pytest.raises(
        RunFailedError,
        match=r"6 of 6 sampled train replies failed \(100% > max-failed-fraction=0.5\)"
        r".*round\(s\) \[1, 2\] trained nobody.*partition-id 0: .*cannot write the "
        r"state of partition-id 0.*max-failed-fraction",
    ) as err:
        _logged(caplog, lambda: run_server(grid, rc))
    assert all(f"partition-id {p}" in str(err.value) for p in range(3))
    res = json.loads((tmp_path / "r" / "results.json").read_text())  # written before the run fails
    deg = res["degradation"]
    assert res["status"] == deg["status"] == "failed" and deg["all_rounds_trained_nobody"] is True
    assert deg["rounds_without_training"] == [1, 2] and deg["nodes_failed_every_round"] == [0, 1, 2]
    assert (
        deg["nodes"]["1"]["train_failed_rounds"] == [1, 2]
        and "cannot write" in deg["nodes"]["1"]["reasons"][0]
    )
    assert "the run FAILED" in caplog.text and not (tmp_path / "r" / LOCK_NAME).exists()
    # max-failed-fraction = 1: report only (status degraded, no exception)
    rc1 = {**rc, "results-dir": str(tmp_path / "r1"), "max-failed-fraction": 1.0}
    res1 = json.loads(
        run_server(
            LocalGrid(_failing_app(lambda rnd, pid: True), 3, run_config=rc1), rc1
        ).read_text()
    )
    assert res1["status"] == "degraded" and res1["degradation"]["all_rounds_trained_nobody"] is True


def test_a_run_with_one_node_failing_once_completes_flagged_degraded(tmp_path, caplog):
    rc = {**TINY, "num-server-rounds": 2, "results-dir": str(tmp_path / "r")}
    grid = LocalGrid(_failing_app(lambda rnd, pid: (rnd, pid) == (1, 1)), 3, run_config=rc)
    res = json.loads(_logged(caplog, lambda: run_server(grid, rc)).read_text())
    deg = res["degradation"]
    assert res["status"] == "degraded" and deg["reasons"] == [] and deg["train_failed"] == 1
    assert (
        deg["train_sampled"] == 6
        and deg["rounds_without_training"] == []
        and deg["nodes_failed_every_round"] == []
    )
    assert list(deg["nodes"]) == ["1"] and deg["nodes"]["1"]["train_failed_rounds"] == [1]
    assert "the run is DEGRADED, not clean" in caplog.text and "partition-id 1" in caplog.text
    clean = _run({**TINY, "results-dir": str(tmp_path / "c")})
    assert clean["status"] == "completed" and clean["degradation"]["train_failed"] == 0


def test_a_reply_the_server_refuses_is_never_committed_by_the_node(tmp_path):
    """lambda=1e30: round 2's train replies carry an infinite grad-norm; the node raises instead of
    replying, so its stored model after the refused round is byte-identical to before it."""
    from flwr_sheaf.client.common import model_key

    rc = {
        **TINY,
        "num-server-rounds": 2,
        "lambda": 1e30,
        "max-failed-fraction": 1.0,
        "results-dir": str(tmp_path),
    }
    grid = LocalGrid(cnn_client_app, 3, run_config=rc)
    before = {}

    def app(msg, ctx):
        if msg.metadata.message_type == "train.sheaf" and msg.metadata.group_id == "2":
            pid = ctx.node_config["partition-id"]
            before[pid] = {k: v.numpy().tobytes() for k, v in ctx.state[model_key("sheaf")].items()}
        return cnn_client_app(msg, ctx)

    grid.app = app
    res = json.loads(run_server(grid, rc).read_text())
    refused = [f for f in res["failures"] if f["round"] == 2]
    assert [f["partition-id"] for f in refused] == [0, 1, 2] and res["rounds"][0][
        "num_trained"
    ] == 3
    assert all("RefusedReplyError" in f["reason"] and "is infinite" in f["reason"] for f in refused)
    for nid, ctx in grid.contexts.items():
        after = {k: v.numpy().tobytes() for k, v in ctx.state[model_key("sheaf")].items()}
        assert after == before[grid.partition_of(nid)]  # byte-identical: nothing committed


# ------------------------------------------------------------------------- item 8
def test_an_evaluation_that_measures_no_edge_says_why_in_the_round_and_the_log(tmp_path, caplog):
    rc = {**TINY, "evaluate-every": 1, "fraction-evaluate": 0.2, "results-dir": str(tmp_path)}
    res = json.loads(_logged(caplog, lambda: _run(rc) and (tmp_path / "results.json")).read_text())
    r = res["rounds"][0]
    assert len(r["evaluated"]) == 1 and res["edges"] == []
    assert (
        r["communication_accuracy_mean"] is None
        and r["communication_accuracy_degree_weighted"] is None
    )
    assert r["communication_accuracy_reason"].startswith(
        f"no edge has both ends evaluated: fraction-evaluate=0.2 "
        f"drew partition-ids {r['evaluated']} of 3"
    )
    assert (
        "communication accuracy not measured (null): no edge has both ends evaluated" in caplog.text
    )
    assert r["private_accuracy_mean"] is not None and res["status"] == "completed"


# ------------------------------------------------------------------------- item 1
def test_resume_with_lost_node_state_is_refused_naming_the_partition_and_the_opt_in(tmp_path):
    import shutil

    state, empty = tmp_path / "S", tmp_path / "S2"
    empty.mkdir()
    rc = {
        **TINY,
        "num-server-rounds": 2,
        "results-dir": str(tmp_path / "r"),
        "node-state-dir": str(state),
    }
    _run(rc)
    typo = {**rc, "resume": True, "num-server-rounds": 3, "node-state-dir": str(empty)}
    _refused(
        typo,
        rf"partition-id 0 trained up to round 2 \(server checkpoint, resumed after round 2\) but "
        rf"{empty}/partition-0 has no state files; .*resume-fresh-nodes=true",
        RuntimeError,
        LocalGrid(cnn_client_app, 3, run_config=typo, run_id=2),
    )
    lost = tmp_path / "lost"
    shutil.copytree(state, lost)
    shutil.rmtree(lost / "partition-1")
    one = {**typo, "node-state-dir": str(lost)}
    _refused(
        one,
        r"partition-id 1 trained up to round 2 .* has no state files; .*restart partition-id 1 from "
        r"initialisation",
        RuntimeError,
        LocalGrid(cnn_client_app, 3, run_config=one, run_id=2),
    )
    fresh = {**typo, "resume-fresh-nodes": True}  # explicit opt-in: runs, and results.json says so
    res = json.loads(
        run_server(LocalGrid(cnn_client_app, 3, run_config=fresh, run_id=2), fresh).read_text()
    )
    assert [r["round"] for r in res["rounds"]] == [1, 2, 3] and res["status"] == "completed"
    assert (
        res["config"]["resume-fresh-nodes"] is True and res["resumed"]["resume_fresh_nodes"] is True
    )
    assert res["resumed"]["nodes_trained_before"] == {"0": 2, "1": 2, "2": 2}
    stale = {
        **typo,
        "node-state-dir": str(state),
    }  # the checkpoint is now at round 3, S holds rounds 1-2 only
    _refused(
        stale,
        r"partition-id 0 trained up to round 3 .* has state files of rounds \[1, 2\] only",
        RuntimeError,
        LocalGrid(cnn_client_app, 3, run_config=stale, run_id=3),
    )


# ------------------------------------------------------------------------- item 11
def test_resume_that_adds_the_default_seed_explicitly_is_the_same_config(tmp_path):
    rc = {
        **TINY,
        "num-server-rounds": 2,
        "results-dir": str(tmp_path / "r"),
        "node-state-dir": str(tmp_path / "S"),
    }
    assert "seed" not in rc
    first = _run(rc)
    again = {**rc, "resume": True, "num-server-rounds": 3, "seed": 0}
    res = json.loads(
        run_server(LocalGrid(cnn_client_app, 3, run_config=again, run_id=2), again).read_text()
    )
    assert res["failures"] == [] and [r["num_trained"] for r in res["rounds"]] == [3, 3, 3]
    assert res["resumed"]["after_round"] == 2 and res["rounds"][:2] == first["rounds"][:2]
    other = {**again, "seed": 1}  # a different effective value is still refused before any message
    _refused(
        other,
        r"seed=0 in the checkpoint, 1 now",
        ConfigError,
        LocalGrid(cnn_client_app, 3, run_config=other, run_id=3),
    )


def test_train_reply_check_refuses_an_infinite_entry_of_a_list_metric():
    """A list metric (per-edge values) with one infinite entry is refused like a scalar one, naming
    the metric and the entry; NaN entries ("not measured") pass."""
    from flwr.app import MetricRecord, RecordDict

    from flwr_sheaf.protocol import METRICS, NUM_EXAMPLES, train_reply_problem

    def reply(values):
        return RecordDict({METRICS: MetricRecord({NUM_EXAMPLES: 10, "edge-tv": values})})

    assert train_reply_problem(reply([1.0, float("nan"), 2.0])) is None
    why = train_reply_problem(reply([1.0, 2.0, float("-inf")]))
    assert why is not None and "edge-tv" in why and "entry 2" in why and "infinite" in why


def test_run_flwr_refuses_ports_in_use_before_starting_or_stopping_anything():
    """scripts/run_flwr.py on a port something already listens on (another user's SuperLink) exits 2
    naming the port and how to pick another, and leaves that listener alone."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        script = Path(__file__).resolve().parents[1] / "scripts" / "run_flwr.py"
        r = subprocess.run(
            [sys.executable, str(script), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and f"[{port}] already in use" in r.stderr, r.stderr
        assert "FLWR_SHEAF_PORT" in r.stderr and "+" not in r.stdout  # flwr run never started
        s.settimeout(2)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # the listener is still there


def test_inprocess_script_reports_a_bad_value_in_one_line_with_exit_code_2():
    """`python simulations/inprocess.py graph=strar`: the ConfigError's line (key, value, valid forms),
    exit code 2, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "simulations" / "inprocess.py"
    r = subprocess.run(
        [sys.executable, str(script), "graph=strar"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "graph='strar'" in r.stderr and "valid forms" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ issue 34, case 9: nothing measured
def _evaluation_fails(fails):
    """The CNN ClientApp whose evaluation handlers raise when ``fails(round, partition-id)``."""

    def app(msg, ctx):
        rnd, pid = int(msg.metadata.group_id or 0), int(ctx.node_config["partition-id"])
        if msg.metadata.message_type.startswith("evaluate.") and fails(rnd, pid):
            raise RuntimeError(f"injected: evaluation of partition-id {pid} failed")
        return cnn_client_app(msg, ctx)

    return app


def test_a_run_whose_every_evaluation_fails_ends_failed_saying_nothing_was_measured(
    tmp_path, caplog
):
    from flwr_sheaf.strategy.ledger import RunFailedError

    rc = {**TINY, "num-server-rounds": 2, "evaluate-every": 1, "results-dir": str(tmp_path / "r")}
    grid = LocalGrid(_evaluation_fails(lambda rnd, pid: True), 3, run_config=rc)
    why = "no accuracy was measured: all evaluations failed (6 evaluation failure(s) in round(s) [1, 2]"
    with pytest.raises(RunFailedError, match=re.escape(why)):
        _logged(caplog, lambda: run_server(grid, rc))
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert all(r["private_accuracy_mean"] is None for r in res["rounds"])  # the premise
    assert all(r["num_trained"] == 3 for r in res["rounds"])  # training itself went well
    assert res["status"] == "failed" and res["degradation"]["accuracy_measured"] is False
    assert any(why in r for r in res["degradation"]["reasons"])
    assert "the run FAILED (no accuracy was measured" in caplog.text
    # max-failed-fraction = 1 (report only): degraded, the same line among the problems
    rc1 = {**rc, "results-dir": str(tmp_path / "r1"), "max-failed-fraction": 1.0}
    grid1 = LocalGrid(_evaluation_fails(lambda rnd, pid: True), 3, run_config=rc1)
    res1 = json.loads(run_server(grid1, rc1).read_text())
    assert res1["status"] == "degraded" and any(why in p for p in res1["degradation"]["problems"])
    # one node's evaluation failing once: accuracies measured, degraded as before
    rc2 = {**rc, "results-dir": str(tmp_path / "r2")}
    grid2 = LocalGrid(_evaluation_fails(lambda rnd, pid: (rnd, pid) == (1, 0)), 3, run_config=rc2)
    res2 = json.loads(run_server(grid2, rc2).read_text())
    assert res2["status"] == "degraded" and res2["degradation"]["accuracy_measured"] is True
    assert res2["degradation"]["reasons"] == [] and "problems" not in res2["degradation"]
