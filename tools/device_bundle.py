"""The device bundle: one folder of at most 60 MiB that an offline GPU machine installs from.

The GPU machines this project borrows have Python 3.12 with torch (and many other packages, see
:data:`ON_DEVICE`) but no flwr, no Ray and no network, and a run carries at most 64 MiB of files.
This script builds, on a machine with pip access, a folder (default ``.bundle/``, git-ignored)
holding:

* cp312 manylinux x86_64 wheels of ``flwr[simulation]`` at the version pinned in
  ``pyproject.toml`` (the version installed here when flwr is importable) and of every runtime
  dependency, found by reading the wheels' ``Requires-Dist`` recursively, that the GPU machine
  lacks (the project's own dependencies from ``[project.dependencies]`` too);
* Ray's wheel (the version flwr's ``simulation`` extra pins), trimmed of what Flower's simulation
  does not import (:data:`RAY_DROP`: the Java jars, the dashboard's web build, RLlib, Data, Serve,
  Tune, Train, LLM) with its ``RECORD`` rewritten so that pip still installs it;
* Fashion-MNIST's four files, each compressed with xz (``lzma`` preset 9 | extreme);
* ``manifest.json``: every file with its size and SHA-256, the total and the install commands.

Build (here; ``--part packages`` / ``--part data`` split it into two bundles for two back-to-back
GPU runs when the whole does not fit)::

    python tools/device_bundle.py --out .bundle

Install (on the GPU machine; checks every SHA-256 first, then pip-installs the wheels into
``/tmp/site`` and restores the data into ``.gpudata/fashion-mnist``)::

    python3 tools/device_bundle.py install .bundle
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH FLWR_SHEAF_DATA=$PWD/.gpudata

The install side and the functions the tests call (:func:`trim_wheel`, :func:`check_budget`,
:func:`compress_data`, :func:`restore_data`) need only the standard library.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.util
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: The bundle's budget: a run carries at most 64 MiB, and the working tree (about 2 MB) travels too.
LIMIT_BYTES = 60 * 2**20

#: The GPU machine's interpreter and platform, for ``pip download`` and for evaluating markers.
PIP_PLATFORM_ARGS = (
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_27_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "manylinux2014_x86_64",
    "--platform",
    "manylinux1_x86_64",
)
MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "platform_release": "",
    "platform_version": "",
}

#: Python packages already on the GPU machine (the device notes' "Python packages already there"
#: for the nvidia-h200 kind, image 'cuda', as read on a machine running it on 2026-11-17: the
#: workplace's KINDS.md). Not bundled unless listed in :data:`ALWAYS_CARRY`. Not in it, so bundled
#: when needed: cryptography, cffi, pycparser, pydantic, tomli, ...
ON_DEVICE = frozenset(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split()
)

#: On the GPU machine but bundled anyway (small, and flwr pins a range the machine's copy may miss;
#: the recorded H200 session of 2026-11-30 imported typer from the carried wheels).
ALWAYS_CARRY = {"typer": "flwr 1.42 requires typer>=0.13,<0.21"}

#: Required by a wheel's metadata but never imported by what runs on the GPU machine; not bundled.
NOT_NEEDED = {
    "uv": "flwr runs `python -m uv sync` only to install a Flower app's dependencies when runtime "
    "dependency installation is on (flwr/supercore/superexec/dependency_installer.py); "
    "an offline machine cannot install anything, and the in-process runner never gets there",
}

#: Members dropped from Ray's wheel (prefixes of zip member names): nothing under them is imported
#: by Flower's simulation engine (``ray``, ``ray.util.actor_pool``, ``ray.util.scheduling_strategies``).
RAY_DROP = (
    "ray/jars/",  # Java workers (~32 MB)
    "ray/dashboard/client/build/",  # the dashboard's web front end
    "ray/rllib/",
    "ray/data/",
    "ray/serve/",
    "ray/tune/",
    "ray/train/",
    "ray/llm/",
)
TRIM = {"ray": RAY_DROP}
#: Members a trimmed Ray wheel must keep (checked after trimming).
RAY_KEEP = ("ray/_raylet.so", "ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server")

#: The named dataset the GPU session reads (``dataset=fashion-mnist``) and its place in a bundle.
DATASET = "fashion-mnist"
XZ_PRESET = 9 | lzma.PRESET_EXTREME

PIP_INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
    "--upgrade --target {target} {dir}/*.whl"
)


class BundleError(RuntimeError):
    """A bundle cannot be built, does not fit its budget, or fails its checks on install."""


# --------------------------------------------------------------------------------------- helpers


def normalize(name: str) -> str:
    """A distribution name in PEP 503 normal form (``Typing_Extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def record_hash(data: bytes) -> str:
    """A wheel ``RECORD`` hash field: ``sha256=`` + urlsafe base64 of the digest without padding."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def wheel_name_version(filename: str) -> tuple[str, str]:
    """(normalized name, version) of a wheel file name (``flwr-1.42.0-py3-none-any.whl``).

    Raises:
        BundleError: not a wheel file name.
    """
    parts = Path(filename).name[: -len(".whl")].split("-") if filename.endswith(".whl") else []
    if len(parts) not in (5, 6):
        raise BundleError(f"not a wheel file name: {filename}")
    return normalize(parts[0]), parts[1]


# -------------------------------------------------------------------------------------- trimming


def trim_wheel(
    src: str | os.PathLike, dst: str | os.PathLike, drop_prefixes: tuple[str, ...] | list[str]
) -> dict:
    """Rewrite the wheel ``src`` as ``dst`` without the members under ``drop_prefixes``.

    Kept members keep their bytes, timestamps and permission bits (the native executables stay
    executable); everything is re-compressed with deflate level 9 (pip reads deflate only). The
    ``*.dist-info/RECORD`` is rewritten to list exactly the kept members, each with the hash and
    size of its bytes, so that pip installs the result.

    Returns:
        ``{"src_bytes", "dst_bytes", "kept_members", "dropped_members", "dropped_uncompressed_bytes",
        "unmatched_prefixes"}`` (the last: prefixes that matched no member).

    Raises:
        BundleError: ``src`` has no ``*.dist-info/RECORD``, or a prefix would drop the dist-info.
    """
    src, dst = Path(src), Path(dst)
    prefixes = tuple(drop_prefixes)
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        records = [
            i.filename for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename)
        ]
        if len(records) != 1:
            raise BundleError(f"{src.name}: expected one *.dist-info/RECORD, found {records}")
        record_name = records[0]
        dist_info = record_name.rsplit("/", 1)[0] + "/"
        bad = [p for p in prefixes if dist_info.startswith(p) or p.startswith(dist_info)]
        if bad:
            raise BundleError(
                f"{src.name}: drop prefixes {bad} would remove the wheel's {dist_info}"
            )
        matched: set[str] = set()
        dropped, dropped_bytes, rows = 0, 0, []
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        with zipfile.ZipFile(tmp, "w") as zout:
            for info in infos:
                hit = next((p for p in prefixes if info.filename.startswith(p)), None)
                if hit is not None:
                    matched.add(hit)
                    dropped += 1
                    dropped_bytes += info.file_size
                    continue
                if info.filename == record_name:
                    continue
                data = zin.read(info)
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.external_attr, out.create_system = info.external_attr, info.create_system
                out.compress_type = zipfile.ZIP_DEFLATED
                zout.writestr(out, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                if not info.is_dir():
                    rows.append((info.filename, record_hash(data), str(len(data))))
            buf = io.StringIO()
            writer = csv.writer(buf, lineterminator="\n")
            writer.writerows(rows)
            writer.writerow((record_name, "", ""))
            rec_info = zin.getinfo(record_name)
            out = zipfile.ZipInfo(record_name, date_time=rec_info.date_time)
            out.external_attr, out.create_system = rec_info.external_attr, rec_info.create_system
            zout.writestr(
                out, buf.getvalue().encode(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9
            )
        os.replace(tmp, dst)
    return {
        "src_bytes": src.stat().st_size,
        "dst_bytes": dst.stat().st_size,
        "kept_members": len(rows) + 1,
        "dropped_members": dropped,
        "dropped_uncompressed_bytes": dropped_bytes,
        "unmatched_prefixes": [p for p in prefixes if p not in matched],
    }


# ---------------------------------------------------------------------------------------- budget


def folder_files(directory: str | os.PathLike) -> list[tuple[str, int]]:
    """(path relative to ``directory``, bytes) of every file under it, sorted by path."""
    root = Path(directory)
    return sorted(
        (p.relative_to(root).as_posix(), p.stat().st_size) for p in root.rglob("*") if p.is_file()
    )


def check_budget(
    directory: str | os.PathLike, limit_bytes: int = LIMIT_BYTES, label: str | None = None
) -> int:
    """The total bytes of the files under ``directory``, refused when over ``limit_bytes``.

    ``label`` names the folder in the message (default: ``directory``).

    Raises:
        BundleError: over the limit; the message gives the total, the limit, the largest files with
            their sizes and the fix (``--part packages`` then ``--part data``: two bundles for two
            back-to-back runs).
    """
    files = folder_files(directory)
    total = sum(n for _, n in files)
    if total > limit_bytes:
        largest = sorted(files, key=lambda f: -f[1])[:5]
        names = ", ".join(f"{name} ({_mib(n)}, {n} bytes)" for name, n in largest)
        raise BundleError(
            f"{label or directory}: {_mib(total)} ({total} bytes) is over the budget of {_mib(limit_bytes)} "
            f"({limit_bytes} bytes); largest files: {names}. Fix: build two bundles for two "
            f"back-to-back runs with --part packages and --part data (a single part over budget needs fewer or "
            f"smaller packages: TRIM, NOT_NEEDED in tools/device_bundle.py)"
        )
    return total


# ------------------------------------------------------------------------------------------ data


def compress_data(
    files: list[str | os.PathLike], out_dir: str | os.PathLike, preset: int = XZ_PRESET
) -> list[dict]:
    """xz-compress each file into ``out_dir/<name>.xz``.

    Returns:
        one entry per file: ``{"file", "bytes", "sha256", "archive", "archive_bytes",
        "archive_sha256"}`` (``archive`` relative to ``out_dir``; the SHA-256s of the original and
        of the archive), the form :func:`restore_data` checks.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for f in map(Path, files):
        arc = out / (f.name + ".xz")
        with open(f, "rb") as src, lzma.open(arc, "wb", preset=preset) as dst:
            shutil.copyfileobj(src, dst, 2**20)
        entries.append(
            {
                "file": f.name,
                "bytes": f.stat().st_size,
                "sha256": sha256_file(f),
                "archive": arc.name,
                "archive_bytes": arc.stat().st_size,
                "archive_sha256": sha256_file(arc),
            }
        )
    return entries


def restore_data(
    entries: list[dict], archive_dir: str | os.PathLike, dest: str | os.PathLike
) -> Path:
    """Decompress the archives listed in ``entries`` (from :func:`compress_data`) into ``dest``.

    Each archive's SHA-256 is checked before it is opened and each restored file's after; a file
    is written under a temporary name and renamed only when it verifies.

    Returns:
        ``dest``.

    Raises:
        BundleError: an archive is missing, corrupt (wrong SHA-256, not xz) or restores to the wrong
            bytes; the message names the file.
    """
    src, dest = Path(archive_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for e in entries:
        arc = src / e["archive"]
        if not arc.is_file():
            raise BundleError(f"missing data archive {arc}")
        if sha256_file(arc) != e["archive_sha256"]:
            raise BundleError(
                f"data archive {arc} has the wrong SHA-256 (corrupt or truncated copy)"
            )
        out = dest / e["file"]
        tmp = out.with_name(out.name + ".part")
        try:
            with lzma.open(arc, "rb") as fh, open(tmp, "wb") as dst:
                shutil.copyfileobj(fh, dst, 2**20)
        except (lzma.LZMAError, EOFError) as err:
            tmp.unlink(missing_ok=True)
            raise BundleError(f"data archive {arc} is not a valid xz file: {err}") from err
        if sha256_file(tmp) != e["sha256"]:
            tmp.unlink(missing_ok=True)
            raise BundleError(
                f"{arc} restored to {out.name} with the wrong SHA-256 (expected {e['sha256']})"
            )
        os.replace(tmp, out)
    return dest


def _catalog():
    """``flwr_sheaf/data/catalog.py`` loaded on its own (stdlib only; no torch import)."""
    spec = importlib.util.spec_from_file_location(
        "_flwr_sheaf_catalog", REPO / "flwr_sheaf" / "data" / "catalog.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------ resolution


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:  # pip vendors it; the build side always has pip
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.specifiers import SpecifierSet
        from pip._vendor.packaging.version import Version
    return Requirement, SpecifierSet, Version


def wheel_requirements(wheel: str | os.PathLike) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's ``*.dist-info/METADATA``."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = z.read(meta).decode("utf-8")
    head = text.split("\n\n", 1)[0]
    return [
        line.split(":", 1)[1].strip()
        for line in head.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def pip_download(spec: str, cache: Path) -> Path:
    """``pip download`` one requirement for the GPU machine into ``cache``; the wheel's path.

    Raises:
        BundleError: pip failed (its last output lines are in the message).
    """
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        *PIP_PLATFORM_ARGS,
        "-d",
        str(cache),
        spec,
    ]
    got = subprocess.run(cmd, capture_output=True, text=True)
    if got.returncode != 0:
        raise BundleError(
            f"`pip download {spec}` failed (no network or no cp312 manylinux wheel?):\n"
            + "\n".join((got.stdout + got.stderr).strip().splitlines()[-8:])
        )
    Requirement, _, Version = _packaging()
    req = Requirement(spec)
    hits = []
    for w in cache.glob("*.whl"):
        name, version = wheel_name_version(w.name)
        if name == normalize(req.name) and req.specifier.contains(version, prereleases=True):
            hits.append((Version(version), w))
    if not hits:
        raise BundleError(f"`pip download {spec}` succeeded but no matching wheel is in {cache}")
    return max(hits)[1]


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """``[project.dependencies]`` of the project, flwr pinned to the version installed here if any."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    Requirement, _, _ = _packaging()
    try:
        from importlib.metadata import PackageNotFoundError, version

        have = version("flwr")
    except PackageNotFoundError:
        have = None
    out = []
    for d in deps:
        req = Requirement(d)
        if normalize(req.name) == "flwr" and have and req.specifier.contains(have):
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            d = f"flwr{extras}=={have}"
        out.append(d)
    return out


def resolve(roots: list[str], cache: Path, log=print) -> tuple[dict[str, Path], dict[str, str]]:
    """Download the wheels the GPU machine needs for ``roots``, following ``Requires-Dist`` recursively.

    A requirement is followed when its marker holds on the GPU machine (:data:`MARKER_ENV`, with the
    extras asked of its parent); packages in :data:`ON_DEVICE` (unless in :data:`ALWAYS_CARRY`)
    and :data:`NOT_NEEDED` are skipped. A package asked for again with a narrower specifier is
    downloaded again at a version meeting all of them.

    Returns:
        ({name: wheel path}, {skipped name: why}).
    """
    Requirement, SpecifierSet, _ = _packaging()
    queue = [Requirement(r) for r in roots]
    specs: dict[str, object] = {}
    extras: dict[str, set[str]] = {}
    wheels: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    while queue:
        req = queue.pop(0)
        name = normalize(req.name)
        if name in NOT_NEEDED:
            skipped[name] = NOT_NEEDED[name]
            continue
        if name in ON_DEVICE and name not in ALWAYS_CARRY:
            skipped[name] = "on the GPU machine"
            continue
        spec = SpecifierSet(
            ",".join(s for s in (str(specs.get(name, "")), str(req.specifier)) if s)
        )
        specs[name] = spec
        new_extras = set(req.extras) - extras.get(name, set())
        extras.setdefault(name, set()).update(req.extras)
        if (
            name in wheels
            and spec.contains(wheel_name_version(wheels[name].name)[1], prereleases=True)
            and not new_extras
        ):
            continue
        wheels[name] = pip_download(f"{name}{spec}", cache)
        log(f"  {wheels[name].name}")
        for line in wheel_requirements(wheels[name]):
            sub = Requirement(line)
            if sub.marker is None or any(
                sub.marker.evaluate({**MARKER_ENV, "extra": e}) for e in [""] + sorted(extras[name])
            ):
                queue.append(sub)
    return wheels, skipped


# ----------------------------------------------------------------------------------------- build


def install_commands(
    part: str = "all",
    bundle: str = ".bundle",
    target: str = "/tmp/site",
    data_dir: str = ".gpudata",
) -> dict:
    """The install commands written into the manifest of a ``part`` bundle in the folder ``bundle``
    (relative to the repository root), with and without this script."""
    env = f"export PYTHONPATH={target}:$PWD PATH={target}/bin:$PATH FLWR_SHEAF_DATA=$PWD/{data_dir}"
    by_hand = [f"(cd {bundle} && sha256sum -c --quiet SHA256SUMS)"]
    if part in ("all", "packages"):
        by_hand.append(PIP_INSTALL.format(target=target, dir=bundle))
    if part in ("all", "data"):
        by_hand.append(
            f"mkdir -p {data_dir}/{DATASET} && for f in {bundle}/data/{DATASET}/*.xz; do "
            f'xz -dc "$f" > {data_dir}/{DATASET}/$(basename "$f" .xz); done'
        )
    return {
        "with_script": [
            f"python3 tools/device_bundle.py install {bundle} --target {target} --data-dir {data_dir}",
            env,
        ],
        "by_hand": by_hand + [env],
    }


def finish_bundle(
    directory: str | os.PathLike,
    manifest: dict,
    limit_bytes: int = LIMIT_BYTES,
    label: str | None = None,
) -> dict:
    """Write ``SHA256SUMS`` and ``manifest.json`` into ``directory`` and check its budget.

    Adds to ``manifest``: ``install`` (:func:`install_commands`), ``files`` (every file but the
    manifest: path, bytes, SHA-256), ``total_bytes`` (their sum) and ``total_bytes_with_manifest``.

    Returns:
        ``manifest``.

    Raises:
        BundleError: over ``limit_bytes`` (:func:`check_budget`).
    """
    directory = Path(directory)
    manifest.setdefault("limit_bytes", limit_bytes)
    manifest.setdefault("data", {})
    manifest["install"] = install_commands(
        manifest.get("part", "all"), manifest.get("bundle", ".bundle")
    )
    sums = [
        (rel, sha256_file(directory / rel))
        for rel, _ in folder_files(directory)
        if rel not in ("SHA256SUMS", "manifest.json")
    ]
    (directory / "SHA256SUMS").write_text("".join(f"{h}  {rel}\n" for rel, h in sums))
    manifest["files"] = [
        {"path": rel, "bytes": n, "sha256": sha256_file(directory / rel)}
        for rel, n in folder_files(directory)
        if rel != "manifest.json"
    ]
    manifest["total_bytes"] = sum(f["bytes"] for f in manifest["files"])
    text = json.dumps(manifest, indent=1)
    (directory / "manifest.json").write_text(text)
    manifest["total_bytes_with_manifest"] = manifest["total_bytes"] + len(text.encode())
    check_budget(directory, limit_bytes, label)
    return manifest


def build(out: Path, part: str, cache: Path, limit_bytes: int = LIMIT_BYTES, log=print) -> dict:
    """Build the bundle ``out`` (``part``: ``all``, ``packages`` or ``data``); its manifest.

    Built in ``<out>.tmp`` and moved to ``out`` only when it fits ``limit_bytes``.

    Raises:
        BundleError: a download failed, the dataset is not installed here, a trimmed wheel lost a
            member it must keep, or the bundle is over budget (the staging folder is removed).
    """
    stage = out.with_name(out.name + ".tmp")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    manifest: dict = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "part": part,
        "bundle": out.name,
        "limit_bytes": limit_bytes,
        "packages": [],
        "skipped": {},
        "trimmed": {},
        "data": {},
    }
    try:
        if part in ("all", "packages"):
            roots = project_requirements()
            log(f"resolving for Python 3.12 manylinux x86_64: {roots}")
            wheels, manifest["skipped"] = resolve(roots, cache, log)
            for name, whl in sorted(wheels.items()):
                dst = stage / whl.name
                if name in TRIM:
                    stats = trim_wheel(whl, dst, TRIM[name])
                    with zipfile.ZipFile(dst) as z:
                        lost = [m for m in RAY_KEEP if name == "ray" and m not in z.namelist()]
                    if lost:
                        raise BundleError(f"trimmed {whl.name} lacks {lost}")
                    manifest["trimmed"][whl.name] = stats
                    log(
                        f"trimmed {whl.name}: {_mib(stats['src_bytes'])} -> {_mib(stats['dst_bytes'])} "
                        f"({stats['dropped_members']} members dropped)"
                    )
                else:
                    shutil.copyfile(whl, dst)
                manifest["packages"].append(
                    {"name": name, "version": wheel_name_version(whl.name)[1], "file": whl.name}
                )
        if part in ("all", "data"):
            catalog = _catalog()
            try:
                src = catalog.find_installed(DATASET)
            except FileNotFoundError as err:
                raise BundleError(str(err)) from err
            problems = catalog.verify(src, DATASET)
            if problems:
                raise BundleError(f"{DATASET} in {src}: {'; '.join(problems)}")
            log(f"compressing {DATASET} from {src} (xz -9e)")
            files = [src / f for f in catalog.NAMED_DATASETS[DATASET]]
            manifest["data"][DATASET] = compress_data(files, stage / "data" / DATASET)
        finish_bundle(stage, manifest, limit_bytes, label=f"the bundle {out} (part {part})")
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(stage, out)
    return manifest


# --------------------------------------------------------------------------------------- install


def verify_bundle(bundle: str | os.PathLike) -> dict:
    """The bundle's manifest, after checking every listed file's size and SHA-256.

    Raises:
        BundleError: no manifest, or a file missing or with the wrong size or SHA-256 (named).
    """
    bundle = Path(bundle)
    path = bundle / "manifest.json"
    if not path.is_file():
        raise BundleError(
            f"{path} not found: not a device bundle (build one with tools/device_bundle.py)"
        )
    manifest = json.loads(path.read_text())
    for f in manifest["files"]:
        p = bundle / f["path"]
        if not p.is_file():
            raise BundleError(f"bundle file missing: {p}")
        if p.stat().st_size != f["bytes"] or sha256_file(p) != f["sha256"]:
            raise BundleError(
                f"bundle file {p} has the wrong size or SHA-256 (corrupt or truncated copy)"
            )
    return manifest


def install(
    bundle: str | os.PathLike,
    target: str | os.PathLike = "/tmp/site",
    data_dir: str | os.PathLike = ".gpudata",
    log=print,
) -> None:
    """On the GPU machine: verify ``bundle``, pip-install its wheels into ``target``, restore its data.

    The data of ``fashion-mnist`` goes to ``data_dir/fashion-mnist`` (the layout
    ``flwr_sheaf.data.catalog`` finds through ``FLWR_SHEAF_DATA=data_dir``).

    Raises:
        BundleError: a check failed, or pip failed (its output in the message).
    """
    bundle = Path(bundle)
    manifest = verify_bundle(bundle)
    log(f"{bundle}: {len(manifest['files'])} files verified ({_mib(manifest['total_bytes'])})")
    wheels = sorted(str(p) for p in bundle.glob("*.whl"))
    if wheels:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(target),
            *wheels,
        ]
        got = subprocess.run(cmd, capture_output=True, text=True)
        if got.returncode != 0:
            raise BundleError(
                f"pip install into {target} failed:\n{(got.stdout + got.stderr).strip()[-2000:]}"
            )
        log(f"installed {len(wheels)} wheels into {target}")
    for name, entries in manifest.get("data", {}).items():
        dest = restore_data(entries, bundle / "data" / name, Path(data_dir) / name)
        log(f"restored {name} into {dest} ({len(entries)} files, SHA-256 checked)")


def main(argv: list[str] | None = None) -> int:
    """CLI: build (default) or ``install <dir>``; prints a one-line error and returns 2 on failure."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["install"]:
            p = argparse.ArgumentParser(
                prog="device_bundle.py install", description=install.__doc__
            )
            p.add_argument("bundle", nargs="?", default=".bundle")
            p.add_argument("--target", default="/tmp/site")
            p.add_argument("--data-dir", default=".gpudata")
            a = p.parse_args(argv[1:])
            install(a.bundle, a.target, a.data_dir)
            target, data = os.path.abspath(a.target), os.path.abspath(a.data_dir)
            print(
                f"next: export PYTHONPATH={target}:$PWD PATH={target}/bin:$PATH FLWR_SHEAF_DATA={data}"
            )
            return 0
        p = argparse.ArgumentParser(
            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        p.add_argument("--out", type=Path, default=REPO / ".bundle")
        p.add_argument("--part", choices=("all", "packages", "data"), default="all")
        p.add_argument(
            "--cache", type=Path, default=REPO / ".bundle-cache", help="downloaded wheels (kept)"
        )
        p.add_argument("--limit-mib", type=float, default=LIMIT_BYTES / 2**20)
        a = p.parse_args(argv)
        m = build(a.out, a.part, a.cache, int(a.limit_mib * 2**20))
        for name, s in m["trimmed"].items():
            print(f"{name}: {_mib(s['src_bytes'])} untrimmed, {_mib(s['dst_bytes'])} trimmed")
        print(
            f"{a.out}: {len(m['files']) + 1} files, {_mib(m['total_bytes_with_manifest'])} "
            f"({m['total_bytes_with_manifest']} bytes) of {_mib(m['limit_bytes'])}; install on the GPU machine with:"
        )
        print("  " + "\n  ".join(m["install"]["with_script"]))
        return 0
    except BundleError as err:
        print(f"device_bundle: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
