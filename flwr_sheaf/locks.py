"""Directory locks of a live run: ``<results-dir>/.lock`` and ``<node-state-dir>/.lock`` (docs/guarantees.md).

A :class:`DirLock` is held with the kernel's ``fcntl.flock`` for as long as the run lives (released
when the process dies, in any PID namespace; taking over a free one is atomic), on the lock file's
open descriptor **and on the directory itself**, so that a lock file removed (or replaced) while a
run holds it does not let a second run in: the directory's ``flock`` still refuses it, and the
holder re-checks the lock file's identity before every write (:meth:`DirLock.verify`, called by
``write_results`` and the checkpointer) and puts it back; a directory moved or replaced meanwhile
(its ``st_dev``/``st_ino`` changed: the lock went with it) is never written again by the holder. The file records who took it (``pid``,
``host``, ``pidns``, ``boot_id``, start time, token) for messages and for the cases the kernel
cannot decide: a lock written on another kernel is refused unless written on this host before its
last boot; one of this host and PID namespace whose process no longer runs (or that names this very
process, which does not hold it) is taken over with a warning, as is one that names no holder (empty,
or not a JSON object) while its kernel lock is free. A lock file that is a symbolic link,
a directory, a hard link (a name shared with another file) or anything but a regular file is refused (never followed, never created through a
link). Without ``fcntl`` (Windows) the lock falls back to the pid check. A process never holds one
directory's lock twice.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from .config import ConfigError

try:  # POSIX; the kernel lock that dies with its process
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "DirLock", "LockedError", "held_by_this_process", "live_holder"]

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
    """Whether process ``pid`` of this PID namespace runs (True where that cannot be told)."""
    if os.name == "nt":  # os.kill(pid, 0) would TerminateProcess it there
        try:
            import psutil
        except ImportError:
            return True
        return bool(psutil.pid_exists(pid))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by another user
        return True
    return True


#: the modules of Flower's processes that run a ServerApp (simulation, deployment)
_FLOWER_RUNTIMES = ("flwr.simulation.app", "flwr.superlink.runtime.run_serverapp")


def _flower_run_id() -> int | None:
    """The Flower run this process serves (``TaskIdentity.run_id`` in a process of Flower's runtime,
    not ``LocalGrid``'s stand-in), or None."""
    if not any(m in sys.modules for m in _FLOWER_RUNTIMES):
        return None
    ident = getattr(sys.modules.get("flwr.supercore.task_identity"), "TaskIdentity", None)
    return getattr(ident, "_run_id", None)


def _after_check(lock: DirLock) -> None:
    """Called between the take-over decision and writing this run's details (a test hook: tests put
    a contender here to interleave two take-overs deterministically)."""


def held_by_this_process(directory: str | Path) -> DirLock | None:
    """The :class:`DirLock` this process holds on ``directory``, or None."""
    return _HELD.get(Path(directory).expanduser().resolve() / LOCK_NAME)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: the most bytes of a lock file read (one written here is one JSON line of about 200 bytes)
_LOCK_MAX = 4096


def _open_lock_file(path: Path, key: str, *, create: bool) -> int | None:
    """An fd of the regular lock file ``path`` (``O_RDWR``, created when ``create``), never through a
    symbolic link; None when it does not exist and ``create`` is False.

    Raises:
        LockedError: ``path`` is a symbolic link, a directory or not a regular file (named, with the fix).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise _not_a_lock_file(path, key, f"a symbolic link (to {os.readlink(path)!r})")
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise _not_a_lock_file(path, key, "a directory")
    flags = os.O_RDWR | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    except IsADirectoryError:
        raise _not_a_lock_file(path, key, "a directory") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW on a link planted between lstat and open
            raise _not_a_lock_file(path, key, "a symbolic link") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = "not a regular file"
        if stat.S_ISREG(
            st.st_mode
        ):  # a hard link: writing the lock would write the other name's file
            what = f"a hard link ({st.st_nlink} names share its content, e.g. a `cp -al` snapshot)"
        raise _not_a_lock_file(path, key, what)
    return fd


def _not_a_lock_file(path: Path, key: str, what: str) -> LockedError:
    return LockedError(
        f"{key} {path.parent}: its lock file {path} is {what}, not a regular file written by flwr-sheaf; "
        f"a lock file is never followed through a link nor replaced, so the run is refused. Remove "
        f"{path} (rm {'-r ' if what == 'a directory' else ''}{path}) if no flwr-sheaf run uses "
        f"{path.parent}, or use another {key}"
    )


#: seconds a taken ``flock`` is retried before a run is refused: another process's :func:`live_holder`
#: probe holds a lock for microseconds, which must not read as a live run
_PROBE_WAIT = 0.25


def _flock_nb(fd: int, mode: int, wait: float = _PROBE_WAIT) -> None:
    """``flock(fd, mode | LOCK_NB)``, retried for ``wait`` seconds while another process holds it.

    Raises:
        BlockingIOError: still held after ``wait`` seconds.
    """
    assert fcntl is not None
    end = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= end:
                raise
            time.sleep(0.01)


def _flock_dir(directory: Path, mode: int, wait: float = _PROBE_WAIT) -> tuple[int | None, bool]:
    """``(fd, locked)``: the directory opened and ``flock``-ed with ``mode | LOCK_NB`` (retried for
    ``wait`` seconds); ``fd`` None where a directory cannot be opened or locked (no ``fcntl``, a file
    system without ``flock`` on directories); ``locked`` False (fd closed, None) when another process
    holds it."""
    if fcntl is None:  # pragma: no cover - Windows
        return None, True
    try:
        fd = os.open(
            directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        )
    except OSError:
        return None, True
    try:
        _flock_nb(fd, mode, wait)
    except BlockingIOError:
        os.close(fd)
        return None, False
    except OSError:  # e.g. NFS without flock on directories: the lock file's own flock only
        os.close(fd)
        return None, True
    return fd, True


def live_holder(directory: str | Path, key: str = "resume-from") -> str | None:
    """Who holds ``directory``'s lock (a live run: its process, host and start time), or None when
    no run holds it. Nothing is created, taken or changed.

    Raises:
        LockedError: the lock file is a symbolic link, a directory or not a regular file.
    """
    lock = DirLock(directory, key)
    dfd, free = _flock_dir(lock.path.parent, fcntl.LOCK_SH if fcntl is not None else 0, wait=0)
    if dfd is not None:
        os.close(dfd)
    fd = _open_lock_file(lock.path, key, create=False)
    info: dict[str, Any] | None = None
    if fd is not None:
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except BlockingIOError:
                    free = False
            info = DirLock._read(fd)
        finally:
            os.close(fd)
    if fcntl is None and info:  # no kernel lock to ask (Windows): whether its process runs
        free = lock._holder_gone(info) is not None
    return None if free else lock._who(info)


class DirLock:
    """The lock file ``<directory>/.lock`` of one run (module docstring).

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
        self._dir_fd: int | None = None
        self._ident: tuple[int, int] | None = None
        #: the locked directory's ``(st_dev, st_ino)`` when taken: one moved or replaced is detected
        self._dir_ident: tuple[int, int] | None = None

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
            "run_id": _flower_run_id(),
        }

    def _describe(self, info: dict[str, Any]) -> str:
        host = str(info.get("host", "?"))
        where = "this host" if host == socket.gethostname() else f"host {host}"
        ns = info.get("pidns")
        if host == socket.gethostname() and ns is not None and ns != _pidns():
            where += " (in another PID namespace, e.g. another container)"
        return f"process {info.get('pid', '?')} on {where}"

    def _who(self, info: dict[str, Any] | None) -> str:
        """Who holds the lock, for messages (``info``: the lock file's details, :meth:`_read`)."""
        if info:
            return f"{self._describe(info)} holds {self.path} (since {info.get('started', '?')})"
        if info is not None:  # {}: the file is there but names no holder (empty, not our JSON)
            return (
                f"a process holds the kernel lock of {self.path} (the lock file does not name it: "
                f"it is empty or not a flwr-sheaf lock file)"
                if fcntl is not None
                else f"its lock file {self.path} names no holder (it is empty or not a flwr-sheaf "
                f"lock file)"
            )
        return (
            f"a process holds a lock on {self.path.parent} (its lock file {self.path} was "
            f"removed or replaced while it ran)"
        )

    def _busy(self, info: dict[str, Any] | None, why: str = "") -> LockedError:
        run = (info or {}).get("run_id")
        stop = f"; it is Flower run {run}: stop it with `flwr stop {run}` (`flwr ls` lists runs)"
        return LockedError(
            f"{self.key} {self.path.parent} is in use by another run: {self._who(info)}{why}"
            f"{stop if run is not None else ''}; wait for it to end or use another {self.key} (remove "
            f"the lock file only if that process is not a flwr-sheaf run)"
        )

    def _peek(self) -> dict[str, Any] | None:
        """The lock file's details, read without taking or creating it (None: none there)."""
        try:
            fd = _open_lock_file(self.path, self.key, create=False)
        except OSError:
            return None
        if fd is None:
            return None
        try:
            return self._read(fd) or {}  # there, but naming no holder: {}
        finally:
            os.close(fd)

    @staticmethod
    def _read(fd: int) -> dict[str, Any] | None:
        """The lock file's details (its first 4 KiB): None when it is empty, ``{}`` when it is not a JSON
        object of at most that size."""
        data = os.pread(fd, _LOCK_MAX + 1, 0)
        if not data.strip():
            return None
        if len(data) > _LOCK_MAX:  # not ours (ours is one short line): never read further
            return {}
        try:
            info = json.loads(data)
        except (ValueError, RecursionError):
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
        pid, ns = info.get("pid"), info.get("pidns")
        if (
            info.get("host") == socket.gethostname()
            and isinstance(pid, int)
            and not isinstance(pid, bool)
            and (ns is None or ns == _pidns())
            and info.get("boot_id") in (None, _boot_id())
        ):  # this kernel and PID namespace (or a lock that does not say): the pid can be asked; a
            # lock naming another boot_id is another machine's that has the same host name (the
            # initial PID namespace has the same inode on every Linux kernel), or of an earlier boot
            if pid == os.getpid():  # this process does not hold it (_HELD): an earlier one's
                return (
                    f"it names this very process (pid {pid}), which does not hold it: it was left by "
                    f"an earlier process that had the same pid"
                )
            if not _pid_alive(pid):
                return f"its process {pid} no longer runs"
        return None

    # ------------------------------------------------------------------ acquire / release
    def acquire(self) -> DirLock:
        """Take the lock (taking over a stale one with a warning); returns self.

        Raises:
            LockedError: see the class docstring.
        """
        if self.path in _HELD:
            raise self._busy(_HELD[self.path]._mine(), " (this same process: two runs at once)")
        dfd, free = _flock_dir(self.path.parent, fcntl.LOCK_EX if fcntl is not None else 0)
        if not free:  # a live run holds the directory, whatever became of its lock file
            raise self._busy(self._peek())
        try:
            st = os.fstat(dfd) if dfd is not None else os.stat(self.path.parent)
            self._dir_ident = (st.st_dev, st.st_ino)
            self._acquire_file()
        except BaseException:
            if dfd is not None:
                os.close(dfd)
            raise
        self._dir_fd = dfd
        return self

    def _acquire_file(self) -> None:
        """:meth:`acquire`'s lock file part (the directory's ``flock`` already held)."""
        for _ in range(100):  # retried only when the file was replaced between open and flock
            existed = os.path.lexists(self.path)
            fd = _open_lock_file(self.path, self.key, create=True)
            assert fd is not None, "created"
            try:
                if fcntl is not None:
                    try:
                        _flock_nb(fd, fcntl.LOCK_EX)
                    except BlockingIOError:
                        raise self._busy(self._read(fd) or {}) from None
                    try:  # the holder we waited on may have removed the file: lock the one at the path
                        a, b = os.fstat(fd), os.lstat(self.path)
                        same = (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
                    except FileNotFoundError:
                        same = False
                    if not same:
                        os.close(fd)
                        fd = -1
                        continue
                info = self._read(fd)
                if (
                    not info and existed and fcntl is not None
                ):  # the kernel lock is free: a leftover
                    log.warning(
                        "taking over the leftover lock file %s: it is %s and no process holds its "
                        "kernel lock (a run that died while writing it, or not written by flwr-sheaf)",
                        self.path,
                        "empty" if info is None else "not a flwr-sheaf lock (no JSON object in it)",
                    )
                elif info is not None:  # a lock file without a live flock: its holder died, or
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
            st = os.fstat(fd)
            self._fd, self._ident, self.held = fd, (st.st_dev, st.st_ino), True
            _HELD[self.path] = self
            return
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
        dfd, self._dir_fd = self._dir_fd, None
        try:  # in the directory held (by its fd: it may have been moved), never in one at the path now
            st = os.lstat(LOCK_NAME, dir_fd=dfd) if dfd is not None else os.lstat(self.path)
            if fd is not None and (st.st_dev, st.st_ino) == self._ident:
                # while still locked: a contender re-checks the inode
                if dfd is not None:
                    os.unlink(LOCK_NAME, dir_fd=dfd)
                else:
                    self.path.unlink()
        except OSError:
            pass
        if fd is not None:
            os.close(fd)
        if dfd is not None:
            os.close(dfd)

    def verify(self) -> None:
        """Check, before a write into the directory, that the lock file at :attr:`path` is still the
        one this run holds (same ``st_dev`` / ``st_ino`` as the held descriptor); one removed or
        replaced meanwhile is put back (with a warning) while this run holds the directory's
        ``flock``, so no other run can have taken the directory.

        Raises:
            LockedError: the directory itself was moved, removed or replaced since the lock was taken
                (its new path, if any, and what to do named: nothing more is written there), or
                this run does not hold the lock, or the lock file was removed or replaced and
                the directory's own lock is not available (a file system without ``flock`` on
                directories), so another run may be writing there (the file and the fix named).
        """
        if not self.held or self._fd is None:
            raise LockedError(f"{self.key} {self.path.parent}: this run does not hold {self.path}")
        self._verify_directory()
        try:
            st = os.lstat(self.path)
            now: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            now = None
        if now == self._ident:
            return
        what = "was removed" if now is None else "was replaced by another file"
        if self._dir_fd is None:
            raise LockedError(
                f"{self.key} {self.path.parent}: the lock file {self.path} {what} while this run held "
                f"it, and the directory itself cannot be locked on this file system, so another run may "
                f"be writing there; nothing more is written to {self.path.parent}: stop the other run, "
                f"or run again with another {self.key}"
            )
        log.warning(
            "%s %s: the lock file %s %s while this run held it; no other run could take the directory "
            "(its own lock is held): putting the lock file back",
            self.key,
            self.path.parent,
            self.path,
            what,
        )
        old = self._fd
        if now is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        fd = _open_lock_file(self.path, self.key, create=True)
        assert fd is not None, "created"
        if fcntl is not None:
            _flock_nb(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(self._mine()).encode())
        os.fsync(fd)
        st = os.fstat(fd)
        self._fd, self._ident = fd, (st.st_dev, st.st_ino)
        os.close(old)

    def _verify_directory(self) -> None:
        """Raise when the locked directory was moved, removed or replaced since :meth:`acquire` (its
        ``st_dev`` / ``st_ino`` at the path differ): this run's lock went with the old directory, so
        another run may hold the one at the path now."""
        try:
            st = os.stat(self.path.parent)
            now: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except OSError:
            now = None
        if self._dir_ident is None or now == self._dir_ident:
            return
        where: str | None = None
        for fd in (self._dir_fd, self._fd):  # Linux: the path the held directory has now
            if fd is None:
                continue
            try:
                where = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if fd == self._fd:
                where = str(Path(where.removesuffix(" (deleted)")).parent)
            break
        if where is None or where.endswith(" (deleted)") or not Path(where).is_dir():
            gone, then = "it was removed, with the files this run wrote there", "run it again"
        else:
            gone = f"it is now {where}, with the files this run wrote there"
            then = (
                f"continue it from its last checkpoint with resume-from='{where}'"
                if (Path(where) / "checkpoint.pkl").is_file()
                else f"run it again (no checkpoint was written in {where})"
            )
        raise LockedError(
            f"{self.key} {self.path.parent}: the directory was moved or replaced while this run held "
            f"it ({gone}); another run may now use {self.path.parent}, so this run writes nothing "
            f"more there and stops: {then}, and do not move or replace a directory a run is using"
        )
