"""Preflight of the ServerApp: what a run will write is checked before any message is sent.

:func:`preflight` (called by :func:`flwr_sheaf.apps.server_app.run_server` once the run config is
parsed) refuses, naming the run-config key, the path and the fix: a directory the run will write
(``results-dir``, ``node-state-dir``, ``tracking-dir``) that cannot be created or written;
``overwrite`` with ``resume``; resuming without a checkpoint; a fresh run into a ``results-dir``
holding another run's files unless ``overwrite = true`` (then they are moved into
``previous-<UTC time>/``, never deleted: :func:`flwr_sheaf.rundir.move_aside`); a ``node-state-dir``
of another run (:func:`flwr_sheaf.rundir.check_node_state_dir`); a second live run on the same
directory (:class:`flwr_sheaf.locks.DirLock`). docs/reliability-run-files.md lists each case.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from .config import ConfigError, RunConfig
from .locks import DirLock
from .rundir import (
    check_node_state_dir,
    claim_node_state_dir,
    move_aside,
    path_error,
    resolve_dir,
)

__all__ = ["RESULT_FILES", "MOVED_FILES", "Preflight", "check_writable_dir", "preflight"]

log = logging.getLogger("flwr_sheaf")

#: Files whose presence means that ``results-dir`` holds another run's results.
RESULT_FILES = ("results.json", "checkpoint.pkl")
#: Files ``overwrite = true`` moves into ``previous-<UTC time>/``.
MOVED_FILES = ("results.json", "checkpoint.pkl", "accuracy.png")


def check_writable_dir(key: str, path: str | Path, *, create: bool = False) -> Path:
    """``path`` resolved, after checking that it is (or can be created as) a writable directory.

    Args:
        key: the run-config key that names ``path`` (for messages).
        create: create the directory (and its parents) now.

    Raises:
        ConfigError: a path component is a regular file, the directory (or its nearest existing parent)
            is not writable, or it cannot be created (key, path and fix named).
    """
    p = resolve_dir(key, path)
    fix = f"set {key} to a directory you can write"
    try:
        p.exists()
    except OSError as exc:  # ELOOP of a link loop below a resolved prefix, EACCES, ...
        raise path_error(key, path, exc) from None
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{key}={str(path)!r}: {p} exists and is not a directory; {fix}")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            f"{key}={str(path)!r}: {probe} is a file, not a directory, so {p} cannot be created; {fix}"
        )
    if create:
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"{key}={str(path)!r}: cannot create {p} ({exc.strerror or exc}); {fix}"
            ) from None
        probe = p
    try:  # os.access is wrong for root and some file systems: really write a file
        fd, tmp = tempfile.mkstemp(prefix=".flwr-sheaf-probe-", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        where = "" if probe == p else f" (its nearest existing parent {probe})"
        raise ConfigError(
            f"{key}={str(path)!r}: {probe}{where} is not writable ({exc.strerror or exc}); {fix}"
        ) from None
    return p


class Preflight:
    """What :func:`preflight` holds for the run; a context manager that releases the locks.

    Attributes:
        locks: the held :class:`~flwr_sheaf.locks.DirLock` of ``results-dir`` (and of ``node-state-dir``).
        previous_run: where ``overwrite = true`` moved the earlier run's files, ``{"moved_to": path,
            "files": [names]}`` (``results.json``'s ``previous_run``), or None.
    """

    def __init__(self) -> None:
        self.locks: list[DirLock] = []
        self.previous_run: dict | None = None

    def release(self) -> None:
        """Release every lock (the node-state-dir's first)."""
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def __enter__(self) -> Preflight:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _no_checkpoint(config: RunConfig, out: Path) -> None:
    """Refuse resuming without a checkpoint, in one line naming what works instead."""
    from .strategy.checkpoint import NoCheckpointError, checkpoint_path

    path = checkpoint_path(config.resume_from or out)
    if path.is_file():
        return
    key = f"resume-from={config.resume_from!r}" if config.resume_from else "resume=true"
    if (path.parent / "results.json").is_file():
        raise NoCheckpointError(
            f"{key}: {path.parent} holds a finished run's results.json but no checkpoint.pkl (that run "
            f"had checkpoint-every=0, or ended before its first checkpoint), so it cannot be extended. "
            f"Run afresh with the rounds you want in another results-dir (or with overwrite=true, which "
            f"moves its files into {path.parent}/previous-<time>/); set checkpoint-every >= 1 for a "
            f"run you may extend later"
        )
    raise NoCheckpointError(
        f"{key}: no checkpoint at {path}: nothing to resume (run without resume first, or point "
        f"resume-from at the stopped run's checkpoint.pkl)"
    )


def preflight(config: RunConfig) -> Preflight:
    """Check every directory the run writes, take its locks and move an overwritten run's files
    aside; returns the :class:`Preflight` holding the locks (``with preflight(config) as pre:``).

    Raises:
        ConfigError: each refusal of the module docstring (key, path and fix named).
        OSError: an earlier run's files cannot be moved aside (nothing deleted).
    """
    resuming = config.resume or bool(config.resume_from)
    if config.overwrite and resuming:
        which = "resume=true" if config.resume else f"resume-from={config.resume_from!r}"
        raise ConfigError(
            f"overwrite=true and {which} contradict each other: overwrite starts a fresh run (moving "
            f"the earlier run's files aside), {which.split('=')[0]} continues the checkpointed run; set "
            f"only one of them"
        )
    state_root = None
    if config.node_state_dir:
        state_root = check_writable_dir("node-state-dir", config.node_state_dir)
    if config.tracking.strip():
        resolve_dir("results-dir", config.results_dir)  # a link loop named by its key first
        # tracking.tracking_dir's default, unresolved: a link loop is then named by check_writable_dir
        check_writable_dir(
            "tracking-dir", config.tracking_dir or str(Path(config.results_dir) / "tracking")
        )
    out = check_writable_dir("results-dir", config.results_dir, create=True)
    pre = Preflight()
    try:
        pre.locks.append(DirLock(out, "results-dir").acquire())
        if resuming:
            _no_checkpoint(config, out)
        old = [out / f for f in RESULT_FILES if (out / f).exists()]
        if old and not resuming and not config.overwrite:
            how = (
                "resume=true to continue that run, or overwrite=true to move its files into "
                f"{out}/previous-<time>/ and start afresh"
                if (out / "checkpoint.pkl").exists()
                else f"or overwrite=true to move its files into {out}/previous-<time>/ and start "
                f"afresh (it has no checkpoint.pkl, so resume=true cannot continue it)"
            )
            raise ConfigError(
                f"results-dir={config.results_dir!r}: {out} already holds another run's results "
                f"({', '.join(p.name for p in old)}); a fresh run would replace them. Use another "
                f"results-dir, {how}"
            )
        # before anything is moved: a refusal leaves results-dir as it was
        if state_root is not None:
            state_root.mkdir(parents=True, exist_ok=True)
            pre.locks.append(DirLock(state_root, "node-state-dir").acquire())
            if not resuming:  # a resumed run's: after its checkpoint check (server_app)
                check_node_state_dir(state_root, config.node_state_dir, config.to_dict(), False)
        if old and not resuming:  # overwrite=true: moved aside, never deleted
            moved = move_aside(out, MOVED_FILES)
            if moved is not None:
                folder, names = moved
                pre.previous_run = {"moved_to": str(folder), "files": names}
                log.warning(
                    "overwrite=true: moved the earlier run's %s from %s into %s (nothing deleted)",
                    ", ".join(names),
                    out,
                    folder,
                )
        if state_root is not None and not resuming:
            claim_node_state_dir(state_root, config.to_dict(), out)
    except BaseException:
        pre.release()
        raise
    return pre
