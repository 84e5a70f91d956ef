"""Named offline datasets: where they are looked for, and how the project installs them.

``dataset=fashion-mnist`` is Debian's ``dataset-fashion-mnist`` package (70,000 28x28 images, four
gzipped idx files): :func:`install` (``bash scripts/get_data.sh fashion-mnist``) fetches it with
``apt-get download``, unpacks it with ``dpkg-deb -x`` and checks every file's SHA-256. Search order
(:func:`data_dirs`, first hit wins): ``$FLWR_SHEAF_DATA/<name>``, the repository's ``data/<name>``,
``/usr/share/datasets/<name>``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "NAMED_DATASETS",
    "check_installed",
    "data_dirs",
    "find_installed",
    "verified_dir",
    "install",
    "install_hint",
    "verify",
    "main",
]

#: name -> {file name: SHA-256 of the file as Debian's ``dataset-fashion-mnist`` 0.0~git20200523.55506a9-1 ships it}.
NAMED_DATASETS: dict[str, dict[str, str]] = {
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
        "train-labels-idx1-ubyte.gz": "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
        "t10k-images-idx3-ubyte.gz": "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
        "t10k-labels-idx1-ubyte.gz": "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
    },
}
_DEBIAN_PACKAGE = {"fashion-mnist": "dataset-fashion-mnist"}
_REPO_DATA = Path(__file__).resolve().parents[2] / "data"


def install_hint(name: str) -> str:
    """The command that installs ``name`` (for error messages)."""
    return f"bash scripts/get_data.sh {name}"


def data_dirs(name: str) -> list[Path]:
    """Directories searched for ``name``, in order (module docstring)."""
    dirs = []
    if os.environ.get("FLWR_SHEAF_DATA"):
        dirs.append(Path(os.environ["FLWR_SHEAF_DATA"]).expanduser() / name)
    dirs += [_REPO_DATA / name, Path("/usr/share/datasets") / name]
    return dirs


def verify(directory: Path, name: str) -> list[str]:
    """Problems of ``directory`` as an install of ``name`` (missing files, SHA-256 mismatches); empty = good."""
    problems = []
    for fname, digest in NAMED_DATASETS[name].items():
        path = Path(directory) / fname
        if not path.is_file():
            problems.append(f"missing {path}")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            problems.append(f"{path} has the wrong SHA-256 (corrupt or another version)")
    return problems


#: ``{(path, size, mtime_ns): SHA-256}`` of the files hashed by :func:`check_installed` in this process.
_HASHED: dict[tuple[str, int, int], str] = {}


def _sha256_cached(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        _HASHED[key] = h.hexdigest()
    return _HASHED[key]


def check_installed(directory: Path, name: str) -> None:
    """Refuse an installed named dataset whose files differ from the published ones (each file hashed
    once per process and ``(path, size, mtime)``).

    Raises:
        ValueError: a missing file or a SHA-256 mismatch (the file named, with the reinstall command).
    """
    for fname, digest in NAMED_DATASETS[name].items():
        path = Path(directory) / fname
        if not path.is_file():
            raise ValueError(f"dataset={name!r}: {path} is missing; re-run `{install_hint(name)}`")
        if _sha256_cached(path) != digest:
            raise ValueError(
                f"dataset={name!r}: {path} has the wrong SHA-256 (modified, truncated or another version "
                f"since it was installed); re-run `{install_hint(name)}` to reinstall it"
            )


def find_installed(name: str) -> Path:
    """The directory holding all of ``name``'s files.

    Raises:
        ValueError: ``name`` is not a named dataset (the known names are listed).
        FileNotFoundError: no searched directory has every file (directories and fix named).
    """
    if name not in NAMED_DATASETS:
        raise ValueError(f"unknown named dataset {name!r}; known: {sorted(NAMED_DATASETS)}")
    for d in data_dirs(name):
        if all((d / f).is_file() for f in NAMED_DATASETS[name]):
            return d
    looked = ", ".join(str(d) for d in data_dirs(name))
    raise FileNotFoundError(
        f"dataset={name!r}: its files are not installed (looked in: {looked}); "
        f"install them with: {install_hint(name)}"
    )


def verified_dir(name: str) -> Path:
    """:func:`find_installed`'s directory of ``name``, resolved and :func:`check_installed`.

    Raises:
        ValueError, FileNotFoundError: as those two.
    """
    directory = find_installed(name).resolve()
    check_installed(directory, name)
    return directory


def _run(cmd: list[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def install(name: str, dest: Path | None = None) -> Path:
    """Install ``name`` into ``dest`` (default: the repository's ``data/<name>``) from its Debian
    package (or a verified system install) and return the directory; idempotent.

    Raises:
        ValueError: unknown name.
        RuntimeError: ``apt-get download`` failed, or the unpacked files fail their SHA-256 check.
    """
    if name not in NAMED_DATASETS:
        raise ValueError(f"unknown named dataset {name!r}; known: {sorted(NAMED_DATASETS)}")
    dest = Path(dest) if dest is not None else _REPO_DATA / name
    if not verify(dest, name):
        return dest
    system = Path("/usr/share/datasets") / name
    with tempfile.TemporaryDirectory() as tmp:
        if not verify(system, name):
            src = system
        else:
            pkg = _DEBIAN_PACKAGE[name]
            got = _run(["apt-get", "download", pkg], tmp)
            if got.returncode != 0 and hasattr(os, "geteuid") and os.geteuid() == 0:
                _run(["apt-get", "update", "-qq"], tmp)  # fresh machine: no package lists yet
                got = _run(["apt-get", "download", pkg], tmp)
            if got.returncode != 0:
                raise RuntimeError(
                    f"`apt-get download {pkg}` failed ({got.stderr.strip()[-400:]}); on Debian/Ubuntu run "
                    f"`sudo apt-get update` and retry, or install it with `sudo apt-get install {pkg}`"
                )
            deb = next(Path(tmp).glob("*.deb"))
            unpack = _run(["dpkg-deb", "-x", str(deb), "root"], tmp)
            if unpack.returncode != 0:
                raise RuntimeError(
                    f"`dpkg-deb -x {deb.name}` failed: {unpack.stderr.strip()[-400:]}"
                )
            src = Path(tmp) / "root" / "usr" / "share" / "datasets" / name
        dest.mkdir(parents=True, exist_ok=True)
        for fname in NAMED_DATASETS[name]:
            shutil.copyfile(src / fname, dest / fname)
    problems = verify(dest, name)
    if problems:
        raise RuntimeError(f"installed {name} into {dest} but: {'; '.join(problems)}")
    return dest


def main(names: list[str]) -> None:
    """CLI of ``scripts/get_data.sh``: install each named dataset and print where it is."""
    for name in names or ["fashion-mnist"]:
        print(f"{name}: installed and verified in {install(name)}")
