"""What a run finds in the directories it writes, and how it leaves an earlier run's files there
(docs/reliability-run-files.md): :func:`resolve_dir` (a symbolic-link loop refused by its key),
:func:`move_aside` (an earlier run's files moved into ``previous-<UTC time>/``, never deleted) and
:func:`check_node_state_dir` / :func:`claim_node_state_dir` (``<node-state-dir>/run.json`` records
the run it belongs to; another run's node state is refused before any message).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import ConfigError, config_differences, resume_identity

__all__ = [
    "NODE_STATE_MARKER",
    "PREVIOUS_PREFIX",
    "resolve_dir",
    "move_aside",
    "check_node_state_dir",
    "claim_node_state_dir",
    "path_error",
]

log = logging.getLogger("flwr_sheaf")

#: The file in ``node-state-dir`` naming the run its node state belongs to.
NODE_STATE_MARKER = "run.json"
#: Subfolder prefix of an earlier run's files moved aside by ``overwrite = true``.
PREVIOUS_PREFIX = "previous-"
_STATE_FILE = re.compile(r"^round-\d+\.state$")


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


def move_aside(directory: Path, names: Sequence[str]) -> tuple[Path, list[str]] | None:
    """Move the files ``names`` that exist in ``directory`` into a new ``directory/previous-<UTC time>/``.

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
    return target, present


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
