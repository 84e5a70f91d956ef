"""Server checkpoints and exact resume of a stopped run (docs/resume.md).

:class:`Checkpointer` is the hook :func:`flwr_sheaf.strategy.rounds.run_rounds` calls: after
discovery :meth:`Checkpointer.restore` (only when resuming) checks the checkpoint against the run
config and the rediscovered nodes and puts the strategy's state back; after every
``checkpoint-every``-th round and the last one :meth:`Checkpointer.save` writes ``checkpoint.pkl``
atomically. A checkpoint holds the run config, the last completed round, the strategy's class, the
nodes' :class:`~flwr_sheaf.protocol.NodeInfo`, the global arrays and **every attribute of the
strategy** except those :data:`REBUILT` (so no list per method can fall out of date); random draws
need no state. The file is sealed (:func:`flwr_sheaf.rundir.write_sealed`) and read back by
:func:`flwr_sheaf.rundir.load_checkpoint` (a modified file is refused before unpickling); load only
checkpoints your own runs wrote.
"""

from __future__ import annotations

import errno
import logging
import pickle
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord

from ..config import ConfigError, config_differences
from ..integrity import write_sealed
from ..protocol import pack_arrays
from ..rundir import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_MAGIC,
    CHECKPOINT_NAME,
    NoCheckpointError,
    checkpoint_path,
    load_checkpoint,
)
from .ledger import RunLedger
from .records import Node

__all__ = [
    "Checkpointed",
    "REBUILT",
    "Checkpointer",
    "CheckpointWriteError",
    "NoCheckpointError",
    "checkpoint_path",
    "load_checkpoint",
]

log = logging.getLogger("flwr_sheaf")

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


class Checkpointed(Protocol):
    """What a checkpoint saves and puts back of a strategy: its attributes (``vars``, less
    :data:`REBUILT`) and its discovered nodes; the checkpointer never imports the strategy's class."""

    @property
    def nodes(self) -> Mapping[int, Node]: ...  # noqa: D102


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (full disk, permissions, ...): the file, the server round,
    the OS reason and the fix named; the checkpoint already there (if any) is unchanged (atomic write)."""


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

    def check(self, strategy: Checkpointed, num_rounds: int) -> dict[str, Any] | None:
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

    def restore(self, strategy: Checkpointed, num_rounds: int) -> tuple[int, ArrayRecord | None]:
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
