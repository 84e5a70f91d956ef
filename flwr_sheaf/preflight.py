"""Preflight of the ServerApp: what a run will write is checked before any message is sent.

:func:`preflight` (called by :func:`flwr_sheaf.apps.server_app.run_server` right after the run config
is parsed) refuses, each time naming the run-config key, the path and the fix:

- a directory the run will write that cannot be created or written: ``results-dir`` (``results.json``,
  ``accuracy.png`` and ``checkpoint.pkl``) and the run config's ``node-state-dir`` (the nodes' state
  on this machine: simulation, in-process runs) and, with ``tracking`` on, ``tracking-dir`` (default
  ``<results-dir>/tracking``). Such a run used to fail only after training, after
  its first round or, with ``checkpoint-every=0``, after the last one;
- a fresh run (neither ``resume`` nor ``resume-from``) into a ``results-dir`` that already holds
  another run's ``results.json`` or ``checkpoint.pkl``, unless ``overwrite = true`` (then those files
  are removed first, with a warning: a checkpoint of the old run must never be resumed as this one's);
- a second run writing the same ``results-dir``: the first one holds ``<results-dir>/.lock`` (created
  exclusively; pid, host and start time inside) until it ends. A lock left by a process that no longer
  runs on this host is taken over with a warning; any other is refused, naming the pid and host.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

from .config import ConfigError, RunConfig

__all__ = ["LOCK_NAME", "RESULT_FILES", "RunLock", "check_writable_dir", "preflight"]

log = logging.getLogger("flwr_sheaf")

LOCK_NAME = ".lock"
#: Files whose presence means that ``results-dir`` holds another run's results.
RESULT_FILES = ("results.json", "checkpoint.pkl")


def check_writable_dir(key: str, path: str | Path, *, create: bool = False) -> Path:
    """``path`` resolved, after checking that it is (or can be created as) a writable directory.

    Args:
        key: the run-config key that names ``path`` (for messages).
        create: create the directory (and its parents) now.

    Raises:
        ConfigError: a path component is a regular file, the directory (or its nearest existing parent)
            is not writable, or it cannot be created (key, path and fix named).
    """
    p = Path(path).expanduser().resolve()
    fix = f"set {key} to a directory you can write"
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    except OSError:
        return True
    return True


class RunLock:
    """The exclusive lock file ``<results-dir>/.lock`` of one run (module docstring); a context manager.

    Raises:
        ConfigError: (``acquire``) a live run holds the lock (its pid, host and start time named), or
            the lock file is unreadable (named, with what to do).
    """

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_NAME
        self.token = uuid.uuid4().hex
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "time": time.time(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "token": self.token,
                },
                fh,
            )
        self.held = True
        return True

    def acquire(self) -> RunLock:
        """Create the lock file, taking over a stale one of a dead process on this host (warning)."""
        if self._create():
            return self
        try:
            info = json.loads(self.path.read_text())
            pid, host = int(info["pid"]), str(info["host"])
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigError(
                f"results-dir lock {self.path} exists but is unreadable: another run may be writing this "
                f"results-dir; if none is, remove {self.path}"
            ) from None
        started = info.get("started", "?")
        if host == socket.gethostname() and not _pid_alive(pid):
            log.warning(
                "taking over the stale lock %s of process %d (host %s, started %s), which no longer runs",
                self.path,
                pid,
                host,
                started,
            )
            self.path.unlink(missing_ok=True)
            if self._create():
                return self
            raise ConfigError(
                f"results-dir {self.path.parent}: another run took the lock {self.path} first"
            )
        where = "this host" if host == socket.gethostname() else f"host {host}"
        raise ConfigError(
            f"results-dir {self.path.parent} is in use by another run: process {pid} on {where} holds "
            f"{self.path} (since {started}); wait for it to end or use another results-dir (remove "
            f"the lock file only if that process is not a flwr-sheaf run)"
        )

    def release(self) -> None:
        """Remove the lock file if this run still holds it."""
        if not self.held:
            return
        self.held = False
        try:
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()
        except (OSError, ValueError, AttributeError):
            pass

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def preflight(config: RunConfig) -> RunLock:
    """Check every directory the run writes and take the results-dir lock (module docstring).

    Returns:
        the held :class:`RunLock` (release it when the run ends: ``with preflight(config): ...``).

    Raises:
        ConfigError: an unwritable directory, another run's results in ``results-dir`` without
            ``resume`` / ``overwrite``, or a live run holding the lock (key, path and fix named).
    """
    if config.node_state_dir:
        check_writable_dir("node-state-dir", config.node_state_dir)
    if config.tracking.strip():
        from .tracking import tracking_dir

        check_writable_dir("tracking-dir", config.tracking_dir or tracking_dir(config))
    out = check_writable_dir("results-dir", config.results_dir, create=True)
    lock = RunLock(out).acquire()
    try:
        resuming = config.resume or bool(config.resume_from)
        old = [out / f for f in RESULT_FILES if (out / f).exists()]
        if old and not resuming:
            if not config.overwrite:
                raise ConfigError(
                    f"results-dir={config.results_dir!r}: {out} already holds another run's results "
                    f"({', '.join(p.name for p in old)}); a fresh run would replace them. Use another results-dir, "
                    f"resume=true to continue that run, or overwrite=true to replace them"
                )
            for p in old + [out / "accuracy.png"]:
                if p.exists():
                    log.warning("overwrite=true: removing %s of an earlier run", p)
                    p.unlink()
    except BaseException:
        lock.release()
        raise
    return lock
