"""Progress of a sweep: done / total and an ETA, for runs executed by a process pool.

On a terminal a rich progress bar (runs done / total, elapsed, remaining); elsewhere (logs, CI,
notebooks' captured output) one line per finished run: ``[k/N] <label> (X s); elapsed E, ETA R``.
The ETA is the mean wall time per finished run so far times the runs left, divided by the workers.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["map_with_progress", "eta_seconds"]


def eta_seconds(elapsed: float, done: int, total: int) -> float:
    """Seconds left if the remaining ``total - done`` runs go at the pace so far (``elapsed / done`` each,
    runs overlapping as they did); NaN before the first run has finished."""
    if done <= 0:
        return float("nan")
    return elapsed / done * (total - done)


def _fmt(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "?"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _indexed(args: tuple[Callable[[Any], Any], int, Any]) -> tuple[int, Any, float]:
    fn, i, job = args
    t = time.monotonic()
    return i, fn(job), time.monotonic() - t


def map_with_progress(
    fn: Callable[[Any], Any],
    jobs: Sequence[Any],
    workers: int,
    label: Callable[[Any], str] = str,
    desc: str = "runs",
    stream=None,
) -> list[Any]:
    """``[fn(job) for job in jobs]`` in ``workers`` spawned processes (in order), reporting progress.

    Args:
        fn: a picklable top-level function of one job.
        jobs: the jobs, in the order of the returned results.
        workers: processes at a time (>= 1).
        label: a job's name in the per-run lines.
        desc: what the jobs are (the bar's title).
        stream: where to report (default ``sys.stderr``); a rich bar only when it is a terminal.

    Returns:
        The results, in the order of ``jobs``.
    """
    stream = stream or sys.stderr
    total, out = len(jobs), [None] * len(jobs)
    t0 = time.monotonic()
    tasks = [(fn, i, job) for i, job in enumerate(jobs)]
    with mp.get_context("spawn").Pool(max(1, workers)) as pool:
        results = pool.imap_unordered(_indexed, tasks, chunksize=1)
        if getattr(stream, "isatty", lambda: False)():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            with Progress(
                TextColumn(desc),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=stream),
            ) as bar:
                task = bar.add_task(desc, total=total)
                for i, res, _ in results:
                    out[i] = res
                    bar.advance(task)
        else:
            for done, (i, res, took) in enumerate(results, start=1):
                out[i] = res
                elapsed = time.monotonic() - t0
                print(
                    f"[{done}/{total}] {label(jobs[i])} ({took:.0f} s); elapsed {_fmt(elapsed)}, "
                    f"ETA {_fmt(eta_seconds(elapsed, done, total))}",
                    file=stream,
                    flush=True,
                )
    return out
