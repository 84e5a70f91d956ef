"""Directory locks of a live run: ``<results-dir>/.lock`` and ``<node-state-dir>/.lock`` (docs/reliability-run-files.md).

A :class:`DirLock` is held with the kernel's ``fcntl.flock`` for as long as the run lives (released
when the process dies, in any PID namespace; taking over a free one is atomic). The file records
who took it (``pid``, ``host``, ``pidns``, ``boot_id``, start time, token) for messages and for the
one case the kernel cannot decide, a lock written on another kernel: refused unless written on this
host before its last boot. Without ``fcntl`` (Windows) the lock falls back to the pid check. A
process never holds one directory's lock twice.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from .config import ConfigError

try:  # POSIX; the kernel lock that dies with its process
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "DirLock", "LockedError", "held_by_this_process"]

log = logging.getLogger("flwr_sheaf")

LOCK_NAME = ".lock"
#: ``{lock file path: DirLock}`` of the locks this process holds.
_HELD: dict[Path, DirLock] = {}


class LockedError(ConfigError):
    """A directory locked by another live run (or by a holder that cannot be shown dead)."""


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _boot_time() -> float | None:
    """Seconds since the epoch at which this machine booted (Linux ``/proc/stat`` ``btime``)."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _pidns() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by another user
        return True
    return True


def _after_check(lock: DirLock) -> None:
    """Called between the take-over decision and writing this run's details (a test hook: tests put
    a contender here to interleave two take-overs deterministically)."""


def held_by_this_process(directory: str | Path) -> DirLock | None:
    """The :class:`DirLock` this process holds on ``directory``, or None."""
    return _HELD.get(Path(directory).expanduser().resolve() / LOCK_NAME)


class DirLock:
    """The lock file ``<directory>/.lock`` of one run (module docstring); a context manager.

    Args:
        directory: the locked directory (must exist).
        key: the run-config key naming it, for messages (``results-dir``, ``node-state-dir``).

    Raises:
        LockedError: (:meth:`acquire`) a live run holds the lock (its pid, host and start time named),
            or its holder cannot be shown dead (why, and what to do, named).
    """

    def __init__(self, directory: str | Path, key: str = "results-dir") -> None:
        self.path = Path(directory).expanduser().resolve() / LOCK_NAME
        self.key = key
        self.token = uuid.uuid4().hex
        self.held = False
        self._fd: int | None = None

    # ------------------------------------------------------------------ details
    def _mine(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "pidns": _pidns(),
            "boot_id": _boot_id(),
            "time": time.time(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "token": self.token,
        }

    def _describe(self, info: dict[str, Any]) -> str:
        host = str(info.get("host", "?"))
        where = "this host" if host == socket.gethostname() else f"host {host}"
        ns = info.get("pidns")
        if host == socket.gethostname() and ns is not None and ns != _pidns():
            where += " (in another PID namespace, e.g. another container)"
        return f"process {info.get('pid', '?')} on {where}"

    def _busy(self, info: dict[str, Any], why: str = "") -> LockedError:
        return LockedError(
            f"{self.key} {self.path.parent} is in use by another run: {self._describe(info)} holds "
            f"{self.path} (since {info.get('started', '?')}){why}; wait for it to end or use another "
            f"{self.key} (remove the lock file only if that process is not a flwr-sheaf run)"
        )

    @staticmethod
    def _read(fd: int) -> dict[str, Any] | None:
        os.lseek(fd, 0, os.SEEK_SET)
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
        if not data.strip():
            return None
        try:
            info = json.loads(data)
        except ValueError:
            return {}
        return info if isinstance(info, dict) else {}

    def _holder_gone(self, info: dict[str, Any]) -> str | None:
        """Why the holder named in a lock file whose ``flock`` is free is dead, or None if that cannot be shown."""
        if fcntl is not None and info.get("boot_id") and info.get("boot_id") == _boot_id():
            return "its process no longer runs (the kernel released its lock)"
        boot = _boot_time()
        if (
            info.get("host") == socket.gethostname()
            and boot is not None
            and isinstance(info.get("time"), (int, float))
            and info["time"] < boot
        ):
            return "it was written on this host before its last boot"
        if fcntl is None and info.get("host") == socket.gethostname():  # pragma: no cover
            pid = info.get("pid")
            if isinstance(pid, int) and not _pid_alive(pid):
                return "its process no longer runs"
        return None

    # ------------------------------------------------------------------ acquire / release
    def acquire(self) -> DirLock:
        """Take the lock (taking over a stale one with a warning); returns self.

        Raises:
            LockedError: see the class docstring.
        """
        if self.path in _HELD:
            raise self._busy(_HELD[self.path]._mine(), " (this same process: two runs at once)")
        for _ in range(100):  # retried only when the file was replaced between open and flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        live = self._read(fd) or {}
                        raise self._busy(live) from None
                    try:  # the holder we waited on may have removed the file: lock the one at the path
                        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                    except FileNotFoundError:
                        same = False
                    if not same:
                        os.close(fd)
                        fd = -1
                        continue
                info = self._read(fd)
                if info is not None:  # a lock file without a live flock: its holder died, or
                    why = self._holder_gone(info)  # it is on a kernel that cannot be asked
                    if why is None:
                        raise self._busy(
                            info,
                            " and it cannot be shown to have ended (the lock was written on another "
                            "kernel, or by an older flwr-sheaf without a kernel lock)",
                        )
                    log.warning(
                        "taking over the stale lock %s of %s (started %s): %s",
                        self.path,
                        self._describe(info),
                        info.get("started", "?"),
                        why,
                    )
                _after_check(self)
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
                os.write(fd, json.dumps(self._mine()).encode())
                os.fsync(fd)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
            self._fd, self.held = fd, True
            _HELD[self.path] = self
            return self
        raise LockedError(  # pragma: no cover - 100 replacements in a row
            f"{self.key} {self.path.parent}: the lock file {self.path} keeps being replaced by other runs"
        )

    def release(self) -> None:
        """Remove the lock file and release the lock, if this run holds it."""
        if not self.held:
            return
        self.held = False
        _HELD.pop(self.path, None)
        fd, self._fd = self._fd, None
        try:
            if fd is not None and os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()  # while still locked: a contender re-checks the inode
        except OSError:
            pass
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
