"""A run's directories and the files in them, each file with one owner (docs/guarantees.md,
docs/resume.md).

- **The run directory**: :class:`RunDir`, :func:`preflight` and :func:`open_run` (each refusal names
  the key, the path and the fix); :data:`RUN_FILES`: every file read back, with its one reader.
- **The locks**: :class:`DirLock` (``<directory>/.lock``); :func:`live_holder`; :func:`main`
  (``main([DIR])``, asked by ``scripts/main.sh``) exits 1 if a live run holds ``DIR``.
- **The checkpoints**: :class:`Checkpointer` writes the server's sealed checkpoint (header and
  SHA-256: :func:`~flwr_sheaf.integrity.write_sealed`) and restores it; :func:`load_checkpoint`
  verifies one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord

from .config import KEYS, ConfigError, RunConfig, config_differences, resume_identity
from .integrity import read_sealed, write_sealed
from .protocol import RESUME_FRESH, RESUME_ROUND, RESUME_STATE_ROUNDS, pack_arrays
from .schema import ResultsFileError, check_results
from .strategy.ledger import RunLedger
from .strategy.records import Node

try:  # POSIX; the kernel lock that dies with its process
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_NAME",
    "DirLock",
    "LockedError",
    "held_by_this_process",
    "live_holder",
    "Checkpointed",
    "REBUILT",
    "Checkpointer",
    "CheckpointWriteError",
    "open_run",
    "ACCURACY_PNG",
    "CHECKPOINT_NAME",
    "NODE_STATE_MARKER",
    "RESULTS_JSON",
    "RUN_FILES",
    "NoCheckpointError",
    "RunDir",
    "RunFile",
    "check_keep_previous",
    "check_node_state_dir",
    "check_writable_dir",
    "checkpoint_path",
    "claim_node_state_dir",
    "load_checkpoint",
    "preflight",
    "read_node_state_claim",
    "recorded_run_config",
    "resolve_dir",
]

log = logging.getLogger("flwr_sheaf")

RESULTS_JSON = "results.json"
"""The run's results in ``results-dir`` (docs/results-schema.md)."""
ACCURACY_PNG = "accuracy.png"
"""The accuracy plot ``write_results`` draws in ``results-dir``."""
CHECKPOINT_NAME = "checkpoint.pkl"
"""The server checkpoint in ``results-dir`` (docs/resume.md)."""
NODE_STATE_MARKER = "run.json"
"""The file in ``node-state-dir`` naming the run its node state belongs to."""
#: Subfolder prefix of an earlier run's files moved aside by ``overwrite = true``.
PREVIOUS_PREFIX = "previous-"
#: A folder :meth:`RunDir.move_aside` made (``previous-<UTC time>[-<n>]``).
_MOVED_ASIDE = re.compile(re.escape(PREVIOUS_PREFIX) + r"\d{8}T\d{6}Z(-\d+)?")
_STATE_FILE = re.compile(r"^round-\d+\.state$")
#: First line of a server checkpoint (the old headerless format starts with the pickle byte 0x80).
CHECKPOINT_MAGIC = b"flwr-sheaf server checkpoint v1\n"
#: 2: rounds and failures in the strategy's ``ledger`` (format 1's ``rounds``/``failures``: refused)
CHECKPOINT_FORMAT = 2
_CHECKPOINT_FIX = (
    "restore the file from a backup, resume from another checkpoint (resume-from), or start the "
    "run afresh in a new results-dir (or with overwrite=true)"
)
#: the most bytes read of a JSON record of a run (``run.json``) and of a ``results.json``
_RECORD_MAX, _RESULTS_MAX = 1 << 20, 1 << 30


# ------------------------------------------------------------------------------ locks
LOCK_NAME = ".lock"
"""A locked directory's lock file (:class:`DirLock`)."""
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
    """When this machine booted, in seconds since the epoch (Linux ``/proc/stat`` ``btime``)."""
    with suppress(OSError, ValueError):
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
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
    """The Flower run this process serves (in Flower's runtime, not ``LocalGrid``), or None."""
    if not any(m in sys.modules for m in _FLOWER_RUNTIMES):
        return None
    ident = getattr(sys.modules.get("flwr.supercore.task_identity"), "TaskIdentity", None)
    return getattr(ident, "_run_id", None)


def _after_check(lock: DirLock) -> None:
    """Test hook between the take-over decision and writing this run's details."""


def held_by_this_process(directory: str | Path) -> DirLock | None:
    """The :class:`DirLock` this process holds on ``directory``, or None."""
    return _HELD.get(Path(directory).expanduser().resolve() / LOCK_NAME)


_NOFOLLOW, _CLOEXEC = getattr(os, "O_NOFOLLOW", 0), getattr(os, "O_CLOEXEC", 0)
#: the most bytes of a lock file read (one written here is one JSON line of about 200 bytes)
_LOCK_MAX = 4096


def _open_regular(path: Path, flags: int, *, one_name: bool = False) -> int:
    """An fd of the regular file ``path`` opened with ``flags``, never through a link nor waiting on
    a FIFO; ValueError (why named) for a link, not a regular file or (``one_name``) a hard link."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW on a link
            raise ValueError("a symbolic link") from None
        raise
    st = os.fstat(fd)
    what = None if stat.S_ISREG(st.st_mode) else "not a regular file"
    if what is None and one_name and st.st_nlink != 1:  # a write would reach the other names
        what = f"a hard link ({st.st_nlink} names share its content, e.g. a `cp -al` snapshot)"
    if what is not None:
        os.close(fd)
        raise ValueError(what)
    return fd


def _inode(path: Path, *, follow: bool = False) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``path`` (``stat`` if ``follow``, else ``lstat``), or None: none."""
    errors = OSError if follow else FileNotFoundError
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except errors:
        return None
    return st.st_dev, st.st_ino


def _open_lock_file(path: Path, key: str, *, create: bool) -> int | None:
    """An ``O_RDWR`` fd of the regular lock file ``path`` (created when ``create``), or None: none
    there; LockedError for a symbolic link, a directory, a hard link or not a regular file."""
    try:
        st = os.lstat(path)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise _not_a_lock_file(path, key, f"a symbolic link (to {os.readlink(path)!r})")
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise _not_a_lock_file(path, key, "a directory")
    flags = os.O_RDWR | _CLOEXEC | (os.O_CREAT if create else 0)
    try:
        return _open_regular(path, flags, one_name=True)
    except FileNotFoundError:
        if create:
            raise
        return None
    except IsADirectoryError:
        raise _not_a_lock_file(path, key, "a directory") from None
    except ValueError as exc:  # e.g. a link planted between lstat and open
        raise _not_a_lock_file(path, key, str(exc)) from None


def _not_a_lock_file(path: Path, key: str, what: str) -> LockedError:
    return LockedError(
        f"{key} {path.parent}: its lock file {path} is {what}, not a regular file written by flwr-sheaf; "
        f"a lock file is never followed through a link nor replaced, so the run is refused. Remove "
        f"{path} (rm {'-r ' if what == 'a directory' else ''}{path}) if no flwr-sheaf run uses "
        f"{path.parent}, or use another {key}"
    )


#: seconds a taken ``flock`` is retried: a :func:`live_holder` probe must not read as a live run
_PROBE_WAIT = 0.25


def _flock_nb(fd: int, mode: int, wait: float = _PROBE_WAIT) -> None:
    """``flock(fd, mode | LOCK_NB)``, retried for ``wait`` seconds (then BlockingIOError)."""
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
    """``(fd, locked)``: the directory ``flock``-ed (:func:`_flock_nb`); ``fd`` None where it cannot
    be (no ``fcntl``, no ``flock`` on directories) or is not ``locked`` (another process has it)."""
    if fcntl is None:  # pragma: no cover - Windows
        return None, True
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
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
    """Who holds ``directory``'s lock (a live run's process, host and start time), or None; nothing
    is created, taken or changed.

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
    """One run's lock on a directory: ``<directory>/.lock`` names the holder (pid, host, start time,
    Flower run) and is held with a kernel ``flock``, as is the directory; a dead holder's lock is
    taken over with a warning.

    Args:
        directory: the locked directory (must exist).
        key: the run-config key naming it, for messages (``results-dir``, ``node-state-dir``).
    """

    def __init__(self, directory: str | Path, key: str = "results-dir") -> None:
        self.path = Path(directory).expanduser().resolve() / LOCK_NAME
        self.key = key
        self.token = uuid.uuid4().hex
        self.held = False
        self._fd: int | None = None
        self._dir_fd: int | None = None
        self._ident: tuple[int, int] | None = None
        #: the directory's ``(st_dev, st_ino)`` when taken (one moved or replaced is detected)
        self._dir_ident: tuple[int, int] | None = None

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
        """Who holds the lock, for messages (``info``: :meth:`_read`)."""
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
        """The lock file's details: None when empty, ``{}`` when not a JSON object of <= 4 KiB."""
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
        """Why the holder of a lock whose ``flock`` is free is dead, or None if unknown."""
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
        ):  # this kernel and PID namespace: the pid can be asked (another boot_id: a namesake host,
            # whose initial PID namespace has the same inode, or an earlier boot)
            if pid == os.getpid():  # this process does not hold it (_HELD): an earlier one's
                return (
                    f"it names this very process (pid {pid}), which does not hold it: it was left by "
                    f"an earlier process that had the same pid"
                )
            if not _pid_alive(pid):
                return f"its process {pid} no longer runs"
        return None

    def acquire(self) -> DirLock:
        """Take the lock (taking over a stale one with a warning); returns self.

        Raises:
            LockedError: a live run holds it, or its holder cannot be shown dead (named).
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
        """:meth:`acquire`'s lock file part (the directory's ``flock`` held)."""
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
                    st = os.fstat(fd)
                    if _inode(self.path) != (st.st_dev, st.st_ino):  # the holder removed it
                        os.close(fd)
                        fd = -1
                        continue
                info = self._read(fd)
                if not info and existed and fcntl is not None:  # kernel lock free: a leftover
                    log.warning(
                        "taking over the leftover lock file %s: it is %s and no process holds its "
                        "kernel lock (a run that died while writing it, or not written by flwr-sheaf)",
                        self.path,
                        "empty" if info is None else "not a flwr-sheaf lock (no JSON object in it)",
                    )
                elif info is not None:  # no live flock: its holder died, or is on another kernel
                    why = self._holder_gone(info)
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
                ident = self._write_mine(fd)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
            self._fd, self._ident, self.held = fd, ident, True
            _HELD[self.path] = self
            return
        raise LockedError(  # pragma: no cover - 100 replacements in a row
            f"{self.key} {self.path.parent}: the lock file {self.path} keeps being replaced by other runs"
        )

    def _write_mine(self, fd: int) -> tuple[int, int]:
        """Write this run's details into the lock file ``fd``; returns its ``(st_dev, st_ino)``."""
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(self._mine()).encode())
        os.fsync(fd)
        st = os.fstat(fd)
        return st.st_dev, st.st_ino

    def release(self) -> None:
        """Remove the lock file and release the lock, if this run holds it."""
        if not self.held:
            return
        self.held = False
        _HELD.pop(self.path, None)
        fd, self._fd = self._fd, None
        dfd, self._dir_fd = self._dir_fd, None
        # in the directory held (by its fd: it may have been moved), never in one at the path now
        name = LOCK_NAME if dfd is not None else self.path
        with suppress(OSError):
            st = os.lstat(name, dir_fd=dfd)
            if fd is not None and (st.st_dev, st.st_ino) == self._ident:  # while still locked
                os.unlink(name, dir_fd=dfd)
        if fd is not None:
            os.close(fd)
        if dfd is not None:
            os.close(dfd)

    def verify(self) -> None:
        """Check, before a write into the directory, that this run still holds it; a lock file
        removed or replaced meanwhile is put back (with a warning) while the directory's ``flock``
        is held.

        Raises:
            LockedError: this run does not hold the lock; the directory was moved, removed or
                replaced; or the lock file was, where the directory cannot be locked.
        """
        if not self.held or self._fd is None:
            raise LockedError(f"{self.key} {self.path.parent}: this run does not hold {self.path}")
        self._verify_directory()
        now = _inode(self.path)
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
            with suppress(OSError):
                os.unlink(self.path)
        fd = _open_lock_file(self.path, self.key, create=True)
        assert fd is not None, "created"
        if fcntl is not None:
            _flock_nb(fd, fcntl.LOCK_EX)
        self._fd, self._ident = fd, self._write_mine(fd)
        os.close(old)

    def _verify_directory(self) -> None:
        """Raise LockedError if the locked directory was moved, removed or replaced."""
        now = _inode(self.path.parent, follow=True)
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
                if (Path(where) / CHECKPOINT_NAME).is_file()
                else f"run it again (no checkpoint was written in {where})"
            )
        raise LockedError(
            f"{self.key} {self.path.parent}: the directory was moved or replaced while this run held "
            f"it ({gone}); another run may now use {self.path.parent}, so this run writes nothing "
            f"more there and stops: {then}, and do not move or replace a directory a run is using"
        )


class NoCheckpointError(ConfigError, FileNotFoundError):
    """Resuming without a checkpoint: a one-line ConfigError that is also a FileNotFoundError."""


def check_keep_previous(value: Any) -> int:
    """``keep-previous`` (run-config key or ``write_results(keep_previous=...)``): an integer >= 0.

    Raises:
        ConfigError: anything else.
    """
    return int(KEYS["keep-previous"](value))


# ------------------------------------------------------------------------------ readers
def checkpoint_path(location: str | Path) -> Path:
    """``location`` itself when it names a file, else ``location/checkpoint.pkl``."""
    p = Path(location).expanduser()
    return p if p.suffix == ".pkl" else p / CHECKPOINT_NAME


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint dict written by :meth:`Checkpointer.save`, after its header, format and
    SHA-256 are verified (nothing is unpickled before: :func:`~flwr_sheaf.integrity.read_sealed`).

    Raises:
        NoCheckpointError: no checkpoint at ``path``.
        ConfigError: not a regular file; empty; not a flwr-sheaf checkpoint; another format;
            truncated or modified (the file and the fix named).
    """
    path = Path(path)
    _refuse_non_file_checkpoint(path)
    if not path.is_file():
        raise NoCheckpointError(
            f"no checkpoint at {path}: nothing to resume (run without resume first)"
        )
    fmt = CHECKPOINT_FORMAT
    with open(path, "rb") as fh:
        magic, meta_line = fh.readline(256), fh.readline(65536)
    header = re.fullmatch(rb"flwr-sheaf server checkpoint v(\d+)\n", magic)
    if header is not None and magic != CHECKPOINT_MAGIC and int(header.group(1)) > 1:
        _newer_checkpoint(path, f"header v{int(header.group(1))}")
    if magic != CHECKPOINT_MAGIC:
        why = (
            "is empty (0 bytes: truncated, e.g. a full disk or a killed copy)"
            if not magic
            else "has the old format (a bare pickle without header and SHA-256, written before "
            "flwr-sheaf checked checkpoint integrity): it cannot be verified, so it is not resumed"
            if magic[:1] == b"\x80"
            else "is not a flwr-sheaf server checkpoint (bad header: it was overwritten by another file)"
        )
        raise ConfigError(f"checkpoint {path} {why}; {_CHECKPOINT_FIX}")
    try:
        got = json.loads(meta_line).get("format")
    except (ValueError, AttributeError, RecursionError):
        got = None  # read_sealed names it
    if isinstance(got, (int, float)) and not isinstance(got, bool) and got > fmt:
        _newer_checkpoint(path, f"format {got!r}")
    if isinstance(got, (int, float)) and not isinstance(got, bool) and got < fmt:
        raise ConfigError(
            f"checkpoint {path} has format {got!r}, written by an older flwr-sheaf: this version "
            f"reads checkpoint format {fmt} only and cannot resume it. Finish that run with the "
            "flwr-sheaf version that wrote it, or start afresh in a new results-dir (or with "
            "overwrite=true)"
        )
    try:
        meta, data = read_sealed(
            path, CHECKPOINT_MAGIC, fmt, what="flwr-sheaf server checkpoint", error=ConfigError
        )
    except ConfigError as exc:
        raise ConfigError(f"checkpoint {exc}; {_CHECKPOINT_FIX}") from None
    ckpt = pickle.loads(data or b"")  # noqa: S301 - verified against its own SHA-256; the run's own file
    if (
        not isinstance(ckpt, dict)
        or ckpt.get("format") != fmt
        or ckpt.get("round") != meta.get("round")
    ):
        raise ConfigError(
            f"checkpoint {path} is not a flwr-sheaf checkpoint of format {fmt}; {_CHECKPOINT_FIX}"
        )
    return ckpt


def _refuse_non_file_checkpoint(path: Path) -> None:
    """Refuse a directory, FIFO, device or broken link in a checkpoint's place."""
    if os.path.lexists(path) and not path.is_file():
        raise ConfigError(
            f"checkpoint {path} is not a regular file (a directory, FIFO, device or broken link); "
            f"{_CHECKPOINT_FIX}"
        )


def _newer_checkpoint(path: Path, what: str) -> None:
    raise ConfigError(
        f"checkpoint {path} has {what}, written by a newer flwr-sheaf: this version reads checkpoint "
        f"format {CHECKPOINT_FORMAT} only, so it is not resumed. Upgrade flwr-sheaf (pip install -U "
        "flwr-sheaf, or the version that wrote it) to resume it"
    )


def _read_json(path: Path, limit: int) -> Any:
    """The JSON in the regular file ``path``, never read through a link nor waiting on a FIFO.

    Raises:
        ValueError: a link, not a regular file, larger than ``limit`` bytes, not JSON (why named).
        OSError: none there (FileNotFoundError), or it cannot be read.
    """
    fd = _open_regular(path, os.O_RDONLY)
    try:
        chunks: list[bytes] = []
        got = 0
        while got <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - got))):
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def recorded_run_config(path: Path) -> dict[str, Any]:
    """The run config recorded in a ``results.json`` (its ``config``) or a ``checkpoint.pkl``.

    Raises:
        ConfigError: the file cannot be read as one (the file and why named).
    """
    recorded: Any
    try:
        if path.suffix != ".json":
            recorded = load_checkpoint(path).get("config")
        else:
            parsed = _read_json(path, _RESULTS_MAX)
            recorded = check_results(parsed, str(path)).get("config")
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        if isinstance(exc, ResultsFileError):  # already "<file>: <field>: <problem>"
            raise ConfigError(str(exc)) from None
        raise ConfigError(f"{path} cannot be read ({exc})") from None
    if not isinstance(recorded, dict):
        raise ConfigError(f"{path} records no run config")
    return recorded


def read_node_state_claim(root: Path) -> dict[str, Any] | None:
    """``<root>/run.json`` (:func:`claim_node_state_dir`): the record (``results-dir``, ``started``,
    ``config`` a dict), or None when there is none.

    Raises:
        ConfigError: a link, not a regular file, larger than 1 MiB or not such a record (fix named).
    """
    path = root / NODE_STATE_MARKER
    try:
        info = _read_json(path, _RECORD_MAX)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
    else:
        if isinstance(info, dict) and isinstance(info.get("config"), dict):
            return info
        why = "not a JSON object with a run config"
    raise ConfigError(
        f"node-state-dir {root}: {path} is not a flwr-sheaf node-state record ({why}), so whose node "
        f"state {root} holds cannot be told; remove it (rm {path}) if that node state is the one this "
        "run continues, or use another node-state-dir"
    )


@dataclass(frozen=True)
class RunFile:
    """One file the package reads back from a run's directory.

    Attributes:
        name: its name in the directory.
        where: the run-config key of the directory (``results-dir``, ``node-state-dir``).
        read: its one reader, ``read(path)``, raising a ``ConfigError`` (or :class:`LockedError`)
            naming ``path`` for a damaged file; None: never read.
        marks_run: its presence means the directory holds a run (refused without ``overwrite``).
        moved: ``overwrite`` moves it into ``previous-<UTC time>/``.
    """

    name: str
    where: str
    read: Callable[[Path], Any] | None
    marks_run: bool = False
    moved: bool = False


RUN_FILES: tuple[RunFile, ...] = (
    RunFile(RESULTS_JSON, "results-dir", recorded_run_config, marks_run=True, moved=True),
    RunFile(CHECKPOINT_NAME, "results-dir", load_checkpoint, marks_run=True, moved=True),
    RunFile(ACCURACY_PNG, "results-dir", None, moved=True),
    RunFile(LOCK_NAME, "results-dir", lambda p: live_holder(p.parent, "results-dir")),
    RunFile(LOCK_NAME, "node-state-dir", lambda p: live_holder(p.parent, "node-state-dir")),
    RunFile(NODE_STATE_MARKER, "node-state-dir", lambda p: read_node_state_claim(p.parent)),
)
"""Every file read back from a run's directories, with its reader."""
#: Files whose presence means that ``results-dir`` holds another run's results.
RESULT_FILES = tuple(f.name for f in RUN_FILES if f.marks_run)
#: Files ``overwrite = true`` moves into ``previous-<UTC time>/``.
MOVED_FILES = tuple(f.name for f in RUN_FILES if f.moved)


# ------------------------------------------------------------------------------ paths
def _path_error(key: str, path: str | Path, exc: BaseException) -> ConfigError:
    """The ConfigError (key, path, fix) for an OSError or ``RuntimeError: Symlink loop``."""
    if isinstance(exc, RuntimeError) or getattr(exc, "errno", None) == 40:  # ELOOP
        return ConfigError(
            f"{key}={str(path)!r}: {path} runs into a symbolic-link loop (a link that points, "
            f"directly or through others, back to itself); replace the link with a real directory or "
            f"set {key} to another path"
        )
    what = getattr(exc, "strerror", None) or str(exc)
    return ConfigError(f"{key}={str(path)!r}: {what}; set {key} to a directory you can write")


def resolve_dir(key: str, path: str | Path) -> Path:
    """``path`` with ``~`` expanded and resolved.

    Raises:
        ConfigError: a symbolic-link loop, or an OS error (key, path and fix named).
    """
    try:
        return Path(path).expanduser().resolve()
    except (RuntimeError, OSError) as exc:
        raise _path_error(key, path, exc) from None


def check_writable_dir(key: str, path: str | Path, *, create: bool = False) -> Path:
    """``path`` resolved, after checking that it is (or can be created as) a writable directory;
    ``create``: create it (and its parents) now; ``key``: the run-config key naming it, for messages.

    Raises:
        ConfigError: a path component is a file, the directory (or its nearest existing parent) is
            not writable, or it cannot be created (key, path and fix named).
    """
    p = resolve_dir(key, path)
    fix = f"set {key} to a directory you can write"
    try:
        p.exists()
    except OSError as exc:  # ELOOP of a link loop below a resolved prefix, EACCES, ...
        raise _path_error(key, path, exc) from None
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


# ------------------------------------------------------------------------------ the run directory
class RunDir:
    """A run's directory: where its files go, its lock, its ``previous-*`` folders.

    A context manager (:func:`preflight`). Left with an exception after ``overwrite = true`` moved
    an earlier run's files aside, it moves them back if the new run wrote none of its own (noted on
    the exception and logged); ``keep-previous`` is applied on leaving.

    Args:
        path: the directory (``~`` expanded, resolved; need not exist yet).
        key: the run-config key (or argument) naming it, for messages (``results-dir``, ``out_dir``).

    Attributes:
        locks: the held :class:`DirLock` of ``results-dir`` (and of ``node-state-dir``).
        previous_run: ``results.json``'s ``previous_run`` (``{"moved_to", "files"}``), or None.
        trained_before: ``{partition-id: last round it trained}`` (:func:`open_run`).
        checkpointer: the run's :class:`Checkpointer` (:func:`open_run`), or None.

    Raises:
        ConfigError: ``path`` runs into a symbolic-link loop.
    """

    def __init__(self, path: str | Path, key: str = "results-dir") -> None:
        self.given, self.key = str(path), key
        self.path = resolve_dir(key, path)
        self.checkpoint = self.path / CHECKPOINT_NAME
        self.keep_previous = 0  # keep-previous, applied on leaving
        self.locks: list[DirLock] = []
        self.previous_run: dict | None = None
        self.trained_before: dict[int, int] = {}
        self.checkpointer: Checkpointer | None = None
        self.protect: list[Path] = []  # previous-* folders never pruned (resume-from's)

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leave the run (class docstring); the locks are released."""
        try:
            if exc is not None and self.previous_run is not None:
                self._after_failed_run(exc)
            if self.keep_previous and self.previous_run is not None:
                newest = Path(self.previous_run["moved_to"])
                self.prune(self.keep_previous, newest, self.protect)
        finally:
            for lock in reversed(self.locks):  # the node-state-dir's first
                lock.release()
            self.locks = []

    def _after_failed_run(self, exc: BaseException) -> None:
        """The earlier run's files after this run ended with ``exc`` (class docstring)."""
        assert self.previous_run is not None
        out, folder = self.path, Path(self.previous_run["moved_to"])
        names = list(self.previous_run["files"])
        mine = [n for n in MOVED_FILES if (out / n).exists()]
        if not mine:
            where = self.move_back(folder, names)
            if where.startswith("nothing"):
                where = f"were moved back into {out} (the results-dir is as before this run)"
                self.previous_run = None
        else:
            where = f"are in {folder} (this run wrote {', '.join(mine)} into {out}" + (
                f"; continue the earlier run with resume-from={str(folder / CHECKPOINT_NAME)!r})"
                if CHECKPOINT_NAME in names
                else ")"
            )
        text = f"the earlier run's {', '.join(names)}, moved aside by overwrite=true, {where}"
        log.warning("this run ended with an error: %s", text)
        exc.add_note(f"flwr-sheaf: {text}")

    def run_files(self) -> list[Path]:
        """The files there that mean it holds a run (:data:`RESULT_FILES`)."""
        return [self.path / n for n in RESULT_FILES if (self.path / n).exists()]

    def lock(self) -> DirLock:
        """Take the directory's lock (LockedError: as :meth:`DirLock.acquire`); returns it."""
        return DirLock(self.path, self.key).acquire()

    def previous(self) -> list[Path]:
        """Its ``previous-*`` folders, oldest first (by the UTC time in their names, then count)."""

        def order(p: Path) -> tuple[str, int]:
            stamp, _, n = p.name[len(PREVIOUS_PREFIX) :].partition("-")
            return stamp, int(n) if n.isdigit() else 1

        try:
            found = [
                p
                for p in self.path.iterdir()
                if p.name.startswith(PREVIOUS_PREFIX) and p.is_dir() and not p.is_symlink()
            ]
        except OSError:
            return []
        return sorted(found, key=order)

    def move_aside(
        self, names: Sequence[str] = MOVED_FILES, *, keep: Any = 0, protect: Sequence[Path] = ()
    ) -> tuple[Path, list[str]] | None:
        """Move the files ``names`` that exist into a new ``previous-<UTC time>/``, all or none;
        return ``(the new folder, the names moved)``, or None when none exists.

        Args:
            keep: ``keep-previous`` (checked first): then :meth:`prune` to the newest ``keep``
                folders (the new one counts; never one in ``protect``); 0: all.

        Raises:
            ConfigError: a bad ``keep``, or a file cannot be moved (where every file is now named).
        """
        keep = check_keep_previous(keep)
        present = [n for n in names if os.path.lexists(self.path / n)]  # a dangling link too
        if not present:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        folder, i = self.path / f"{PREVIOUS_PREFIX}{stamp}", 1
        while True:
            try:
                folder.mkdir()
                break
            except FileExistsError:
                i += 1
                folder = self.path / f"{PREVIOUS_PREFIX}{stamp}-{i}"
            except OSError as exc:
                raise _path_error(self.key, self.given, exc) from None
        done: list[str] = []
        try:
            for n in present:
                os.replace(self.path / n, folder / n)
                done.append(n)
        except OSError as exc:
            where = self.move_back(folder, done)
            raise ConfigError(
                f"{self.key}={self.given!r}: the earlier run's {n} cannot be moved into {folder} "
                f"({exc.strerror or exc}); {where}, so that run is never left split. Make "
                f"{self.path / n} movable (e.g. chattr -i {self.path / n}) or use another {self.key}"
            ) from exc
        if keep:
            self.prune(keep, folder, protect)
        return folder, present

    def move_back(self, folder: Path, names: Sequence[str]) -> str:
        """Move ``names`` from ``folder`` back, then remove ``folder``; returns where they are, as a
        clause (``"nothing was moved: ..."``, or where each one stays)."""
        back: list[str] = []
        try:
            for n in names:
                os.replace(folder / n, self.path / n)
                back.append(n)
            folder.rmdir()
        except OSError as err:
            left = [n for n in names if n not in back]
            return (
                f"{', '.join(left)} stay in {folder} (moving them back failed: "
                f"{err.strerror or err}), the rest in {self.path}"
            )
        return f"nothing was moved: the earlier run's files are in {self.path} as before"

    def prune(self, keep: int, newest: Path, protect: Sequence[Path] = ()) -> None:
        """Remove the oldest ``previous-*`` folders beyond the newest ``keep`` (only those
        :meth:`move_aside` made, never ``newest`` nor one in ``protect``), each logged."""
        folders = [
            p
            for p in self.previous()
            if p != newest and p not in protect and _MOVED_ASIDE.fullmatch(p.name)
        ]
        folders.append(newest)
        for old in folders[: max(len(folders) - keep, 0)]:
            try:
                held = ", ".join(sorted(p.name for p in old.iterdir())) or "empty"
                shutil.rmtree(old)
            except OSError as exc:
                log.warning("keep-previous=%d: could not remove %s (kept): %s", keep, old, exc)
                continue
            log.warning(
                "keep-previous=%d: removed %s (an earlier run's files: %s), the oldest beyond the "
                "newest %d",
                keep,
                old,
                held,
                keep,
            )

    @contextmanager
    def writing(
        self,
        names: Sequence[str] = (),
        *,
        overwrite: bool = False,
        keep: Any = 0,
        claim: DirLock | None = None,
    ) -> Iterator[Path]:
        """Held while writing into the directory (``write_results``); yields it. Its lock is taken
        (unless held, or ``claim``: :func:`~flwr_sheaf.results.check_results_dir`'s) and verified;
        ``names`` are moved aside first (:meth:`move_aside`), with ``overwrite`` (the lock not held
        before) an earlier ``results.json`` / ``accuracy.png`` too.

        Raises:
            LockedError: another live run holds it, or it was moved or removed while this one held it.
            ConfigError: as :meth:`move_aside`.
        """
        keep = check_keep_previous(keep)
        held = None if claim is not None else held_by_this_process(self.path)
        if held is None and claim is None:
            self.path.mkdir(parents=True, exist_ok=True)
        lock = claim or held or self.lock()
        try:
            lock.verify()
            if overwrite and held is None:  # an earlier write_results' files: moved, not replaced
                names = [RESULTS_JSON, ACCURACY_PNG, *names]
            moved = self.move_aside(names, keep=keep)
            if moved is not None:
                log.warning(
                    "overwrite=True: moved the earlier %s from %s into %s (nothing deleted)",
                    ", ".join(moved[1]),
                    self.path,
                    moved[0],
                )
            yield self.path
        finally:
            if held is None:
                lock.release()


# ------------------------------------------------------------------------------ node-state-dir
def _state_partitions(root: Path) -> list[str]:
    """Names of the ``partition-*`` folders of ``root`` holding state files."""
    if not root.is_dir():
        return []
    return [
        p.name
        for p in sorted(root.iterdir())
        if p.name.startswith("partition-")
        and p.is_dir()
        and any(_STATE_FILE.match(f.name) for f in p.iterdir())
    ]


def check_node_state_dir(
    root: Path, given: str, run_config: Mapping[str, Any], resuming: bool
) -> None:
    """Refuse a ``node-state-dir`` ``root`` (``given`` as in the run config) that holds another run's
    node state; ``run_config``: ``RunConfig.to_dict()``; ``resuming``: ``resume`` / ``resume-from``.

    Raises:
        ConfigError: a fresh run over another run's node state; a resumed run over another run
            config's (keys named); a damaged ``run.json``.
    """
    marker = read_node_state_claim(root) if root.is_dir() else None
    parts = _state_partitions(root)
    if marker is None and not parts:
        return
    owner = ""
    if marker:
        owner = (
            f" (recorded in {root / NODE_STATE_MARKER}: the run of results-dir "
            f"{marker.get('results-dir', '?')!r} started {marker.get('started', '?')}, seed "
            f"{marker['config'].get('seed', 0)!r})"
        )
    if not resuming:
        files = f"state files of {', '.join(parts)}" if parts else "no state files yet"
        raise ConfigError(
            f"node-state-dir={given!r}: {root} holds the node state of another run{owner}, {files}; "
            f"a fresh run must not start from it (its nodes would load that state, or refuse it in every "
            f"round). Use another node-state-dir, remove {root} to start afresh, or set resume=true "
            f"to continue that run"
        )
    if marker:
        diff = config_differences(marker["config"], resume_identity(run_config))
        if diff:
            text = ", ".join(f"{k}={a!r} there, {b!r} now" for k, (a, b) in diff.items())
            raise ConfigError(
                f"node-state-dir={given!r}: {root} holds the node state of another run config "
                f"({text}){owner}; point node-state-dir at the stopped run's node state"
            )


def claim_node_state_dir(root: Path, run_config: Mapping[str, Any], results_dir: Path) -> None:
    """Record in ``root/run.json`` (atomically; OSError if it cannot) whose node state this is."""
    root.mkdir(parents=True, exist_ok=True)
    data = {
        "results-dir": str(results_dir),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": resume_identity(run_config),
    }
    tmp = root / f".{NODE_STATE_MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, root / NODE_STATE_MARKER)


# ------------------------------------------------------------------------------ preflight
def _no_checkpoint(config: RunConfig, out: Path) -> None:
    """Refuse resuming without a checkpoint, naming what works instead."""
    path = checkpoint_path(config.resume_from or out)
    if path.is_file():
        return
    _refuse_non_file_checkpoint(path)
    key = f"resume-from={config.resume_from!r}" if config.resume_from else "resume=true"
    hint = ""
    moved = [p / CHECKPOINT_NAME for p in RunDir(out).previous() if (p / CHECKPOINT_NAME).is_file()]
    if moved and not config.resume_from:
        hint = (
            f"; an earlier run's checkpoint was moved (overwrite=true) into {moved[-1]}: to continue "
            f"that run set resume-from={str(moved[-1])!r} (resume=true reads only {path})"
        )
    if (path.parent / RESULTS_JSON).is_file():
        raise NoCheckpointError(
            f"{key}: {path.parent} holds a finished run's results.json but no checkpoint.pkl (that run "
            f"had checkpoint-every=0, or ended before its first checkpoint), so it cannot be extended. "
            f"Run afresh with the rounds you want in another results-dir (or with overwrite=true, which "
            f"moves its files into {path.parent}/previous-<time>/); set checkpoint-every >= 1 for a "
            f"run you may extend later{hint}"
        )
    raise NoCheckpointError(
        f"{key}: no checkpoint at {path}: nothing to resume (run without resume first, or point "
        f"resume-from at the stopped run's checkpoint.pkl){hint}"
    )


def _check_resume_from_free(config: RunConfig, source: RunDir, out: Path) -> None:
    """Refuse (LockedError) ``resume-from`` a directory a live run holds: its checkpoint changes."""
    where = source.path
    if where == out or held_by_this_process(where) or not where.is_dir():
        return
    holder = live_holder(where, "resume-from")
    if holder is not None:
        raise LockedError(
            f"resume-from={config.resume_from!r}: {where} is still in use by a live run: {holder}; "
            f"its checkpoint changes as that run goes on, so it is not resumed while it runs: wait for "
            f"that run to end (or stop it), then resume from it"
        )


def _check_resume_into(config: RunConfig, out: Path, old: Sequence[Path]) -> None:
    """Refuse ``resume-from`` into a ``results-dir`` whose files ``old`` are another config's."""
    ckpt = checkpoint_path(config.resume_from)
    resumed = recorded_run_config(ckpt)  # readable: checked by _no_checkpoint and load_checkpoint
    why = []
    for path in old:
        try:
            diff = config_differences(recorded_run_config(path), resumed)
        except ConfigError as exc:
            why.append(f"{path.name} cannot be read as this run's ({exc})")
            continue
        if diff:
            text = ", ".join(
                f"{k}={a!r} there, {b!r} in the checkpoint" for k, (a, b) in diff.items()
            )
            why.append(f"{path.name} records another run config ({text})")
    if why:
        names = ", ".join(p.name for p in old)
        raise ConfigError(
            f"resume-from={config.resume_from!r}: results-dir={config.results_dir!r} ({out}) holds "
            f"another run's {names} ({'; '.join(why)}); the resumed run would replace them. Set "
            f"results-dir to another directory (an empty one, or {ckpt.parent} to continue that run "
            f"where it is), or add overwrite=true to move {out}'s files into {out}/previous-<time>/ "
            f"(nothing deleted)"
        )


def _check_overwrite_with_resume(config: RunConfig, resuming: bool, source: RunDir | None) -> None:
    """Refuse ``overwrite=true`` with ``resume=true`` or a ``resume-from`` of the results-dir."""
    if not (config.overwrite and resuming):
        return
    if source is not None and source.path != resolve_dir("results-dir", config.results_dir):
        return
    which = "resume=true" if config.resume else f"resume-from={config.resume_from!r}"
    raise ConfigError(
        f"overwrite=true and {which} contradict each other: overwrite starts a fresh run (moving "
        f"the earlier run's files aside), {which.split('=')[0]} continues the checkpointed run; set "
        f"only one of them"
        + (
            ""
            if config.resume
            else " (overwrite=true with resume-from applies only to another results-dir: it moves "
            "that directory's files aside)"
        )
    )


def resume_without_node_state(out: Path, before: str) -> str:
    """Why a simulated run in ``out`` cannot be resumed without ``node-state-dir`` (the stopped
    run's was ``before``; ``""``: not set) and what works instead, in one sentence."""
    fix = (
        f"set node-state-dir={before!r}, where the stopped run's nodes wrote their state"
        if before
        else f"run it afresh with overwrite=true (moves {out}'s files into {out}/previous-<time>/); "
        "set node-state-dir=<dir> in a run you may want to continue after a stop"
    )
    return (
        f"resume: the stopped run in {out} cannot continue without its nodes' state, and in "
        f"Flower's simulation engine a node keeps its state in memory only unless the run config "
        f"node-state-dir names a directory (the stopped run's: {before or 'not set'}; this run's: "
        f"not set): {fix}"
    )


def _check_fresh_run_into(
    config: RunConfig, run: RunDir, old: Sequence[Path], simulation: bool = False
) -> None:
    """Refuse a fresh run into a ``results-dir`` holding another run's files ``old``."""
    kept = None  # the checkpointed run's node-state-dir ("": none); None: no readable checkpoint
    if run.checkpoint.exists():
        try:
            kept = str(load_checkpoint(run.checkpoint)["config"].get("node-state-dir", ""))
        except Exception:  # noqa: BLE001 - a broken checkpoint: resuming names its problem
            pass
    if kept or (kept is not None and not simulation):
        how = (
            "resume=true to continue that run, or overwrite=true to move its files into "
            f"{run.path}/previous-<time>/ and start afresh"
        )
    else:
        why = (
            "its nodes kept their state in memory only (no node-state-dir)"
            if kept is not None
            else "its checkpoint.pkl cannot be read"
            if run.checkpoint.exists()
            else "it has no checkpoint.pkl"
        )
        how = (
            f"or overwrite=true to move its files into {run.path}/previous-<time>/ and start "
            f"afresh ({why}, so resume=true cannot continue it)"
        )
    raise ConfigError(
        f"results-dir={config.results_dir!r}: {run.path} already holds another run's results "
        f"({', '.join(p.name for p in old)}); a fresh run would replace them. Use another "
        f"results-dir, {how}"
    )


def preflight(config: RunConfig, simulation: bool = False) -> RunDir:
    """Check every directory the run writes, take its locks, move an overwritten run's files aside;
    return the locked :class:`RunDir` of ``results-dir`` (``with preflight(config) as run:``).

    Args:
        simulation: Flower's simulation engine (nodes keep state only in ``node-state-dir``).

    Raises:
        ConfigError: (key, path and fix named) ``results-dir``, ``node-state-dir`` or
            ``tracking-dir`` cannot be written; ``overwrite`` with ``resume``; resuming without a
            checkpoint; ``results-dir`` or ``node-state-dir`` holds another run's files; a file
            cannot be moved aside.
        LockedError: a live run holds ``results-dir``, ``node-state-dir`` or the ``resume-from`` source.
    """
    resuming = config.resume or bool(config.resume_from)
    source = None  # the directory of the checkpoint resume-from names
    if config.resume_from:
        source = RunDir(checkpoint_path(config.resume_from).parent, "resume-from")
    _check_overwrite_with_resume(config, resuming, source)
    # tracking-dir without tracking: warned once, by apps.server_app.run_config_warnings
    state_root = None
    if config.node_state_dir:
        state_root = check_writable_dir("node-state-dir", config.node_state_dir)
    if config.tracking.strip():
        resolve_dir("results-dir", config.results_dir)  # a link loop named by its key first
        check_writable_dir(  # tracking.tracking_dir's default, unresolved
            "tracking-dir", config.tracking_dir or str(Path(config.results_dir) / "tracking")
        )
    run = RunDir(check_writable_dir("results-dir", config.results_dir, create=True))
    run.keep_previous = config.keep_previous
    try:
        run.locks.append(run.lock())
        if resuming:
            _no_checkpoint(config, run.path)
        if source is not None:
            _check_resume_from_free(config, source, run.path)
        old = run.run_files()
        if old and source is not None and source.path != run.path:  # into another results-dir
            if source.path.parent == run.path:
                run.protect.append(source.path)  # a previous-* folder of out: never pruned
            if not config.overwrite:
                _check_resume_into(config, run.path, old)
        if old and not resuming and not config.overwrite:
            _check_fresh_run_into(config, run, old, simulation)
        # before anything is moved: a refusal leaves results-dir as it was
        if state_root is not None:
            state_root.mkdir(parents=True, exist_ok=True)
            run.locks.append(DirLock(state_root, "node-state-dir").acquire())
            if not resuming:  # a resumed run's: after its checkpoint check (server_app)
                check_node_state_dir(state_root, config.node_state_dir, config.to_dict(), False)
        if old and (not resuming or config.overwrite):  # overwrite=true: moved aside, never deleted
            moved = run.move_aside()  # keep-previous: on leaving (RunDir.__exit__)
            if moved is not None:
                run.previous_run = {"moved_to": str(moved[0]), "files": moved[1]}
                log.warning(
                    "overwrite=true: moved the earlier run's %s from %s into %s (nothing deleted; "
                    "moved back if this run ends with an error before writing its own)",
                    ", ".join(moved[1]),
                    run.path,
                    moved[0],
                )
        if state_root is not None and not resuming:
            claim_node_state_dir(state_root, config.to_dict(), run.path)
    except BaseException as exc:
        run.__exit__(type(exc), exc, exc.__traceback__)  # moved files back, locks released
        raise
    return run


# ------------------------------------------------------------------------------ checkpoints
REBUILT = frozenset(
    {
        "nodes",
        "exchange",
        "extra_train_config",
        "extra_evaluate_config",
        "alpha",
        "discovery_timeout",
        "checkpointer",
        "resume_check",
        "round_callbacks",
        "requested_rounds",
    }
)
"""Strategy attributes a checkpoint does not store: rebuilt from the run config, by discovery, per
call of ``start``, or the checkpointer itself."""


class Checkpointed(Protocol):
    """A strategy as a checkpoint sees it: attributes (``vars``, less :data:`REBUILT`) and nodes."""

    @property
    def nodes(self) -> Mapping[int, Node]: ...  # noqa: D102


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (file, round, OS reason and fix named); the one
    already there, if any, is unchanged."""


class Checkpointer:
    """Writes the strategy's checkpoints (sealed, atomically) and restores one (docs/resume.md).

    Args:
        directory: where ``checkpoint.pkl`` is written (the run's ``results-dir``).
        config: the run config's ``{key: value}`` (``RunConfig.to_dict()``).
        every: write after every this many rounds and after the last one (0 = never).
        resume_from: a checkpoint file or directory to continue from (None = a fresh run).

    Raises:
        ValueError: ``every < 0``.
    """

    def __init__(
        self,
        directory: str | Path,
        config: Mapping[str, Any],
        every: int = 1,
        resume_from: str | Path | None = None,
    ) -> None:
        if int(every) != every or every < 0:
            raise ValueError(f"checkpoint-every must be an integer >= 0, got {every!r}")
        self.path = Path(directory).expanduser() / CHECKPOINT_NAME
        self.config = dict(config)
        self.every = int(every)
        self.resume_from = None if resume_from is None else checkpoint_path(resume_from)
        self.restored_round = 0  # the restored checkpoint's round (0: a fresh run)
        self.previous_wall_seconds = 0.0  # of the run's stopped parts before it
        self._checked: dict[str, Any] | None = None

    def check(self, strategy: Checkpointed, num_rounds: int) -> dict[str, Any] | None:
        """Load and check the checkpoint to resume from against the run, before any message; returns
        it, or None for a fresh run.

        Raises:
            FileNotFoundError: resuming without a checkpoint.
            ConfigError: another format or strategy class; run-config keys that differ outside
                :data:`~flwr_sheaf.config.RESUME_MUTABLE_KEYS`; a checkpoint past the last round.
        """
        if self.resume_from is None:
            return None
        ckpt = load_checkpoint(self.resume_from)
        diff = config_differences(ckpt["config"], self.config)
        if diff:
            text = ", ".join(
                f"{k}={a!r} in the checkpoint, {b!r} now" for k, (a, b) in diff.items()
            )
            raise ConfigError(
                f"resume from {self.resume_from}: the run config differs ({text}); only "
                f"num-server-rounds, timeouts, results-dir and checkpoint settings may change"
            )
        cls = f"{type(strategy).__module__}.{type(strategy).__qualname__}"
        if ckpt["strategy"] != cls:
            raise ConfigError(
                f"{self.resume_from} is a {ckpt['strategy']} run, this run builds {cls}"
            )
        if ckpt["round"] > num_rounds:
            raise ConfigError(
                f"num-server-rounds={num_rounds}: the checkpoint {self.resume_from} is already at "
                f"round {ckpt['round']}"
            )
        self._checked = ckpt
        return ckpt

    def restore(self, strategy: Checkpointed, num_rounds: int) -> tuple[int, ArrayRecord | None]:
        """Put the checkpointed state back into ``strategy`` (after its discovery); returns
        ``(next server round, global arrays or None)``, ``(1, None)`` for a fresh run.

        Raises:
            FileNotFoundError, ConfigError: see :meth:`check`.
            RuntimeError: a rediscovered node reports other data than in the checkpointed run.
        """
        ckpt = self._checked if self._checked is not None else self.check(strategy, num_rounds)
        if ckpt is None:
            return 1, None
        for pid, saved in ckpt["nodes"].items():
            now = {
                k: v for k, v in asdict(strategy.nodes[pid].info).items() if k != "num_partitions"
            }
            then = {k: v for k, v in saved.items() if k != "num_partitions"}
            if now != then:
                bad = {k: (then[k], now[k]) for k in now if now[k] != then[k]}
                raise RuntimeError(
                    f"resume: partition-id {pid} reports {bad} (checkpointed, now); the SuperNodes "
                    f"must serve the same zoo and data as the stopped run"
                )
        for name, value in ckpt["state"].items():
            held = getattr(strategy, name, None)
            if isinstance(held, RunLedger):  # in place: the exchange records into this ledger
                vars(held).update(vars(value))
            else:
                setattr(strategy, name, value)
        self.restored_round = int(ckpt["round"])
        self.previous_wall_seconds = float(ckpt["wall_seconds"])
        self._checked = None
        log.info("resumed from %s after server round %d", self.resume_from, self.restored_round)
        arrays = ckpt["arrays"]
        return self.restored_round + 1, (pack_arrays(arrays) if arrays else None)

    def due(self, server_round: int, num_rounds: int) -> bool:
        """Whether a checkpoint is written after ``server_round``."""
        return self.every > 0 and (server_round % self.every == 0 or server_round == num_rounds)

    def save(
        self,
        strategy: Checkpointed,
        server_round: int,
        arrays: ArrayRecord | None,
        wall_seconds: float,
    ) -> Path:
        """Write the checkpoint of completed round ``server_round`` (with the global ``arrays``, if any,
        and the run's ``wall_seconds`` so far) atomically; returns its path.

        Raises:
            pickle.PicklingError / TypeError / AttributeError: a strategy attribute that cannot be
                pickled (add it to :data:`REBUILT` if it is rebuilt from the config).
            CheckpointWriteError: the file cannot be written (the previous checkpoint unchanged).
            LockedError: as :meth:`DirLock.verify` of results-dir's lock.
        """
        lock = held_by_this_process(self.path.parent)
        if lock is not None:
            lock.verify()
        state = {k: v for k, v in vars(strategy).items() if k not in REBUILT}
        ckpt = {
            "format": CHECKPOINT_FORMAT,
            "config": self.config,
            "round": int(server_round),
            "wall_seconds": float(wall_seconds),
            "strategy": f"{type(strategy).__module__}.{type(strategy).__qualname__}",
            "nodes": {pid: asdict(n.info) for pid, n in strategy.nodes.items()},
            "arrays": {k: np.array(v.numpy()) for k, v in (arrays or {}).items()},
            "state": state,
            "written_at": time.time(),
        }
        data = pickle.dumps(ckpt, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            meta = {"round": int(server_round), "payload": "pickle"}
            write_sealed(self.path, CHECKPOINT_MAGIC, meta, data, CHECKPOINT_FORMAT)
        except OSError as exc:
            kept = (
                f"the previous checkpoint {self.path} is unchanged (resume=true continues from it)"
                if self.path.is_file()
                else "no earlier checkpoint exists"
            )
            fix = (
                "free space on that file system, or set results-dir to another one"
                if exc.errno == errno.ENOSPC
                else "make results-dir writable, or set it to another directory"
            )
            raise CheckpointWriteError(
                exc.errno,
                f"cannot write the checkpoint of server round {server_round} to {self.path}: "
                f"{exc.strerror or exc}; {kept}; {fix}",
            ) from exc
        return self.path


def open_run(config: RunConfig, strategy: Any, simulation: bool = False) -> RunDir:
    """:func:`preflight`, then ``strategy.checkpointer`` set and, when resuming, the checkpoint and
    node state checked and ``strategy.resume_check`` set.

    Raises:
        ConfigError, LockedError: as :func:`preflight`, :meth:`Checkpointer.check` and
            :func:`check_node_state_dir`; resuming trained nodes in simulation without
            ``node-state-dir``.
    """
    run = preflight(config, simulation)
    try:
        run.trained_before = _prepare_resume(config, strategy, run.path, simulation)
        run.checkpointer = strategy.checkpointer
    except BaseException as exc:
        run.__exit__(type(exc), exc, exc.__traceback__)
        raise
    if not Path(config.results_dir).expanduser().is_absolute():
        log.info(
            "results-dir=%r is relative: results go to %s (the ServerApp's working directory; "
            "under flwr run, where the local SuperLink was first started: give an absolute path "
            "to choose)",
            config.results_dir,
            run.path,
        )
    return run


def _prepare_resume(
    config: RunConfig, strategy: Any, out: Path, simulation: bool
) -> dict[int, int]:
    """:func:`open_run`'s checkpoint part; returns ``{partition-id: last round it trained}``."""
    resume_from = config.resume_from or (out if config.resume else None)
    ckpt = strategy.checkpointer = Checkpointer(
        out, config.to_dict(), config.checkpoint_every, resume_from
    )
    checked = ckpt.check(strategy, config.num_server_rounds)
    if checked is None:
        return {}
    if config.node_state_dir:  # the node state is this run's
        state_root = Path(config.node_state_dir).expanduser().resolve()
        check_node_state_dir(state_root, config.node_state_dir, config.to_dict(), True)
        claim_node_state_dir(state_root, config.to_dict(), out)
    trained_before = _last_trained(checked["state"]["ledger"].rounds, strategy.num_nodes)
    if simulation and not config.node_state_dir and any(trained_before.values()):
        # else every node refuses the resume query alone, each with Flower's traceback
        raise ConfigError(
            resume_without_node_state(out, str(checked["config"].get("node-state-dir", "")))
        )
    strategy.resume_check = {
        RESUME_STATE_ROUNDS: [trained_before.get(p, 0) for p in range(strategy.num_nodes)],
        RESUME_ROUND: int(checked["round"]),
        RESUME_FRESH: config.resume_fresh_nodes,
    }
    return trained_before


def _last_trained(rounds: Sequence[Any], num_nodes: int) -> dict[int, int]:
    """``{partition-id: last round whose train reply was accepted}`` of a checkpoint's round records."""
    out: dict[int, int] = {}
    for r in rounds:
        if r.num_trained == 0:
            continue
        for pid in set(r.sampled) - set(r.failed.get("train", [])):
            if pid < num_nodes:
                out[pid] = max(out.get(pid, 0), int(r.round))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``main([DIR])`` (``argv`` default: ``sys.argv[1:]``): 0 when no live run holds ``DIR``; else 1,
    who holds it (or why its lock file is refused) printed on stderr; 2 for another number of arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: flwr_sheaf.rundir.main([DIR])", file=sys.stderr)
        return 2
    try:
        holder = live_holder(args[0], "results-dir")
    except LockedError as exc:
        print(exc, file=sys.stderr)
        return 1
    if holder is not None:
        print(f"{args[0]} is in use by a live run: {holder}", file=sys.stderr)
        return 1
    return 0
