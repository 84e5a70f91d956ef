"""What a simulation worker pays before its first reply (issue 34, benchmarks/records/performance-ray-load.md).

- A named dataset's decoded arrays are cached on disk (``flwr_sheaf.data.sources``): the cached
  arrays are the decoded ones bit for bit, a changed source file misses the cache, and a cache
  directory that cannot be written (or holds a broken entry) only means decoding again.
- Importing the ClientApp does not import the libraries only the ServerApp side needs (networkx).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles.idx_files import write_idx

from flwr_sheaf.data import sources
from flwr_sheaf.data.sources import clear_source_cache, decoded_cache_dir, load_source

ROOT = Path(__file__).resolve().parents[1]


def _idx_dir(root: Path, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A train (plain) + t10k (gzipped) idx directory of random images; returns the raw uint8 arrays."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    x[0, 0, :3] = (0, 255, 51)  # 0.0, 1.0 and 0.2 exactly / inexactly representable
    y = rng.integers(0, 10, size=7, dtype=np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    write_idx(root / "train-images-idx3-ubyte", x[:5])
    write_idx(root / "train-labels-idx1-ubyte", y[:5])
    write_idx(root / "t10k-images-idx3-ubyte", x[5:], compress=True)
    write_idx(root / "t10k-labels-idx1-ubyte", y[5:], compress=True)
    return x, y


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []


@pytest.fixture(autouse=True)
def _fresh_sources():
    clear_source_cache()
    yield
    clear_source_cache()


def _no_decoding(*args, **kwargs):
    raise AssertionError("decoded the idx files although the cache holds them")


def test_cached_arrays_equal_the_decoded_ones_bit_for_bit(tmp_path, monkeypatch):
    raw_x, raw_y = _idx_dir(tmp_path / "data")
    cache = tmp_path / "cache"
    decoded = sources._load_idx_dir(str(tmp_path / "data"))  # no cache
    assert not cache.exists()
    first = sources._load_idx_dir(str(tmp_path / "data"), str(cache))  # miss: decodes, writes
    names = _entries(cache)
    assert [n.split(".", 1)[1] for n in names] == ["images.npy", "labels.npy", "seal"]
    clear_source_cache()
    monkeypatch.setattr(sources, "read_idx_file", _no_decoding)
    cached = sources._load_idx_dir(str(tmp_path / "data"), str(cache))  # hit: memory-mapped
    # the documented output, from the raw bytes independently: float32 raw / 255, int64 labels
    want_x = torch.from_numpy(raw_x.reshape(7, 1, 28, 28).astype(np.float32) / np.float32(255))
    for x, y in (decoded, first, cached):
        assert x.dtype == torch.float32 and x.shape == (7, 1, 28, 28) and x.is_contiguous()
        assert y.dtype == torch.int64 and y.tolist() == raw_y.astype(np.int64).tolist()
        assert torch.equal(x.view(torch.int32), want_x.view(torch.int32))  # bit for bit
    assert torch.equal(cached[0].view(torch.int32), decoded[0].view(torch.int32))
    assert torch.equal(cached[1], decoded[1])
    assert _entries(cache) == names


def test_a_changed_source_file_misses_the_cache_and_replaces_its_entry(tmp_path):
    root = tmp_path / "data"
    _idx_dir(root, seed=0)
    cache = tmp_path / "cache"
    before = sources._load_idx_dir(str(root), str(cache))[0].clone()
    old = _entries(cache)
    clear_source_cache()
    raw_x, _ = _idx_dir(root, seed=1)  # same sizes, new content (and mtime)
    st = (root / "train-images-idx3-ubyte").stat()
    os.utime(root / "train-images-idx3-ubyte", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    after = sources._load_idx_dir(str(root), str(cache))[0]
    assert not torch.equal(after, before)
    want = torch.from_numpy(raw_x.reshape(7, 1, 28, 28).astype(np.float32) / np.float32(255))
    assert torch.equal(after.view(torch.int32), want.view(torch.int32))
    new = _entries(cache)
    assert len(new) == 3 and not set(new) & set(old)  # the stale entry was removed


def test_an_unwritable_cache_dir_falls_back_to_decoding(tmp_path):
    raw_x, _ = _idx_dir(tmp_path / "data")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    want = torch.from_numpy(raw_x.reshape(7, 1, 28, 28).astype(np.float32) / np.float32(255))
    # a cache path below a regular file cannot be created (even by root)
    x, _ = sources._load_idx_dir(str(tmp_path / "data"), str(blocker / "cache"))
    assert torch.equal(x, want) and blocker.read_text() == "not a directory"
    clear_source_cache()
    # a read-only directory (where the permissions bind: not for root)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        x, _ = sources._load_idx_dir(str(tmp_path / "data"), str(ro))
        assert torch.equal(x, want)
        if os.geteuid() != 0:
            assert _entries(ro) == []
    finally:
        ro.chmod(0o700)


def test_a_broken_cache_entry_is_decoded_again_and_rewritten(tmp_path):
    raw_x, _ = _idx_dir(tmp_path / "data")
    cache = tmp_path / "cache"
    sources._load_idx_dir(str(tmp_path / "data"), str(cache))
    clear_source_cache()
    images = next(p for p in cache.iterdir() if p.name.endswith(".images.npy"))
    images.write_bytes(images.read_bytes()[:100])  # truncated by a crash or a full disk
    x, _ = sources._load_idx_dir(str(tmp_path / "data"), str(cache))
    want = torch.from_numpy(raw_x.reshape(7, 1, 28, 28).astype(np.float32) / np.float32(255))
    assert torch.equal(x, want)
    assert images.stat().st_size > 7 * 784 * 4  # rewritten whole


def _damage(kind: str, entry: Path, cut: int) -> None:
    """Damage cache ``entry`` (its path without suffixes) the way ``kind`` says."""
    images, labels = entry.with_suffix(".images.npy"), entry.with_suffix(".labels.npy")
    x, y = np.load(images), np.load(labels)
    if kind == "truncated":
        images.write_bytes(images.read_bytes()[: cut % images.stat().st_size])
    elif kind == "empty":
        labels.write_bytes(b"")
    elif kind == "permuted labels":
        np.save(labels, np.roll(y, 1 + cut % (len(y) - 1)))
    elif kind == "labels of 42":
        np.save(labels, np.full_like(y, 42))
    elif kind == "NaN images":
        np.save(images, np.full_like(x, np.nan))
    elif kind == "wrong dtype":
        np.save(images, x.astype(np.float64))
    elif kind == "wrong shape":
        np.save(images, x.reshape(len(x), -1))
    elif kind == "a link":
        copy = entry.parent.parent / "elsewhere.npy"
        copy.write_bytes(images.read_bytes())
        images.unlink()
        images.symlink_to(copy)
    elif kind == "garbage seal":
        entry.with_suffix(".seal").write_bytes(b"\x00" * cut)
    elif kind == "a FIFO seal":  # opening it for reading waited for a writer for ever
        entry.with_suffix(".seal").unlink()
        os.mkfifo(entry.with_suffix(".seal"))
    elif kind == "a FIFO images":
        images.unlink()
        os.mkfifo(images)
    elif kind == "a directory seal":
        entry.with_suffix(".seal").unlink()
        entry.with_suffix(".seal").mkdir()


DAMAGES = (
    "truncated",
    "empty",
    "permuted labels",
    "labels of 42",
    "NaN images",
    "wrong dtype",
    "wrong shape",
    "a link",
    "garbage seal",
    "a FIFO seal",
    "a FIFO images",
    "a directory seal",
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(DAMAGES), cut=st.integers(0, 10_000))
def test_a_damaged_cache_entry_is_named_removed_and_decoded_again(kind, cut, caplog):
    """Whatever the damage, the run gets the decoded arrays bit for bit and a warning names the entry."""
    with tempfile.TemporaryDirectory() as tmp:
        root, cache = Path(tmp) / "data", Path(tmp) / "cache"
        raw_x, raw_y = _idx_dir(root, seed=cut)
        want = torch.from_numpy(raw_x.reshape(7, 1, 28, 28).astype(np.float32) / np.float32(255))
        sources._load_idx_dir(str(root), str(cache))
        clear_source_cache()
        entry = cache / next(iter(_entries(cache))).split(".", 1)[0]
        _damage(kind, entry, cut)
        caplog.clear()
        with caplog.at_level("WARNING", logger="flwr_sheaf"):
            x, y = sources._load_idx_dir(str(root), str(cache))
        assert torch.equal(x.view(torch.int32), want.view(torch.int32))
        assert torch.equal(y, torch.from_numpy(raw_y.astype(np.int64)))
        assert f"decoded-data cache entry {entry}.* is damaged" in caplog.text
        assert "removed, the dataset is decoded again" in caplog.text
        # rewritten whole: the next process reads it without decoding
        assert [n.split(".", 1)[1] for n in _entries(cache)] == ["images.npy", "labels.npy", "seal"]
        assert not entry.with_suffix(".images.npy").is_symlink()
        clear_source_cache()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sources, "read_idx_file", _no_decoding)
            assert torch.equal(sources._load_idx_dir(str(root), str(cache))[1], y)
        clear_source_cache()


def test_temp_files_of_dead_writers_are_removed(tmp_path):
    # before: a loader killed mid-write left its temp file (38-220 MB) for ever
    _idx_dir(tmp_path / "data")
    cache = tmp_path / "cache"
    cache.mkdir()
    killed, writing = cache / ".tmp-abc123.npy", cache / ".tmp-def456.npy"
    for path in (killed, writing):
        path.write_bytes(b"\x93NUMPY partial")
    hour_ago = time.time() - 3601
    os.utime(killed, (hour_ago, hour_ago))  # untouched for an hour: its writer is gone
    sources._load_idx_dir(str(tmp_path / "data"), str(cache))
    assert not killed.exists() and writing.exists()


def test_a_cache_dir_env_naming_a_file_is_refused(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FLWR_SHEAF_CACHE_DIR", str(blocker))
    with pytest.raises(
        ValueError, match=r"FLWR_SHEAF_CACHE_DIR='.*a-file' is not a directory.*'off'"
    ):
        decoded_cache_dir()


def test_named_datasets_use_the_cache_dir_from_the_environment(tmp_path, monkeypatch):
    from flwr_sheaf.data import catalog

    raw_x, _ = _idx_dir(tmp_path / "fashion-mnist")
    # the install's SHA-256 check is catalog's (tests/test_data.py); here only the cache's wiring
    monkeypatch.setattr(sources, "verified_dir", lambda name: tmp_path / "fashion-mnist")
    assert "fashion-mnist" in catalog.NAMED_DATASETS
    monkeypatch.setenv("FLWR_SHEAF_CACHE_DIR", str(tmp_path / "cache"))
    assert decoded_cache_dir() == tmp_path / "cache"
    load_source("fashion-mnist")
    assert len(_entries(tmp_path / "cache")) == 3
    clear_source_cache()
    monkeypatch.setattr(sources, "read_idx_file", _no_decoding)
    x, _ = load_source("fashion-mnist")
    want = torch.from_numpy(raw_x.reshape(7, 1, 28, 28).astype(np.float32) / np.float32(255))
    assert torch.equal(x, want)
    # "off" (or empty) disables it; unset: the user's cache directory
    monkeypatch.setenv("FLWR_SHEAF_CACHE_DIR", "off")
    assert decoded_cache_dir() is None
    monkeypatch.delenv("FLWR_SHEAF_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert decoded_cache_dir() == tmp_path / "xdg" / "flwr-sheaf" / "decoded"


def test_idx_directories_are_not_cached(tmp_path, monkeypatch):
    _idx_dir(tmp_path / "data")
    monkeypatch.setenv("FLWR_SHEAF_CACHE_DIR", str(tmp_path / "cache"))
    load_source(f"idx:{tmp_path / 'data'}")  # a user's own folder: decoded, nothing written
    assert not (tmp_path / "cache").exists()


#: Imported only where a graph is built or walked (the ServerApp side), never by a worker's import.
LAZY = ("networkx", "geoopt", "matplotlib", "tensorboard", "sklearn", "scipy")


def test_importing_the_client_app_does_not_import_server_side_libraries():
    code = (
        "import sys, flwr_sheaf.apps.client_app\n"
        f"print(sorted(m for m in {LAZY!r} if m in sys.modules))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _fake_checkout(root: Path) -> Path:
    """``root`` as a checkout for scripts/setup.sh whose ``.venv/bin/python`` only logs its arguments."""
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
    (root / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    bin_ = root / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(f'#!/bin/sh\necho "$*" >> {root}/python.log\n')
    (bin_ / "python").chmod(0o755)
    (bin_ / "activate").write_text(f'PATH="{bin_}:$PATH"\n')
    return root


def test_setup_skips_pip_while_pyproject_is_unchanged_and_installs_when_it_changed(tmp_path):
    root = _fake_checkout(tmp_path / "checkout")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_SPEC"}

    def pip_runs() -> list[str]:
        (root / "python.log").unlink(missing_ok=True)
        subprocess.run(["bash", str(root / "scripts" / "setup.sh")], env=env, check=True)
        return [x for x in (root / "python.log").read_text().splitlines() if x.startswith("-m pip")]

    first = pip_runs()
    assert "-m pip install -q -e .[dev,docs]" in first
    assert pip_runs() == []  # the same pyproject.toml: no pip at all
    with (root / "pyproject.toml").open("a") as f:
        f.write("\n# a changed dependency\n")
    assert "-m pip install -q -e .[dev,docs]" in pip_runs()
    assert pip_runs() == []
    env["TORCH_SPEC"] = "torch==0 torchvision==0"  # another TORCH_SPEC: pip runs again
    assert "-m pip install -q -e .[dev,docs]" in pip_runs()
