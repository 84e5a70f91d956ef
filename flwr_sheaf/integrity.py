"""Files with a header and a SHA-256: node state files, server checkpoints, the data cache's seals.

A file is ``<magic line>`` + one JSON metadata line (``format``, the caller's fields,
``payload-bytes``, ``sha256``) + the payload (:func:`write_sealed`, :func:`read_sealed`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["SealedFileError", "write_sealed", "read_sealed"]


class SealedFileError(ValueError):
    """A sealed file that must not be used: wrong header or format, truncated or modified payload."""


def write_sealed(path: Path, magic: bytes, meta: Mapping[str, Any], data: bytes, fmt: int) -> Path:
    """Write ``magic`` + metadata line (``format``, ``meta``, size, SHA-256) + ``data`` to ``path`` atomically.

    Raises:
        OSError: the directory cannot be created or written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {
        "format": fmt,
        **meta,
        "payload-bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(magic + json.dumps(head, sort_keys=True).encode() + b"\n" + data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_sealed(
    path: Path,
    magic: bytes,
    fmt: int,
    *,
    payload: bool = True,
    what: str = "file",
    error: type[ValueError] = SealedFileError,
    fix: str = "",
) -> tuple[dict, bytes | None]:
    """``(metadata, payload or None)`` of a file written by :func:`write_sealed` (checksum verified).

    Args:
        what: what the file is, for messages (``"flwr-sheaf node state file"``).
        error: exception class raised (a ``ValueError`` subclass).
        fix: what to do, appended to every refusal.

    Raises:
        error: not a regular file, a bad header, format, metadata, size or SHA-256 (file named).
        OSError: it cannot be opened (missing, no permission).
    """
    tail = f"; {fix}" if fix else ""
    # never waits on a FIFO (a reader's open blocks until a writer comes); refused below
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise error(f"{path}: not a regular file (a FIFO, device or directory){tail}")
        if fh.readline(len(magic)) != magic:
            raise error(f"{path}: not a {what} (bad header){tail}")
        try:
            meta = json.loads(fh.readline(65536))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting
            raise error(f"{path}: corrupted metadata ({exc}){tail}") from None
        if not isinstance(meta, dict) or meta.get("format") != fmt:
            got = meta.get("format") if isinstance(meta, dict) else None
            raise error(f"{path}: format {got!r}, this version reads {fmt}{tail}")
        data = fh.read() if payload else None
    if data is not None and (
        len(data) != meta.get("payload-bytes")
        or hashlib.sha256(data).hexdigest() != meta.get("sha256")
    ):
        raise error(
            f"{path}: payload is truncated or corrupted ({len(data)} bytes, the header says "
            f"{meta.get('payload-bytes')}; or the SHA-256 differs from its header){tail}"
        )
    return meta, data
