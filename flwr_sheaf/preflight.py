"""Preflight of the ServerApp: what a run will write is checked before any message is sent.

:func:`preflight` (called by :func:`flwr_sheaf.apps.server_app.run_server` once the run config is
parsed) refuses, naming the run-config key, the path and the fix: a directory the run will write
(``results-dir``, ``node-state-dir``, ``tracking-dir``) that cannot be created or written;
``overwrite`` with ``resume``; resuming without a checkpoint; a fresh run into a ``results-dir``
holding another run's files unless ``overwrite = true`` (then they are moved into
``previous-<UTC time>/``, never deleted: :func:`move_aside`, and moved back when the new run
ends with an error before writing any of its own; ``keep-previous`` bounds how many such
folders stay); a ``node-state-dir`` of another run (:func:`check_node_state_dir`); a second live run
on the same directory (:class:`flwr_sheaf.locks.DirLock`), or on the directory ``resume-from``
names; ``resume-from`` into a ``results-dir`` holding another run's ``results.json`` /
``checkpoint.pkl`` (:func:`_check_resume_into`; ``overwrite = true`` moves them aside). ``tracking-dir``
without ``tracking`` is warned about. docs/reliability-run-files.md lists
each case.

Helpers: :func:`resolve_dir` (a symbolic-link loop refused by its key) and
:func:`claim_node_state_dir` (``<node-state-dir>/run.json`` records the run the node state belongs to).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import ConfigError, RunConfig, config_differences, resume_identity
from .locks import DirLock, LockedError, held_by_this_process, live_holder

__all__ = [
    "RESULT_FILES",
    "MOVED_FILES",
    "Preflight",
    "check_writable_dir",
    "preflight",
    "NODE_STATE_MARKER",
    "PREVIOUS_PREFIX",
    "resolve_dir",
    "move_aside",
    "check_node_state_dir",
    "claim_node_state_dir",
    "path_error",
    "previous_folders",
]

log = logging.getLogger("flwr_sheaf")

#: Files whose presence means that ``results-dir`` holds another run's results.
RESULT_FILES = ("results.json", "checkpoint.pkl")
#: Files ``overwrite = true`` moves into ``previous-<UTC time>/``.
MOVED_FILES = ("results.json", "checkpoint.pkl", "accuracy.png")


# ------------------------------------------------------------------------------ run directories
#: The file in ``node-state-dir`` naming the run its node state belongs to.
NODE_STATE_MARKER = "run.json"
#: Subfolder prefix of an earlier run's files moved aside by ``overwrite = true``.
PREVIOUS_PREFIX = "previous-"
_STATE_FILE = re.compile(r"^round-\d+\.state$")
#: The name of a folder :func:`move_aside` made (``previous-<UTC time>[-<n>]``).
_MOVED_ASIDE = re.compile(re.escape(PREVIOUS_PREFIX) + r"\d{8}T\d{6}Z(-\d+)?")


def path_error(key: str, path: str | Path, exc: BaseException) -> ConfigError:
    """A :class:`ConfigError` naming ``key``, ``path`` and the fix for an OS error (or Python's
    ``RuntimeError: Symlink loop``) met while resolving or probing ``path``."""
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
        raise path_error(key, path, exc) from None


def previous_folders(directory: Path) -> list[Path]:
    """The ``previous-*`` folders of ``directory`` (:func:`move_aside`), oldest first (by the UTC time
    in their names, then their counter)."""

    def order(p: Path) -> tuple[str, int]:
        stamp, _, n = p.name[len(PREVIOUS_PREFIX) :].partition("-")
        return stamp, int(n) if n.isdigit() else 1

    try:
        found = [
            p for p in directory.iterdir() if p.name.startswith(PREVIOUS_PREFIX) and p.is_dir()
        ]
    except OSError:
        return []
    return sorted(found, key=order)


def move_aside(
    directory: Path, names: Sequence[str], *, keep: int | None = None
) -> tuple[Path, list[str]] | None:
    """Move the files ``names`` that exist in ``directory`` into a new ``directory/previous-<UTC time>/``.

    Args:
        keep: then keep only the newest ``keep`` ``previous-*`` folders (the new one counts), removing
            the older ones, each logged (run-config key ``keep-previous``); None or 0 = keep every one.

    Returns:
        ``(the new folder, the names moved)``, or None when none of them exists.

    Raises:
        OSError: the folder cannot be created or a file cannot be moved (then nothing was deleted;
            files already moved are in the folder).
    """
    present = [n for n in names if (directory / n).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = directory / f"{PREVIOUS_PREFIX}{stamp}"
    i = 1
    while True:
        try:
            target.mkdir()
            break
        except FileExistsError:
            i += 1
            target = directory / f"{PREVIOUS_PREFIX}{stamp}-{i}"
    for n in present:
        os.replace(directory / n, target / n)
    if keep:
        _prune_previous(directory, int(keep), target)
    return target, present


def _prune_previous(directory: Path, keep: int, newest: Path, protect: Sequence[Path] = ()) -> None:
    """Remove the oldest ``previous-*`` folders of ``directory`` beyond the newest ``keep`` (never
    ``newest`` nor one in ``protect``), each logged; one that cannot be removed is logged and kept."""
    import shutil

    folders = [
        p
        for p in previous_folders(directory)
        if p != newest and p not in protect and _MOVED_ASIDE.fullmatch(p.name)
    ]  # only the folders move_aside made: never a user's own "previous-<anything>"
    folders.append(newest)
    for old in folders[: max(len(folders) - keep, 0)]:
        try:
            held = ", ".join(sorted(p.name for p in old.iterdir())) or "empty"
            shutil.rmtree(old)
        except OSError as exc:
            log.warning("keep-previous=%d: could not remove %s (kept): %s", keep, old, exc)
            continue
        log.warning(
            "keep-previous=%d: removed %s (an earlier run's files: %s), the oldest beyond the newest %d",
            keep,
            old,
            held,
            keep,
        )


# ------------------------------------------------------------------------------ node-state-dir
def _state_partitions(root: Path) -> list[str]:
    """Names of the ``partition-*`` folders of ``root`` holding state files."""
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if p.name.startswith("partition-") and p.is_dir():
            if any(_STATE_FILE.match(f.name) for f in p.iterdir()):
                out.append(p.name)
    return out


def _read_marker(root: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((root / NODE_STATE_MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def check_node_state_dir(
    root: Path, given: str, run_config: Mapping[str, Any], resuming: bool
) -> None:
    """Refuse a ``node-state-dir`` ``root`` (``given`` as in the run config) that holds another run's
    node state; ``run_config``: ``RunConfig.to_dict()``; ``resuming``: ``resume`` / ``resume-from``.

    Raises:
        ConfigError: a fresh run over node state (state files or a ``run.json``) of another run; a
            resumed run over node state recorded for another run config (the keys and both values
            named).
    """
    marker = _read_marker(root)
    parts = _state_partitions(root)
    if marker is None and not parts:
        return
    owner = ""
    if marker:
        owner = (
            f" (recorded in {root / NODE_STATE_MARKER}: the run of results-dir "
            f"{marker.get('results-dir', '?')!r} started {marker.get('started', '?')}, seed "
            f"{marker.get('config', {}).get('seed', 0)!r})"
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
        diff = config_differences(marker.get("config", {}), resume_identity(run_config))
        if diff:
            text = ", ".join(f"{k}={a!r} there, {b!r} now" for k, (a, b) in diff.items())
            raise ConfigError(
                f"node-state-dir={given!r}: {root} holds the node state of another run config "
                f"({text}){owner}; point node-state-dir at the stopped run's node state"
            )


def claim_node_state_dir(root: Path, run_config: Mapping[str, Any], results_dir: Path) -> None:
    """Record in ``root/run.json`` the run this node state belongs to (written atomically).

    Raises:
        OSError: the file cannot be written.
    """
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

    Leaving it with an exception after ``overwrite = true`` moved an earlier run's files aside: when
    the new run wrote none of its own files (``results.json``, ``checkpoint.pkl``,
    ``accuracy.png``; e.g. it died at discovery) they are moved back into ``results-dir``, else they
    stay in ``previous-<UTC time>/``; either way a note on the exception and a log line say where
    they are.

    Attributes:
        locks: the held :class:`~flwr_sheaf.locks.DirLock` of ``results-dir`` (and of ``node-state-dir``).
        previous_run: where ``overwrite = true`` moved the earlier run's files, ``{"moved_to": path,
            "files": [names]}`` (``results.json``'s ``previous_run``), or None.
    """

    def __init__(self) -> None:
        self.locks: list[DirLock] = []
        self.previous_run: dict | None = None
        self.results_dir: Path | None = None
        #: ``keep-previous``: applied on leaving, once the moved files are known to stay aside
        self.keep_previous = 0
        #: ``previous-*`` folders never pruned (the one ``resume-from`` reads from)
        self.protect: list[Path] = []

    def release(self) -> None:
        """Release every lock (the node-state-dir's first)."""
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def __enter__(self) -> Preflight:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc is not None and self.previous_run is not None and self.results_dir is not None:
                self._after_failed_run(exc)
            if (
                self.keep_previous
                and self.previous_run is not None
                and self.results_dir is not None
            ):
                _prune_previous(
                    self.results_dir,
                    self.keep_previous,
                    Path(self.previous_run["moved_to"]),
                    self.protect,
                )
        finally:
            self.release()

    def _after_failed_run(self, exc: BaseException) -> None:
        """The moved-aside earlier run's files after the new run ended with ``exc``: moved back when
        the new run wrote none of its own, the way noted on ``exc`` and logged."""
        assert self.previous_run is not None and self.results_dir is not None
        out, folder = self.results_dir, Path(self.previous_run["moved_to"])
        names = list(self.previous_run["files"])
        mine = [n for n in MOVED_FILES if (out / n).exists()]
        if not mine:
            try:
                for n in names:
                    os.replace(folder / n, out / n)
                folder.rmdir()
            except OSError as err:
                where = f"are in {folder} (moving them back failed: {err.strerror or err})"
            else:
                where = f"were moved back into {out} (the results-dir is as before this run)"
                self.previous_run = None
        else:
            where = (
                f"are in {folder} (this run wrote {', '.join(mine)} into {out}; continue the "
                f"earlier run with resume-from={str(folder / 'checkpoint.pkl')!r})"
                if "checkpoint.pkl" in names
                else f"are in {folder} (this run wrote {', '.join(mine)} into {out})"
            )
        text = f"the earlier run's {', '.join(names)}, moved aside by overwrite=true, {where}"
        log.warning("this run ended with an error: %s", text)
        exc.add_note(f"flwr-sheaf: {text}")


def _previous_checkpoint_hint(out: Path) -> str:
    """Where overwrite=true moved the newest earlier checkpoint of ``out`` (a sentence), or ''."""
    from .strategy.checkpoint import CHECKPOINT_NAME

    found = [p / CHECKPOINT_NAME for p in previous_folders(out) if (p / CHECKPOINT_NAME).is_file()]
    if not found:
        return ""
    return (
        f"; an earlier run's checkpoint was moved (overwrite=true) into {found[-1]}: to continue "
        f"that run set resume-from={str(found[-1])!r} (resume=true reads only {out / CHECKPOINT_NAME})"
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


def _checkpoint_node_state_dir(out: Path) -> str | None:
    """The ``node-state-dir`` of the run checkpointed in ``out`` (``""``: none), or None when its
    checkpoint cannot be read."""
    from .strategy.checkpoint import CHECKPOINT_NAME, load_checkpoint

    try:
        return str(load_checkpoint(out / CHECKPOINT_NAME)["config"].get("node-state-dir", ""))
    except Exception:  # noqa: BLE001 - a broken checkpoint: resuming names its problem
        return None


def _no_checkpoint(config: RunConfig, out: Path) -> None:
    """Refuse resuming without a checkpoint, in one line naming what works instead."""
    from .strategy.checkpoint import NoCheckpointError, checkpoint_path

    path = checkpoint_path(config.resume_from or out)
    if path.is_file():
        return
    key = f"resume-from={config.resume_from!r}" if config.resume_from else "resume=true"
    hint = "" if config.resume_from else _previous_checkpoint_hint(out)
    if (path.parent / "results.json").is_file():
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


def _check_resume_from_free(config: RunConfig, out: Path) -> None:
    """Refuse ``resume-from`` a directory a live run still holds (its checkpoint changes under us).

    Raises:
        LockedError: that run's process, host and start time named.
    """
    from .strategy.checkpoint import checkpoint_path

    where = resolve_dir("resume-from", checkpoint_path(config.resume_from).parent)
    if where == out or held_by_this_process(where) or not where.is_dir():
        return
    holder = live_holder(where, "resume-from")
    if holder is not None:
        raise LockedError(
            f"resume-from={config.resume_from!r}: {where} is still in use by a live run: {holder}; "
            f"its checkpoint changes as that run goes on, so it is not resumed while it runs: wait for "
            f"that run to end (or stop it), then resume from it"
        )


def _resume_source(config: RunConfig) -> Path | None:
    """The directory of the checkpoint ``resume-from`` names (resolved), or None without it.

    Raises:
        ConfigError: a symbolic-link loop (key and path named).
    """
    if not config.resume_from:
        return None
    from .strategy.checkpoint import checkpoint_path

    return resolve_dir("resume-from", checkpoint_path(config.resume_from).parent)


def _recorded_run_config(path: Path) -> dict[str, Any]:
    """The run config recorded in a ``results.json`` (its ``config``) or a ``checkpoint.pkl``.

    Raises:
        ConfigError / OSError / ValueError: the file cannot be read as one.
    """
    from .strategy.checkpoint import load_checkpoint

    if path.suffix == ".json":
        recorded = json.loads(path.read_text()).get("config")
    else:
        recorded = load_checkpoint(path).get("config")
    if not isinstance(recorded, dict):
        raise ValueError("it records no run config")
    return recorded


def _check_resume_into(config: RunConfig, out: Path, old: Sequence[Path]) -> None:
    """Refuse ``resume-from`` into a ``results-dir`` whose ``results.json`` / ``checkpoint.pkl`` (``old``)
    belong to another run: the resumed run's writes would replace them. Files of the run being resumed
    pass (their recorded run config has the checkpoint's run identity: no key outside
    :data:`~flwr_sheaf.config.RESUME_MUTABLE_KEYS` differs, :func:`~flwr_sheaf.config.config_differences`).

    Raises:
        ConfigError: the files, why they are another run's, and the fixes (another results-dir, or
            ``overwrite = true``, which moves them aside) named.
    """
    from .strategy.checkpoint import checkpoint_path

    ckpt = checkpoint_path(config.resume_from)
    resumed = _recorded_run_config(ckpt)  # readable: checked by _no_checkpoint and load_checkpoint
    why = []
    for path in old:
        try:
            diff = config_differences(_recorded_run_config(path), resumed)
        except (ConfigError, OSError, ValueError) as exc:
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


def _check_overwrite_with_resume(config: RunConfig, resuming: bool, source: Path | None) -> None:
    """Refuse ``overwrite=true`` together with ``resume=true``, or with a ``resume-from`` of the
    results-dir itself (``source``: :func:`_resume_source`): one starts afresh, the other continues.

    Raises:
        ConfigError: naming both keys and the fix.
    """
    if (
        config.overwrite
        and resuming
        and (source is None or source == resolve_dir("results-dir", config.results_dir))
    ):
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


def preflight(config: RunConfig, simulation: bool = False) -> Preflight:
    """Check every directory the run writes, take its locks and move an overwritten run's files
    aside; returns the :class:`Preflight` holding the locks (``with preflight(config) as pre:``).
    ``simulation``: Flower's simulation engine, whose nodes keep state only in ``node-state-dir``
    (a refusal then advises ``resume=true`` only for a run that set it).

    Raises:
        ConfigError: each refusal of the module docstring (key, path and fix named).
        OSError: an earlier run's files cannot be moved aside (nothing deleted).
    """
    resuming = config.resume or bool(config.resume_from)
    source = _resume_source(config)
    _check_overwrite_with_resume(config, resuming, source)
    # tracking-dir without tracking: warned once, by apps.server_app.run_config_warnings
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
    pre.results_dir, pre.keep_previous = out, config.keep_previous
    try:
        pre.locks.append(DirLock(out, "results-dir").acquire())
        if resuming:
            _no_checkpoint(config, out)
            if config.resume_from:
                _check_resume_from_free(config, out)
        old = [out / f for f in RESULT_FILES if (out / f).exists()]
        if old and source is not None and source != out:  # resume-from into another results-dir
            if source.parent == out:
                pre.protect.append(source)  # a previous-* folder of out: never pruned
            if not config.overwrite:
                _check_resume_into(config, out, old)
        if old and not resuming and not config.overwrite:
            kept = _checkpoint_node_state_dir(out) if (out / "checkpoint.pkl").exists() else None
            how = (
                "resume=true to continue that run, or overwrite=true to move its files into "
                f"{out}/previous-<time>/ and start afresh"
                if kept or (kept is not None and not simulation)
                else f"or overwrite=true to move its files into {out}/previous-<time>/ and start "
                "afresh ("
                + (
                    "its nodes kept their state in memory only (no node-state-dir)"
                    if kept is not None
                    else "its checkpoint.pkl cannot be read"
                    if (out / "checkpoint.pkl").exists()
                    else "it has no checkpoint.pkl"
                )
                + ", so resume=true cannot continue it)"
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
        if old and (not resuming or config.overwrite):  # overwrite=true: moved aside, never deleted
            moved = move_aside(out, MOVED_FILES)  # keep-previous: on leaving (Preflight.__exit__)
            if moved is not None:
                folder, names = moved
                pre.previous_run = {"moved_to": str(folder), "files": names}
                log.warning(
                    "overwrite=true: moved the earlier run's %s from %s into %s (nothing deleted; "
                    "moved back if this run ends with an error before writing its own)",
                    ", ".join(names),
                    out,
                    folder,
                )
        if state_root is not None and not resuming:
            claim_node_state_dir(state_root, config.to_dict(), out)
    except BaseException as exc:
        pre.__exit__(type(exc), exc, exc.__traceback__)  # moved files back, locks released
        raise
    return pre
