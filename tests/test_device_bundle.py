"""tools/device_bundle.py: wheel trimming, the budget check, the data round trip, install's checks.

No network: a fake Ray wheel is built with zipfile (a correct RECORD, as real wheels have), trimmed,
checked member by member against hashes recomputed here, and installed with pip (``--no-index``,
for the GPU machine's Python 3.12 manylinux platform) when pip is available.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import lzma
import os
import stat
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import device_bundle as db  # noqa: E402

WHEEL = "ray-2.55.1-cp312-cp312-manylinux2014_x86_64.whl"
DIST_INFO = "ray-2.55.1.dist-info"
EXECUTABLES = ("ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server")
KEPT = ("ray/__init__.py", "ray/_raylet.so", *EXECUTABLES, "ray/util/actor_pool.py")
DROPPED = (
    "ray/jars/ray_dist.jar",
    "ray/dashboard/client/build/index.html",
    "ray/rllib/__init__.py",
    "ray/serve/x.py",
    "ray/tune/tests/test_x.py",
)


def _b64_sha256(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def _members() -> dict[str, bytes]:
    rnd = os.urandom
    return {
        "ray/__init__.py": b"__version__ = '2.55.1'\n",
        "ray/_raylet.so": b"\x7fELF" + rnd(5000),
        "ray/core/src/ray/raylet/raylet": b"\x7fELF" + rnd(3000),
        "ray/core/src/ray/gcs/gcs_server": b"\x7fELF" + rnd(3000),
        "ray/util/actor_pool.py": b"class ActorPool: ...\n",
        "ray/jars/ray_dist.jar": b"PK" + rnd(20000),
        "ray/dashboard/client/build/index.html": b"<html></html>\n" * 50,
        "ray/rllib/__init__.py": b"import ray\n",
        "ray/serve/x.py": b"x = 1\n",
        "ray/tune/tests/test_x.py": b"def test(): pass\n",
        f"{DIST_INFO}/METADATA": b"Metadata-Version: 2.1\nName: ray\nVersion: 2.55.1\n",
        f"{DIST_INFO}/WHEEL": b"Wheel-Version: 1.0\nGenerator: bdist_wheel\nRoot-Is-Purelib: false\n"
        b"Tag: cp312-cp312-manylinux2014_x86_64\n",
        f"{DIST_INFO}/top_level.txt": b"ray\n",
    }


def _fake_ray_wheel(directory: Path) -> tuple[Path, dict[str, bytes]]:
    members = _members()
    path = directory / WHEEL
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 2, 3, 4, 6))
            mode = 0o755 if name in EXECUTABLES else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            z.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            writer.writerow((name, _b64_sha256(data), len(data)))
        writer.writerow((f"{DIST_INFO}/RECORD", "", ""))
        z.writestr(f"{DIST_INFO}/RECORD", buf.getvalue())
    return path, members


@pytest.fixture
def trimmed(tmp_path):
    (tmp_path / "src").mkdir()
    src, members = _fake_ray_wheel(tmp_path / "src")
    dst = tmp_path / "out" / WHEEL
    stats = db.trim_wheel(src, dst, db.RAY_DROP)
    return src, dst, members, stats


def test_trim_drops_members_and_keeps_the_rest_byte_identical(trimmed):
    src, dst, members, stats = trimmed
    with zipfile.ZipFile(dst) as z:
        names = set(z.namelist())
        assert not names & set(DROPPED)
        for name in KEPT:
            assert z.read(name) == members[name], name
        for name in EXECUTABLES:  # pip makes a file executable from these bits
            assert (z.getinfo(name).external_attr >> 16) & 0o111, name
        assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist())
    assert stats["dropped_members"] == len(DROPPED)
    assert stats["dropped_uncompressed_bytes"] == sum(len(members[n]) for n in DROPPED)
    assert stats["dst_bytes"] < stats["src_bytes"] == src.stat().st_size
    # prefixes of RAY_DROP absent from this small wheel are reported, not an error
    assert set(stats["unmatched_prefixes"]) == {"ray/data/", "ray/train/", "ray/llm/"}


def test_trimmed_record_lists_exactly_the_remaining_members(trimmed):
    _, dst, _, _ = trimmed
    with zipfile.ZipFile(dst) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
        rows = list(csv.reader(io.StringIO(z.read(f"{DIST_INFO}/RECORD").decode())))
        assert sorted(r[0] for r in rows) == sorted(names)
        for path, digest, size in rows:
            if path == f"{DIST_INFO}/RECORD":
                assert (digest, size) == ("", "")
                continue
            data = z.read(path)
            assert digest == _b64_sha256(data), path
            assert int(size) == len(data), path


def test_trim_refuses_a_wheel_without_record_and_a_prefix_dropping_the_dist_info(tmp_path):
    bare = tmp_path / WHEEL
    with zipfile.ZipFile(bare, "w") as z:
        z.writestr("ray/__init__.py", "")
    with pytest.raises(db.BundleError, match="RECORD"):
        db.trim_wheel(bare, tmp_path / "out.whl", db.RAY_DROP)
    (tmp_path / "src").mkdir()
    src, _ = _fake_ray_wheel(tmp_path / "src")
    with pytest.raises(db.BundleError, match="dist-info"):
        db.trim_wheel(src, tmp_path / "out.whl", ("ray",))


def _has_pip() -> bool:
    return (
        subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode
        == 0
    )


@pytest.mark.skipif(not _has_pip(), reason="pip is not available to this interpreter")
def test_pip_installs_the_trimmed_wheel(trimmed, tmp_path):
    _, dst, members, _ = trimmed
    target = tmp_path / "site"
    # the GPU machine's interpreter and platform, whatever runs the test
    got = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "--disable-pip-version-check",
            *db.PIP_PLATFORM_ARGS,
            "--target",
            str(target),
            str(dst),
        ],
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, got.stdout + got.stderr
    for name in KEPT:
        assert (target / name).read_bytes() == members[name], name
    for name in EXECUTABLES:
        assert os.access(target / name, os.X_OK), name
    for name in DROPPED:
        assert not (target / name).exists(), name
    assert not (target / "ray" / "jars").exists() and not (target / "ray" / "rllib").exists()
    installed = {r[0] for r in csv.reader((target / DIST_INFO / "RECORD").read_text().splitlines())}
    assert not installed & set(DROPPED)


def test_budget_refuses_over_the_limit_naming_the_largest_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "small.whl").write_bytes(b"a" * 100)
    (tmp_path / "sub" / "big.xz").write_bytes(b"b" * 1500)
    with pytest.raises(db.BundleError) as err:
        db.check_budget(tmp_path, 1024)
    msg = str(err.value)
    assert (
        "sub/big.xz" in msg and "1500 bytes" in msg and "1024 bytes" in msg and "1600 bytes" in msg
    )
    assert "--part" in msg
    assert db.check_budget(tmp_path, 2048) == 1600
    assert db.check_budget(tmp_path, 1600) == 1600


def _fake_idx(path: Path) -> bytes:
    data = struct.pack(">IIII", 0x00000803, 3, 28, 28) + bytes(range(256)) * 9 + bytes(48)
    path.write_bytes(data)
    return data


def test_data_round_trip_and_corruption(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = _fake_idx(src / "t10k-images-idx3-ubyte")
    labels = bytes([1, 2, 3]) + b"\x00\x00\x08\x01"
    (src / "t10k-labels-idx1-ubyte").write_bytes(labels)
    entries = db.compress_data(sorted(src.iterdir()), tmp_path / "bundle")
    assert [e["file"] for e in entries] == ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    assert entries[0]["sha256"] == hashlib.sha256(data).hexdigest()
    arc = tmp_path / "bundle" / "t10k-images-idx3-ubyte.xz"
    assert lzma.decompress(arc.read_bytes()) == data  # a plain xz stream (xz -dc restores it too)

    out = db.restore_data(entries, tmp_path / "bundle", tmp_path / "restored")
    assert (out / "t10k-images-idx3-ubyte").read_bytes() == data
    assert (out / "t10k-labels-idx1-ubyte").read_bytes() == labels

    corrupt = bytearray(arc.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF
    arc.write_bytes(bytes(corrupt))
    with pytest.raises(db.BundleError, match="t10k-images-idx3-ubyte.xz.*wrong SHA-256"):
        db.restore_data(entries, tmp_path / "bundle", tmp_path / "again")
    assert not (tmp_path / "again" / "t10k-images-idx3-ubyte").exists()

    # an archive that matches its recorded hash but is not xz, and one restoring to other bytes
    arc.write_bytes(b"not xz at all")
    bad = [dict(entries[0], archive_sha256=hashlib.sha256(b"not xz at all").hexdigest())]
    with pytest.raises(db.BundleError, match="t10k-images-idx3-ubyte.xz is not a valid xz file"):
        db.restore_data(bad, tmp_path / "bundle", tmp_path / "again")
    arc.write_bytes(lzma.compress(b"other bytes"))
    bad = [dict(entries[0], archive_sha256=hashlib.sha256(arc.read_bytes()).hexdigest())]
    with pytest.raises(
        db.BundleError, match="restored to t10k-images-idx3-ubyte with the wrong SHA-256"
    ):
        db.restore_data(bad, tmp_path / "bundle", tmp_path / "again")
    assert not list((tmp_path / "again").iterdir())


def test_data_only_bundle_installs_and_a_corrupt_file_is_refused(tmp_path):
    bundle = tmp_path / "bundle"
    src = tmp_path / "src"
    src.mkdir()
    data = _fake_idx(src / "train-images-idx3-ubyte")
    entries = db.compress_data([src / "train-images-idx3-ubyte"], bundle / "data" / db.DATASET)
    manifest = db.finish_bundle(bundle, {"part": "data", "data": {db.DATASET: entries}}, 2**20)
    on_disk = json.loads((bundle / "manifest.json").read_text())
    assert {f["path"] for f in on_disk["files"]} == {
        "SHA256SUMS",
        f"data/{db.DATASET}/train-images-idx3-ubyte.xz",
    }
    assert (
        on_disk["total_bytes"]
        == manifest["total_bytes"]
        == sum(f["bytes"] for f in on_disk["files"])
    )
    assert any("device_bundle.py install" in c for c in on_disk["install"]["with_script"])

    assert (
        db.main(
            [
                "install",
                str(bundle),
                "--target",
                str(tmp_path / "site"),
                "--data-dir",
                str(tmp_path / "gpudata"),
            ]
        )
        == 0
    )
    assert (tmp_path / "gpudata" / db.DATASET / "train-images-idx3-ubyte").read_bytes() == data

    xz = bundle / "data" / db.DATASET / "train-images-idx3-ubyte.xz"
    xz.write_bytes(xz.read_bytes()[:-4])
    with pytest.raises(
        db.BundleError, match="train-images-idx3-ubyte.xz has the wrong size or SHA-256"
    ):
        db.install(bundle, tmp_path / "site", tmp_path / "gpudata2")
    assert not (tmp_path / "gpudata2").exists()


def test_finish_bundle_refuses_over_budget(tmp_path):
    (tmp_path / "x.whl").write_bytes(b"x" * 4000)
    with pytest.raises(db.BundleError, match=r"x\.whl \(0\.0 MiB, 4000 bytes\)"):
        db.finish_bundle(tmp_path, {"part": "packages"}, 1024)
