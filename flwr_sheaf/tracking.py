"""Per-round tracking to TensorBoard and Weights & Biases (optional extras; docs/tracking.md)."""

from __future__ import annotations

import json
import logging
import math
import numbers
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from .config import DEFAULTS, TRACKERS, ConfigError, RunConfig, check_trackers

__all__ = [
    "Tracker",
    "check_trackers",
    "round_scalars",
    "tracking_dir",
]

log = logging.getLogger("flwr_sheaf")


def tracking_dir(config: RunConfig) -> Path:
    """Where a run's trackers write: ``tracking-dir``, or ``<results-dir>/tracking`` when it is empty."""
    base = config.tracking_dir or str(Path(config.results_dir) / "tracking")
    return Path(base).expanduser().resolve()


def round_scalars(record: Mapping[str, Any]) -> dict[str, int | float]:
    """``{name: value}`` of every finite int/float entry of a round's ``results.json`` dict but
    ``round``, plus ``failed/<phase>``: the count of failed nodes per phase of ``failed``."""
    out: dict[str, int | float] = {}
    for name, value in record.items():
        if name == "round" or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        if isinstance(value, numbers.Integral):
            out[name] = int(value)
        elif math.isfinite(float(value)):
            out[name] = float(value)
    failed = record.get("failed")
    if isinstance(failed, Mapping):
        for phase, pids in failed.items():
            out[f"failed/{phase}"] = len(pids)
    return out


class Tracker:
    """Logs each round's :func:`round_scalars` to TensorBoard and/or Weights & Biases; a context manager.

    TensorBoard writes ``<log_dir>/tensorboard/<run_name>``, W&B ``wandb.init(dir=log_dir)``, step =
    server round. A tracker that fails is switched off with a warning (its error in :meth:`describe`).

    Args:
        trackers: names (:func:`parse_trackers`: ``"tensorboard"``, ``"wandb"``, ``"tensorboard,wandb"``).
        log_dir: directory of the trackers' files (created if missing).
        run_name: name of the TensorBoard run directory and of the W&B run (default
            ``flwr-sheaf-<YYYYmmdd-HHMMSS>``; ``-2``, ``-3``, ... appended when taken).
        config: JSON-serialisable mapping recorded with the run (the run config).
        wandb_mode: ``"offline"`` or ``"online"``.

    Raises:
        ConfigError: no tracker, an unknown one or one not installed; a bad ``wandb_mode``.
        OSError: ``log_dir`` cannot be created.
    """

    def __init__(
        self,
        trackers: str | Iterable[str],
        log_dir: str | Path,
        *,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        wandb_project: str = DEFAULTS["wandb-project"],
        wandb_mode: str = DEFAULTS["wandb-mode"],
    ) -> None:
        self.names = check_trackers(trackers)
        if not self.names:
            raise ConfigError(
                f"Tracker(trackers={trackers!r}): name at least one of {sorted(TRACKERS)}"
            )
        if wandb_mode not in ("offline", "online"):
            raise ConfigError(f"wandb-mode={wandb_mode!r}: must be one of ['offline', 'online']")
        self.log_dir = Path(log_dir).expanduser().resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_name = run_name or f"flwr-sheaf-{time.strftime('%Y%m%d-%H%M%S')}"
        self.config = dict(config or {})
        #: ``{tracker: error}`` of trackers switched off after an error.
        self.errors: dict[str, str] = {}
        self.rounds_logged = 0
        self._writer: Any = None
        self._run: Any = None
        self.tensorboard_dir: Path | None = None
        self.wandb_dir: Path | None = None
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard_dir = self._own_run_dir(self.log_dir / "tensorboard")
            self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir))
            text = json.dumps(self.config, indent=1, default=str)
            self._writer.add_text("config", f"```\n{text}\n```", global_step=0)
            self._writer.flush()
        if "wandb" in self.names:
            import wandb

            mode: Literal["offline", "online"] = "online" if wandb_mode == "online" else "offline"
            self._run = wandb.init(
                project=wandb_project,
                mode=mode,
                dir=str(self.log_dir),
                name=self.run_name,
                config=self.config,
                reinit="create_new",  # never finish a W&B run the host app has open
                settings=wandb.Settings(console="off"),
            )
            self.wandb_dir = Path(self._run.dir).parent

    def _own_run_dir(self, parent: Path) -> Path:
        """``parent/<run_name>`` created exclusively, else ``<run_name>-2``, ``-3``, ... (logged)."""
        parent.mkdir(parents=True, exist_ok=True)
        name, i = self.run_name, 1
        while True:
            try:
                (parent / name).mkdir()
                break
            except FileExistsError:
                i += 1
                name = f"{self.run_name}-{i}"
        if name != self.run_name:
            log.info(
                "tracking: %s already holds a run named %s: this run is %s",
                parent,
                self.run_name,
                name,
            )
            self.run_name = name
        return parent / name

    @classmethod
    def from_config(cls, config: RunConfig) -> Tracker | None:
        """The tracker of a run config's ``tracking`` keys, or None (errors: the class's)."""
        if not config.tracking:  # the parser's comma-joined names; "" = off
            return None
        name = Path(config.results_dir).expanduser().resolve().name or "run"
        return cls(
            config.tracking,
            tracking_dir(config),
            run_name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}",
            config=config.to_dict(),
            wandb_project=config.wandb_project,
            wandb_mode=config.wandb_mode,
        )

    def log_round(self, record: Mapping[str, Any]) -> None:
        """Log one finished round's ``results.json`` dict; a failing tracker is switched off."""
        step = int(record["round"])
        scalars = round_scalars(record)
        writer, run = self._writer, self._run

        def tensorboard() -> None:
            for name, value in scalars.items():
                writer.add_scalar(name, value, global_step=step)
            writer.flush()

        logged = False  # by at least one tracker (none left after every one failed)
        if writer is not None:
            logged = self._guarded("tensorboard", tensorboard)
        if run is not None:
            logged = self._guarded("wandb", lambda: run.log(dict(scalars), step=step)) or logged
        if logged:
            self.rounds_logged += 1

    def _guarded(self, name: str, action: Callable[[], object]) -> bool:
        """Run one tracker's ``action``; whether it succeeded (one that raises is switched off)."""
        try:
            action()
        except Exception as exc:  # tracking must not end a training run nor cost it its results
            self.errors[name] = f"{type(exc).__name__}: {exc}"[-500:]
            log.warning("tracking: %s switched off after an error: %s", name, self.errors[name])
            if name == "tensorboard":
                self._writer = None
            else:
                self._run = None
            return False
        return True

    def describe(self) -> dict[str, Any]:
        """``results.json``'s ``tracking``: trackers, run name, directories, rounds logged, errors."""
        dirs = {"tensorboard_dir": self.tensorboard_dir, "wandb_dir": self.wandb_dir}
        return {
            "trackers": list(self.names),
            "run_name": self.run_name,
            **{k: str(v) for k, v in dirs.items() if v is not None},
            "rounds_logged": self.rounds_logged,
            "errors": dict(self.errors),
        }

    @property
    def problems(self) -> list[str]:
        """One line per tracker switched off after an error (``write_results``' ``problems``)."""
        return [
            f"tracker {name} switched off after an error: {err}"
            for name, err in self.errors.items()
        ]

    def close(self) -> None:
        """Close the trackers (idempotent; a failure is recorded in :attr:`errors`, never raised)."""
        writer, run = self._writer, self._run
        self._writer = self._run = None
        if writer is not None:
            self._guarded("tensorboard", writer.close)
        if run is not None:
            self._guarded("wandb", run.finish)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
