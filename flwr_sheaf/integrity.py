"""Files with a header and a SHA-256: one format for node state files (:mod:`flwr_sheaf.client.state`)
and server checkpoints (:mod:`flwr_sheaf.strategy.checkpoint`).

A file is ``<magic line>`` + one JSON metadata line (``format``, the caller's fields,
``payload-bytes``, ``sha256``) + the payload, written atomically by :func:`write_sealed` and read
by :func:`read_sealed`, which refuses a wrong header or format and a truncated or modified payload
(:class:`SealedFileError` naming the file).
"""

from __future__ import annotations

import hashlib
import json
import os
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
        error: a bad header, format, metadata, size or SHA-256 (the file named).
    """
    tail = f"; {fix}" if fix else ""
    with open(path, "rb") as fh:
        if fh.readline() != magic:
            raise error(f"{path}: not a {what} (bad header){tail}")
        try:
            meta = json.loads(fh.readline())
        except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError of non-UTF-8 bytes
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


# ------------------------------------------------------------------------------ server checkpoints
#: First line of a server checkpoint (flwr_sheaf.strategy.checkpoint). Files of the old format (a bare
#: pickle, before the header existed) start with the pickle protocol byte ``0x80`` instead.
CHECKPOINT_MAGIC = b"flwr-sheaf server checkpoint v1\n"
_CHECKPOINT_FIX = (
    "restore the file from a backup, resume from another checkpoint (resume-from), or start the "
    "run afresh in a new results-dir (or with overwrite=true)"
)


def write_checkpoint_file(path: Path, data: bytes, fmt: int, server_round: int) -> Path:
    """Write a pickled checkpoint ``data`` sealed (header + SHA-256) and atomically to ``path``.

    Raises:
        OSError: the directory cannot be written.
    """
    return write_sealed(
        path, CHECKPOINT_MAGIC, {"round": int(server_round), "payload": "pickle"}, data, fmt
    )


def read_checkpoint_file(path: Path, fmt: int, error: type[ValueError]) -> dict[str, Any]:
    """The checkpoint dict in ``path``, after its header and SHA-256 are verified (nothing unpickled before).

    A checkpoint of the old format (a bare pickle, no header) is refused: it cannot be verified,
    and a truncated or modified one was resumed silently.

    ``error`` is the exception type raised (the checkpointer passes ``ConfigError``: this module sits
    below the config layer and imports nothing of it).

    Raises:
        error: a file that is not a flwr-sheaf checkpoint, an old-format checkpoint, a truncated or
            modified file, another format version (the file, what is wrong and the fix named).
    """
    import pickle

    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(len(CHECKPOINT_MAGIC))
    if head != CHECKPOINT_MAGIC:
        if not head:
            raise error(
                f"checkpoint {path} is empty (0 bytes: truncated, e.g. a full disk or a killed copy); "
                f"{_CHECKPOINT_FIX}"
            )
        if head[:1] == b"\x80":
            raise error(
                f"checkpoint {path} has the old format (a bare pickle without header and SHA-256, written "
                f"before flwr-sheaf checked checkpoint integrity): it cannot be verified, so it is not "
                f"resumed; finish that run with the flwr-sheaf version that wrote it, or start afresh in "
                f"a new results-dir (or with overwrite=true)"
            )
        raise error(
            f"checkpoint {path} is not a flwr-sheaf server checkpoint (bad header: it was overwritten "
            f"by another file); {_CHECKPOINT_FIX}"
        )
    try:
        meta, data = read_sealed(
            path,
            CHECKPOINT_MAGIC,
            fmt,
            what="flwr-sheaf server checkpoint",
            error=error,
            fix=_CHECKPOINT_FIX,
        )
    except error as exc:
        raise error(f"checkpoint {exc}") from None
    assert data is not None, "read_sealed returns the payload (payload=True by default)"
    ckpt = pickle.loads(data)  # noqa: S301 - verified against its own SHA-256; the run's own file
    if (
        not isinstance(ckpt, dict)
        or ckpt.get("format") != fmt
        or ckpt.get("round") != meta.get("round")
    ):
        raise error(
            f"checkpoint {path} is not a flwr-sheaf checkpoint of format {fmt}; {_CHECKPOINT_FIX}"
        )
    return ckpt
