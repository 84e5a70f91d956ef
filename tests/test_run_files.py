"""Issue #28, cases 1, 3, 4, 5, 6, 7 and 9: nothing lost on overwrite, locks, write_results, bad
numbers, OS errors, shared node state and the in-process runner (docs/guarantees.md, "Cases of
issue #28"). In-process runs (LocalGrid) on ``zoo=tiny-3``, ``graph=ring``.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from flwr.app import MetricRecord

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.config import ConfigError
from flwr_sheaf.rundir import LOCK_NAME, CheckpointWriteError, DirLock, LockedError, load_checkpoint
from flwr_sheaf.testing import LocalGrid

torch.set_num_threads(1)
logging.getLogger("flwr_sheaf").setLevel(logging.WARNING)

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "zoo": "tiny-3",
    "graph": "ring",
    "num-pilots": 64,
    "max-steps-per-epoch": 2,
    "local-epochs": 1,
    "num-server-rounds": 1,
    "evaluate-every": 0,
}


def _run(rc: dict, grid: LocalGrid | None = None) -> dict:
    grid = grid or LocalGrid(cnn_client_app, 3, run_config=rc)
    return json.loads(run_server(grid, rc).read_text())


def _refused(rc: dict, match: str, exc=ConfigError, grid=None) -> LocalGrid:
    """``rc`` is refused with ``match`` and no training message was sent."""
    grid = grid or LocalGrid(cnn_client_app, 3, run_config=rc)
    with pytest.raises(exc, match=match):
        run_server(grid, rc)
    assert not [m for m in grid.delivered if not m.metadata.message_type.startswith("query.")]
    return grid


def _logged(caplog):
    log = logging.getLogger("flwr_sheaf")
    log.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.WARNING)
    return log


class HookGrid(LocalGrid):
    """LocalGrid calling ``hook(grid, messages)`` before delivering each batch, and ``edit(reply)`` on
    every reply (a node that sends what the test wants)."""

    def __init__(self, *args, hook=None, edit=None, **kw):
        super().__init__(*args, **kw)
        self.hook, self.edit = hook, edit

    def push_messages(self, messages):
        messages = list(messages)
        if self.hook is not None:
            self.hook(self, messages)
        ids = super().push_messages(messages)
        if self.edit is not None:
            for mid in ids:
                if mid in self._replies:
                    self.edit(self._replies[mid])
        return ids


def _is(messages, category: str, rnd: int) -> bool:
    return any(
        m.metadata.message_type.startswith(category + ".") and m.metadata.group_id == str(rnd)
        for m in messages
    )


# ------------------------------------------------------------------------- case 1: overwrite
def test_overwrite_moves_the_earlier_run_aside_and_a_new_run_dying_at_discovery_loses_nothing(
    tmp_path, caplog
):
    out = tmp_path / "r"
    rc = {**TINY, "results-dir": str(out)}
    _run(rc)
    before = {n: (out / n).read_bytes() for n in ("results.json", "checkpoint.pkl")}
    again = {**rc, "overwrite": True, "discovery-timeout": 1}
    silent = LocalGrid(cnn_client_app, 3, run_config=again, drop=lambda m: True)
    _logged(caplog)
    with pytest.raises(RuntimeError, match="no SuperNode answered") as err:
        run_server(silent, again)  # every node silent: the new run dies at discovery
    # issue 34, case 9: it wrote nothing of its own, so the earlier run's files are moved back
    assert {n: (out / n).read_bytes() for n in before} == before  # nothing lost
    assert not list(out.glob("previous-*"))
    assert "overwrite=true: moved the earlier run's results.json, checkpoint.pkl" in caplog.text
    assert "nothing deleted" in caplog.text
    back = f"accuracy.png, moved aside by overwrite=true, were moved back into {out}"
    assert any(back in n for n in err.value.__notes__) and back in caplog.text
    res = _run({**rc, "overwrite": True})
    assert Path(res["previous_run"]["moved_to"]).parent == out
    res = _run({**rc, "overwrite": True})
    assert Path(res["previous_run"]["moved_to"]).parent == out
    assert res["previous_run"]["files"] == ["results.json", "checkpoint.pkl", "accuracy.png"]
    assert len(list(out.glob("previous-*"))) == 2 and not (out / LOCK_NAME).exists()


def test_resume_with_overwrite_is_refused_naming_both_keys(tmp_path):
    rc = {**TINY, "results-dir": str(tmp_path / "r"), "checkpoint-every": 1}
    _run(rc)
    _refused(
        {**rc, "resume": True, "overwrite": True, "num-server-rounds": 2},
        r"overwrite=true and resume=true contradict each other.*set only one of them",
    )
    _refused(
        {**rc, "resume-from": str(tmp_path / "r"), "overwrite": True, "num-server-rounds": 2},
        r"overwrite=true and resume-from='.*' contradict each other",
    )
    assert load_checkpoint(tmp_path / "r" / "checkpoint.pkl")["round"] == 1  # untouched


def test_extending_a_run_without_checkpoint_gets_one_answer_naming_what_works(tmp_path):
    out = tmp_path / "r"
    rc = {**TINY, "results-dir": str(out), "checkpoint-every": 0}
    _run(rc)
    assert not (out / "checkpoint.pkl").exists()
    longer = {**rc, "num-server-rounds": 2}
    resumed = _refused(
        {**longer, "resume": True},
        r"resume=true: .* holds a finished run's results.json but no checkpoint.pkl .*cannot be "
        r"extended. Run afresh .* in another results-dir \(or with overwrite=true",
    )
    assert resumed.delivered == []
    with pytest.raises(ConfigError) as fresh:
        run_server(LocalGrid(cnn_client_app, 3, run_config=longer), longer)
    text = str(fresh.value)
    assert "another results-dir" in text and "overwrite=true" in text
    assert "resume=true cannot continue it" in text and "resume=true to continue" not in text


@pytest.mark.parametrize("kind", ["dir", "fifo", "dangling"])
def test_resume_over_a_checkpoint_that_is_not_a_file_names_it(tmp_path, kind):
    # before: "no checkpoint at ...: nothing to resume (run without resume first)", and the run
    # without resume: "holds another run's results (checkpoint.pkl) ... resume=true to continue"
    out = tmp_path / "r"
    out.mkdir()
    ckpt = out / "checkpoint.pkl"
    {
        "dir": ckpt.mkdir,
        "fifo": lambda: os.mkfifo(ckpt),
        "dangling": lambda: ckpt.symlink_to(tmp_path / "x"),
    }[kind]()
    rc = {**TINY, "results-dir": str(out), "resume": True}
    grid = LocalGrid(cnn_client_app, 3, run_config=rc)
    with pytest.raises(ConfigError) as err:
        run_server(grid, rc)
    assert (
        grid.delivered == [] and type(err.value) is ConfigError
    )  # not NoCheckpointError: something is there
    assert f"checkpoint {ckpt} is not a regular file" in str(err.value)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pkl"]


def test_overwrite_with_the_earlier_runs_node_state_dir_is_refused_and_moves_nothing(tmp_path):
    out, state = tmp_path / "r", tmp_path / "S"
    rc = {**TINY, "results-dir": str(out), "node-state-dir": str(state)}
    _run(rc)
    before = (out / "results.json").read_bytes()
    _refused(
        {**rc, "overwrite": True},
        rf"node-state-dir='{state}': {state} holds the node state of another run \(recorded in "
        rf"{state}/run.json: the run of results-dir '{out}'.*\), state files of partition-0, "
        rf"partition-1, partition-2; a fresh run must not start from it.*Use another node-state-dir",
    )
    assert (out / "results.json").read_bytes() == before and not list(out.glob("previous-*"))


# ------------------------------------------------------------------------- case 3: write_results
def test_a_run_whose_start_raised_in_round_2_of_3_is_written_failed_with_its_rounds(tmp_path):
    class Crash(Exception):
        pass

    def crash(grid, messages):
        if _is(messages, "train", 2):
            raise Crash("the grid went away")

    rc = {**TINY, "num-server-rounds": 3, "results-dir": str(tmp_path / "r")}
    with pytest.raises(Crash) as err:
        run_server(HookGrid(cnn_client_app, 3, run_config=rc, hook=crash), rc)
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [1] and res["status"] == "failed"
    assert res["degradation"]["rounds_requested"] == 3
    assert res["degradation"]["rounds_completed"] == 1
    reasons = res["degradation"]["reasons"]
    assert "the run stopped after server round 1 of 3 (strategy.start did not finish)" in reasons
    assert "Crash: the grid went away" in reasons
    assert any("(status 'failed') written to" in n for n in err.value.__notes__)


def _own_strategy(tmp_path, crash_round=None):
    """An own app's SheafFRL run for 3 rounds; the grid raises in ``crash_round``'s training."""
    from flwr_sheaf import FederationConfig, LocalTrainConfig, SheafFRL

    def crash(grid, messages):
        if crash_round is not None and _is(messages, "train", crash_round):
            raise RuntimeError("killed")

    rc = {"zoo": "tiny-3", "num-pilots": 64}
    grid = HookGrid(cnn_client_app, 3, run_config=rc, hook=crash)
    s = SheafFRL(
        3,
        federation=FederationConfig(graph="ring", evaluate_every=0),
        train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=2),
    )
    try:
        s.start(grid=grid, num_rounds=3, timeout=5)
    except RuntimeError:
        pass
    return s


def test_write_results_of_a_crashed_own_run_is_failed_and_refuses_other_runs_files(tmp_path):
    from flwr_sheaf import write_results

    crashed = _own_strategy(tmp_path, crash_round=2)
    res = json.loads(write_results(crashed, tmp_path / "a").read_text())
    assert res["status"] == "failed" and [r["round"] for r in res["rounds"]] == [1]
    assert res["degradation"]["reasons"] == [
        "the run stopped after server round 1 of 3 (strategy.start did not finish)"
    ]
    # beside another run's checkpoint.pkl: refused; overwrite=True moves it aside
    other = tmp_path / "b"
    _run({**TINY, "results-dir": str(other)})
    (other / "results.json").unlink()
    (other / "accuracy.png").unlink()
    ckpt = (other / "checkpoint.pkl").read_bytes()
    with pytest.raises(FileExistsError, match=r"holds another run's checkpoint .*checkpoint.pkl"):
        write_results(crashed, other)
    assert not (other / "results.json").exists()
    write_results(crashed, other, overwrite=True)
    [prev] = other.glob("previous-*")
    assert (prev / "checkpoint.pkl").read_bytes() == ckpt and not (
        other / "checkpoint.pkl"
    ).exists()


def test_write_results_into_a_directory_locked_by_a_live_run_is_refused(tmp_path):
    from flwr_sheaf import write_results

    done = _own_strategy(tmp_path)
    assert json.loads(write_results(done, tmp_path / "ok").read_text())["status"] == "completed"
    locked = tmp_path / "locked"
    locked.mkdir()
    with _holder(locked) as pid:
        with pytest.raises(
            LockedError, match=rf"in use by another run: process {pid} on this host"
        ):
            write_results(done, locked)
    assert not (locked / "results.json").exists()


@pytest.mark.parametrize("name", ["results.json", "accuracy.png"])
def test_write_results_never_writes_through_a_link_in_a_files_place(tmp_path, name):
    # a dangling link out/results.json -> victim: the file was written at the link's target,
    # outside out_dir, with or without overwrite
    from flwr_sheaf import write_results

    done = _own_strategy(tmp_path)
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(FileExistsError, match=rf"already holds another run's results \({name}\)"):
        write_results(done, out)
    written = write_results(done, out, overwrite=True)
    [prev] = out.glob("previous-*")
    assert not victim.exists() and (prev / name).readlink() == victim  # the link, moved aside
    assert not written.is_symlink() and not (out / "accuracy.png").is_symlink()
    assert json.loads(written.read_text())["status"] == "completed"
    assert sorted(p.name for p in out.iterdir()) == ["accuracy.png", prev.name, "results.json"]


# ------------------------------------------------------------------------- case 4: NaN
def test_a_nan_train_metric_or_private_accuracy_is_that_nodes_recorded_failure(tmp_path):
    pid_of = {}

    def edit(reply):
        pid = pid_of[reply.metadata.src_node_id]
        kind = reply.metadata.message_type
        if reply.has_error() or pid != 1 or not kind.startswith(("train.", "evaluate.sheaf")):
            return
        m = reply.content["metrics"]
        if kind.startswith("train.") and reply.metadata.group_id == "1":
            reply.content["metrics"] = MetricRecord({**dict(m), "ce": math.nan})
        if kind == "evaluate.sheaf" and reply.metadata.group_id == "2":
            reply.content["metrics"] = MetricRecord({**dict(m), "private-accuracy": math.nan})

    rc = {**TINY, "num-server-rounds": 2, "evaluate-every": 1, "results-dir": str(tmp_path / "r")}
    grid = HookGrid(cnn_client_app, 3, run_config=rc, edit=edit)
    pid_of.update({n: i for i, n in enumerate(grid.node_ids)})
    res = _run(rc, grid)
    got = {(f["round"], f["phase"], f["partition-id"]): f["reason"] for f in res["failures"]}
    assert set(got) == {(1, "train", 1), (2, "evaluate", 1)}
    assert got[(1, "train", 1)].startswith("metric ce = nan is not a number")
    assert got[(2, "evaluate", 1)].startswith("bad evaluation reply: private-accuracy = nan")
    assert res["status"] == "degraded" and res["rounds"][0]["num_trained"] == 2
    assert "1" not in res["nodes"] or res["nodes"]["1"]["private_accuracy"] is None
    finite = [x for x in (res["rounds"][1]["private_accuracy_mean"],) if x is not None]
    assert finite and all(math.isfinite(x) for x in finite)


# ------------------------------------------------------------------------- case 5: locks
def test_two_contenders_taking_over_one_stale_lock_have_one_winner(tmp_path, monkeypatch):
    import flwr_sheaf.rundir as locks

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = DirLock(tmp_path)._mine() | {"pid": dead.pid, "token": "dead"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    first, second = DirLock(tmp_path), DirLock(tmp_path)
    outcome = {}

    def contender(lock):  # the second contender runs entirely inside the first one's window
        if lock is first and not outcome:
            outcome["second"] = "running"
            try:
                second.acquire()
                outcome["second"] = "won"
            except LockedError as exc:
                outcome["second"] = str(exc)

    monkeypatch.setattr(locks, "_after_check", contender)
    first.acquire()
    assert outcome["second"] != "won" and "in use by another run" in outcome["second"]
    assert first.held and not second.held
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == first.token
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()


class _holder:
    """A subprocess holding ``DirLock(directory)`` until the context ends; yields its pid."""

    def __init__(self, directory: Path, key: str = "results-dir"):
        self.directory, self.key = directory, key

    def __enter__(self) -> int:
        code = textwrap.dedent(
            f"""
            import sys
            from flwr_sheaf.rundir import DirLock
            DirLock({str(self.directory)!r}, {self.key!r}).acquire()
            print("held", flush=True)
            sys.stdin.read()
            """
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "held"
        return self.proc.pid

    def __exit__(self, *exc) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def test_a_live_lock_of_a_process_in_another_pid_namespace_is_not_taken_over(tmp_path):
    with _holder(tmp_path):
        # what a run in another container (PID namespace) on this host writes: a pid that does not
        # exist here, another namespace's inode; its flock is live
        info = json.loads((tmp_path / LOCK_NAME).read_text())
        info.update(pid=999_999_9, pidns=1)
        (tmp_path / LOCK_NAME).write_text(json.dumps(info))
        with pytest.raises(
            LockedError,
            match=r"in use by another run: process 9999999 on this host \(in another PID "
            r"namespace, e.g. another container\) holds",
        ):
            DirLock(tmp_path).acquire()
    lock = DirLock(tmp_path).acquire()  # the holder ended: its kernel lock went with it
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    lock.release()


def test_a_lock_written_on_another_kernel_is_not_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"pid": 12, "host": "other-machine", "boot_id": "x", "time": 4e9})
    )
    with pytest.raises(LockedError, match=r"process 12 on host other-machine .*cannot be shown"):
        DirLock(tmp_path).acquire()


# ------------------------------------------------------------------------- case 6: OS errors
@pytest.mark.parametrize("fail_round", [1, 2])
def test_a_full_disk_at_a_checkpoint_names_the_file_keeps_the_last_one_and_writes_the_rounds(
    tmp_path, monkeypatch, fail_round
):
    out = tmp_path / "r"
    real = os.replace

    def replace(src, dst, *a, **kw):
        name = Path(dst).name
        if name == "checkpoint.pkl" and (out / "checkpoint.pkl").exists() == (fail_round > 1):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)
    rc = {**TINY, "num-server-rounds": 3, "results-dir": str(out)}
    with pytest.raises(CheckpointWriteError) as err:
        _run(rc)
    msg = str(err.value)
    assert err.value.errno == errno.ENOSPC
    assert (
        f"cannot write the checkpoint of server round {fail_round} to {out}/checkpoint.pkl" in msg
    )
    assert "No space left on device" in msg and "free space on that file system" in msg
    if fail_round == 1:
        assert "no earlier checkpoint exists" in msg and not (out / "checkpoint.pkl").exists()
    else:
        assert "the previous checkpoint" in msg and "is unchanged" in msg
        assert load_checkpoint(out / "checkpoint.pkl")["round"] == 1
    assert not list(out.glob(".checkpoint-*"))  # no temp file left
    res = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == list(range(1, fail_round + 1))
    assert res["status"] == "failed"
    assert any("cannot write the checkpoint" in r for r in res["degradation"]["reasons"])


def test_a_full_disk_at_a_node_state_write_names_the_file_and_keeps_the_one_there(
    tmp_path, monkeypatch
):
    from flwr.app import ConfigRecord, RecordDict

    from flwr_sheaf.client.state import read_state, write_state

    meta = {"partition-id": 0, "num-partitions": 1, "run-id": 1, "round": 1, "previous-round": 0}
    meta["run-config"] = {}
    path = write_state(tmp_path, RecordDict({"a": ConfigRecord({"x": 1})}), meta)
    before = path.read_bytes()

    def full(src, dst, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError) as err:
        write_state(tmp_path, RecordDict({"a": ConfigRecord({"x": 2})}), meta)
    assert err.value.errno == errno.ENOSPC
    assert str(err.value) == (
        f"[Errno 28] cannot write the node state file {path}: No space left on device; free space "
        f"there or set the node config state-dir (run config node-state-dir) to a writable directory"
    )
    monkeypatch.undo()
    assert path.read_bytes() == before and read_state(path)[1]["a"]["x"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


@pytest.mark.parametrize("key", ["results-dir", "node-state-dir", "tracking-dir"])
def test_a_symlink_loop_is_named_by_its_key(tmp_path, key):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    rc = {**TINY, "results-dir": str(tmp_path / "r"), key: str(tmp_path / "a" / "out")}
    if key == "tracking-dir":
        rc["tracking"] = "tensorboard"
    grid = _refused(
        rc,
        rf"{key}='{tmp_path}/a/out': {tmp_path}/a/out runs into a symbolic-link loop .*replace the "
        rf"link with a real directory or set {key} to another path",
    )
    assert grid.delivered == []


# ------------------------------------------------------------------------- case 7: node state
def test_a_fresh_run_over_another_runs_node_state_dir_is_refused_before_training(tmp_path):
    state = tmp_path / "S"
    _run({**TINY, "results-dir": str(tmp_path / "r0"), "node-state-dir": str(state)})
    grid = _refused(
        {**TINY, "seed": 1, "results-dir": str(tmp_path / "r1"), "node-state-dir": str(state)},
        rf"node-state-dir='{state}': .* holds the node state of another run \(.*seed 0\).*a fresh "
        rf"run must not start from it",
    )
    assert grid.delivered == []
    # a seed-1 run of its own, resumed (its checkpoint agrees) over the seed-0 run's node state:
    # refused before any message, naming the key and both values
    own = {
        **TINY,
        "seed": 1,
        "results-dir": str(tmp_path / "r1"),
        "node-state-dir": str(tmp_path / "S1"),
    }
    _run(own)
    _refused(
        {**own, "resume": True, "num-server-rounds": 2, "node-state-dir": str(state)},
        rf"node-state-dir='{state}': .* holds the node state of another run config \(seed=0 there, "
        r"1 now\)",
    )


def test_two_runs_at_once_on_one_node_state_dir_the_second_is_refused(tmp_path):
    state = tmp_path / "S"
    second = {**TINY, "results-dir": str(tmp_path / "r2"), "node-state-dir": str(state)}
    refused = []

    def start_second(grid, messages):
        if _is(messages, "train", 1) and not refused:
            with pytest.raises(
                LockedError,
                match=rf"node-state-dir {state} is in use by another run: process "
                rf"{os.getpid()} on this host",
            ):
                run_server(LocalGrid(cnn_client_app, 3, run_config=second), second)
            refused.append(True)

    first = {
        **TINY,
        "num-server-rounds": 2,
        "results-dir": str(tmp_path / "r1"),
        "node-state-dir": str(state),
    }
    res = _run(first, HookGrid(cnn_client_app, 3, run_config=first, hook=start_second))
    assert refused and res["status"] == "completed" and res["failures"] == []
    assert [r["num_trained"] for r in res["rounds"]] == [3, 3]
    assert not (tmp_path / "r2" / "results.json").exists() and not (state / LOCK_NAME).exists()


# ------------------------------------------------------------------------- case 9: inprocess.py
def _inprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "simulations" / "inprocess.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_inprocess_runner_evaluate_every_0_and_resume_without_checkpoint(tmp_path):
    args = [f"{k}={v}" for k, v in {**TINY, "results-dir": str(tmp_path / "r")}.items()]
    r = _inprocess(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no round was evaluated (evaluate-every=0 means never)" in r.stdout
    r = _inprocess(
        *[a for a in args if not a.startswith("results-dir")],
        f"results-dir={tmp_path / 'none'}",
        "resume=true",
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1:] == [
        f"inprocess.py: resume=true: no checkpoint at {tmp_path / 'none'}/checkpoint.pkl: nothing "
        f"to resume (run without resume first, or point resume-from at the stopped run's "
        f"checkpoint.pkl)"
    ]


# ------------------------------------------------------------------------- issue 34: run files
# docs/guarantees.md
def test_a_lock_file_removed_while_a_run_holds_it_still_refuses_a_second_run(tmp_path, caplog):
    out = tmp_path / "r"
    out.mkdir()
    with _holder(out) as pid:
        (out / LOCK_NAME).unlink()  # e.g. a clean-up script, or a user who thought it stale
        rc = {**TINY, "results-dir": str(out)}
        _refused(
            rc,
            rf"results-dir {out} is in use by another run: a process holds a lock on {out} \(its "
            r"lock file .*\.lock was removed or replaced while it ran\)",
            LockedError,
        )
        assert not (out / "results.json").exists()
        assert pid > 0
    # the holder of a removed lock file puts it back before it writes (results.json, checkpoint)
    from flwr_sheaf import write_results

    done = _own_strategy(tmp_path)
    lock = DirLock(out).acquire()
    try:
        (out / LOCK_NAME).unlink()
        _logged(caplog)
        with pytest.raises(LockedError, match="in use by another run"):
            DirLock(out).acquire()
        write_results(done, out)
        assert json.loads((out / LOCK_NAME).read_text())["token"] == lock.token
        assert f"the lock file {out / LOCK_NAME} was removed while this run held it" in caplog.text
    finally:
        lock.release()
    assert not (out / LOCK_NAME).exists() and (out / "results.json").exists()


@pytest.mark.parametrize("target", ["existing", "dangling"])
def test_a_symlinked_lock_file_is_refused_and_nothing_is_written_through_it(tmp_path, target):
    out, victim = tmp_path / "r", tmp_path / "victim.txt"
    out.mkdir()
    if target == "existing":
        victim.write_text("someone's file")
    os.symlink(victim, out / LOCK_NAME)
    _refused(
        {**TINY, "results-dir": str(out)},
        rf"results-dir {out}: its lock file {out / LOCK_NAME} is a symbolic link \(to "
        rf"'{victim}'\), not a regular file .* Remove {out / LOCK_NAME} \(rm {out / LOCK_NAME}\)",
        LockedError,
    )
    if target == "existing":
        assert victim.read_text() == "someone's file"  # was: the lock's JSON written into it
    else:
        assert not victim.exists()  # was: created by the lock
    assert os.path.islink(out / LOCK_NAME)


def test_a_lock_path_that_is_a_directory_is_refused_with_the_fix(tmp_path):
    out = tmp_path / "r"
    (out / LOCK_NAME).mkdir(parents=True)
    with pytest.raises(
        LockedError,
        match=rf"its lock file {out / LOCK_NAME} is a directory, not a regular file .*"
        rf"\(rm -r {out / LOCK_NAME}\)",
    ):  # was: IsADirectoryError: [Errno 21] Is a directory
        DirLock(out).acquire()


@pytest.mark.parametrize("who", ["dead", "this process"])
def test_a_leftover_lock_of_a_dead_process_or_naming_this_one_is_taken_over_with_a_warning(
    tmp_path, caplog, who
):
    import socket

    if who == "dead":
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        pid, why = proc.pid, f"its process {proc.pid} no longer runs"
    else:
        pid, why = (
            os.getpid(),
            f"it names this very process (pid {os.getpid()}), which does not hold it",
        )
    # a leftover without boot_id (hand-made, or an older flwr-sheaf's): this host, a pid that can be asked
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    _logged(caplog)
    lock = DirLock(
        tmp_path
    ).acquire()  # was: LockedError "in use by another run ... cannot be shown"
    try:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
        assert f"taking over the stale lock {tmp_path / LOCK_NAME} of process {pid}" in caplog.text
        assert why in caplog.text
    finally:
        lock.release()


@pytest.mark.parametrize("content", ["not json", ""])
def test_a_leftover_lock_file_naming_no_holder_is_taken_over_or_refused_by_its_kernel_lock(
    tmp_path, caplog, content
):
    """Issue 34 attack F4 (docs/guarantees.md): an unreadable or empty ``.lock`` whose kernel
    lock is free is a leftover, taken over with a warning saying what was found (was: garbage refused
    as "process ? on host ?", an empty one taken over without a word); with its kernel lock held the
    error says a process holds it, inventing no pid or host."""
    (tmp_path / LOCK_NAME).write_text(content)
    _logged(caplog)
    lock = DirLock(tmp_path).acquire()
    try:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
        found = "empty" if not content else "not a flwr-sheaf lock (no JSON object in it)"
        assert (
            f"taking over the leftover lock file {tmp_path / LOCK_NAME}: it is {found} and no "
            "process holds its kernel lock"
        ) in caplog.text
    finally:
        lock.release()
    out = tmp_path / "held"
    out.mkdir()
    with _holder(out):
        (out / LOCK_NAME).write_text(content)  # the live holder's file, overwritten in place
        with pytest.raises(LockedError) as err:
            DirLock(out).acquire()
    assert f"a process holds the kernel lock of {out / LOCK_NAME}" in str(err.value)
    assert "process ?" not in str(err.value) and "host ?" not in str(err.value)


def test_a_results_dir_moved_away_while_a_run_holds_it_is_not_written_by_that_run(tmp_path, caplog):
    """Issue 34 attack F3 (docs/guarantees.md): ``mv dir dir.old; mkdir dir`` while run A holds
    ``dir``: A's lock went with ``dir.old``, so run B may take the new ``dir``; A refuses its next
    write there, naming where its directory went (was: A put its lock file into B's directory with
    the false "no other run could take the directory" and replaced B's results.json)."""
    from flwr_sheaf import write_results

    done = _own_strategy(tmp_path)
    out, old = tmp_path / "r", tmp_path / "r.old"
    out.mkdir()
    lock = DirLock(out).acquire()
    try:
        out.rename(old)
        out.mkdir()
        _logged(caplog)
        with pytest.raises(LockedError) as err:
            write_results(done, out)
        msg = str(err.value)
        assert msg.startswith(
            f"results-dir {out}: the directory was moved or replaced while this run held it (it is "
            f"now {old}, with the files this run wrote there)"
        ), msg
        assert f"another run may now use {out}, so this run writes nothing more there" in msg
        assert f"no checkpoint was written in {old}" in msg
        assert "no other run could take" not in caplog.text
        # nothing written into the new directory (run B's): no results.json, no lock file put back
        assert sorted(p.name for p in out.iterdir()) == []
    finally:
        lock.release()
    assert not (old / LOCK_NAME).exists()  # released where it was held: in the moved directory


def test_a_leftover_lock_of_another_kernel_with_this_host_name_is_never_taken_over(tmp_path):
    """A lock file on a shared file system written by another machine that has the same host name
    (its ``boot_id`` differs; the initial PID namespace has the same inode on every kernel): its pid
    says nothing here, so the live run there keeps its lock."""
    import socket
    import time

    from flwr_sheaf.rundir import _pidns

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that does not run here (it may well run on the other machine)
    info = {
        "pid": proc.pid,
        "host": socket.gethostname(),
        "pidns": _pidns(),
        "boot_id": "00000000-another-kernel",
        "time": time.time(),
        "started": "2026-01-01 00:00:00",
    }
    (tmp_path / LOCK_NAME).write_text(json.dumps(info))
    with pytest.raises(  # was: taken over, "its process ... no longer runs"
        LockedError,
        match=rf"in use by another run: process {proc.pid} on this host holds .* and it cannot be "
        r"shown to have ended",
    ):
        DirLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text()) == info


def test_the_pid_check_never_signals_a_process_on_windows(monkeypatch):
    """``os.kill(pid, 0)`` is TerminateProcess on Windows: the stale-lock check must not call it."""
    from flwr_sheaf import rundir as locks

    def kill(pid, sig):
        raise AssertionError(f"os.kill({pid}, {sig}) called")

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with monkeypatch.context() as m:
        m.setattr(os, "kill", kill)
        m.setattr(os, "name", "nt")
        m.setitem(sys.modules, "psutil", None)  # not installed: cannot be told, so alive
        unknown = locks._pid_alive(proc.pid)
    assert unknown is True
    import types

    asked = []
    fake = types.SimpleNamespace(pid_exists=lambda pid: asked.append(pid) or pid == os.getpid())
    with monkeypatch.context() as m:  # installed: psutil's Windows pid_exists tells
        m.setattr(os, "kill", kill)
        m.setattr(os, "name", "nt")
        m.setitem(sys.modules, "psutil", fake)
        alive, dead = locks._pid_alive(os.getpid()), locks._pid_alive(proc.pid)
    assert (alive, dead, asked) == (True, False, [os.getpid(), proc.pid])


def test_a_momentary_probe_of_the_directory_lock_does_not_refuse_a_run(tmp_path):
    """``live_holder`` (resume-from's check, in another process) holds the directory's lock for an
    instant; a run starting on that directory meanwhile must not read it as a live run."""
    import fcntl
    import threading

    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # the probe, released 50 ms later
    timer = threading.Timer(0.05, lambda: fcntl.flock(fd, fcntl.LOCK_UN))
    timer.start()
    try:
        lock = DirLock(tmp_path).acquire()  # was: LockedError "... its lock file was removed"
        lock.release()
    finally:
        timer.join()
        os.close(fd)


def test_write_results_in_a_finally_after_a_discovery_failure_raises_the_real_error(tmp_path):
    from flwr_sheaf import FederationConfig, LocalTrainConfig, SheafFRL, write_results

    silent = LocalGrid(cnn_client_app, 3, run_config={"zoo": "tiny-3"}, drop=lambda m: True)
    s = SheafFRL(
        3,
        federation=FederationConfig(graph="ring"),
        train=LocalTrainConfig(local_epochs=1, max_steps_per_epoch=2),
    )
    s.discovery_timeout = 1.0
    with pytest.raises(RuntimeError, match="no SuperNode answered") as err:
        try:
            s.start(grid=silent, num_rounds=1, timeout=5)
        finally:
            write_results(s, tmp_path / "r")  # was: its ValueError replaced the discovery error
    notes = "\n".join(err.value.__notes__)
    assert f"write_results(out_dir='{tmp_path / 'r'}') could not write this run's results" in notes
    assert "ValueError: SheafFRL has no completed round" in notes
    assert err.value.__context__ is None  # raised plainly: nothing posing as its cause
    assert not (tmp_path / "r" / "results.json").exists()
    with pytest.raises(ValueError, match="no completed round"):  # not in flight: its own error
        write_results(s, tmp_path / "r")


def test_write_results_overwrite_moves_the_earlier_files_aside_and_keep_previous_bounds_them(
    tmp_path, caplog
):
    from flwr_sheaf import write_results
    from flwr_sheaf.rundir import RunDir

    done, out = _own_strategy(tmp_path), tmp_path / "r"
    _logged(caplog)
    first = write_results(done, out, extra={"n": 1}).read_bytes()
    write_results(done, out, overwrite=True, extra={"n": 2})
    [prev] = RunDir(out).previous()
    assert (prev / "results.json").read_bytes() == first  # was: replaced, the first one lost
    assert (prev / "accuracy.png").exists()
    assert f"moved the earlier results.json, accuracy.png from {out} into {prev}" in caplog.text
    write_results(done, out, overwrite=True, extra={"n": 3}, keep_previous=1)
    [kept] = RunDir(out).previous()
    assert json.loads((kept / "results.json").read_text())["n"] == 2
    assert (
        f"keep-previous=1: removed {prev} (an earlier run's files: accuracy.png, results.json)"
        in (caplog.text)
    )
    assert json.loads((out / "results.json").read_text())["n"] == 3


def test_keep_previous_run_config_key_bounds_the_previous_folders_of_overwrite(tmp_path, caplog):
    from flwr_sheaf.rundir import RunDir

    out = tmp_path / "r"
    rc = {**TINY, "results-dir": str(out), "checkpoint-every": 0}
    _run(rc)
    _run({**rc, "overwrite": True})
    _run({**rc, "overwrite": True})  # default keep-previous=0: every folder kept
    assert len(RunDir(out).previous()) == 2
    _logged(caplog)
    res = _run({**rc, "overwrite": True, "keep-previous": 2})
    assert res["config"]["keep-previous"] == 2
    folders = RunDir(out).previous()
    assert len(folders) == 2 and folders[-1] == Path(res["previous_run"]["moved_to"])
    assert "keep-previous=2: removed" in caplog.text
    with pytest.raises(ConfigError, match=r"keep-previous=-1"):
        _run({**rc, "overwrite": True, "keep-previous": -1})


def test_after_an_overwrite_whose_run_died_resume_names_where_the_checkpoint_went(tmp_path):
    out = tmp_path / "r"
    rc = {**TINY, "results-dir": str(out)}
    _run(rc)
    ckpt = (out / "checkpoint.pkl").read_bytes()

    def crash(grid, messages):
        if _is(messages, "train", 2):
            raise RuntimeError("the machine went away")

    again = {**rc, "overwrite": True, "checkpoint-every": 0, "num-server-rounds": 2}
    grid = HookGrid(cnn_client_app, 3, run_config=again, hook=crash)
    with pytest.raises(RuntimeError, match="the machine went away") as err:
        run_server(grid, again)  # wrote its round-1 results.json (failed), no checkpoint
    [prev] = out.glob("previous-*")
    assert (prev / "checkpoint.pkl").read_bytes() == ckpt
    assert any(
        f"are in {prev} (this run wrote results.json" in n
        and f"resume-from='{prev / 'checkpoint.pkl'}'" in n
        for n in err.value.__notes__
    )
    _refused(  # was: "no checkpoint.pkl ... cannot be extended", nothing about where it went
        {**rc, "resume": True, "num-server-rounds": 2},
        rf"an earlier run's checkpoint was moved \(overwrite=true\) into {prev / 'checkpoint.pkl'}: "
        rf"to continue that run set resume-from='{prev / 'checkpoint.pkl'}'",
        ConfigError,
    )


def test_resume_from_a_directory_a_live_run_holds_is_refused_naming_it(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _run({**TINY, "results-dir": str(a)})
    with _holder(a) as pid:  # e.g. that run was resumed and is running again
        _refused(  # was: resumed from a checkpoint that changes under it
            {**TINY, "results-dir": str(b), "resume-from": str(a), "num-server-rounds": 2},
            rf"resume-from='{a}': {a} is still in use by a live run: process {pid} on this host "
            rf"holds {a / LOCK_NAME} .* wait for that run to end",
            LockedError,
        )
    from flwr_sheaf.rundir import live_holder

    assert live_holder(a) is None  # that run ended: resume-from it is no longer refused for it


def test_resume_from_into_a_results_dir_holding_another_runs_results_refuses_or_moves_them(
    tmp_path,
):
    """``resume-from=<a>`` with ``results-dir=<b>`` where ``<b>`` holds another run's files: the
    resumed run's writes would replace them (was: ``<b>/results.json`` and its checkpoint replaced)."""
    import shutil

    a, b, backup = tmp_path / "a", tmp_path / "b", tmp_path / "backup"
    rc = {**TINY, "checkpoint-every": 1, "node-state-dir": str(tmp_path / "state")}
    _run({**rc, "results-dir": str(a)})
    # the files of the run being resumed (same run config) are its own: resuming into them passes
    backup.mkdir()
    shutil.copy(a / "checkpoint.pkl", backup / "checkpoint.pkl")
    own = {**rc, "results-dir": str(a), "resume-from": str(backup), "num-server-rounds": 2}
    assert [r["round"] for r in _run(own)["rounds"]] == [1, 2]
    # another run (another seed) in b
    _run({**TINY, "checkpoint-every": 1, "results-dir": str(b), "seed": 7})
    before = {n: (b / n).read_bytes() for n in ("results.json", "checkpoint.pkl", "accuracy.png")}
    resumed = {**rc, "results-dir": str(b), "resume-from": str(a), "num-server-rounds": 3}
    _refused(
        resumed,
        rf"resume-from='{a}': results-dir='{b}' \({b}\) holds another run's results.json, "
        r"checkpoint.pkl \(results.json records another run config \(seed=7 there, .* in the "
        r"checkpoint\); checkpoint.pkl records another run config \(seed=7 there, .*\); the resumed "
        rf"run would replace them. Set results-dir to another directory \(an empty one, or {a} to "
        rf"continue that run where it is\), or add overwrite=true to move {b}'s files into "
        rf"{b}/previous-<time>/ \(nothing deleted\)",
    )
    assert {n: (b / n).read_bytes() for n in before} == before and not list(b.glob("previous-*"))
    # overwrite=true (another results-dir than the resumed one): b's files moved aside, then resumed
    res = _run({**resumed, "overwrite": True})
    [prev] = b.glob("previous-*")
    assert {n: (prev / n).read_bytes() for n in before} == before
    assert res["previous_run"] == {"moved_to": str(prev), "files": list(before)}
    assert res["resumed"]["after_round"] == 2 and [r["round"] for r in res["rounds"]] == [1, 2, 3]


def test_keep_previous_removes_only_folders_that_overwrite_made(tmp_path, caplog):
    """A folder of the user's own named ``previous-...`` is never removed by ``keep-previous``."""
    from flwr_sheaf.rundir import RunDir

    old, mine = tmp_path / "previous-20200101T000000Z", tmp_path / "previous-keep-me"
    for folder in (old, mine):
        folder.mkdir()
        (folder / "results.json").write_text(folder.name)
    (tmp_path / "results.json").write_text("now")
    _logged(caplog)
    new, moved = RunDir(tmp_path).move_aside(["results.json"], keep=1)
    assert moved == ["results.json"] and (new / "results.json").read_text() == "now"
    assert not old.exists() and f"keep-previous=1: removed {old}" in caplog.text
    assert (mine / "results.json").read_text() == "previous-keep-me"  # was: removed


def test_keep_previous_never_removes_the_folder_resume_from_reads(tmp_path):
    """``resume-from=<dir>/previous-<time>`` (where an overwrite moved a run) into ``<dir>`` with
    ``overwrite=true`` and ``keep-previous=1``: the source folder stays, though it is the oldest."""
    from flwr_sheaf.methods.registry import parse_run_config
    from flwr_sheaf.rundir import RunDir, preflight

    source, older = tmp_path / "previous-20200101T000000Z", tmp_path / "previous-20200102T000000Z"
    for folder in (source, older):
        folder.mkdir()
    (source / "checkpoint.pkl").write_bytes(b"the stopped run's checkpoint")
    (tmp_path / "results.json").write_text("{}")  # another run's: moved aside by overwrite
    rc = {"results-dir": str(tmp_path), "resume-from": str(source), "overwrite": True}
    with preflight(parse_run_config({**rc, "keep-previous": 1})[0]) as pre:
        new = Path(pre.previous_run["moved_to"])
    assert (new / "results.json").read_text() == "{}"
    assert RunDir(tmp_path).previous() == [source, new] and not older.exists()
    assert (source / "checkpoint.pkl").read_bytes() == b"the stopped run's checkpoint"


def test_write_results_in_a_finally_keeps_the_real_errors_own_context(tmp_path):
    """The error in flight keeps the error it was raised while handling (its ``__context__``), and
    write_results' own error does not pose as its cause in the traceback."""
    from flwr_sheaf import SheafFRL, write_results

    with pytest.raises(RuntimeError, match="the real error") as err:
        try:
            try:
                raise KeyError("what caused it")
            except KeyError:
                raise RuntimeError("the real error")  # noqa: B904 - implicit context on purpose
        finally:
            write_results(SheafFRL(3), tmp_path / "r")  # no completed round: its ValueError
    assert isinstance(err.value.__context__, KeyError)  # was: replaced by write_results' ValueError
    assert any("ValueError: SheafFRL has no completed round" in n for n in err.value.__notes__)


# ------------------------------------------------------------------------- the run's files: gates


@pytest.mark.parametrize(
    "given",
    [
        {"keep_previous": -1},
        {"keep_previous": 0.5},
        {"keep_previous": "abc"},
        {"config": {"keep-previous": -1}},
    ],
)
def test_a_bad_keep_previous_is_refused_as_the_run_config_refuses_it_before_anything_moves(
    tmp_path, given
):
    """``write_results(..., overwrite=True)`` with a bad ``keep-previous`` (argument or config) gets the
    run config's own message before anything moves (was: -1 and 0.5 deleted every ``previous-*``
    folder, the one just made included; 'abc' a bare ValueError after results.json was moved)."""
    from flwr_sheaf import write_results
    from flwr_sheaf.methods.registry import parse_run_config

    done, out = _own_strategy(tmp_path), tmp_path / "r"
    write_results(done, out, extra={"n": 1})
    write_results(done, out, overwrite=True, extra={"n": 2})
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    value = given.get("keep_previous", given.get("config", {}).get("keep-previous"))
    with pytest.raises(ConfigError) as rc_err:
        parse_run_config({"keep-previous": value})
    with pytest.raises(ConfigError) as err:
        write_results(done, out, overwrite=True, extra={"n": 3}, **given)
    assert str(err.value) == str(rc_err.value).splitlines()[0]  # one validator, one message
    assert str(err.value).startswith(f"keep-previous={value!r}: ")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert len(list(out.glob("previous-*"))) == 1


def test_a_lock_file_hard_linked_to_a_users_file_is_refused_and_the_file_kept(tmp_path):
    """A ``.lock`` that shares its inode with a file outside the directory (a ``cp -al`` snapshot
    leaves it so): refused naming the path and ``rm`` (was: the user's file overwritten with the
    lock's JSON)."""
    out, users = tmp_path / "r", tmp_path / "notes.txt"
    out.mkdir()
    users.write_text("the user's own notes")
    os.link(users, out / LOCK_NAME)
    with pytest.raises(LockedError) as err:
        DirLock(out).acquire()
    assert f"its lock file {out / LOCK_NAME} is a hard link (2 names share its content" in str(
        err.value
    )
    assert f"(rm {out / LOCK_NAME})" in str(err.value)
    assert users.read_text() == "the user's own notes"


def test_a_huge_garbage_lock_file_is_taken_over_reading_only_its_first_bytes(tmp_path, caplog):
    """A 64 MiB garbage ``.lock`` whose kernel lock is free is taken over at once (was: 67 s, read
    by repeated concatenation)."""
    import time

    out = tmp_path / "r"
    out.mkdir()
    (out / LOCK_NAME).write_bytes(b"x" * (64 << 20))
    _logged(caplog)
    t0 = time.monotonic()
    lock = DirLock(out).acquire()
    took = time.monotonic() - t0
    lock.release()
    assert took < 5, took
    assert "not a flwr-sheaf lock (no JSON object in it)" in caplog.text


def _main_sh_guard(out: Path) -> subprocess.CompletedProcess:
    """scripts/main.sh's lines from ``OUT=`` to the first ``fi`` (the guard that moves an earlier
    run's directory aside), run by bash with ``RESULTS_DIR=out``."""
    lines = (ROOT / "scripts" / "main.sh").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("OUT="))
    end = next(i for i in range(start, len(lines)) if lines[i] == "fi")
    script = "set -euo pipefail\n" + "\n".join(lines[start : end + 1])
    env = {**os.environ, "RESULTS_DIR": str(out), "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, text=True, capture_output=True)


def test_main_sh_never_moves_aside_a_live_runs_directory_whose_lock_file_was_removed(tmp_path):
    """scripts/main.sh asks the package whether a live run holds ``$OUT`` (was: it tested only that
    ``$OUT/.lock`` exists, so a live run whose lock file a cleanup removed had its directory moved
    aside under it)."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "results.json").write_text("{}")
    with _holder(out) as pid:
        (out / LOCK_NAME).unlink()  # a clean-up
        done = _main_sh_guard(out)
        assert done.returncode == 0, done.stderr
        assert (out / "results.json").exists() and sorted(tmp_path.iterdir()) == [out]
        assert f"a process holds a lock on {out}" in done.stderr and pid > 0
    done = _main_sh_guard(out)  # that run ended: the earlier run is moved aside, and said so
    assert done.returncode == 0, done.stderr
    [kept] = [p for p in tmp_path.iterdir() if p != out]
    assert (kept / "results.json").exists() and f"moved to {kept}" in done.stdout


def test_an_earlier_run_whose_checkpoint_cannot_move_is_left_whole_and_named(tmp_path, monkeypatch):
    """``overwrite=true`` over a run whose ``checkpoint.pkl`` cannot be moved (an immutable file):
    nothing is moved and the file, the reason and the fix are named (was: a bare PermissionError with
    results.json in ``previous-*`` and the checkpoint left in results-dir)."""
    out = tmp_path / "r"
    rc = {**TINY, "results-dir": str(out)}
    _run(rc)
    before = {n: (out / n).read_bytes() for n in ("results.json", "checkpoint.pkl", "accuracy.png")}
    replace = os.replace

    def immutable(src, dst, *a, **kw):
        if Path(src) == out / "checkpoint.pkl":
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", immutable)
    _refused(
        {**rc, "overwrite": True},
        rf"results-dir='{out}': the earlier run's checkpoint.pkl cannot be moved into "
        rf"{out}/previous-\d{{8}}T\d{{6}}Z \(Operation not permitted\); nothing was moved: the earlier "
        rf"run's files are in {out} as before, so that run is never left split. Make "
        rf"{out / 'checkpoint.pkl'} movable \(e.g. chattr -i {out / 'checkpoint.pkl'}\)",
    )
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not list(out.glob("previous-*"))


def test_a_results_dir_removed_while_its_run_holds_it_is_not_recreated(tmp_path):
    """``rm -rf`` of a live run's results-dir: its next write is refused and the directory stays
    gone (was: refused, after an empty directory was created again)."""
    import shutil

    from flwr_sheaf import write_results

    done, out = _own_strategy(tmp_path), tmp_path / "r"
    out.mkdir()
    lock = DirLock(out).acquire()
    try:
        shutil.rmtree(out)
        with pytest.raises(LockedError, match="it was removed, with the files this run wrote"):
            write_results(done, out)
        assert not out.exists()
    finally:
        lock.release()
