"""Generated tests over the run directory's file gates: damaged versions of every file the package
reads back from a run's directories (``flwr_sheaf.rundir.RUN_FILES``: truncated, flipped bytes,
wrong types, deep nesting, links, a directory or a FIFO in its place) each give a clear error naming
the file, or are read as what they are, and never lose a file; ``previous-*`` folders of every kind
survive ``keep-previous`` unless ``overwrite`` made them. A file declared in ``RUN_FILES`` without a
sample here fails :func:`test_every_declared_file_has_a_sample`.

Examples per property: the Hypothesis profile (tests/conftest.py; ``HYPOTHESIS_PROFILE=deep`` for
many more).
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flwr_sheaf.config import KEYS, ConfigError
from flwr_sheaf.integrity import write_sealed
from flwr_sheaf.methods.registry import parse_run_config
from flwr_sheaf.rundir import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_MAGIC,
    RUN_FILES,
    RunDir,
    RunFile,
    preflight,
)

CONFIG = {"seed": 3, "method": "sheaf-frl", "zoo": "tiny-3"}


def _checkpoint() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        ckpt = {"format": CHECKPOINT_FORMAT, "round": 1, "config": CONFIG, "state": {}}
        meta = {"round": 1, "payload": "pickle"}
        path = write_sealed(
            Path(d) / "c", CHECKPOINT_MAGIC, meta, pickle.dumps(ckpt), CHECKPOINT_FORMAT
        )
        return path.read_bytes()


#: a sound file of each declared kind, as the package writes it
SAMPLES: dict[tuple[str, str], bytes] = {
    ("results.json", "results-dir"): json.dumps({"config": CONFIG, "status": "completed"}).encode(),
    ("checkpoint.pkl", "results-dir"): _checkpoint(),
    (".lock", "results-dir"): json.dumps(
        {"pid": 2**22 + 7, "host": "another-host", "started": "2020-01-01 00:00:00", "token": "t"}
    ).encode(),
    (".lock", "node-state-dir"): json.dumps({"pid": 2**22 + 7, "host": "h", "time": 0.0}).encode(),
    ("run.json", "node-state-dir"): json.dumps(
        {"results-dir": "/r", "started": "2020-01-01 00:00:00", "config": CONFIG}
    ).encode(),
}
READ = [f for f in RUN_FILES if f.read is not None]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
damage = st.one_of(
    st.tuples(st.just("bytes"), st.binary(max_size=300)),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
    st.tuples(st.just("json"), json_values),
    st.tuples(
        st.just("retype"), st.sampled_from(["config", "results-dir", "pid", "format"]), json_values
    ),
    st.tuples(st.just("deep"), st.integers(500, 200_000)),
    st.sampled_from([("symlink",), ("hardlink",), ("dangling",), ("dir",), ("fifo",)]),
)


def _place(path: Path, sample: bytes, how: tuple, outside: Path) -> None:
    """Put a damaged version of ``sample`` at ``path`` (a link's target goes to ``outside``)."""
    kind = how[0]
    if kind == "bytes":
        path.write_bytes(how[1])
    elif kind == "truncate":
        path.write_bytes(sample[: int(how[1] * len(sample))])
    elif kind == "flip":
        i = int(how[1] * len(sample))
        path.write_bytes(sample[:i] + bytes([how[2]]) + sample[i + 1 :])
    elif kind == "json":
        path.write_text(json.dumps(how[1]))
    elif kind == "retype":
        try:
            data = json.loads(sample)
        except ValueError:  # the checkpoint: its metadata line
            magic, meta, payload = sample.split(b"\n", 2)
            head = json.loads(meta)
            head[how[1]] = how[2]
            path.write_bytes(magic + b"\n" + json.dumps(head).encode() + b"\n" + payload)
            return
        data[how[1]] = how[2]
        path.write_text(json.dumps(data))
    elif kind == "deep":
        path.write_bytes(b"[" * how[1] + b"]" * how[1])
    elif kind in ("symlink", "hardlink"):
        outside.write_bytes(sample)
        (os.symlink if kind == "symlink" else os.link)(outside, path)
    elif kind == "dangling":
        os.symlink(outside.parent / "missing", path)
    elif kind == "dir":
        path.mkdir()
        (path / "inside").write_bytes(sample)
    elif kind == "fifo":
        os.mkfifo(path)


def _files(root: Path) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every regular file under ``root`` (links not followed)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def _names_the_file(exc: BaseException, path: Path) -> bool:
    return str(path) in str(exc)


def test_every_declared_file_has_a_sample():
    """A file added to RUN_FILES with a reader is drawn by the properties below once it has a sample."""
    assert {(f.name, f.where) for f in READ} == set(SAMPLES)


@pytest.mark.parametrize("rf", READ, ids=lambda f: f"{f.where}/{f.name}")
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(how=damage)
def test_a_damaged_file_is_refused_by_its_reader_naming_it_and_nothing_changes(rf: RunFile, how):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        d = root / rf.where
        d.mkdir()
        path = d / rf.name
        _place(path, SAMPLES[rf.name, rf.where], how, root / "users-file")
        before = _files(root)
        try:
            rf.read(path)  # read as what it is (e.g. a lock naming no live holder), or refused:
        except ConfigError as exc:  # (a LockedError, NoCheckpointError are ConfigErrors)
            assert _names_the_file(exc, path), str(exc)
        assert _files(root) == before


@pytest.mark.parametrize(
    "rf",
    [f for f in READ if f.name != ".lock" or f.where == "results-dir"],
    ids=lambda f: f"{f.where}/{f.name}",
)
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(how=damage, overwrite=st.booleans(), resume=st.booleans())
def test_the_preflight_over_a_damaged_file_refuses_naming_it_or_loses_no_file(
    rf: RunFile, how, overwrite, resume
):
    """The preflight of a run into a results-dir holding another run (and a node-state-dir) with one
    damaged file: a clear refusal, or it goes on; every file (but a taken-over lock's own) is still
    there byte for byte, in its directory or moved into ``previous-*``."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out, state = root / "results-dir", root / "node-state-dir"
        out.mkdir()
        state.mkdir()
        (out / "results.json").write_bytes(SAMPLES["results.json", "results-dir"])
        path = root / rf.where / rf.name
        if path.exists():
            path.unlink()
        _place(path, SAMPLES[rf.name, rf.where], how, root / "users-file")
        before = {k: v for k, v in _files(root).items() if Path(k).name != ".lock"}
        rc = {"results-dir": str(out), "node-state-dir": str(state), "overwrite": overwrite}
        rc |= {"resume": True} if resume and not overwrite else {}
        config = parse_run_config(rc)[0]
        try:
            with preflight(config):
                pass
        except ConfigError as exc:
            assert str(path) in str(exc) or str(out) in str(exc) or str(state) in str(exc), str(exc)
        after = _files(root)
        for name, data in before.items():
            where = [k for k, v in after.items() if Path(k).name == Path(name).name and v == data]
            assert where, f"{name} lost"


previous_entries = st.lists(
    st.tuples(
        st.one_of(
            st.builds(lambda d: f"previous-2020{d:04d}T000000Z", st.integers(101, 1231)),
            st.builds(lambda n: f"previous-20200101T000000Z-{n}", st.integers(2, 9)),
            st.text("abcxyz-_", min_size=1, max_size=8).map(lambda t: f"previous-{t}"),
        ),
        st.sampled_from(["dir", "file", "symlink"]),
    ),
    max_size=8,
    unique_by=lambda e: e[0],
)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=previous_entries,
    keep=st.one_of(st.integers(-2, 6), st.floats(-1, 3), st.text(max_size=3)),
)
def test_keep_previous_removes_only_folders_overwrite_made_and_a_bad_value_moves_nothing(
    entries, keep
):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out, elsewhere = root / "r", root / "elsewhere"
        out.mkdir()
        elsewhere.mkdir()
        (elsewhere / "kept").write_text("a user's folder a link points to")
        made = 0
        for name, kind in entries:
            if kind == "dir":
                (out / name).mkdir()
                (out / name / "results.json").write_text(name)
                made += name[9:10].isdigit()  # the form overwrite gives its folders
            elif kind == "file":
                (out / name).write_text(name)
            else:
                os.symlink(elsewhere, out / name)
        (out / "results.json").write_text("now")
        before = _files(root)
        try:
            valid = KEYS["keep-previous"](keep)
        except ConfigError as exc:
            with pytest.raises(ConfigError) as err:
                RunDir(out).move_aside(["results.json"], keep=keep)
            assert str(err.value) == str(exc)
            assert _files(root) == before  # a bad keep-previous moves nothing
            return
        new, moved = RunDir(out).move_aside(["results.json"], keep=valid)
        assert moved == ["results.json"] and (new / "results.json").read_text() == "now"
        assert (elsewhere / "kept").exists()
        for name, kind in entries:  # a file, a link, a user's own previous-<name> folder: kept
            if kind != "dir" or not name[9:10].isdigit():
                assert os.path.lexists(out / name), name
        stamped = [p for p in RunDir(out).previous() if p.name[9:10].isdigit()]
        assert new in stamped
        assert len(stamped) == (made + 1 if valid == 0 else min(valid, made + 1))
