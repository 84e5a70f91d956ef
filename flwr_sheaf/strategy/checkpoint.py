"""Server checkpoints and exact resume of a stopped run (docs/resume.md).

:class:`Checkpointer` is the hook :func:`flwr_sheaf.strategy.rounds.run_rounds` calls: after
discovery :meth:`Checkpointer.restore` (only when resuming) checks the checkpoint against the run
config and the rediscovered nodes and puts the strategy's state back; after every
``checkpoint-every``-th round and the last one :meth:`Checkpointer.save` writes ``checkpoint.pkl``
atomically. A checkpoint holds the run config, the last completed round, the strategy's class, the
nodes' :class:`~flwr_sheaf.protocol.NodeInfo`, the global arrays and **every attribute of the
strategy** except those :data:`REBUILT` (so no list per method can fall out of date); random draws
need no state. The file is sealed (:mod:`flwr_sheaf.integrity`: a modified file is refused before
unpickling); load only checkpoints your own runs wrote.
"""

from __future__ import annotations

import errno
import logging
import pickle
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord

from ..config import ConfigError, config_differences
from ..integrity import read_sealed, write_sealed
from ..protocol import pack_arrays
from .ledger import RunLedger

if TYPE_CHECKING:
    from .graph import GraphStrategy

__all__ = [
    "CHECKPOINT_NAME",
    "REBUILT",
    "Checkpointer",
    "CheckpointWriteError",
    "NoCheckpointError",
    "checkpoint_path",
    "load_checkpoint",
]

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


def read_checkpoint_file(path: Path, fmt: int) -> dict[str, Any]:
    """The checkpoint dict in ``path``, after its header and SHA-256 are verified (nothing unpickled before).

    A checkpoint of the old format (a bare pickle, no header) is refused: it cannot be verified,
    and a truncated or modified one was resumed silently.

    Raises:
        ConfigError: a file that is not a flwr-sheaf checkpoint, an old-format checkpoint, a truncated or
            modified file, another format version (the file, what is wrong and the fix named).
    """
    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(len(CHECKPOINT_MAGIC))
    if head != CHECKPOINT_MAGIC:
        if not head:
            raise ConfigError(
                f"checkpoint {path} is empty (0 bytes: truncated, e.g. a full disk or a killed copy); "
                f"{_CHECKPOINT_FIX}"
            )
        if head[:1] == b"\x80":
            raise ConfigError(
                f"checkpoint {path} has the old format (a bare pickle without header and SHA-256, written "
                f"before flwr-sheaf checked checkpoint integrity): it cannot be verified, so it is not "
                f"resumed; finish that run with the flwr-sheaf version that wrote it, or start afresh in "
                f"a new results-dir (or with overwrite=true)"
            )
        raise ConfigError(
            f"checkpoint {path} is not a flwr-sheaf server checkpoint (bad header: it was overwritten "
            f"by another file); {_CHECKPOINT_FIX}"
        )
    try:
        meta, data = read_sealed(
            path,
            CHECKPOINT_MAGIC,
            fmt,
            what="flwr-sheaf server checkpoint",
            error=ConfigError,
            fix=_CHECKPOINT_FIX,
        )
    except ConfigError as exc:
        raise ConfigError(f"checkpoint {exc}") from None
    assert data is not None, "read_sealed returns the payload (payload=True by default)"
    ckpt = pickle.loads(data)  # noqa: S301 - verified against its own SHA-256; the run's own file
    if (
        not isinstance(ckpt, dict)
        or ckpt.get("format") != fmt
        or ckpt.get("round") != meta.get("round")
    ):
        raise ConfigError(
            f"checkpoint {path} is not a flwr-sheaf checkpoint of format {fmt}; {_CHECKPOINT_FIX}"
        )
    return ckpt


log = logging.getLogger("flwr_sheaf")

CHECKPOINT_NAME = "checkpoint.pkl"
"""The checkpoint's file name in ``results-dir``."""
#: 2: the strategy's rounds and failures live in its ``ledger`` (format 1 held them as ``rounds`` and
#: ``failures``; such a checkpoint is refused naming both formats rather than resumed without its history)
FORMAT = 2

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
"""Strategy attributes a checkpoint does not store: rebuilt from the run config (``alpha``), by
discovery (``nodes``, the ``exchange``), per call of ``start`` (``extra_*_config``, round
callbacks), or the checkpointer itself. The ledger is stored without its round being built."""


class NoCheckpointError(ConfigError, FileNotFoundError):
    """Resuming without a checkpoint: a :class:`~flwr_sheaf.config.ConfigError` (one line, no traceback,
    in the in-process runner too) that is also a ``FileNotFoundError``."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (full disk, permissions, ...): the file, the server round,
    the OS reason and the fix named; the checkpoint already there (if any) is unchanged (atomic write)."""


def checkpoint_path(location: str | Path) -> Path:
    """``location`` itself when it names a file, else ``location/checkpoint.pkl``."""
    p = Path(location).expanduser()
    return p if p.suffix == ".pkl" else p / CHECKPOINT_NAME


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :meth:`Checkpointer.save`.

    Raises:
        NoCheckpointError: no checkpoint at ``path`` (named; a ``ConfigError`` and a ``FileNotFoundError``).
        ConfigError: not a flwr-sheaf checkpoint, another format version (a newer one: upgrade
            flwr-sheaf, named), or a truncated or modified file (header + SHA-256,
            :mod:`flwr_sheaf.integrity`; the file and the fix named).
    """
    path = Path(path)
    if not path.is_file():
        raise NoCheckpointError(
            f"no checkpoint at {path}: nothing to resume (run without resume first)"
        )
    _refuse_other_format(path)
    return read_checkpoint_file(path, FORMAT)


def _refuse_other_format(path: Path) -> None:
    """Refuse a checkpoint written by a newer flwr-sheaf (a newer header line, or a ``format`` above
    :data:`FORMAT` in its metadata line; fix: upgrade) or by an older one (a ``format`` below it; fix:
    the version that wrote it, or start afresh), naming the file and its format.

    Raises:
        ConfigError: the checkpoint's format is not the one this version reads.
    """
    import json
    import re

    try:
        with open(path, "rb") as fh:
            magic, meta = fh.readline(256), fh.readline(65536)
    except OSError:
        return  # read_checkpoint_file names the error
    newer: object = None
    header = re.compile(rb"flwr-sheaf server checkpoint v(\d+)\n")
    ours = header.fullmatch(CHECKPOINT_MAGIC)
    assert ours is not None, "CHECKPOINT_MAGIC has the header's form"
    head = header.fullmatch(magic)
    if head is not None and int(head.group(1)) > int(ours.group(1)):
        newer = f"header v{int(head.group(1))}"
    elif magic == CHECKPOINT_MAGIC:
        try:
            fmt = json.loads(meta).get("format")
        except (ValueError, AttributeError):
            return
        if isinstance(fmt, (int, float)) and not isinstance(fmt, bool) and fmt > FORMAT:
            newer = f"format {fmt!r}"
        elif isinstance(fmt, (int, float)) and not isinstance(fmt, bool) and fmt < FORMAT:
            raise ConfigError(
                f"checkpoint {path} has format {fmt!r}, written by an older flwr-sheaf: this version "
                f"reads checkpoint format {FORMAT} only and cannot resume it. Finish that run with "
                "the flwr-sheaf version that wrote it, or start afresh in a new results-dir (or "
                "with overwrite=true)"
            )
    if newer is not None:
        raise ConfigError(
            f"checkpoint {path} has {newer}, written by a newer flwr-sheaf: this version reads "
            f"checkpoint format {FORMAT} only, so it is not resumed. Upgrade flwr-sheaf (pip install "
            f"-U flwr-sheaf, or the version that wrote it) to resume it"
        )


class Checkpointer:
    """Writes the strategy's checkpoints and restores one (module docstring).

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
        #: the round the restored checkpoint ended with (0 for a fresh run).
        self.restored_round = 0
        #: wall seconds of the run before the restored round (sum over its stopped parts).
        self.previous_wall_seconds = 0.0
        self._checked: dict[str, Any] | None = None

    def check(self, strategy: GraphStrategy, num_rounds: int) -> dict[str, Any] | None:
        """Load and check the checkpoint to resume from against the run, before any message is sent
        (:meth:`restore` calls it when the caller did not). Returns the checkpoint, None for a fresh run.

        Raises:
            FileNotFoundError: resuming without a checkpoint.
            ConfigError: another format or strategy class; run-config keys that differ from the
                checkpointed run's outside :data:`~flwr_sheaf.config.RESUME_MUTABLE_KEYS` (each key
                with both values named); a checkpoint past ``num-server-rounds``.
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

    def restore(self, strategy: GraphStrategy, num_rounds: int) -> tuple[int, ArrayRecord | None]:
        """Put the checkpointed state back into ``strategy`` (after its discovery); returns
        ``(next server round, global arrays or None)``. A fresh run returns ``(1, None)``.

        Raises:
            FileNotFoundError, ConfigError: see :meth:`check`.
            RuntimeError: a rediscovered node reports other data than in the checkpointed run
                (partition-id and the differing fields named).
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
        strategy: GraphStrategy,
        server_round: int,
        arrays: ArrayRecord | None,
        wall_seconds: float,
    ) -> Path:
        """Write the checkpoint of completed round ``server_round`` (with the global ``arrays``, if any,
        and the run's ``wall_seconds`` so far) atomically; returns its path.

        Raises:
            pickle.PicklingError / TypeError / AttributeError: a strategy attribute that cannot be
                pickled (add it to :data:`REBUILT` if it is rebuilt from the config).
            CheckpointWriteError: the file cannot be written (an ``OSError`` naming the file, the
                round, the reason and the fix; the previous checkpoint is left as it was).
            flwr_sheaf.locks.LockedError: results-dir's lock file was removed or replaced while
                this run held it and the directory itself cannot be locked (:meth:`DirLock.verify`).
        """
        from ..locks import held_by_this_process

        lock = held_by_this_process(self.path.parent)
        if lock is not None:  # its lock file removed or replaced meanwhile: put back, or refused
            lock.verify()
        state = {k: v for k, v in vars(strategy).items() if k not in REBUILT}
        ckpt = {
            "format": FORMAT,
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
            write_checkpoint_file(self.path, data, FORMAT, int(server_round))
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
