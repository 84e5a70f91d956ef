"""Validating reader of MNIST-format idx files (plain or gzipped).

The idx format: two zero bytes, a type byte (``0x08`` = unsigned byte), the number of dimensions,
one big-endian int32 per dimension, then the data. Images are ``idx3`` (magic ``0x00000803``:
``(N, rows, cols)``), labels ``idx1`` (magic ``0x00000801``: ``(N,)``). Every way a file can be
broken is refused with the file named, what is wrong and the fix: an empty file, a header shorter
than its dimensions, a wrong magic number, a data size that differs from the header's (truncated or
padded), and a truncated or corrupt ``.gz`` archive (which used to surface as a bare ``EOFError``).
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

__all__ = ["IDX_MAGIC", "read_idx_bytes", "read_idx_file"]

#: kind -> (magic number, number of dimensions).
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
